package policysync

import (
	"context"
	"errors"
	"time"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store"
)

// keysTimeout bounds one key operation on the sidecar's own store.
const keysTimeout = 5 * time.Second

// keysReport answers a KeysRequest from the manager about this sidecar's
// own records. It never sends an argument; a response only for a lookup
// that asks for it (the manager checked the caller may read results).
func (c *Client) keysReport(ctx context.Context, req *policywire.KeysRequest) policywire.Report {
	r := c.report("", "", "")
	reply := &policywire.KeysReply{ID: req.ID}
	r.KeysReply = reply
	if c.o.Keys == nil {
		reply.Error = "this sidecar's store is not its own: the manager reads it"
		return r
	}
	ctx, cancel := context.WithTimeout(ctx, keysTimeout)
	defer cancel()
	var (
		rec store.Record
		err error
	)
	switch req.Op {
	case policywire.KeysList:
		var recs []store.Record
		recs, err = c.o.Keys.Records(ctx, policywire.MaxKeysListed+1)
		if len(recs) > policywire.MaxKeysListed {
			recs, reply.Truncated = recs[:policywire.MaxKeysListed], true
		}
		for _, rec := range recs {
			reply.Records = append(reply.Records, wireRecord(rec))
		}
	case policywire.KeysLookup:
		var resp []byte
		rec, resp, err = c.o.Keys.Lookup(ctx, req.Key)
		// The record holds the call's tracing trailer after the response:
		// the manager shows the response as a replay returns it.
		resp = claim.StripTrace(resp)
		if err == nil {
			reply.Records = []policywire.KeyRecord{wireRecord(rec)}
			if req.Response && len(resp) > policywire.MaxKeysResponseBytes {
				reply.Error = "the stored result is too large to show over the policy stream"
			} else if req.Response {
				reply.Response = resp
			}
		}
	case policywire.KeysRelease, policywire.KeysForget:
		d := store.DropClaim
		if req.Op == policywire.KeysForget {
			d = store.DropResult
		}
		rec, err = c.o.Keys.Drop(ctx, req.Key, d)
		if rec.Key != "" {
			reply.Records = []policywire.KeyRecord{wireRecord(rec)}
		}
		if err == nil {
			c.log.Info("Dropped a record as the manager asked (kubectl idemcp keys)", "op", req.Op, "key", req.Key, "tool", rec.Tool)
		}
	default:
		reply.Error = "unknown key operation " + req.Op
		return r
	}
	switch {
	case err == nil:
	case errors.Is(err, store.ErrNoRecord):
		reply.Code = policywire.KeysNotFound
	case errors.Is(err, store.ErrWrongState):
		reply.Code = policywire.KeysWrongState
	case errors.Is(err, store.ErrLeaseLive):
		reply.Code = policywire.KeysLeaseLive
	default:
		reply.Error = err.Error()
	}
	return r
}

func wireRecord(r store.Record) policywire.KeyRecord {
	return policywire.KeyRecord{Key: r.Key, Tool: r.Tool, Pod: r.Pod, Completed: r.Completed, Claimed: r.Claimed, LeaseUntil: r.LeaseUntil, Expires: r.Expires}
}
