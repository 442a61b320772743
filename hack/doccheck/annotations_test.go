package doccheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	nameLiteral = regexp.MustCompile(`"(idemcp\.io/[a-z][a-z0-9-]*)"`)
	nameInCell  = regexp.MustCompile("`(idemcp\\.io/[a-z][a-z0-9-]*)")
	codeSpan    = regexp.MustCompile("`([^`]+)`")
)

// TestAnnotationsDocumented checks that every idemcp.io/ annotation, label
// and finalizer the Kubernetes side names in its code has a row in
// docs/annotations.md, and that the README's summary names every one a
// user sets (a row whose "on" column does not say "written by").
func TestAnnotationsDocumented(t *testing.T) {
	page, err := os.ReadFile(filepath.Join(root, "docs", "annotations.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	inCode := map[string]string{}
	for _, dir := range []string{"api", "webhook", "controllers", "cmd"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range nameLiteral.FindAllStringSubmatch(string(src), -1) {
				inCode[m[1]] = rel(path)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(inCode) < 10 {
		t.Fatalf("found only %d idemcp.io/ names in the code: %v", len(inCode), inCode)
	}
	rows := tableRows(section(string(page), "The list"))
	if len(rows) == 0 {
		t.Fatal(`docs/annotations.md has no table under "## The list"`)
	}
	for name, file := range inCode {
		if _, ok := rows[name]; !ok {
			t.Errorf("%s (named in %s) has no row in docs/annotations.md", name, file)
		}
	}
	for name, on := range rows {
		if strings.Contains(on, "written by") {
			continue
		}
		if !strings.Contains(string(readme), "`"+name) {
			t.Errorf("%s is set by users (docs/annotations.md says: on %s) but the README's summary does not name it", name, on)
		}
	}
}

// section returns the text under the level-2 heading title.
func section(page, title string) string {
	_, after, ok := strings.Cut(page, "\n## "+title+"\n")
	if !ok {
		return ""
	}
	body, _, _ := strings.Cut(after, "\n## ")
	return body
}

// tableRows maps each idemcp.io/ name in the first cell of a table row to
// the row's second cell.
func tableRows(page string) map[string]string {
	rows := map[string]string{}
	for _, line := range strings.Split(page, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(line, "|")
		if len(cells) < 4 {
			continue
		}
		for _, m := range nameInCell.FindAllStringSubmatch(cells[1], -1) {
			rows[m[1]] = strings.TrimSpace(cells[2])
		}
	}
	return rows
}
