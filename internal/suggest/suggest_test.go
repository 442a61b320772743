package suggest

import "testing"

func TestClosest(t *testing.T) {
	fields := []string{"name", "mode", "ttl", "keyScope", "onAbandoned", "cacheToolErrors", "ignoreArguments"}
	for word, want := range map[string]string{
		"mod":        "mode",
		"tll":        "ttl",
		"keyscope":   "keyScope",
		"onAbandon":  "onAbandoned",
		"ignoreArgs": "ignoreArguments",
		"color":      "",
		"x":          "",
	} {
		if got := Closest(word, fields); got != want {
			t.Errorf("Closest(%q) = %q, want %q", word, got, want)
		}
	}
	if got := Closest("lisen", []string{"listen", "upstream"}); got != "listen" {
		t.Errorf("Closest(lisen) = %q", got)
	}
}
