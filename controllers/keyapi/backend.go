package keyapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
)

// backend is where a policy's records are.
type backend interface {
	list(ctx context.Context) ([]Record, []string, error)
	lookup(ctx context.Context, key string, response bool) (Record, []byte, error)
	drop(ctx context.Context, key string, d store.Drop) ([]Record, []string, error)
	close()
}

func (s *Server) backend(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (backend, error) {
	switch p.Spec.Store.Type {
	case v1alpha1.StoreMemory, "":
		if s.Stream == nil {
			return nil, refuse(http.StatusServiceUnavailable, "the manager runs without its policy stream (--policy-stream-bind-address=0), through which a Memory store's sidecars answer")
		}
		return &sidecars{stream: s.Stream, ns: p.Namespace, name: p.Name}, nil
	case v1alpha1.StoreRedis:
		return s.redis(ctx, p)
	case v1alpha1.StorePostgres:
		return s.postgres(ctx, p)
	}
	return nil, refuse(http.StatusNotImplemented, "kubectl idemcp keys does not read a store of type %s yet; it reads Memory, Redis and Postgres", p.Spec.Store.Type)
}

func toRecord(r store.Record, holder string, now time.Time) Record {
	return Record{Key: r.Key, Tool: r.Tool, State: string(r.State(now)), Pod: r.Pod, Holder: holder,
		Claimed: r.Claimed, LeaseUntil: r.LeaseUntil, Expires: r.Expires}
}

// dropError turns a store's refusal into the API's.
func dropError(key string, rec store.Record, err error, now time.Time) error {
	switch {
	case errors.Is(err, store.ErrNoRecord):
		return refuse(http.StatusNotFound, "key %s is no longer stored (it expired, or was released or completed meanwhile)", Short(key))
	case errors.Is(err, store.ErrWrongState) && rec.Completed:
		return refuse(http.StatusConflict, "key %s is completed (its result is stored): release is for a pending or outcome-unknown claim; to make the next identical call run, forget it", Short(key))
	case errors.Is(err, store.ErrWrongState):
		return refuse(http.StatusConflict, "key %s is %s, not completed: forget drops a stored result; to let the next retry run, release it", Short(key), rec.State(now))
	case errors.Is(err, store.ErrLeaseLive):
		return refuse(http.StatusConflict, "key %s is pending: its call is still running in the sidecar of %s, whose lease lasts until %s; releasing it now would let a retry run the tool a second time. Wait for it to complete, or for the lease to run out (state outcome-unknown)",
			Short(key), orText(rec.Pod, "an unknown pod"), rec.LeaseUntil.UTC().Format(time.RFC3339))
	}
	return fmt.Errorf("dropping key %s: %w", Short(key), err)
}

// shared is a store every sidecar of the policy shares, read by the
// manager.
type shared struct {
	st   store.Store
	in   store.Inspector
	open func(ctx context.Context) (*store.Sealed, error)
}

func (b *shared) close() { _ = b.st.Close() }

func (b *shared) list(ctx context.Context) ([]Record, []string, error) {
	recs, err := b.in.Records(ctx, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("listing the store's keys: %w", err)
	}
	now := time.Now()
	out := make([]Record, 0, len(recs))
	for _, r := range recs {
		out = append(out, toRecord(r, "", now))
	}
	return out, nil, nil
}

func (b *shared) lookup(ctx context.Context, key string, response bool) (Record, []byte, error) {
	in := b.in
	if response {
		sealed, err := b.open(ctx)
		if err != nil {
			return Record{}, nil, err
		}
		in = sealed
	}
	r, resp, err := in.Lookup(ctx, key)
	var broken *store.SealBrokenError
	switch {
	case errors.Is(err, store.ErrNoRecord):
		return Record{}, nil, refuse(http.StatusNotFound, "key %s is no longer stored", Short(key))
	case errors.As(err, &broken):
		return toRecord(r, "", time.Now()), nil, refuse(http.StatusConflict, "key %s: %v", Short(key), err)
	case err != nil:
		return Record{}, nil, fmt.Errorf("reading key %s: %w", Short(key), err)
	}
	return toRecord(r, "", time.Now()), resp, nil
}

func (b *shared) drop(ctx context.Context, key string, d store.Drop) ([]Record, []string, error) {
	r, err := b.in.Drop(ctx, key, d)
	if err != nil {
		return nil, nil, dropError(key, r, err, time.Now())
	}
	return []Record{toRecord(r, "", time.Now())}, nil, nil
}

// redis opens the policy's Redis as its sidecars do: the same addresses,
// password Secret, key prefix and seal keys.
func (s *Server) redis(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (backend, error) {
	r := p.Spec.Store.Redis
	if r == nil {
		return nil, refuse(http.StatusConflict, "IdempotencyPolicy %s/%s has store.type Redis but no store.redis", p.Namespace, p.Name)
	}
	o := redisstore.Options{Prefix: policy.RedisKeyPrefix(p.Namespace, p.Name)}
	switch {
	case r.Managed != nil:
		o.Addrs = []string{controllers.RedisEndpoint(p)}
	case r.External != nil:
		o.Addrs, o.SentinelMaster, o.TLS = r.External.Addresses, r.External.SentinelMaster, r.External.TLS
	}
	for _, ref := range credentials.Refs(p) {
		if ref.Env != "IDEMCP_REDIS_PASSWORD" {
			continue
		}
		pw, err := s.secretKey(ctx, p.Namespace, ref)
		if err != nil {
			return nil, err
		}
		o.Password = pw
	}
	st, err := redisstore.New(o)
	if err != nil {
		return nil, fmt.Errorf("opening the Redis store of %s/%s: %w", p.Namespace, p.Name, err)
	}
	return &shared{st: st, in: st, open: s.sealed(p, st, o.Prefix)}, nil
}

// postgres opens the policy's PostgreSQL as its sidecars do: the URL
// Secret, key prefix and seal keys. The manager only reads and deletes
// rows: it runs no cleanup and never waits on a key.
func (s *Server) postgres(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (backend, error) {
	if p.Spec.Store.Postgres == nil {
		return nil, refuse(http.StatusConflict, "IdempotencyPolicy %s/%s has store.type Postgres but no store.postgres", p.Namespace, p.Name)
	}
	o := pgstore.Options{Prefix: policy.RedisKeyPrefix(p.Namespace, p.Name), CleanupInterval: -1}
	for _, ref := range credentials.Refs(p) {
		if ref.Env != "IDEMCP_POSTGRES_URL" {
			continue
		}
		url, err := s.secretKey(ctx, p.Namespace, ref)
		if err != nil {
			return nil, err
		}
		o.URL = url
	}
	st, err := pgstore.New(o)
	if err != nil {
		return nil, refuse(http.StatusConflict, "opening the Postgres store of %s/%s: %v", p.Namespace, p.Name, err)
	}
	return &shared{st: st, in: st, open: s.sealed(p, st, st.KeyPrefix())}, nil
}

// sealed opens st with the policy's seal keys, bound to the store's key
// prefix as the sidecars' seals are.
func (s *Server) sealed(p *v1alpha1.IdempotencyPolicy, st store.Store, prefix string) func(ctx context.Context) (*store.Sealed, error) {
	return func(ctx context.Context) (*store.Sealed, error) {
		ref := credentials.Ref{Field: "the seal keys", Name: credentials.SealSecretName(p.Name), Key: credentials.SealKeysKey}
		text, err := s.secretKey(ctx, p.Namespace, ref)
		if err != nil {
			return nil, err
		}
		ring, err := store.ParseKeyring(text)
		if err != nil {
			return nil, refuse(http.StatusConflict, "Secret %s/%s: %v", p.Namespace, ref.Name, err)
		}
		return store.Seal(st, store.SealOptions{Keyring: ring, Context: prefix}), nil
	}
}

func (s *Server) secretKey(ctx context.Context, ns string, ref credentials.Ref) (string, error) {
	var sec corev1.Secret
	if err := s.APIReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: ref.Name}, &sec); err != nil {
		if apierrors.IsNotFound(err) {
			return "", refuse(http.StatusConflict, "Secret %s/%s (%s) not found: the policy's status says what to fix", ns, ref.Name, ref.Field)
		}
		return "", fmt.Errorf("reading Secret %s/%s: %w", ns, ref.Name, err)
	}
	if err := credentials.Check(ref, &sec); err != nil {
		return "", refuse(http.StatusConflict, "%v", err)
	}
	v, ok := sec.Data[ref.Key]
	if !ok {
		return "", refuse(http.StatusConflict, "Secret %s/%s (%s) has no key %q", ns, ref.Name, ref.Field, ref.Key)
	}
	return string(v), nil
}

// sidecars are a Memory store's: each sidecar holds its own records and
// answers over its policy stream.
type sidecars struct {
	stream   *policystream.Server
	ns, name string
}

func (b *sidecars) close() {}

func (b *sidecars) ask(ctx context.Context, req policywire.KeysRequest) ([]policystream.SidecarKeys, []string, error) {
	answers, err := b.stream.AskSidecars(ctx, b.ns, b.name, req)
	if errors.Is(err, policystream.ErrNotServing) {
		return nil, nil, refuse(http.StatusServiceUnavailable, "%v", err)
	}
	if err != nil {
		return nil, nil, err
	}
	var notes []string
	ok := answers[:0:0]
	for _, a := range answers {
		switch {
		case a.Err != nil:
			notes = append(notes, a.Err.Error())
		case a.Reply.Error != "":
			notes = append(notes, fmt.Sprintf("sidecar %s: %s", a.Pod, a.Reply.Error))
		default:
			ok = append(ok, a)
		}
	}
	if len(answers) == 0 {
		notes = append(notes, fmt.Sprintf("no sidecar of %s/%s holds a policy stream now: a Memory store's keys are only in its sidecars (kubectl idemcp status %s shows them)", b.ns, b.name, b.name))
	}
	return ok, notes, nil
}

func fromWire(r policywire.KeyRecord) store.Record {
	return store.Record{Key: r.Key, Tool: r.Tool, Pod: r.Pod, Completed: r.Completed, Claimed: r.Claimed, LeaseUntil: r.LeaseUntil, Expires: r.Expires}
}

func (b *sidecars) list(ctx context.Context) ([]Record, []string, error) {
	answers, notes, err := b.ask(ctx, policywire.KeysRequest{Op: policywire.KeysList})
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	out := []Record{}
	for _, a := range answers {
		for _, r := range a.Reply.Records {
			out = append(out, toRecord(fromWire(r), a.Pod, now))
		}
		if a.Reply.Truncated {
			notes = append(notes, fmt.Sprintf("sidecar %s holds more than %d records: only those are listed", a.Pod, policywire.MaxKeysListed))
		}
	}
	return out, notes, nil
}

func (b *sidecars) lookup(ctx context.Context, key string, response bool) (Record, []byte, error) {
	answers, _, err := b.ask(ctx, policywire.KeysRequest{Op: policywire.KeysLookup, Key: key, Response: response})
	if err != nil {
		return Record{}, nil, err
	}
	now := time.Now()
	var found *Record
	for _, a := range answers {
		if len(a.Reply.Records) == 0 {
			continue
		}
		r := toRecord(fromWire(a.Reply.Records[0]), a.Pod, now)
		// A result is worth more than a claim: show it first.
		if found == nil || r.Completed() && !found.Completed() {
			found = &r
			if r.Completed() && response {
				return r, a.Reply.Response, nil
			}
		}
	}
	if found == nil {
		return Record{}, nil, refuse(http.StatusNotFound, "key %s is no longer stored", Short(key))
	}
	return *found, nil, nil
}

func (b *sidecars) drop(ctx context.Context, key string, d store.Drop) ([]Record, []string, error) {
	op := policywire.KeysRelease
	if d == store.DropResult {
		op = policywire.KeysForget
	}
	answers, notes, err := b.ask(ctx, policywire.KeysRequest{Op: op, Key: key})
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	var dropped []Record
	var refusal error
	for _, a := range answers {
		var rec store.Record
		if len(a.Reply.Records) > 0 {
			rec = fromWire(a.Reply.Records[0])
		}
		switch a.Reply.Code {
		case "":
			dropped = append(dropped, toRecord(rec, a.Pod, now))
		case policywire.KeysNotFound:
		case policywire.KeysWrongState:
			refusal = dropError(key, rec, store.ErrWrongState, now)
		case policywire.KeysLeaseLive:
			refusal = dropError(key, rec, store.ErrLeaseLive, now)
		}
	}
	if len(dropped) == 0 {
		switch {
		case refusal == nil && len(notes) > 0:
			// A sidecar that did not answer may hold it.
			refusal = refuse(http.StatusServiceUnavailable, "key %s was not dropped: %s; retry", Short(key), strings.Join(notes, "; "))
		case refusal == nil:
			refusal = dropError(key, store.Record{}, store.ErrNoRecord, now)
		}
		return nil, notes, refusal
	}
	return dropped, notes, nil
}
