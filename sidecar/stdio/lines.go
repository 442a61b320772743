package stdio

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"sync"

	"github.com/idemcp/idemcp/sidecar/idscan"
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
	var sc idscan.Scanner
	_, _ = sc.Write(prefix)
	size := int64(len(prefix))
	for {
		if err == nil {
			_, _ = sc.Write(chunk[:len(chunk)-1])
			size += int64(len(chunk) - 1)
			break
		}
		_, _ = sc.Write(chunk)
		size += int64(len(chunk))
		if !errors.Is(err, bufio.ErrBufferFull) {
			lr.err = err
			break
		}
		chunk, err = lr.r.ReadSlice('\n')
	}
	return &overlong{size: size, id: sc.ID(), method: sc.Method()}
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
