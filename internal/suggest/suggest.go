// Package suggest finds the name a typo probably meant, for "did you mean"
// hints in errors about flags and policy fields.
package suggest

import "strings"

// Closest returns the candidate nearest to word, or "" when none is near
// enough to be a likely typo: at most a third of word's letters differ
// (at least one), compared without regard to case; else the one candidate
// that begins with word (an abbreviation, such as ignoreArgs).
func Closest(word string, candidates []string) string {
	if c := nearest(word, candidates); c != "" {
		return c
	}
	var found string
	for _, c := range candidates {
		w := strings.ToLower(word)
		if len(w) >= 3 && strings.HasPrefix(strings.ToLower(c), strings.TrimSuffix(w, "s")) {
			if found != "" {
				return ""
			}
			found = c
		}
	}
	return found
}

func nearest(word string, candidates []string) string {
	best, bestDist := "", len(word)/3+1
	if bestDist < 2 {
		bestDist = 2
	}
	lw := strings.ToLower(word)
	for _, c := range candidates {
		if d := distance(lw, strings.ToLower(c)); d < bestDist {
			best, bestDist = c, d
		}
	}
	return best
}

// distance is the Levenshtein distance of a and b, in bytes.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
