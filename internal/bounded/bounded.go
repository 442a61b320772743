// Package bounded keeps what idemcp writes into a status or an Event
// within the API server's limits however large the cluster grows: a list
// of names shows its first few and says "and N more", and a message past
// its limit is cut, saying so. A status write the API server refuses
// ("Too long") would freeze every condition, observedGeneration included.
package bounded

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

const (
	// Names is how many names a list shows.
	Names = 10
	// MessageBytes bounds a condition message (the API allows 32768; three
	// conditions and the rest of the status stay far below an object's
	// limit with this).
	MessageBytes = 4096
	// NoteBytes is the limit of an Event's note (events.k8s.io/v1).
	NoteBytes = 1024
)

// List joins the first Names of names with ", ", and says how many more
// there are.
func List(names []string) string { return ListN(names, Names) }

// ListN is List with its own bound.
func ListN(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:n], ", "), len(names)-n)
}

// Count says "1 pod (a)" or "12 pods (a, b, ... and 2 more)".
func Count(n int, one, many string, names []string) string {
	noun := many
	if n == 1 {
		noun = one
	}
	if len(names) == 0 {
		return fmt.Sprintf("%d %s", n, noun)
	}
	return fmt.Sprintf("%d %s (%s)", n, noun, List(names))
}

// Message cuts s to MessageBytes.
func Message(s string) string { return Cut(s, MessageBytes) }

// Note cuts s to NoteBytes.
func Note(s string) string { return Cut(s, NoteBytes) }

// Cut cuts s to at most n bytes, on a rune boundary, ending in a mark
// that says it was cut.
func Cut(s string, n int) string {
	const mark = " ... (cut)"
	if len(s) <= n {
		return s
	}
	end := n - len(mark)
	for end > 0 && !utf8.RuneStart(s[end]) {
		end--
	}
	return s[:end] + mark
}
