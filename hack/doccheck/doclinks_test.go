package doccheck

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

const root = "../.."

// TestDocLinks follows every relative link of README.md and docs/*.md: the
// file must exist, and an #anchor must name a heading of the target page
// (as GitHub makes anchors from headings).
func TestDocLinks(t *testing.T) {
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{filepath.Join(root, "README.md")}, pages...)
	if len(pages) < 2 {
		t.Fatalf("no docs/*.md found next to README.md")
	}
	checked := 0
	for _, page := range pages {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range links(string(text)) {
			checked++
			if err := resolve(page, l.target); err != nil {
				t.Errorf("%s:%d: link %q: %v", rel(page), l.line, l.target, err)
			}
		}
	}
	t.Logf("%d relative links checked in %d pages", checked, len(pages))
}

func rel(p string) string {
	r, err := filepath.Rel(root, p)
	if err != nil {
		return p
	}
	return r
}

type link struct {
	target string
	line   int
}

var (
	linkRE = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeRE = regexp.MustCompile("`[^`]*`")
)

// links returns the relative link targets of a markdown page, outside code
// blocks and code spans.
func links(text string) []link {
	var out []link
	fence := false
	for i, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fence = !fence
			continue
		}
		if fence {
			continue
		}
		line = codeRE.ReplaceAllString(line, "code")
		for _, m := range linkRE.FindAllStringSubmatch(line, -1) {
			target := m[1]
			if u, err := url.Parse(target); err == nil && u.Scheme != "" {
				continue // http(s), mailto: not checked here
			}
			out = append(out, link{target: target, line: i + 1})
		}
	}
	return out
}

func resolve(from, target string) error {
	path, anchor, _ := strings.Cut(target, "#")
	file := from
	if path != "" {
		file = filepath.Join(filepath.Dir(from), filepath.FromSlash(path))
		if _, err := os.Stat(file); err != nil {
			return fmt.Errorf("%s does not exist", rel(file))
		}
	}
	if anchor == "" {
		return nil
	}
	if !strings.HasSuffix(file, ".md") {
		return fmt.Errorf("an anchor into %s, which is not a markdown page", rel(file))
	}
	text, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	ids := anchors(string(text))
	if !ids[anchor] {
		return fmt.Errorf("%s has no heading with the anchor #%s", rel(file), anchor)
	}
	return nil
}

// anchors returns the anchors GitHub gives the headings of a page.
func anchors(text string) map[string]bool {
	ids := map[string]bool{}
	seen := map[string]int{}
	fence := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fence = !fence
			continue
		}
		if fence || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimLeft(line, "#")
		if !strings.HasPrefix(h, " ") {
			continue
		}
		id := slug(h)
		if n := seen[id]; n > 0 {
			ids[fmt.Sprintf("%s-%d", id, n)] = true
		} else {
			ids[id] = true
		}
		seen[id]++
	}
	return ids
}

// slug is GitHub's heading anchor: lower case, letters, digits, '-' and
// '_' kept, spaces turned into '-', everything else dropped.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

func TestSlug(t *testing.T) {
	for heading, want := range map[string]string{
		" See it on Kubernetes: `make demo`":         "see-it-on-kubernetes-make-demo",
		" Leases, `onAbandoned` and failover":        "leases-onabandoned-and-failover",
		" Legacy HTTP+SSE (2024-11-05)":              "legacy-httpsse-2024-11-05",
		" Every call gets -32013":                    "every-call-gets--32013",
		" `idemcp sidecar`":                          "idemcp-sidecar",
		" Try it in two minutes, without Kubernetes": "try-it-in-two-minutes-without-kubernetes",
	} {
		if got := slug(heading); got != want {
			t.Errorf("slug(%q) = %q, want %q", heading, got, want)
		}
	}
}

func TestAnchorsSkipCodeAndNumberDuplicates(t *testing.T) {
	page := "# Title\n\n```sh\n# not a heading\n```\n\n## Status\n\n### Status\n"
	got := anchors(page)
	for _, want := range []string{"title", "status", "status-1"} {
		if !got[want] {
			t.Errorf("anchors lack %q: %v", want, got)
		}
	}
	if got["not-a-heading"] {
		t.Errorf("a comment in a code block counted as a heading: %v", got)
	}
}
