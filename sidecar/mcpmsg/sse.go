package mcpmsg

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// Event is one server-sent event: Raw is exactly what was read (to be
// relayed untouched), Data the joined data lines.
type Event struct {
	Raw  []byte
	Data []byte
}

// EventReader reads server-sent events one at a time, so that each can be
// flushed to the client as soon as it arrives.
type EventReader struct {
	r       *bufio.Reader
	maxSize int
}

// NewEventReader reads events of at most maxSize bytes from r.
func NewEventReader(r io.Reader, maxSize int) *EventReader {
	return &EventReader{r: bufio.NewReaderSize(r, 32<<10), maxSize: maxSize}
}

// ErrEventTooLarge is returned for an event over the reader's limit, with
// what was read of it so far; the rest of the stream is Rest.
var ErrEventTooLarge = errors.New("server-sent event over the size limit")

// SkipEvent copies the rest of an event Next refused as too large to w,
// up to its end, so the caller can go on reading events after it.
func (er *EventReader) SkipEvent(w io.Writer) (int64, error) {
	var n int64
	for {
		line, err := er.r.ReadSlice('\n')
		m, _ := w.Write(line)
		n += int64(m)
		if err == nil && len(bytes.TrimRight(line, "\r\n")) == 0 {
			return n, nil
		}
		if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
			return n, err
		}
	}
}

// Rest is the stream after what Next returned, for a caller that stops
// parsing (after ErrEventTooLarge) and copies the rest as it is.
func (er *EventReader) Rest() io.Reader { return er.r }

// Next returns the next event. At the end of the stream it returns io.EOF;
// a partial event at the end is returned with io.ErrUnexpectedEOF.
func (er *EventReader) Next() (Event, error) {
	var raw, data []byte
	sawData := false
	for {
		line, err := er.r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A long line: gather it whole.
			full := append([]byte(nil), line...)
			for errors.Is(err, bufio.ErrBufferFull) {
				if len(raw)+len(full) > er.maxSize {
					return Event{Raw: append(raw, full...)}, ErrEventTooLarge
				}
				line, err = er.r.ReadSlice('\n')
				full = append(full, line...)
			}
			line = full
		}
		if len(line) > 0 {
			raw = append(raw, line...)
			if len(raw) > er.maxSize {
				return Event{Raw: raw}, fmt.Errorf("%w (%d bytes)", ErrEventTooLarge, er.maxSize)
			}
		}
		content := bytes.TrimRight(line, "\r\n")
		if len(content) == 0 && err == nil {
			if len(raw) == len(line) { // blank lines between events
				raw = raw[:0]
				continue
			}
			return Event{Raw: raw, Data: data}, nil
		}
		if v, ok := bytes.CutPrefix(content, []byte("data:")); ok {
			v = bytes.TrimPrefix(v, []byte(" "))
			if sawData {
				data = append(data, '\n')
			}
			data = append(data, v...)
			sawData = true
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				if len(bytes.TrimSpace(raw)) > 0 {
					return Event{Raw: raw, Data: data}, io.ErrUnexpectedEOF
				}
				return Event{}, io.EOF
			}
			return Event{}, err
		}
	}
}

// AppendEvent appends an SSE "message" event carrying data.
func AppendEvent(buf, data []byte) []byte {
	buf = append(buf, "event: message\ndata: "...)
	buf = append(buf, data...)
	return append(buf, "\n\n"...)
}
