// Package idscan finds the top-level "id" and "method" members of a JSON
// object written to it in pieces, in one pass and constant memory: it
// tells whom to answer about a message too large to hold (an SSE event
// over the limit, a stdio line over the limit), which both transports
// relay or skip without keeping.
package idscan

import (
	"bytes"
	"encoding/json"
)

// Limits: a longer id is not answered; a longer member name is no "id".
const (
	MaxID   = 1 << 10
	maxName = 64
)

// Scanner is an io.Writer that keeps only what it needs of the object.
// The zero value is ready.
type Scanner struct {
	depth     int
	inStr     bool
	esc       bool
	expectKey bool // at depth 1, the next string is a member name
	inKey     bool
	key       []byte
	keyLong   bool
	inID      bool // reading the "id" member's value
	id        []byte
	idLong    bool
	ids       int
	method    bool
	done      bool // the object ended
	bad       bool // not an object
}

// Write scans b; it never fails.
func (s *Scanner) Write(b []byte) (int, error) {
	for _, c := range b {
		if s.done || s.bad {
			break
		}
		s.byte(c)
	}
	return len(b), nil
}

func (s *Scanner) byte(c byte) {
	if s.inID && (s.depth != 1 || s.inStr || (c != ',' && c != '}')) {
		if len(s.id) < MaxID {
			s.id = append(s.id, c)
		} else {
			s.idLong = true
		}
	}
	if s.inStr {
		switch {
		case s.esc:
			s.esc = false
		case c == '\\':
			s.esc = true
		case c == '"':
			s.inStr = false
			if s.inKey {
				s.inKey = false
				return
			}
		}
		if s.inKey {
			if len(s.key) < maxName {
				s.key = append(s.key, c)
			} else {
				s.keyLong = true
			}
		}
		return
	}
	switch c {
	case ' ', '\t', '\r', '\n':
	case '"':
		s.inStr = true
		if s.depth == 1 && s.expectKey {
			s.inKey, s.expectKey = true, false
			s.key, s.keyLong = s.key[:0], false
		}
	case '{', '[':
		if s.depth == 0 && c != '{' {
			s.bad = true
		}
		s.depth++
		if s.depth == 1 {
			s.expectKey = true
		}
	case '}', ']':
		if s.depth == 1 {
			s.inID = false
			s.done = true
		}
		s.depth--
	case ',':
		if s.depth == 1 {
			s.inID = false
			s.expectKey = true
		}
	case ':':
		if s.depth == 1 {
			switch s.memberName() {
			case "id":
				s.inID, s.id, s.idLong = true, s.id[:0], false
				s.ids++
			case "method":
				s.method = true
			}
		}
	default:
		if s.depth == 0 {
			s.bad = true
		}
	}
}

func (s *Scanner) memberName() string {
	if s.keyLong {
		return ""
	}
	if bytes.IndexByte(s.key, '\\') < 0 {
		return string(s.key)
	}
	var name string
	if json.Unmarshal(append(append([]byte{'"'}, s.key...), '"'), &name) != nil {
		return ""
	}
	return name
}

// ID is the value of the last top-level "id" member seen, when it is a
// JSON string or number of at most MaxID bytes; else nil. The object need
// not have ended: a number at the end of what was written counts.
func (s *Scanner) ID() json.RawMessage {
	if s.bad || s.idLong || s.ids == 0 {
		return nil
	}
	id := bytes.TrimSpace(s.id)
	if len(id) == 0 || !json.Valid(id) {
		return nil
	}
	if c := id[0]; c != '"' && c != '-' && (c < '0' || c > '9') {
		return nil // an object, an array, true, false or null
	}
	return json.RawMessage(bytes.Clone(id))
}

// Method reports a top-level "method" member.
func (s *Scanner) Method() bool { return s.method }

// IDs counts the top-level "id" members.
func (s *Scanner) IDs() int { return s.ids }

// Complete reports that one whole object was written.
func (s *Scanner) Complete() bool { return s.done && !s.bad }
