package stdio

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
)

func TestLineReader(t *testing.T) {
	big := strings.Repeat("x", 200)
	type out struct {
		line   string // a line returned whole
		over   string // a line skipped: its text, to compute its size
		id     string
		method bool
	}
	tests := []struct {
		name  string
		input string
		limit int
		want  []out
	}{
		{"lines", "a\nbb\n\nccc\n", 10, []out{{line: "a"}, {line: "bb"}, {line: ""}, {line: "ccc"}}},
		{"last line without newline", "a\nbb", 10, []out{{line: "a"}, {line: "bb"}}},
		{"crlf kept", "a\r\nb\n", 10, []out{{line: "a\r"}, {line: "b"}}},
		{"exactly the limit", "12345\n", 5, []out{{line: "12345"}}},
		{"over, id first", `{"id":7,"method":"x","p":"` + big + `"}` + "\nok\n", 50,
			[]out{{over: `{"id":7,"method":"x","p":"` + big + `"}`, id: "7", method: true}, {line: "ok"}}},
		{"over, id last", `{"method":"x","p":{"id":1,"q":"` + big + `"},"id":"late"}` + "\nok\n", 50,
			[]out{{over: `{"method":"x","p":{"id":1,"q":"` + big + `"},"id":"late"}`, id: `"late"`, method: true}, {line: "ok"}}},
		{"over, response at EOF", `{"result":{"id":3,"x":"` + big + `"},"id":-1.5e3}`, 50,
			[]out{{over: `{"result":{"id":3,"x":"` + big + `"},"id":-1.5e3}`, id: "-1.5e3"}}},
		{"over, escaped quote in id", `{"id":"a\"b","m":"` + big + `"}` + "\n", 50,
			[]out{{over: `{"id":"a\"b","m":"` + big + `"}`, id: `"a\"b"`}}},
		{"over, object id is no id", `{"id":{"a":1},"method":"` + big + `"}` + "\n", 50,
			[]out{{over: `{"id":{"a":1},"method":"` + big + `"}`, method: true}}},
		{"over, nested id is no id", `{"params":{"id":9},"x":"` + big + `"}` + "\n", 50,
			[]out{{over: `{"params":{"id":9},"x":"` + big + `"}`}}},
		{"over, value that looks like a key", `{"x":"\"id\":5","y":"` + big + `"}` + "\n", 50,
			[]out{{over: `{"x":"\"id\":5","y":"` + big + `"}`}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// A small buffer makes long lines arrive in many pieces.
			lr := newLineReaderSize(strings.NewReader(tc.input), tc.limit, 16)
			var got, want []string
			for _, w := range tc.want {
				if w.over != "" {
					want = append(want, fmt.Sprintf("over(%d bytes, id %q, method %v)", len(w.over), w.id, w.method))
				} else {
					want = append(want, fmt.Sprintf("%q", w.line))
				}
			}
			for {
				line, over, err := lr.next()
				switch {
				case over != nil:
					got = append(got, fmt.Sprintf("over(%d bytes, id %q, method %v)", over.size, over.id, over.method))
				case line != nil:
					got = append(got, fmt.Sprintf("%q", line))
				}
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if strings.Join(got, "\n") != strings.Join(want, "\n") {
				t.Errorf("got:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
		})
	}
}
