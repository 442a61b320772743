package mcpmsg

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
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
	// Sent is how much of Raw was already written to the reader's Stream
	// writer while the event was read: the caller writes Raw[Sent:].
	Sent int
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
	src io.Reader
	buf []byte
	// first is the read buffer the reader started with, from readBufs,
	// which Release gives back (nil once given back).
	first *[minReadBuf]byte
	// chunk is the part of buf Next is parsing, which stands for Raw from
	// len(Raw) on until Next appends what the event used.
	chunk []byte
	r, w  int
	// nl is an index of buf for lineEnd: the next "\n" it found, or where
	// its look for one ended.
	nl  int
	err error // sticky error of src
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
	valueNUL  bool   // the value has a NUL past what value keeps
	comment   bool   // the line starts with a colon

	// The event being read.
	ev       Event
	nonBlank bool      // a non-blank line was read since the last event
	skip     io.Writer // SkipEvent's destinations, while it runs
	skipData io.Writer
	lastID   string
	// The event's data while it is one run of Raw (a single data line,
	// as servers send a response): Raw[dataFrom:dataTo], not a copy.
	dataInRaw        bool
	dataFrom, dataTo int

	// A large event's Raw is kept in blocks as it is read, not in one
	// slice that doubles as it grows (which allocated up to four times a
	// 1 MiB event, and copied it twice): head holds its first headLen
	// bytes, in blocks of up to rawBlock bytes, ev.Raw the rest, and
	// event joins them once, at the event's size. A small event is all
	// in ev.Raw, as before.
	head    [][]byte
	headLen int

	// stream receives a large event's bytes as they are read (Stream).
	stream    io.Writer
	lineStart int  // where the line being read starts in Raw
	held      bool // an id line was read: nothing from holdAt on is sent
	holdAt    int
}

// streamMin is how much of an event is held before Stream sends it on:
// a small event is still written whole, once.
const streamMin = 16 << 10

// Stream has the bytes of an event larger than streamMin written to w as
// they are read, up to the event's first id line (or a line that may yet
// be one): a caller that relays events as they come relays a large one
// without waiting for its end, and no id reaches w before the event that
// carries it is returned whole. Event.Sent says how much went. w must
// not keep the slices it is given (as io.Writer says): they are the
// reader's, and reused for other events.
func (er *EventReader) Stream(w io.Writer) { er.stream = w }

// streamUpTo is how much of Raw may be sent now.
func (er *EventReader) streamUpTo() int {
	switch {
	case er.held:
		return er.holdAt
	case er.inLine && !er.comment && !er.inValue && !er.nameLong && strings.HasPrefix("id", string(er.name)):
		return er.lineStart
	}
	return er.rawLen()
}

// hold marks the line being read an id line.
func (er *EventReader) hold() {
	if !er.held {
		er.held, er.holdAt = true, er.lineStart
	}
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

// NewEventReader reads events of at most maxSize bytes from r. Release
// it when done, so that the next reader reuses its buffer.
func NewEventReader(r io.Reader, maxSize int) *EventReader {
	first := readBufs.Get().(*[minReadBuf]byte)
	return &EventReader{src: r, buf: first[:], first: first, max: maxSize}
}

// readBufs holds the readers' first read buffers: a sidecar makes a
// reader for every response, most of which never need a larger one.
var readBufs = sync.Pool{New: func() any { return new([minReadBuf]byte) }}

// Release gives the reader's first buffer back for another reader. What
// the reader returned stays valid: no Event shares the read buffer (Raw
// and Data are copies, and a Stream writer is given only Raw's bytes),
// Rest's reader holds a copy of what was buffered, and SkipEvent's
// writers keep none of what they are given. A Next or SkipEvent after it
// returns ErrReleased.
func (er *EventReader) Release() {
	if er.first == nil {
		return
	}
	first := er.first
	er.first, er.buf, er.r, er.w, er.nl, er.err = nil, nil, 0, 0, 0, ErrReleased
	readBufs.Put(first)
}

// ErrReleased is what a reader answers once released.
var ErrReleased = errors.New("mcpmsg: the event reader was released")

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
		room := er.max - er.rawLen()
		if room <= 0 {
			ev := er.event()
			return ev, fmt.Errorf("%w (%d bytes)", ErrEventTooLarge, er.max)
		}
		chunk := er.buf[er.r:min(er.w, er.r+room)]
		// Parsed where it lies, as if it were Raw from base on, so that
		// data can be a run of Raw; then only what the event used goes
		// into Raw. (Copied whole first, every small event cost a copy of
		// the buffer behind it, up to 32 KiB.)
		base := er.rawLen()
		er.chunk = chunk
		n, done := er.consume(chunk, base)
		er.chunk = nil
		er.addRaw(chunk[:n])
		er.r += n
		if done {
			return er.take(), nil
		}
		if er.stream != nil && er.rawLen()-er.ev.Sent >= streamMin {
			for upTo := er.streamUpTo(); er.ev.Sent < upTo; {
				piece := er.rawPiece(er.ev.Sent, upTo)
				_, _ = er.stream.Write(piece)
				er.ev.Sent += len(piece)
			}
		}
	}
}

// SkipEvent reads the rest of the event Next refused as too large,
// copying its bytes exactly to raw and the rest of its data (what Data
// would have held after what Next returned) to data. Either may be nil.
// The stream's end also ends the event. Next reads on after it. Neither
// writer may keep the slices it is given (as io.Writer says): they are
// the reader's read buffer, which another reader reuses after Release.
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
		n, done := er.consume(chunk, -1)
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
		er.r, er.w, er.nl = 0, 0, 0
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
		er.addRaw(bom)
		er.r += len(bom)
	}
	return true
}

// rawBlock is the size of the blocks a large event's Raw is kept in.
const rawBlock = 64 << 10

// rawBlocks holds the blocks of events that were joined.
var rawBlocks = sync.Pool{New: func() any { return new([rawBlock]byte) }}

// rawLen is the length of the event's Raw so far.
func (er *EventReader) rawLen() int { return er.headLen + len(er.ev.Raw) }

// addRaw appends b to the event's Raw: in ev.Raw, doubling its room as it
// grows up to a block (append grows a large slice by a quarter: five
// times the event in copies), then in blocks.
func (er *EventReader) addRaw(b []byte) {
	raw := er.ev.Raw
	if need := len(raw) + len(b); need > cap(raw) && need <= rawBlock {
		grown := make([]byte, len(raw), min(max(need, min(2*cap(raw), er.max)), rawBlock))
		copy(grown, raw)
		raw = grown
	}
	for len(raw)+len(b) > cap(raw) {
		n := cap(raw) - len(raw)
		raw = append(raw, b[:n]...)
		b = b[n:]
		// No block is empty, so that every rawPiece is not (a chunk
		// larger than a block, into an event with no Raw yet, would push
		// one).
		if len(raw) > 0 {
			er.head = append(er.head, raw)
			er.headLen += len(raw)
		}
		raw = rawBlocks.Get().(*[rawBlock]byte)[:0]
	}
	er.ev.Raw = append(raw, b...)
}

// joinRaw makes the event's Raw one slice, of its size, and gives its
// blocks back.
func (er *EventReader) joinRaw() {
	if len(er.head) == 0 {
		return
	}
	tail := er.ev.Raw
	er.ev.Raw = bytes.Join(append(er.head, tail), nil)
	er.dropBlocks(tail)
}

// dropBlocks gives the event's blocks and tail, the ev.Raw that followed
// them, back; nothing uses them any more.
func (er *EventReader) dropBlocks(tail []byte) {
	for _, b := range er.head {
		putRawBlock(b)
	}
	putRawBlock(tail)
	clear(er.head[:cap(er.head)]) // a join may have put tail past len
	er.head, er.headLen = er.head[:0], 0
}

// putRawBlock gives a block back; b is no longer used. A slice of
// another size (the first, grown by doubling) is left to the collector.
func putRawBlock(b []byte) {
	if cap(b) == rawBlock {
		rawBlocks.Put((*[rawBlock]byte)(b[:rawBlock]))
	}
}

// rawPiece is the longest run of Raw[from:to] that is one slice: of a
// block, of ev.Raw, or, past them, of the chunk Next is parsing. The
// blocks are searched from the last, since what is asked for is mostly
// what was read last.
func (er *EventReader) rawPiece(from, to int) []byte {
	if from < er.headLen {
		off := er.headLen
		for i := len(er.head) - 1; i >= 0; i-- {
			off -= len(er.head[i])
			if from >= off {
				return er.head[i][from-off : min(to, off+len(er.head[i]))-off]
			}
		}
	}
	in := er.rawLen()
	if from < in {
		return er.ev.Raw[from-er.headLen : min(to, in)-er.headLen]
	}
	return er.chunk[from-in : to-in]
}

// appendRawRange appends Raw[from:to] to dst. While Next parses a chunk,
// the positions from rawLen on are in that chunk, not yet in Raw.
func (er *EventReader) appendRawRange(dst []byte, from, to int) []byte {
	for from < to {
		piece := er.rawPiece(from, to)
		dst = append(dst, piece...)
		from += len(piece)
	}
	return dst
}

// consume runs the parser over b and returns how many bytes it used, and
// whether they end an event. base is where b is in Raw, or -1 when Raw is
// not kept (SkipEvent).
func (er *EventReader) consume(b []byte, base int) (int, bool) {
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
		j := er.lineEnd(b, i) - i
		pos := -1
		if base >= 0 {
			pos = base + i
		}
		er.content(b[i:i+j], pos)
		i += j
	}
	return i, false
}

// lineEnd is where the line content at b[i] ends, or at least a piece
// of it: the next "\r" or "\n" in b, or len(b). b is er.buf from er.r
// on, and b[i] is neither. It looks for each with bytes.IndexByte, not
// for both a byte at a time (bytes.IndexAny), which cost a 1 MiB data
// line more than reading it. The "\n" found is kept in er.nl, as an
// index of er.buf, until the scan passes it, across lines and events, so
// that a stream of many bare "\r" line ends is still scanned once.
func (er *EventReader) lineEnd(b []byte, i int) int {
	at := er.r + i
	// er.nl is the first "\n" at or after where it was looked for, or
	// where that look ended (none before it); b[i] is no "\n", so one at
	// or before at is behind.
	if er.nl <= at {
		if k := bytes.IndexByte(b[i:], '\n'); k >= 0 {
			er.nl = at + k
		} else {
			er.nl = er.r + len(b)
		}
	}
	end := min(er.nl-er.r, len(b))
	if k := bytes.IndexByte(b[i:end], '\r'); k >= 0 {
		return i + k
	}
	return end
}

// content takes a run of a line's bytes, without line endings, found at
// Raw[pos:] (pos is -1 when Raw is not kept).
func (er *EventReader) content(b []byte, pos int) {
	if !er.inLine {
		er.inLine, er.nonBlank = true, true
		er.comment = b[0] == ':'
		er.lineStart = pos
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
		if !er.nameLong && string(er.name) == "id" {
			er.hold()
		}
		b = b[k+1:]
		if pos >= 0 {
			pos += k + 1
		}
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
			if pos >= 0 {
				pos++
			}
		}
	}
	if er.isData() {
		er.appendData(b, pos)
		return
	}
	if room := maxFieldValue - len(er.value); room > 0 {
		keep := min(len(b), room)
		er.value = append(er.value, b[:keep]...)
		b = b[keep:]
	}
	// What is cut off still counts for an id's NUL, which makes the
	// specification ignore the field.
	if len(b) > 0 && !er.valueNUL && bytes.IndexByte(b, 0) >= 0 {
		er.valueNUL = true
	}
}

func (er *EventReader) isData() bool {
	return !er.nameLong && string(er.name) == "data"
}

func (er *EventReader) startData() {
	if er.ev.HasData {
		er.appendData([]byte{'\n'}, -1)
	}
	er.ev.HasData = true
}

// appendData adds b, found at Raw[pos:] (or nowhere there, pos -1), to the
// event's data: by extending the run of Raw it is while it is one.
func (er *EventReader) appendData(b []byte, pos int) {
	if er.skipData != nil {
		_, _ = er.skipData.Write(b)
		return
	}
	switch {
	case pos >= 0 && er.dataInRaw && pos == er.dataTo:
		er.dataTo += len(b)
		return
	case pos >= 0 && !er.dataInRaw && len(er.ev.Data) == 0:
		er.dataInRaw, er.dataFrom, er.dataTo = true, pos, pos+len(b)
		return
	case er.dataInRaw:
		er.ev.Data = er.appendRawRange(er.ev.Data, er.dataFrom, er.dataTo)
		er.dataInRaw = false
	}
	er.ev.Data = append(er.ev.Data, b...)
}

// event is the event read so far, its data made a slice.
func (er *EventReader) event() Event {
	er.joinRaw()
	ev := er.ev
	ev.Raw = ev.Raw[:len(ev.Raw):len(ev.Raw)]
	if er.dataInRaw {
		ev.Data = ev.Raw[er.dataFrom:er.dataTo:er.dataTo]
	}
	return ev
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
			er.hold()
			if !er.valueNUL && bytes.IndexByte(er.value, 0) < 0 {
				er.ev.ID, er.ev.HasID = string(er.value), true
				er.lastID = er.ev.ID
			}
		}
	}
	er.inLine, er.inValue, er.spaceDone, er.comment, er.nameLong, er.valueNUL = false, false, false, false, false, false
	er.name, er.value = er.name[:0], er.value[:0]
}

// take returns the event read and starts the next.
func (er *EventReader) take() Event {
	ev := er.event()
	er.reset()
	return ev
}

func (er *EventReader) reset() {
	if len(er.head) > 0 { // an event never returned: give its blocks back
		er.dropBlocks(er.ev.Raw)
	}
	er.ev = Event{}
	er.nonBlank = false
	er.dataInRaw = false
	er.held = false
}

// end is the stream's end: a line and an event cut by it still count.
func (er *EventReader) end() (Event, error) {
	if er.inLine && errors.Is(er.err, io.EOF) {
		er.endLine()
	}
	if er.rawLen() == 0 {
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
