package bounded_test

import (
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/idemcp/idemcp/internal/bounded"
)

func TestList(t *testing.T) {
	var names []string
	for i := range 1000 {
		names = append(names, fmt.Sprintf("Deployment/w%d", i))
	}
	for _, tc := range []struct {
		n    int
		want string
	}{
		{0, ""},
		{2, "Deployment/w0, Deployment/w1"},
		{10, "Deployment/w0, Deployment/w1, Deployment/w2, Deployment/w3, Deployment/w4, Deployment/w5, Deployment/w6, Deployment/w7, Deployment/w8, Deployment/w9"},
		{1000, "Deployment/w0, Deployment/w1, Deployment/w2, Deployment/w3, Deployment/w4, Deployment/w5, Deployment/w6, Deployment/w7, Deployment/w8, Deployment/w9 and 990 more"},
	} {
		if got := bounded.List(names[:tc.n]); got != tc.want {
			t.Errorf("List of %d = %q, want %q", tc.n, got, tc.want)
		}
	}
	if got := bounded.Count(1, "pod", "pods", []string{"a"}); got != "1 pod (a)" {
		t.Errorf("Count = %q", got)
	}
}

func TestCut(t *testing.T) {
	s := strings.Repeat("é", 3000)
	got := bounded.Message(s)
	if len(got) > bounded.MessageBytes || !utf8.ValidString(got) || !strings.HasSuffix(got, "(cut)") {
		t.Errorf("Message: %d bytes, valid %v, %q", len(got), utf8.ValidString(got), got[len(got)-20:])
	}
	if bounded.Note("short") != "short" {
		t.Error("a short note was changed")
	}
}
