package canonical

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
	"unsafe"
)

// Decode parses JSON into the value tree the other functions take: objects
// are map[string]any, arrays []any and numbers json.Number, so no precision
// is lost before canonicalization. RFC 8785 takes I-JSON (RFC 7493), so
// what would make two different documents hash the same is refused: a
// duplicate member name, invalid UTF-8, a lone surrogate escape. Trailing
// data is an error.
func Decode(data []byte) (any, error) {
	return decode(data, false)
}

// DecodeShared is Decode for a tree used only while data stays unchanged
// (hashing it at once, say): its strings and numbers share data's memory
// instead of copying it, which saves an allocation per string.
func DecodeShared(data []byte) (any, error) {
	return decode(data, true)
}

func decode(data []byte, shared bool) (any, error) {
	if !utf8.Valid(data) {
		return nil, errors.New("not valid UTF-8")
	}
	p := parser{data: data, shared: shared}
	v, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.space()
	if p.i != len(p.data) {
		return nil, fmt.Errorf("unexpected data after the JSON value at offset %d", p.i)
	}
	return v, nil
}

// maxDepth bounds nesting, so a hostile document cannot exhaust the stack.
const maxDepth = 1000

type parser struct {
	data   []byte
	i      int
	shared bool // strings point into data (DecodeShared)
}

// text returns data[from:to] as a string, shared or copied.
func (p *parser) text(from, to int) string {
	if p.shared && to > from {
		return unsafe.String(&p.data[from], to-from)
	}
	return string(p.data[from:to])
}

func (p *parser) errorf(format string, args ...any) error {
	return fmt.Errorf("offset %d: %s", p.i, fmt.Sprintf(format, args...))
}

func (p *parser) space() {
	for p.i < len(p.data) {
		switch p.data[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *parser) value(depth int) (any, error) {
	if depth > maxDepth {
		return nil, p.errorf("nested deeper than %d", maxDepth)
	}
	p.space()
	if p.i >= len(p.data) {
		return nil, p.errorf("unexpected end of JSON")
	}
	switch c := p.data[p.i]; {
	case c == '{':
		return p.object(depth)
	case c == '[':
		return p.array(depth)
	case c == '"':
		return p.str()
	case c == '-' || (c >= '0' && c <= '9'):
		return p.number()
	default:
		for _, lit := range []struct {
			text string
			v    any
		}{{"true", true}, {"false", false}, {"null", nil}} {
			if len(p.data)-p.i >= len(lit.text) && string(p.data[p.i:p.i+len(lit.text)]) == lit.text {
				p.i += len(lit.text)
				return lit.v, nil
			}
		}
		return nil, p.errorf("invalid character %q", c)
	}
}

func (p *parser) object(depth int) (any, error) {
	p.i++ // {
	m := map[string]any{}
	p.space()
	if p.i < len(p.data) && p.data[p.i] == '}' {
		p.i++
		return m, nil
	}
	for {
		p.space()
		if p.i >= len(p.data) || p.data[p.i] != '"' {
			return nil, p.errorf("expected a member name")
		}
		k, err := p.str()
		if err != nil {
			return nil, err
		}
		if _, dup := m[k]; dup {
			return nil, p.errorf("duplicate member name %q", k)
		}
		p.space()
		if p.i >= len(p.data) || p.data[p.i] != ':' {
			return nil, p.errorf("expected ':' after member name")
		}
		p.i++
		v, err := p.value(depth + 1)
		if err != nil {
			return nil, err
		}
		m[k] = v
		p.space()
		if p.i < len(p.data) && p.data[p.i] == ',' {
			p.i++
			continue
		}
		if p.i < len(p.data) && p.data[p.i] == '}' {
			p.i++
			return m, nil
		}
		return nil, p.errorf("expected ',' or '}' in object")
	}
}

func (p *parser) array(depth int) (any, error) {
	p.i++ // [
	a := []any{}
	p.space()
	if p.i < len(p.data) && p.data[p.i] == ']' {
		p.i++
		return a, nil
	}
	for {
		v, err := p.value(depth + 1)
		if err != nil {
			return nil, err
		}
		a = append(a, v)
		p.space()
		if p.i < len(p.data) && p.data[p.i] == ',' {
			p.i++
			continue
		}
		if p.i < len(p.data) && p.data[p.i] == ']' {
			p.i++
			return a, nil
		}
		return nil, p.errorf("expected ',' or ']' in array")
	}
}

// str reads a string. Escapes are checked for lone surrogates, which
// encoding/json would turn into U+FFFD, making "\ud800" and "\udc00" equal.
func (p *parser) str() (string, error) {
	start := p.i
	p.i++ // "
	escaped := false
	for p.i < len(p.data) {
		c := p.data[p.i]
		switch {
		case c == '"':
			p.i++
			raw := p.data[start:p.i]
			if !escaped {
				return p.text(start+1, p.i-1), nil
			}
			var s string
			if err := json.Unmarshal(raw, &s); err != nil {
				return "", p.errorf("invalid string: %v", err)
			}
			return s, nil
		case c == '\\':
			escaped = true
			if p.i+1 >= len(p.data) {
				return "", p.errorf("unterminated string")
			}
			if p.data[p.i+1] != 'u' {
				p.i += 2
				continue
			}
			r, ok := p.hex4(p.i + 2)
			if !ok {
				return "", p.errorf("invalid \\u escape")
			}
			switch {
			case r >= 0xD800 && r <= 0xDBFF:
				low, ok := p.hex4(p.i + 8)
				if !ok || p.data[p.i+6] != '\\' || p.data[p.i+7] != 'u' || low < 0xDC00 || low > 0xDFFF {
					return "", p.errorf("lone surrogate \\u%04x (not I-JSON)", r)
				}
				p.i += 12
			case r >= 0xDC00 && r <= 0xDFFF:
				return "", p.errorf("lone surrogate \\u%04x (not I-JSON)", r)
			default:
				p.i += 6
			}
		case c < 0x20:
			return "", p.errorf("control character in string")
		default:
			p.i++
		}
	}
	return "", p.errorf("unterminated string")
}

func (p *parser) hex4(at int) (rune, bool) {
	if at+4 > len(p.data) {
		return 0, false
	}
	v, err := strconv.ParseUint(string(p.data[at:at+4]), 16, 16)
	return rune(v), err == nil
}

func (p *parser) number() (any, error) {
	start := p.i
	if p.data[p.i] == '-' {
		p.i++
	}
	digits := func() int {
		n := 0
		for p.i < len(p.data) && p.data[p.i] >= '0' && p.data[p.i] <= '9' {
			p.i++
			n++
		}
		return n
	}
	intStart := p.i
	if n := digits(); n == 0 || (n > 1 && p.data[intStart] == '0') {
		return nil, p.errorf("invalid number")
	}
	if p.i < len(p.data) && p.data[p.i] == '.' {
		p.i++
		if digits() == 0 {
			return nil, p.errorf("invalid number")
		}
	}
	if p.i < len(p.data) && (p.data[p.i] == 'e' || p.data[p.i] == 'E') {
		p.i++
		if p.i < len(p.data) && (p.data[p.i] == '+' || p.data[p.i] == '-') {
			p.i++
		}
		if digits() == 0 {
			return nil, p.errorf("invalid number")
		}
	}
	return json.Number(p.text(start, p.i)), nil
}
