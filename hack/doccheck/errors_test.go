package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestErrorCodesDocumented checks that every JSON-RPC error code idemcp
// defines (the Code constants of internal/mcpmsg) has a row in
// docs/errors.md's summary and a section with its cause and fix.
func TestErrorCodesDocumented(t *testing.T) {
	src := filepath.Join(root, "internal", "mcpmsg", "mcpmsg.go")
	file, err := parser.ParseFile(token.NewFileSet(), src, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]string{}
	for _, decl := range file.Decls {
		g, ok := decl.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, spec := range g.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if !strings.HasPrefix(name.Name, "Code") || i >= len(vs.Values) {
					continue
				}
				if u, ok := vs.Values[i].(*ast.UnaryExpr); ok && u.Op == token.SUB {
					if lit, ok := u.X.(*ast.BasicLit); ok {
						codes[name.Name] = "-" + lit.Value
					}
				}
			}
		}
	}
	if len(codes) < 10 {
		t.Fatalf("found only %d Code constants in %s: %v", len(codes), rel(src), codes)
	}
	page, err := os.ReadFile(filepath.Join(root, "docs", "errors.md"))
	if err != nil {
		t.Fatal(err)
	}
	for name, code := range codes {
		if !strings.Contains(string(page), "\n| "+code+" |") {
			t.Errorf("%s (%s) has no row in docs/errors.md's summary", code, name)
		}
		if !strings.Contains(string(page), "\n### "+code+" ") {
			t.Errorf("%s (%s) has no section (### %s ...) in docs/errors.md", code, name, code)
		}
	}
}
