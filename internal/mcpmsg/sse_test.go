package mcpmsg

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// parsed is what a client sees of an event (Raw aside).
type parsed struct {
	Name, Data, ID string
	HasData, HasID bool
}

func (p parsed) String() string {
	return fmt.Sprintf("{name=%q data=%q(%v) id=%q(%v)}", p.Name, p.Data, p.HasData, p.ID, p.HasID)
}

// readAll parses a stream read through r; an oversized event is skipped
// with SkipEvent and reported with its whole data. It returns the events,
// every byte the reader gave back (Raw and skipped bytes), and the error
// that ended the stream if not io.EOF.
func readAll(r io.Reader, maxSize int) ([]parsed, []byte, error) {
	er := NewEventReader(r, maxSize)
	var evs []parsed
	var raw bytes.Buffer
	for {
		ev, err := er.Next()
		raw.Write(ev.Raw)
		if errors.Is(err, ErrEventTooLarge) {
			var data bytes.Buffer
			data.Write(ev.Data)
			if _, serr := er.SkipEvent(&raw, &data); serr != nil {
				return evs, raw.Bytes(), serr
			}
			evs = append(evs, parsed{Data: data.String(), HasData: true})
			continue
		}
		if errors.Is(err, io.EOF) {
			return evs, raw.Bytes(), nil
		}
		if err != nil {
			return evs, raw.Bytes(), err
		}
		if ev.HasData || ev.Name != "" || ev.HasID {
			evs = append(evs, parsed{ev.Name, string(ev.Data), ev.ID, ev.HasData, ev.HasID})
		}
	}
}

func TestEventReaderSpec(t *testing.T) {
	for _, tc := range []struct {
		name, stream string
		want         []parsed
	}{
		{"fields", ": comment\n\nevent: message\nid: 1\ndata: {\"a\":\ndata: 1}\n\n", []parsed{
			{Name: "message", Data: "{\"a\":\n1}", HasData: true, ID: "1", HasID: true}}},
		{"CRLF", "event: message\r\ndata: {}\r\n\r\n", []parsed{{Name: "message", Data: "{}", HasData: true}}},
		{"bare CR", "event: message\rdata: {}\r\rdata: 2\r\r", []parsed{
			{Name: "message", Data: "{}", HasData: true}, {Data: "2", HasData: true}}},
		{"mixed endings", "data: 1\r\n\rdata: 2\n\r\ndata: 3\r\r\n", []parsed{
			{Data: "1", HasData: true}, {Data: "2", HasData: true}, {Data: "3", HasData: true}}},
		{"no final blank line", "data: 1\n\ndata: {\"id\":1}\n", []parsed{
			{Data: "1", HasData: true}, {Data: `{"id":1}`, HasData: true}}},
		{"no final line ending", "data: {\"id\":1}", []parsed{{Data: `{"id":1}`, HasData: true}}},
		{"BOM", "\xEF\xBB\xBFdata: x\n\n", []parsed{{Data: "x", HasData: true}}},
		{"BOM only at the start", "data: x\n\n\xEF\xBB\xBFdata: y\n\n", []parsed{{Data: "x", HasData: true}}},
		{"retry and unknown fields", "retry: 1000\nfoo: bar\ndata:x\n\n", []parsed{{Data: "x", HasData: true}}},
		{"one space dropped", "data:  two\ndata\ndata:\n\n", []parsed{{Data: " two\n\n", HasData: true}}},
		{"id with NUL ignored", "id: 7\nid: a\x00b\ndata: x\n\n", []parsed{{Data: "x", HasData: true, ID: "7", HasID: true}}},
		{"id with NUL past the kept 4 KiB ignored", "id: 7\nid: " + strings.Repeat("a", maxFieldValue) + "\x00\ndata: x\n\n", []parsed{{Data: "x", HasData: true, ID: "7", HasID: true}}},
		{"long id cut at 4 KiB", "id: " + strings.Repeat("b", maxFieldValue+5) + "\ndata: x\n\n", []parsed{{Data: "x", HasData: true, ID: strings.Repeat("b", maxFieldValue), HasID: true}}},
		{"priming event", "id: 42\ndata:\n\n", []parsed{{HasData: true, ID: "42", HasID: true}}},
		{"field without colon", "event\ndata\n\n", []parsed{{HasData: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, reader := range []struct {
				name string
				r    io.Reader
			}{
				{"whole", strings.NewReader(tc.stream)},
				{"byte by byte", iotest.OneByteReader(strings.NewReader(tc.stream))},
			} {
				got, raw, err := readAll(reader.r, 1<<20)
				if err != nil {
					t.Fatalf("%s: %v", reader.name, err)
				}
				if fmt.Sprint(got) != fmt.Sprint(tc.want) {
					t.Errorf("%s: events %v, want %v", reader.name, got, tc.want)
				}
				if string(raw) != tc.stream {
					t.Errorf("%s: Raw put together is %q, want the stream %q", reader.name, raw, tc.stream)
				}
			}
		})
	}
}

func TestEventReaderTornStream(t *testing.T) {
	boom := errors.New("connection reset")
	er := NewEventReader(io.MultiReader(strings.NewReader("data: 1\n\ndata: {\"par"), iotest.ErrReader(boom)), 1<<20)
	if ev, err := er.Next(); err != nil || string(ev.Data) != "1" {
		t.Fatalf("first event %q, %v", ev.Data, err)
	}
	ev, err := er.Next()
	if !errors.Is(err, boom) || string(ev.Raw) != "data: {\"par" {
		t.Errorf("torn event: %q, %v; want its bytes and the reader's error", ev.Raw, err)
	}
}

func TestEventReaderLastEventID(t *testing.T) {
	er := NewEventReader(strings.NewReader("id: 1\ndata: a\n\ndata: b\n\nid: 2\n\n"), 1<<20)
	for range 3 {
		if _, err := er.Next(); err != nil {
			t.Fatal(err)
		}
	}
	if got := er.LastEventID(); got != "2" {
		t.Errorf("LastEventID = %q, want 2", got)
	}
}

func TestEventReaderOversizedEventIsSkippedWhole(t *testing.T) {
	big := strings.Repeat("x", 100)
	stream := "data: 1\n\nevent: message\r\ndata: " + big + "\r\ndata: tail\r\n\r\ndata: 3\n\n"
	for _, r := range []io.Reader{strings.NewReader(stream), iotest.HalfReader(strings.NewReader(stream))} {
		got, raw, err := readAll(r, 50)
		if err != nil {
			t.Fatal(err)
		}
		want := []parsed{{Data: "1", HasData: true}, {Data: big + "\ntail", HasData: true}, {Data: "3", HasData: true}}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("events %v, want %v", got, want)
		}
		if string(raw) != stream {
			t.Errorf("relayed %q, want the stream", raw)
		}
	}
}

// lineEndings writes every line ending of b as nl.
func lineEndings(b []byte, nl string) []byte {
	b = bytes.ReplaceAll(b, []byte("\r\n"), []byte("\n"))
	b = bytes.ReplaceAll(b, []byte("\r"), []byte("\n"))
	return bytes.ReplaceAll(b, []byte("\n"), []byte(nl))
}

// chunked returns r's bytes in reads of sizes drawn from seed.
type chunked struct {
	b    []byte
	seed uint64
}

func (c *chunked) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	c.seed = c.seed*6364136223846793005 + 1442695040888963407
	n := min(int(c.seed>>59)+1, len(p), len(c.b)) // 1..32 bytes
	copy(p, c.b[:n])
	c.b = c.b[n:]
	return n, nil
}

func FuzzSSEParser(f *testing.F) {
	for _, s := range []string{
		"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n",
		"event: message\r\ndata: {}\r\n\r\n",
		"event: message\rdata: {}\r\r",
		"data: {\"id\":1}",
		"\xEF\xBB\xBF: comment\nretry: 10\nid: a\x00\nevent: endpoint\ndata: /m?s=1\n\n",
		"id: 1\ndata:\n\n\r\n\rdata:  x\rdata\n\n",
		"data: " + strings.Repeat("y", 80) + "\r\ndata: z\r\n\r\ndata: after\n\n",
		"\r\n\r\n\n\r",
		"\xEF\xBB",
	} {
		f.Add([]byte(s), uint64(7))
	}
	f.Fuzz(func(t *testing.T, stream []byte, seed uint64) {
		const large = 1 << 20
		whole, raw, err := readAll(bytes.NewReader(stream), large)
		if err != nil {
			t.Fatalf("reading a whole stream: %v", err)
		}
		if !bytes.Equal(raw, stream) {
			t.Fatalf("Raw put together is %q, want the stream %q", raw, stream)
		}
		inChunks, raw, err := readAll(&chunked{b: stream, seed: seed}, large)
		if err != nil || !bytes.Equal(raw, stream) {
			t.Fatalf("in chunks: %v, Raw %q", err, raw)
		}
		if fmt.Sprint(inChunks) != fmt.Sprint(whole) {
			t.Fatalf("in chunks %v, whole %v", inChunks, whole)
		}
		// A small limit: oversized events are skipped, with the same data.
		small, raw, err := readAll(&chunked{b: stream, seed: seed}, 16)
		if err != nil || !bytes.Equal(raw, stream) {
			t.Fatalf("with a small limit: %v, Raw %q", err, raw)
		}
		if a, b := datas(small), datas(whole); a != b {
			t.Fatalf("data with a small limit %q, without %q", a, b)
		}
		// The three line endings mean the same.
		for _, nl := range []string{"\n", "\r\n", "\r"} {
			got, _, err := readAll(bytes.NewReader(lineEndings(stream, nl)), large)
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got) != fmt.Sprint(whole) {
				t.Fatalf("with line endings %q: %v, want %v", nl, got, whole)
			}
		}
	})
}

// datas lists the non-empty data of events.
func datas(evs []parsed) string {
	var out []string
	for _, ev := range evs {
		if ev.Data != "" {
			out = append(out, ev.Data)
		}
	}
	return fmt.Sprintf("%q", out)
}

func TestStreamSendsALargeEventAsItIsRead(t *testing.T) {
	big := strings.Repeat("x", 100<<10)
	for _, tc := range []struct {
		name, stream string
		early        bool // some of the first event goes before its end
	}{
		{"data only", "event: message\ndata: " + big + "\n\n", true},
		{"id first", "id: 7\ndata: " + big + "\n\n", false},
		{"id after the data", "data: " + big + "\nid: 7\n\n", true},
		{"small", "data: {}\n\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			er := NewEventReader(&chunked{b: []byte(tc.stream), seed: 3}, 1<<20)
			var early []byte
			er.Stream(writerFunc(func(b []byte) (int, error) {
				early = append(early, b...)
				return len(b), nil
			}))
			ev, err := er.Next()
			if err != nil {
				t.Fatal(err)
			}
			if got := string(early) + string(ev.Raw[ev.Sent:]); got != tc.stream {
				t.Fatalf("sent and the rest of Raw are not the stream (%d + %d bytes)", len(early), len(ev.Raw)-ev.Sent)
			}
			if string(ev.Raw) != tc.stream || ev.Sent != len(early) {
				t.Fatalf("Raw %d bytes, Sent %d, early %d", len(ev.Raw), ev.Sent, len(early))
			}
			if (len(early) > 0) != tc.early {
				t.Fatalf("%d bytes sent early, want some: %v", len(early), tc.early)
			}
			if bytes.Contains(early, []byte("id:")) {
				t.Fatal("an id line was sent before its event was read")
			}
		})
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// TestSmallEventsCostTheirSize: a stream of many small events (progress
// notifications before a response) costs each event about its own size,
// not a copy of the read buffer behind it (which made 1,000 events of 60
// bytes allocate 11.5 MB).
func TestSmallEventsCostTheirSize(t *testing.T) {
	var stream bytes.Buffer
	const events = 1000
	for i := range events {
		fmt.Fprintf(&stream, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"p\",\"n\":%04d}\n\n", i)
	}
	// Two data lines: the data is no run of Raw, and is copied.
	stream.WriteString("data: {\"a\":\ndata: 1}\n\n")
	size := stream.Len()
	er := NewEventReader(bytes.NewReader(stream.Bytes()), 1<<20)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var last Event
	for i := 0; ; i++ {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if i < events && string(ev.Data) != fmt.Sprintf(`{"jsonrpc":"2.0","method":"p","n":%04d}`, i) {
			t.Fatalf("event %d: data %q", i, ev.Data)
		}
		last = ev
	}
	runtime.ReadMemStats(&after)
	if string(last.Data) != "{\"a\":\n1}" {
		t.Errorf("the two-line event's data is %q", last.Data)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > uint64(4*size)+64<<10 {
		t.Errorf("reading %d events (%d bytes) allocated %d bytes, want about their size", events+1, size, got)
	}
}

// TestLargeEventsInBlocks: events larger than a block, at its edges and
// far past them, one data line or many (data copied out of the blocks),
// read in small chunks while Stream sends them on, come back whole and
// exact; each event returned keeps its bytes while the blocks are reused
// for the events after it; and a 1 MiB event, once the blocks are warm,
// allocates about its own size, where doubling a slice allocated four
// times it.
func TestLargeEventsInBlocks(t *testing.T) {
	type want struct{ raw, data string }
	var stream strings.Builder
	var wants []want
	add := func(raw, data string) {
		stream.WriteString(raw)
		wants = append(wants, want{raw, data})
	}
	for i, n := range []int{rawBlock - 10, rawBlock - 9, rawBlock, rawBlock + 1, 3*rawBlock + 7, 1<<20 + 3} {
		d := strings.Repeat(string(rune('a'+i)), n)
		add("event: message\ndata: "+d+"\n\n", d)
	}
	// Many data lines, one CRLF-ended: the data is no run of Raw.
	line := strings.Repeat("L", 40<<10)
	add("data: "+line+"\ndata: "+line+"\r\ndata: "+line+"\ndata: "+line+"\nid: 9\n\n", line+"\n"+line+"\n"+line+"\n"+line)
	add("data: {}\n\n", "{}")

	er := NewEventReader(&chunked{b: []byte(stream.String()), seed: 11}, 4<<20)
	var sent []byte
	er.Stream(writerFunc(func(b []byte) (int, error) {
		sent = append(sent, b...)
		return len(b), nil
	}))
	var got []Event
	var relayed []byte
	for {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		relayed = append(append(relayed, sent...), ev.Raw[ev.Sent:]...)
		sent = sent[:0]
		got = append(got, ev)
	}
	if len(got) != len(wants) {
		t.Fatalf("%d events, want %d", len(got), len(wants))
	}
	for i, w := range wants {
		if string(got[i].Raw) != w.raw || string(got[i].Data) != w.data {
			t.Errorf("event %d: Raw %d bytes, Data %d bytes; want %d and %d, as sent", i, len(got[i].Raw), len(got[i].Data), len(w.raw), len(w.data))
		}
	}
	if string(relayed) != stream.String() {
		t.Errorf("what Stream sent and the rest of each Raw are not the stream (%d bytes, want %d)", len(relayed), stream.Len())
	}

	// An event over a limit larger than a block: what Next returns of it
	// and what SkipEvent reads of the rest are the event, exactly.
	over := "data: " + strings.Repeat("o", 5*rawBlock) + "\ndata: end\n\n"
	for _, limit := range []int{rawBlock + 1, 3 * rawBlock} {
		got, raw, err := readAll(&chunked{b: []byte(over + "data: after\n\n"), seed: 5}, limit)
		if err != nil || string(raw) != over+"data: after\n\n" {
			t.Fatalf("limit %d: %v, %d bytes relayed", limit, err, len(raw))
		}
		if len(got) != 2 || got[0].Data != strings.Repeat("o", 5*rawBlock)+"\nend" || got[1].Data != "after" {
			t.Errorf("limit %d: the oversized event and the one after it are not read as sent", limit)
		}
	}
	// A stream cut after more than a block: the event so far, whole, with
	// the reader's error.
	boom := errors.New("connection reset")
	cut := "data: " + strings.Repeat("c", 2*rawBlock+3)
	ev, err := NewEventReader(io.MultiReader(&chunked{b: []byte(cut), seed: 9}, iotest.ErrReader(boom)), 4<<20).Next()
	if !errors.Is(err, boom) || string(ev.Raw) != cut {
		t.Errorf("a torn large event: %d bytes, %v; want its %d bytes and the reader's error", len(ev.Raw), err, len(cut))
	}

	big := "event: message\ndata: " + strings.Repeat("z", 1<<20) + "\n\n"
	read := func() uint64 {
		er := NewEventReader(bytes.NewReader([]byte(big)), 4<<20)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		ev, err := er.Next()
		runtime.ReadMemStats(&after)
		if err != nil || string(ev.Raw) != big {
			t.Fatalf("the 1 MiB event: %v, %d bytes", err, len(ev.Raw))
		}
		return after.TotalAlloc - before.TotalAlloc
	}
	read()
	alloc := read()
	t.Logf("reading a 1 MiB event allocated %d bytes", alloc)
	if alloc > uint64(len(big))*2 {
		t.Errorf("reading a 1 MiB event allocated %d bytes, want under twice its size", alloc)
	}
}

// BenchmarkEventReaderLineEnds: 4 MiB of small events with each line
// ending, and one 1 MiB data line; MB/s should be about alike for the
// three line endings (a bare "\r" once cost a scan ahead per event).
func BenchmarkEventReaderLineEnds(b *testing.B) {
	for name, stream := range map[string]string{
		"lf":         strings.Repeat("data:x\n\n", 1<<19),
		"crlf":       strings.Repeat("data:x\r\n\r\n", 1<<18),
		"cr":         strings.Repeat("data:x\r\r", 1<<19),
		"comment-cr": strings.Repeat(":\r\r", 1<<20),
		"1MiB-line":  "data: " + strings.Repeat("y", 1<<20) + "\n\n",
	} {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(stream)))
			for b.Loop() {
				er := NewEventReader(strings.NewReader(stream), 2<<20)
				for {
					if _, err := er.Next(); err != nil {
						if !errors.Is(err, io.EOF) {
							b.Fatal(err)
						}
						break
					}
				}
			}
		})
	}
}

// A released reader's buffer goes to the next reader; what the first one
// returned (events, Rest's bytes) and what a Stream writer was given are
// kept whole while other readers read into that buffer. A released reader
// answers ErrReleased at once, even on a source that would block. And a
// reader of a small response, released, costs less than its 4 KiB read
// buffer.
func TestEventReaderRelease(t *testing.T) {
	const (
		ev1   = "id: 1\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"a\":1}}\n\n"
		ev2   = ": a comment\nevent: x\ndata: tail\n\n"
		later = "data: later\n\n"
	)
	er := NewEventReader(strings.NewReader(ev1+ev2+later), 1<<20)
	var events []Event
	for range 2 {
		ev, err := er.Next()
		if err != nil {
			t.Fatal(err)
		}
		events = append(events, ev)
	}
	rest := er.Rest() // holds later, read into the buffer with the rest
	er.Release()
	er.Release() // twice is once

	large := "data: " + strings.Repeat("L", 3*streamMin) + "\n\n"
	streamed := NewEventReader(strings.NewReader(large), 1<<20)
	var sent []byte
	streamed.Stream(writerFunc(func(b []byte) (int, error) {
		sent = append(sent, b...)
		return len(b), nil
	}))
	big, err := streamed.Next()
	if err != nil || big.Sent == 0 {
		t.Fatalf("the large event: Sent %d, %v; want some of it streamed", big.Sent, err)
	}
	streamed.Release()

	for range 4 {
		next := NewEventReader(strings.NewReader(strings.Repeat("data: ZZZZZZZZ\n\n", 300)), 1<<20)
		for {
			if _, err := next.Next(); err != nil {
				break
			}
		}
		next.Release()
	}
	restBytes, _ := io.ReadAll(rest)
	if string(events[0].Raw) != ev1 || string(events[0].Data) != `{"jsonrpc":"2.0","id":1,"result":{"a":1}}` || events[0].ID != "1" ||
		string(events[1].Raw) != ev2 || string(events[1].Data) != "tail" || events[1].Name != "x" || string(restBytes) != later {
		t.Errorf("after the buffer was reused: events %+v, rest %q", events, restBytes)
	}
	if string(big.Raw) != large || string(sent) != large[:big.Sent] {
		t.Errorf("after the buffer was reused: the large event's Raw is %d bytes, the streamed %d; want both of the event (%d)", len(big.Raw), len(sent), len(large))
	}

	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	blocked := NewEventReader(pr, 1<<20)
	blocked.Release()
	answered := make(chan error, 1)
	go func() {
		_, err := blocked.Next()
		answered <- err
	}()
	select {
	case err := <-answered:
		if !errors.Is(err, ErrReleased) {
			t.Errorf("Next on a released reader: %v, want ErrReleased", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Next on a released reader waits on its source")
	}

	small := "data: " + strings.Repeat("x", 200) + "\n\n"
	read := func() {
		er := NewEventReader(strings.NewReader(small), 1<<20)
		for {
			if _, err := er.Next(); err != nil {
				break
			}
		}
		er.Release()
	}
	read()
	const n = 2000
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		read()
	}
	runtime.ReadMemStats(&after)
	if got := (after.TotalAlloc - before.TotalAlloc) / n; got >= minReadBuf {
		t.Errorf("reading a %d-byte event and releasing the reader allocates %d bytes, want less than the %d-byte read buffer", len(small), got, minReadBuf)
	}
}
