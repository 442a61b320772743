package policystream

import (
	"bufio"
	"errors"
	"io"
	"strings"
	"testing"
)

// TestReadLine: reports shorter and longer than the read buffer come
// whole, a last line without a newline too, and one over the limit ends
// the stream.
func TestReadLine(t *testing.T) {
	long := strings.Repeat("x", 3*reportReadBuffer+7)
	br := bufio.NewReaderSize(strings.NewReader("short\n"+long+"\n\nlast"), reportReadBuffer)
	for _, want := range []string{"short", long, "", "last"} {
		got, err := readLine(br, 1<<20)
		if err != nil || string(got) != want {
			t.Fatalf("got %d bytes, %v; want %d bytes", len(got), err, len(want))
		}
	}
	if _, err := readLine(br, 1<<20); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last line: %v, want EOF", err)
	}
	br = bufio.NewReaderSize(strings.NewReader(long+"\n"), reportReadBuffer)
	if _, err := readLine(br, reportReadBuffer); !errors.Is(err, errLineTooLong) {
		t.Fatalf("a line over the limit: %v, want errLineTooLong", err)
	}
}
