package doccheck

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestPolicyFieldsDocumented checks that every field of the
// IdempotencyPolicy spec has a row in docs/policy.md's field table (or, for
// the parts of a structured field such as store.redis.managed, is named in
// its parent's row), and that the README's summary names every top-level
// field.
func TestPolicyFieldsDocumented(t *testing.T) {
	page, err := os.ReadFile(filepath.Join(root, "docs", "policy.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	rows := fieldRows(section(string(page), "Fields"))
	if len(rows) == 0 {
		t.Fatal(`docs/policy.md has no field table under "## Fields"`)
	}
	summary := fieldRows(readmeSection(string(readme), "Policy fields"))
	specType := reflect.TypeFor[v1alpha1.IdempotencyPolicySpec]()
	for _, f := range fields(specType, "") {
		if _, ok := rows[f]; ok {
			continue
		}
		parent, last := f, f[strings.LastIndex(f, ".")+1:]
		documented := false
		for {
			i := strings.LastIndex(parent, ".")
			if i < 0 {
				break
			}
			parent = parent[:i]
			if row, ok := rows[parent]; ok {
				documented = strings.Contains(row, "`"+last)
				break
			}
		}
		if !documented {
			t.Errorf("spec.%s has no row in docs/policy.md's field table", f)
		}
	}
	for i := range specType.NumField() {
		name := jsonName(specType.Field(i))
		if _, ok := summary[name]; !ok {
			t.Errorf("spec.%s is missing from the README's policy field summary", name)
		}
	}
}

// fields lists the JSON paths of a spec type's fields (tools[].name),
// descending into the api package's own structs except SecretKeyRef, which
// its parent's row describes. A struct it descends into is not listed
// itself: its fields are.
func fields(t reflect.Type, prefix string) []string {
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		name := jsonName(f)
		if name == "" {
			continue
		}
		path := prefix + name
		ft := f.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			if ft.Kind() == reflect.Slice {
				path += "[]"
			}
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && ft.PkgPath() == reflect.TypeFor[v1alpha1.IdempotencyPolicySpec]().PkgPath() &&
			ft != reflect.TypeFor[v1alpha1.SecretKeyRef]() {
			out = append(out, fields(ft, path+".")...)
			continue
		}
		out = append(out, strings.TrimSuffix(path, "[]"))
	}
	return out
}

func jsonName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	return name
}

// fieldRows maps each backticked name in the first cell of a table row to
// the whole row.
func fieldRows(text string) map[string]string {
	rows := map[string]string{}
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(line, "|")
		for _, m := range codeSpan.FindAllStringSubmatch(cells[1], -1) {
			rows[m[1]] = line
		}
	}
	return rows
}

// readmeSection returns the text under the level-3 heading title.
func readmeSection(page, title string) string {
	_, after, ok := strings.Cut(page, "\n### "+title+"\n")
	if !ok {
		return ""
	}
	body, _, _ := strings.Cut(after, "\n#")
	return body
}
