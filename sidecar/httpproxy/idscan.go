package httpproxy

import (
	"bytes"
	"encoding/json"

	"github.com/idemcp/idemcp/sidecar/mcpmsg"
)

// idScanner finds the top-level "id" and "method" members of a JSON object
// written to it in pieces, keeping nothing else: it tells which call a
// response too large to hold answers.
type idScanner struct {
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

const maxScannedID = 1 << 10

func (s *idScanner) Write(b []byte) (int, error) {
	for _, c := range b {
		if s.done || s.bad {
			break
		}
		s.byte(c)
	}
	return len(b), nil
}

func (s *idScanner) byte(c byte) {
	if s.inID && (s.depth != 1 || s.inStr || (c != ',' && c != '}')) {
		if len(s.id) < maxScannedID {
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
			if len(s.key) < 64 {
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
			s.endMember()
			s.done = true
		}
		s.depth--
	case ',':
		if s.depth == 1 {
			s.endMember()
			s.expectKey = true
		}
	case ':':
		if s.depth == 1 {
			switch s.memberName() {
			case "id":
				s.inID, s.id = true, s.id[:0]
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

func (s *idScanner) endMember() { s.inID = false }

func (s *idScanner) memberName() string {
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

// responseID returns the id of the response scanned: a complete object
// with exactly one valid "id" and no "method".
func (s *idScanner) responseID() (json.RawMessage, bool) {
	if !s.done || s.bad || s.method || s.ids != 1 || s.idLong {
		return nil, false
	}
	id := bytes.TrimSpace(s.id)
	if len(id) == 0 || bytes.Equal(id, []byte("null")) {
		return nil, false
	}
	if _, err := mcpmsg.Parse(append(append([]byte(`{"jsonrpc":"2.0","result":{},"id":`), id...), '}')); err != nil {
		return nil, false
	}
	return json.RawMessage(id), true
}
