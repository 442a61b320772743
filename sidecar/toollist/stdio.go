package toollist

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// Stdio lists a stdio MCP server's tools with the wrapper's own tools/list
// requests, sent in the client's session once the client has initialized
// it (the server has no other session). Their ids carry a random part, so
// they never meet the client's; the wrapper hands their responses to
// Deliver and keeps them from the client.
type Stdio struct {
	send   func(line []byte) error
	prefix string
	seq    atomic.Int64
	ready  atomic.Bool

	mu      sync.Mutex
	waiting map[string]chan *mcpmsg.Message
	meta    json.RawMessage // the client's protocol _meta, for 2026-07-28
}

// Open marks the session open, with the client's protocol _meta (for
// 2026-07-28; nil: none), and reports whether it just was.
func (l *Stdio) Open(meta json.RawMessage) bool {
	l.mu.Lock()
	if meta != nil {
		l.meta = meta
	}
	l.mu.Unlock()
	return l.ready.CompareAndSwap(false, true)
}

// Opened reports whether the session is open.
func (l *Stdio) Opened() bool { return l.ready.Load() }

// NewStdio returns a lister whose requests are lines given to send (the
// server's stdin).
func NewStdio(send func(line []byte) error) *Stdio {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &Stdio{send: send, prefix: "idemcp-tools-list-" + hex.EncodeToString(b[:]) + "-", waiting: make(map[string]chan *mcpmsg.Message)}
}

// Deliver hands a response to the lister's own request it answers, and
// reports whether it was one.
func (l *Stdio) Deliver(msg *mcpmsg.Message) bool {
	k := mcpmsg.IDKey(msg.ID)
	l.mu.Lock()
	ch, ok := l.waiting[k]
	delete(l.waiting, k)
	l.mu.Unlock()
	if ok {
		ch <- msg
	}
	return ok
}

// List does one listing through the server (a ListFunc).
func (l *Stdio) List(ctx context.Context, hints *engine.ToolHints) error {
	if !l.ready.Load() {
		return errors.New("the client has not initialized the session yet")
	}
	cursor := ""
	for range maxPages {
		id := json.RawMessage(strconv.Quote(l.prefix + strconv.FormatInt(l.seq.Add(1), 10)))
		params := map[string]any{}
		if cursor != "" {
			params["cursor"] = cursor
		}
		l.mu.Lock()
		if l.meta != nil {
			params["_meta"] = l.meta
		}
		l.mu.Unlock()
		line, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": params})
		ch := make(chan *mcpmsg.Message, 1)
		k := mcpmsg.IDKey(id)
		l.mu.Lock()
		l.waiting[k] = ch
		l.mu.Unlock()
		if err := l.send(line); err != nil {
			l.drop(k)
			return fmt.Errorf("writing tools/list to the MCP server: %w", err)
		}
		var msg *mcpmsg.Message
		select {
		case msg = <-ch:
		case <-ctx.Done():
			l.drop(k)
			return fmt.Errorf("tools/list: %w", ctx.Err())
		}
		if len(msg.Error) > 0 && string(msg.Error) != "null" {
			return fmt.Errorf("tools/list: the MCP server answered %s", msg.Error)
		}
		if cursor = hints.ObserveListResult(msg.Result); cursor == "" {
			return nil
		}
	}
	return fmt.Errorf("tools/list: more than %d pages", maxPages)
}

func (l *Stdio) drop(k string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.waiting, k)
}
