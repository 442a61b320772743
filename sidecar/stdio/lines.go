package stdio

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"sync"
)

// lineReader reads newline-delimited messages of at most max bytes. A
// longer line is skipped without being held in memory: only its size and,
// if they can be seen on the way, its id and whether it has a method are
// kept, so that its sender can be answered.
type lineReader struct {
	r   *bufio.Reader
	max int
	err error
}

// overlong describes a line that was over the limit and was skipped.
type overlong struct {
	size   int64
	id     json.RawMessage // nil when no top-level id was found
	method bool
}

func newLineReader(r io.Reader, limit int) *lineReader {
	return newLineReaderSize(r, limit, 64<<10)
}

func newLineReaderSize(r io.Reader, limit, size int) *lineReader {
	return &lineReader{r: bufio.NewReaderSize(r, size), max: limit}
}

// next returns the next line without its newline, or a description of a
// line that was over the limit. A last line without a newline is returned
// before the reader's error.
func (lr *lineReader) next() ([]byte, *overlong, error) {
	if lr.err != nil {
		return nil, nil, lr.err
	}
	var line []byte
	for {
		chunk, err := lr.r.ReadSlice('\n')
		content := chunk
		if err == nil {
			content = chunk[:len(chunk)-1]
		}
		if len(line)+len(content) > lr.max {
			return nil, lr.skip(line, chunk, err), nil
		}
		switch {
		case err == nil:
			if line == nil {
				return bytes.Clone(content), nil, nil
			}
			return append(line, content...), nil, nil
		case errors.Is(err, bufio.ErrBufferFull):
			line = append(line, chunk...)
		default:
			lr.err = err
			line = append(line, chunk...)
			if len(line) > 0 {
				return line, nil, nil
			}
			return nil, nil, err
		}
	}
}

// skip consumes the rest of an over-long line, scanning it for its id.
func (lr *lineReader) skip(prefix, chunk []byte, err error) *overlong {
	var sc idScanner
	sc.feed(prefix)
	size := int64(len(prefix))
	for {
		if err == nil {
			sc.feed(chunk[:len(chunk)-1])
			size += int64(len(chunk) - 1)
			break
		}
		sc.feed(chunk)
		size += int64(len(chunk))
		if !errors.Is(err, bufio.ErrBufferFull) {
			lr.err = err
			break
		}
		chunk, err = lr.r.ReadSlice('\n')
	}
	return &overlong{size: size, id: sc.result(), method: sc.method}
}

// idScanner finds the top-level "id" of a JSON object streamed through it
// in pieces, and notes a top-level "method", in one pass and constant
// memory.
type idScanner struct {
	depth    int
	inString bool
	escaped  bool
	wantKey  bool // at depth 1 the next string is a member name
	inKey    bool
	key      []byte
	keyLong  bool
	val      int
	id       []byte
	idLong   bool
	gotID    bool
	method   bool
}

const (
	valNone = iota
	valNext
	valString
	valNumber
)

// maxIDBytes bounds a remembered id; a longer one is not answered.
const maxIDBytes = 256

func (s *idScanner) feed(b []byte) {
	for _, c := range b {
		s.byte(c)
	}
}

func (s *idScanner) keep(c byte) {
	if len(s.id) < maxIDBytes {
		s.id = append(s.id, c)
	} else {
		s.idLong = true
	}
}

func (s *idScanner) byte(c byte) {
	if s.inString {
		switch {
		case s.escaped:
			s.escaped = false
		case c == '\\':
			s.escaped = true
		case c == '"':
			s.inString = false
			s.inKey = false
			if s.val == valString {
				s.keep(c)
				s.val = valNone
				s.gotID = !s.idLong
			}
			return
		}
		if s.inKey {
			if len(s.key) < 16 {
				s.key = append(s.key, c)
			} else {
				s.keyLong = true
			}
		}
		if s.val == valString {
			s.keep(c)
		}
		return
	}
	if s.val == valNumber {
		if (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E' {
			s.keep(c)
			return
		}
		s.val = valNone
		s.gotID = !s.idLong
	}
	switch c {
	case ' ', '\t', '\r', '\n':
	case '"':
		s.inString = true
		switch {
		case s.depth == 1 && s.wantKey:
			s.wantKey, s.inKey, s.keyLong = false, true, false
			s.key = s.key[:0]
		case s.val == valNext:
			s.val, s.idLong, s.gotID = valString, false, false
			s.id = append(s.id[:0], '"')
		}
	case ':':
		if s.depth == 1 && !s.keyLong {
			switch string(s.key) {
			case "id":
				s.val = valNext
			case "method":
				s.method = true
			}
		}
	case ',':
		if s.depth == 1 {
			s.wantKey = true
		}
	case '{', '[':
		s.depth++
		s.wantKey = s.depth == 1 && c == '{'
		s.val = valNone
	case '}', ']':
		s.depth--
	default:
		if s.val == valNext {
			s.val = valNone
			if c == '-' || (c >= '0' && c <= '9') {
				s.val, s.idLong, s.gotID = valNumber, false, false
				s.id = append(s.id[:0], c)
			}
		}
	}
}

// result returns the id found, or nil.
func (s *idScanner) result() json.RawMessage {
	if s.val == valNumber {
		s.gotID = !s.idLong
	}
	if !s.gotID || !json.Valid(s.id) {
		return nil
	}
	return json.RawMessage(s.id)
}

// lineWriter writes whole lines; concurrent writers never interleave.
// After the first write error every write fails with it.
type lineWriter struct {
	mu  sync.Mutex
	w   *bufio.Writer
	c   io.Closer
	err error
}

var errClosed = errors.New("closed")

func newLineWriter(w io.Writer, c io.Closer) *lineWriter {
	return &lineWriter{w: bufio.NewWriterSize(w, 64<<10), c: c}
}

func (l *lineWriter) writeLine(b []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return l.err
	}
	_, _ = l.w.Write(b)
	_ = l.w.WriteByte('\n')
	if err := l.w.Flush(); err != nil {
		l.err = err
	}
	return l.err
}

// close ends the stream: the reader sees EOF, later writes fail.
func (l *lineWriter) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		l.err = errClosed
	}
	if l.c != nil {
		_ = l.c.Close()
		l.c = nil
	}
}
