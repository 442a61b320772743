// Package canonical writes JSON in the RFC 8785 canonical form (JCS), so that
// two argument objects that mean the same thing hash the same: keys sorted by
// UTF-16 code units, numbers in their shortest ECMAScript form, strings with
// the minimal escaping of JSON.stringify.
package canonical

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Transform returns the canonical form of a JSON document.
func Transform(data []byte) ([]byte, error) {
	v, err := Decode(data)
	if err != nil {
		return nil, err
	}
	return Append(nil, v)
}

// Append appends the canonical form of a decoded value to buf.
func Append(buf []byte, v any) ([]byte, error) {
	switch x := v.(type) {
	case nil:
		return append(buf, "null"...), nil
	case bool:
		if x {
			return append(buf, "true"...), nil
		}
		return append(buf, "false"...), nil
	case string:
		return appendString(buf, x), nil
	case json.Number:
		f, err := strconv.ParseFloat(string(x), 64)
		if err != nil {
			// ParseFloat reports out-of-range values with ±Inf, which
			// JSON cannot carry: refuse rather than hash something wrong.
			return nil, fmt.Errorf("number %s is out of the IEEE 754 range", x)
		}
		fits, ok := fitsFloat64(string(x), f)
		if !ok {
			return nil, fmt.Errorf("number %s has an exponent out of range", x)
		}
		if !fits {
			// RFC 8785 would round this to a double, and two different
			// ids (9007199254740993 and 9007199254740992) would hash the
			// same. Keep its exact value instead, in a form no double's
			// canonical text takes.
			return appendExact(buf, string(x))
		}
		return AppendNumber(buf, f)
	case float64:
		return AppendNumber(buf, x)
	case []any:
		buf = append(buf, '[')
		for i, e := range x {
			if i > 0 {
				buf = append(buf, ',')
			}
			var err error
			if buf, err = Append(buf, e); err != nil {
				return nil, err
			}
		}
		return append(buf, ']'), nil
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, compareUTF16)
		buf = append(buf, '{')
		for i, k := range keys {
			if i > 0 {
				buf = append(buf, ',')
			}
			buf = appendString(buf, k)
			buf = append(buf, ':')
			var err error
			if buf, err = Append(buf, x[k]); err != nil {
				return nil, err
			}
		}
		return append(buf, '}'), nil
	default:
		return nil, fmt.Errorf("canonical: unsupported type %T", v)
	}
}

// decimal splits a JSON number literal into sign, significant digits (no
// leading or trailing zeros) and the exponent of its last digit.
func decimal(lit string) (neg bool, digits string, exp int, ok bool) {
	if lit != "" && lit[0] == '-' {
		neg, lit = true, lit[1:]
	}
	mant, e, _ := strings.Cut(strings.ToLower(lit), "e")
	if e != "" {
		var err error
		if exp, err = strconv.Atoi(e); err != nil || exp > 1<<30 || exp < -(1<<30) {
			return false, "", 0, false
		}
	}
	intPart, frac, _ := strings.Cut(mant, ".")
	digits = strings.TrimLeft(intPart+frac, "0")
	exp -= len(frac)
	trimmed := strings.TrimRight(digits, "0")
	exp += len(digits) - len(trimmed)
	if trimmed == "" {
		exp = 0 // zero has no digits and one exponent
	}
	return neg, trimmed, exp, true
}

// fitsFloat64 reports whether the double f's shortest form is the decimal
// value the literal wrote. It is not for subnormals, values past the
// double range and literals with more digits than a double holds: those
// would collide with other values if rounded.
func fitsFloat64(lit string, f float64) (fits, ok bool) {
	_, litDigits, litExp, ok := decimal(lit)
	if !ok {
		return false, false
	}
	_, fDigits, fExp, _ := decimal(strconv.FormatFloat(f, 'e', -1, 64))
	return litDigits == fDigits && litExp == fExp, true
}

func appendExact(buf []byte, lit string) ([]byte, error) {
	neg, digits, exp, ok := decimal(lit)
	if !ok {
		return nil, fmt.Errorf("number %s has an exponent out of range", lit)
	}
	if neg {
		buf = append(buf, '-')
	}
	buf = append(buf, digits...)
	buf = append(buf, 'e')
	return strconv.AppendInt(buf, int64(exp), 10), nil
}

// AppendNumber appends f as ECMAScript's Number.prototype.toString writes it.
func AppendNumber(buf []byte, f float64) ([]byte, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return nil, fmt.Errorf("number %v cannot be represented in JSON", f)
	}
	if f == 0 {
		return append(buf, '0'), nil
	}
	if f < 0 {
		buf = append(buf, '-')
		f = -f
	}
	// Shortest round-tripping digits, as d.ddddde±x.
	var tmp [32]byte
	e := strconv.AppendFloat(tmp[:0], f, 'e', -1, 64)
	mant, exp, _ := strings.Cut(string(e), "e")
	digits := strings.Replace(mant, ".", "", 1)
	x, _ := strconv.Atoi(exp)
	n := x + 1 // the value is 0.digits × 10^n
	k := len(digits)
	switch {
	case k <= n && n <= 21:
		buf = append(buf, digits...)
		for range n - k {
			buf = append(buf, '0')
		}
	case 0 < n && n <= 21:
		buf = append(buf, digits[:n]...)
		buf = append(buf, '.')
		buf = append(buf, digits[n:]...)
	case -6 < n && n <= 0:
		buf = append(buf, "0."...)
		for range -n {
			buf = append(buf, '0')
		}
		buf = append(buf, digits...)
	default:
		buf = append(buf, digits[0])
		if k > 1 {
			buf = append(buf, '.')
			buf = append(buf, digits[1:]...)
		}
		buf = append(buf, 'e')
		if n-1 > 0 {
			buf = append(buf, '+')
		}
		buf = strconv.AppendInt(buf, int64(n-1), 10)
	}
	return buf, nil
}

func appendString(buf []byte, s string) []byte {
	buf = append(buf, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				buf = append(buf, `\ufffd`...)
			} else {
				buf = append(buf, s[i:i+size]...)
			}
			i += size
			continue
		}
		switch c {
		case '"':
			buf = append(buf, `\"`...)
		case '\\':
			buf = append(buf, `\\`...)
		case '\b':
			buf = append(buf, `\b`...)
		case '\f':
			buf = append(buf, `\f`...)
		case '\n':
			buf = append(buf, `\n`...)
		case '\r':
			buf = append(buf, `\r`...)
		case '\t':
			buf = append(buf, `\t`...)
		default:
			if c < 0x20 {
				const hex = "0123456789abcdef"
				buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			} else {
				buf = append(buf, c)
			}
		}
		i++
	}
	return append(buf, '"')
}

// compareUTF16 orders strings by their UTF-16 code units, as RFC 8785 asks.
// It differs from byte order only when a string holds characters outside
// the Basic Multilingual Plane.
func compareUTF16(a, b string) int {
	if isASCII(a) && isASCII(b) {
		return strings.Compare(a, b)
	}
	ua, ub := utf16.Encode([]rune(a)), utf16.Encode([]rune(b))
	return slices.Compare(ua, ub)
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}
