package policystream

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/idemcp/idemcp/internal/policywire"
)

// ErrNotServing means this replica holds no policy streams now (it is not
// the leader): ask the one that does.
var ErrNotServing = errors.New("this manager replica does not hold the policy streams now (not the leader); retry")

// SidecarKeys is one sidecar's answer to a KeysRequest.
type SidecarKeys struct {
	Pod   string
	Reply *policywire.KeysReply
	// Err says why there is no reply (the sidecar did not answer in time,
	// or its stream ended).
	Err error
}

// SidecarKeysTimeout bounds the wait for each sidecar's answer.
const SidecarKeysTimeout = 5 * time.Second

// AskSidecars sends req to every sidecar of the policy whose store is its
// own (a Memory store: its Reports say Keys) and returns each one's
// answer, waiting at most until ctx ends for each. Sidecars of a shared
// store are not asked: the manager reads the store itself.
func (s *Server) AskSidecars(ctx context.Context, namespace, name string, req policywire.KeysRequest) ([]SidecarKeys, error) {
	if !s.leading.Load() {
		return nil, ErrNotServing
	}
	key := types.NamespacedName{Namespace: namespace, Name: name}
	s.mu.Lock()
	var targets []*stream
	for c := range s.state(key).streams {
		if c.report.Keys {
			targets = append(targets, c)
		}
	}
	s.mu.Unlock()
	// One slow sidecar is a note in the answer, not the end of the request.
	ctx, cancel := context.WithTimeout(ctx, SidecarKeysTimeout)
	defer cancel()
	out := make([]SidecarKeys, len(targets))
	var wg sync.WaitGroup
	for i, c := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = s.askOne(ctx, c, req)
		}()
	}
	wg.Wait()
	return out, nil
}

func (s *Server) askOne(ctx context.Context, c *stream, req policywire.KeysRequest) SidecarKeys {
	id, err := newKeysID()
	if err != nil {
		return SidecarKeys{Pod: c.pod, Err: err}
	}
	req.ID = id
	line, err := json.Marshal(policywire.Snapshot{Keys: &req})
	if err != nil {
		return SidecarKeys{Pod: c.pod, Err: err}
	}
	answer := s.keyAnswers.expect(c, req.ID)
	defer s.keyAnswers.drop(req.ID)
	gone := fmt.Errorf("the policy stream of sidecar %s ended before it answered", c.pod)
	select {
	case c.keys <- append(line, '\n'):
	case <-c.done:
		return SidecarKeys{Pod: c.pod, Err: gone}
	case <-ctx.Done():
		return SidecarKeys{Pod: c.pod, Err: fmt.Errorf("sidecar %s did not take the request: %w", c.pod, ctx.Err())}
	}
	select {
	case r := <-answer:
		return SidecarKeys{Pod: c.pod, Reply: r}
	case <-c.done:
		return SidecarKeys{Pod: c.pod, Err: gone}
	case <-ctx.Done():
		return SidecarKeys{Pod: c.pod, Err: fmt.Errorf("sidecar %s did not answer within %s: %w", c.pod, SidecarKeysTimeout, ctx.Err())}
	}
}

// newKeysID is a KeysRequest's id: random, so that no sidecar can guess
// the id of a request sent to another one.
func newKeysID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("making a keys request id: %w", err)
	}
	return hex.EncodeToString(b[:]) + "-keys", nil
}

// keyAnswers routes KeysReplies to the requests waiting for them.
type keyAnswers struct {
	mu      sync.Mutex
	waiting map[string]keyWaiter
}

// keyWaiter is one request waiting: only the stream it was sent on may
// answer it (a pod name alone is not enough: a pod of the same name in
// another namespace, or a later pod of that name, has its own stream).
type keyWaiter struct {
	stream *stream
	ch     chan *policywire.KeysReply
}

func (k *keyAnswers) expect(c *stream, id string) <-chan *policywire.KeysReply {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.waiting == nil {
		k.waiting = map[string]keyWaiter{}
	}
	ch := make(chan *policywire.KeysReply, 1)
	k.waiting[id] = keyWaiter{stream: c, ch: ch}
	return ch
}

func (k *keyAnswers) drop(id string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.waiting, id)
}

// deliver hands r, read from stream c, to its request; a reply nobody
// waits for (late, unasked, or to a request sent on another stream) is
// dropped.
func (k *keyAnswers) deliver(c *stream, r *policywire.KeysReply) {
	k.mu.Lock()
	w, ok := k.waiting[r.ID]
	ok = ok && w.stream == c
	if ok {
		delete(k.waiting, r.ID)
	}
	k.mu.Unlock()
	if ok {
		w.ch <- r
	}
}

// writeLine writes one line to a stream under the write timeout.
func (s *Server) writeLine(rc *http.ResponseController, w http.ResponseWriter, line []byte) bool {
	_ = rc.SetWriteDeadline(time.Now().Add(s.opts.WriteTimeout))
	defer func() { _ = rc.SetWriteDeadline(time.Time{}) }()
	if _, err := w.Write(line); err != nil {
		return false
	}
	return rc.Flush() == nil
}
