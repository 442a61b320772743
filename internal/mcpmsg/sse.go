package mcpmsg

import (
	"bytes"
	"errors"
	"fmt"
	"io"
)

// Event is one server-sent event, parsed as the WHATWG HTML specification
// says (section 9.2.6, "Interpreting an event stream").
type Event struct {
	// Raw is every byte read for the event, exactly: the blank lines and
	// comments before it, its lines, and the blank line that ends it.
	// The Raw of successive events put together is the stream itself.
	Raw []byte
	// Name is the value of the last "event" field ("" when none, which
	// the specification dispatches as "message").
	Name string
	// Data is the values of the "data" fields joined by "\n".
	Data []byte
	// HasData reports at least one "data" field: only such events are
	// dispatched by the specification (Data may still be empty).
	HasData bool
	// ID is the value of the last valid "id" field, if HasID.
	ID    string
	HasID bool
}

// ErrEventTooLarge is returned by Next for an event over the reader's
// limit, with what was read of it so far; SkipEvent reads the rest.
var ErrEventTooLarge = errors.New("server-sent event over the size limit")

// EventReader reads server-sent events one at a time, so that each can be
// relayed as soon as it is complete. Lines end in "\r\n", "\n" or a bare
// "\r"; a byte order mark at the start of the stream is skipped; comments
// and unknown fields are ignored; an "id" containing NUL is ignored.
//
// One departure from the specification: an event the stream ends in
// without its blank line is returned (the specification drops it), because
// the Go SDK's client dispatches it, and the sidecar must see every
// response its clients see.
type EventReader struct {
	src  io.Reader
	buf  []byte
	r, w int
	err  error // sticky error of src
	// filled: the last read filled buf, so the stream is not small.
	filled bool
	max    int

	started bool // the start of the stream was checked for a BOM
	afterCR bool // the last line ended in "\r": a "\n" right after it is part of it

	// The line being read.
	inLine    bool   // some of the line's content was read
	name      []byte // the field name, up to maxFieldName bytes
	nameLong  bool   // the name is longer: not a field of interest
	inValue   bool   // past the colon
	spaceDone bool   // the first byte of the value was checked for the one space to drop
	value     []byte // the value of a field other than data, up to maxFieldValue bytes
	comment   bool   // the line starts with a colon

	// The event being read.
	ev       Event
	nonBlank bool      // a non-blank line was read since the last event
	skip     io.Writer // SkipEvent's destinations, while it runs
	skipData io.Writer
	lastID   string
}

const (
	maxFieldName  = 8       // longer names are none of event, data, id, retry
	maxFieldValue = 4 << 10 // longer event names and ids are cut here
)

// The read buffer starts small, since most streams carry one response of
// a few hundred bytes, and doubles after each read that fills it.
const (
	minReadBuf = 4 << 10
	maxReadBuf = 32 << 10
)

// NewEventReader reads events of at most maxSize bytes from r.
func NewEventReader(r io.Reader, maxSize int) *EventReader {
	return &EventReader{src: r, buf: make([]byte, minReadBuf), max: maxSize}
}

// Next returns the next event. At the end of the stream it returns
// io.EOF; any other error of the underlying reader is returned with what
// was read of the event it interrupted (Raw, for the caller to relay).
// An event over the size limit is returned with ErrEventTooLarge and as
// much of it as the limit allows; call SkipEvent to go past it.
func (er *EventReader) Next() (Event, error) {
	for {
		if er.r == er.w {
			if er.err != nil {
				return er.end()
			}
			er.fill()
			continue
		}
		if !er.started && !er.checkBOM() {
			continue
		}
		room := er.max - len(er.ev.Raw)
		if room <= 0 {
			ev := er.ev
			return ev, fmt.Errorf("%w (%d bytes)", ErrEventTooLarge, er.max)
		}
		chunk := er.buf[er.r:min(er.w, er.r+room)]
		n, done := er.consume(chunk)
		er.ev.Raw = append(er.ev.Raw, chunk[:n]...)
		er.r += n
		if done {
			return er.take(), nil
		}
	}
}

// SkipEvent reads the rest of the event Next refused as too large,
// copying its bytes exactly to raw and the rest of its data (what Data
// would have held after what Next returned) to data. Either may be nil.
// The stream's end also ends the event. Next reads on after it.
func (er *EventReader) SkipEvent(raw, data io.Writer) (int64, error) {
	if raw == nil {
		raw = io.Discard
	}
	if data == nil {
		data = io.Discard
	}
	er.skip, er.skipData = raw, data
	defer func() { er.skip, er.skipData = nil, nil }()
	var total int64
	for {
		if er.r == er.w {
			if er.err != nil {
				if errors.Is(er.err, io.EOF) {
					if er.inLine {
						er.endLine()
					}
					er.reset()
					return total, nil
				}
				return total, er.err
			}
			er.fill()
			continue
		}
		chunk := er.buf[er.r:er.w]
		n, done := er.consume(chunk)
		m, _ := raw.Write(chunk[:n])
		total += int64(m)
		er.r += n
		if done {
			er.reset()
			return total, nil
		}
	}
}

// Rest is the stream after what Next and SkipEvent returned, for a caller
// that stops parsing and copies the rest as it is.
func (er *EventReader) Rest() io.Reader {
	rest := bytes.Clone(er.buf[er.r:er.w])
	er.r = er.w
	tail := er.src
	if er.err != nil {
		tail = errReader{er.err}
	}
	return io.MultiReader(bytes.NewReader(rest), tail)
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// LastEventID is the specification's last event ID buffer: the last valid
// "id" field of the events read so far, for a Last-Event-ID header.
func (er *EventReader) LastEventID() string { return er.lastID }

func (er *EventReader) fill() {
	if er.r > 0 && er.r == er.w {
		er.r, er.w = 0, 0
		if er.filled && len(er.buf) < maxReadBuf {
			er.buf = make([]byte, 2*len(er.buf))
		}
	}
	n, err := er.src.Read(er.buf[er.w:])
	er.w += n
	er.filled = er.w == len(er.buf)
	if err != nil {
		er.err = err
	} else if n == 0 {
		// A reader that returns nothing and no error: try again, as
		// bufio does, a bounded number of times.
		for range 100 {
			if n, err = er.src.Read(er.buf[er.w:]); n > 0 || err != nil {
				er.w += n
				er.err = err
				return
			}
		}
		er.err = io.ErrNoProgress
	}
}

var bom = []byte("\xEF\xBB\xBF")

// checkBOM skips a byte order mark at the start of the stream (keeping it
// in Raw). It reports false while it needs more bytes to tell.
func (er *EventReader) checkBOM() bool {
	b := er.buf[er.r:er.w]
	if len(b) < len(bom) && bytes.HasPrefix(bom, b) && er.err == nil {
		er.fill()
		return false
	}
	er.started = true
	if bytes.HasPrefix(b, bom) {
		er.ev.Raw = append(er.ev.Raw, bom...)
		er.r += len(bom)
	}
	return true
}

// consume runs the parser over b and returns how many bytes it used, and
// whether they end an event.
func (er *EventReader) consume(b []byte) (int, bool) {
	i := 0
	for i < len(b) {
		if er.afterCR {
			er.afterCR = false
			if b[i] == '\n' {
				i++
				continue
			}
		}
		c := b[i]
		if c == '\r' || c == '\n' {
			i++
			er.afterCR = c == '\r'
			if er.inLine {
				er.endLine()
				continue
			}
			// A blank line: the end of an event, if there was one.
			if er.nonBlank {
				return i, true
			}
			continue
		}
		j := bytes.IndexAny(b[i:], "\r\n")
		if j < 0 {
			j = len(b) - i
		}
		er.content(b[i : i+j])
		i += j
	}
	return i, false
}

// content takes a run of a line's bytes, without line endings.
func (er *EventReader) content(b []byte) {
	if !er.inLine {
		er.inLine, er.nonBlank = true, true
		er.comment = b[0] == ':'
	}
	if er.comment {
		return
	}
	if !er.inValue {
		k := bytes.IndexByte(b, ':')
		name := b
		if k >= 0 {
			name = b[:k]
		}
		if len(er.name)+len(name) > maxFieldName {
			er.nameLong = true
		} else {
			er.name = append(er.name, name...)
		}
		if k < 0 {
			return
		}
		er.inValue = true
		b = b[k+1:]
		if er.isData() {
			er.startData()
		}
	}
	if len(b) == 0 {
		return
	}
	if !er.spaceDone {
		er.spaceDone = true
		if b[0] == ' ' {
			b = b[1:]
		}
	}
	if er.isData() {
		er.appendData(b)
		return
	}
	if room := maxFieldValue - len(er.value); room > 0 {
		er.value = append(er.value, b[:min(len(b), room)]...)
	}
}

func (er *EventReader) isData() bool {
	return !er.nameLong && string(er.name) == "data"
}

func (er *EventReader) startData() {
	if er.ev.HasData {
		er.appendData([]byte{'\n'})
	}
	er.ev.HasData = true
}

func (er *EventReader) appendData(b []byte) {
	if er.skipData != nil {
		_, _ = er.skipData.Write(b)
		return
	}
	er.ev.Data = append(er.ev.Data, b...)
}

// endLine applies the field of the line just ended.
func (er *EventReader) endLine() {
	if !er.comment && !er.nameLong {
		switch string(er.name) {
		case "data":
			if !er.inValue { // "data" alone: an empty value
				er.startData()
			}
		case "event":
			er.ev.Name = string(er.value)
		case "id":
			if bytes.IndexByte(er.value, 0) < 0 {
				er.ev.ID, er.ev.HasID = string(er.value), true
				er.lastID = er.ev.ID
			}
		}
	}
	er.inLine, er.inValue, er.spaceDone, er.comment, er.nameLong = false, false, false, false, false
	er.name, er.value = er.name[:0], er.value[:0]
}

// take returns the event read and starts the next.
func (er *EventReader) take() Event {
	ev := er.ev
	er.reset()
	return ev
}

func (er *EventReader) reset() {
	er.ev = Event{}
	er.nonBlank = false
}

// end is the stream's end: a line and an event cut by it still count.
func (er *EventReader) end() (Event, error) {
	if er.inLine && errors.Is(er.err, io.EOF) {
		er.endLine()
	}
	if len(er.ev.Raw) == 0 {
		if errors.Is(er.err, io.EOF) {
			return Event{}, io.EOF
		}
		return Event{}, er.err
	}
	ev := er.take()
	if errors.Is(er.err, io.EOF) {
		return ev, nil
	}
	return ev, er.err
}

// AppendEvent appends an SSE "message" event carrying data.
func AppendEvent(buf, data []byte) []byte {
	buf = append(buf, "event: message\ndata: "...)
	buf = append(buf, data...)
	return append(buf, "\n\n"...)
}
