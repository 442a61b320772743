package canonical

import (
	"fmt"
	"strconv"
	"strings"
)

// Pointer is a parsed RFC 6901 JSON pointer.
type Pointer []string

// ParsePointer parses a JSON pointer such as "/order/requestedAt".
// The empty pointer (the whole document) is refused: ignoring everything
// would make every call a duplicate of every other.
func ParsePointer(s string) (Pointer, error) {
	if s == "" {
		return nil, fmt.Errorf("%q is the whole document; name a member such as /requestedAt", s)
	}
	if s[0] != '/' {
		return nil, fmt.Errorf("%q must start with '/' (a JSON pointer, RFC 6901, such as /requestedAt)", s)
	}
	parts := strings.Split(s[1:], "/")
	for i, p := range parts {
		for j := 0; j < len(p); j++ {
			if p[j] == '~' && (j+1 == len(p) || (p[j+1] != '0' && p[j+1] != '1')) {
				return nil, fmt.Errorf("%q has a '~' not followed by 0 or 1 (write ~0 for '~' and ~1 for '/')", s)
			}
		}
		parts[i] = strings.NewReplacer("~1", "/", "~0", "~").Replace(p)
	}
	return parts, nil
}

// Remove deletes the member the pointer names from a decoded value, if it
// exists. Array elements are addressed by index; the array closes up.
func (p Pointer) Remove(v any) any {
	if len(p) == 0 {
		return v
	}
	switch x := v.(type) {
	case map[string]any:
		if len(p) == 1 {
			delete(x, p[0])
			return x
		}
		if child, ok := x[p[0]]; ok {
			x[p[0]] = p[1:].Remove(child)
		}
		return x
	case []any:
		i, err := strconv.Atoi(p[0])
		if err != nil || i < 0 || i >= len(x) || (len(p[0]) > 1 && p[0][0] == '0') {
			return x
		}
		if len(p) == 1 {
			return append(x[:i:i], x[i+1:]...)
		}
		x[i] = p[1:].Remove(x[i])
		return x
	default:
		return v
	}
}
