// Package policysync keeps a sidecar's policy in step with the manager: it
// holds the manager's policy stream open (internal/policywire), applies each
// snapshot atomically through the engine, acknowledges the hash it applied
// or says why it could not, and keeps the last good policy while the
// manager is away, reconnecting with capped, jittered exponential backoff.
package policysync

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store"
)

// Engine is what the client needs of the sidecar's engine.
type Engine interface {
	Policy() *policy.Policy
	SetPolicy(*policy.Policy)
}

// UnscopedCounter is implemented by an engine that counts calls forwarded
// without dedup because they had no scope; the count rides on every report.
type UnscopedCounter interface {
	UnscopedCalls() uint64
}

// LegacyKeySetter is implemented by an engine that keys its calls in a
// key space, told by the manager what to do with keys without it
// (engine.LegacyKeys).
type LegacyKeySetter interface {
	SetLegacyKeys(engine.LegacyKeys)
	LegacyKeys() engine.LegacyKeys
}

// ToolReporter is implemented by an engine that reports what it decided
// for each tool it has seen; the decisions ride on every report, and a
// change of them sends one.
type ToolReporter interface {
	ToolDecisions(limit int) ([]policywire.Tool, int)
	ToolsVersion() uint64
}

// toolsCheck is how often the client looks for new tool decisions to
// report.
const toolsCheck = 500 * time.Millisecond

// Options configure a Client.
type Options struct {
	// Endpoint is the manager's stream, such as
	// https://idemcp-policy-stream.idemcp-system.svc:9444.
	Endpoint string
	// Namespace and Name of the policy.
	Namespace, Name string
	// Token returns the projected token (audience idemcp); it is read
	// again at every connection, as the kubelet rotates it.
	Token func() (string, error)
	// CABundle is the PEM the webhook injected; the manager's certificate
	// must verify against it or a bundle received on the stream since.
	CABundle []byte
	Engine   Engine
	// StoreIdentity is policywire.StoreIdentity of the store the sidecar
	// opened at start: a policy naming another store is applied, but the
	// store stays, and the report says a restart is required.
	StoreIdentity string
	// OnApply, when set, is called with each policy applied, after the
	// engine has it: what of the store may change live (Redis's
	// minReplicas) follows it.
	OnApply func(*policy.Policy)
	Logger  *slog.Logger
	// Backoff between attempts after a network error or a 503 starts at
	// MinBackoff and doubles up to MaxBackoff (defaults 200ms, 5s); a
	// refusal (401, 403, 404) waits RefusedBackoff (default 1m), doubling up
	// to 10m: a token or label problem is not fixed by retrying at once.
	MinBackoff, MaxBackoff, RefusedBackoff time.Duration
	// ConnectTimeout bounds the TCP connect and the TLS handshake, and
	// HeaderTimeout the wait for the stream's response header (defaults
	// 5s, 30s). Without them a connect to the Service while it still
	// points at a manager pod that just died waits out the kernel's SYN
	// retries, about two minutes, before the next attempt.
	ConnectTimeout, HeaderTimeout time.Duration
	// ReportTimeout bounds how long a report may wait to be taken by a
	// manager that stopped reading them (default DefaultReportTimeout):
	// the stream then ends and the sidecar connects again, rather than
	// stop reading snapshots for good.
	ReportTimeout time.Duration
	// Transport overrides the HTTP transport (tests, benchmarks).
	Transport http.RoundTripper
	// Keys, when set, is the sidecar's own store (Memory), whose records
	// the manager lists and resolves over the stream for kubectl idemcp
	// keys; a shared store is read by the manager itself.
	Keys store.Inspector
}

// DefaultReportTimeout is Options.ReportTimeout when not set: the
// manager's own bound on writing a snapshot to a sidecar.
const DefaultReportTimeout = 10 * time.Second

// Client is a running policy sync.
type Client struct {
	o   Options
	log *slog.Logger
	// order is where the policy enforced stands among the policy's
	// versions (nil: not known, as for the starting snapshot); only the
	// goroutine running sessions touches it.
	order *policywire.Order
	// ticket is the review ticket the manager gave with ticketToken, sent
	// back with that token so that its successor needs no TokenReview;
	// only the goroutine running sessions touches them.
	ticket, ticketToken string

	mu        sync.Mutex
	roots     *x509.CertPool
	caPEM     [][]byte
	connected bool
	sessions  uint64
	applied   chan string
}

// New checks the options.
func New(o Options) (*Client, error) {
	if o.Endpoint == "" || !strings.HasPrefix(o.Endpoint, "https://") {
		return nil, fmt.Errorf("policy endpoint %q is not an https:// URL", o.Endpoint)
	}
	if o.Namespace == "" || o.Name == "" {
		return nil, errors.New("policy sync needs the policy's namespace and name")
	}
	if o.Token == nil || o.Engine == nil {
		return nil, errors.New("policy sync needs a token source and an engine")
	}
	c := &Client{o: o, log: o.Logger, applied: make(chan string, 1)}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if len(o.CABundle) > 0 {
		c.addCAs(o.CABundle)
		if c.roots == nil {
			return nil, errors.New("IDEMCP_POLICY_CA holds no PEM certificate")
		}
	}
	setDefault(&c.o.MinBackoff, 200*time.Millisecond)
	setDefault(&c.o.MaxBackoff, 5*time.Second)
	setDefault(&c.o.RefusedBackoff, time.Minute)
	setDefault(&c.o.ConnectTimeout, 5*time.Second)
	setDefault(&c.o.HeaderTimeout, 30*time.Second)
	setDefault(&c.o.ReportTimeout, DefaultReportTimeout)
	return c, nil
}

func setDefault(d *time.Duration, def time.Duration) {
	if *d <= 0 {
		*d = def
	}
}

// TokenFile returns a token source that reads path at every call.
func TokenFile(path string) func() (string, error) {
	return func() (string, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("reading the policy stream token: %w", err)
		}
		return strings.TrimSpace(string(b)), nil
	}
}

// Applied delivers the hash of every policy applied (latest only): tests
// and benchmarks wait on it.
func (c *Client) Applied() <-chan string { return c.applied }

// Connected reports whether a stream is open now.
func (c *Client) Connected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.connected
}

// Sessions counts the streams opened so far (answered 200): more than one
// means the sidecar reconnected.
func (c *Client) Sessions() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sessions
}

// addCAs adds every certificate of pem to the trusted roots, keeping the
// ones already there: a rotated CA joins, the old one stays until restart.
func (c *Client) addCAs(pem []byte) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, known := range c.caPEM {
		if bytes.Equal(known, pem) {
			return false
		}
	}
	pool := x509.NewCertPool()
	for _, known := range c.caPEM {
		pool.AppendCertsFromPEM(known)
	}
	if !pool.AppendCertsFromPEM(pem) {
		return false
	}
	c.caPEM = append(c.caPEM, pem)
	c.roots = pool
	return true
}

// statusError is a non-200 answer.
type statusError struct {
	code int
	body string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("the manager answered %d: %s", e.code, strings.TrimSpace(e.body))
}

func (e *statusError) refused() bool {
	return e.code == http.StatusUnauthorized || e.code == http.StatusForbidden || e.code == http.StatusNotFound
}

// Run keeps the stream until ctx ends. It never returns before that: the
// sidecar enforces its last good policy whatever happens to the manager.
func (c *Client) Run(ctx context.Context) error {
	var failures int
	refused := false
	for {
		got, err := c.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if got {
			failures, refused = 0, false
		}
		var se *statusError
		wasRefused := errors.As(err, &se) && se.refused()
		if wasRefused != refused {
			failures = 0
		}
		refused = wasRefused
		base, ceiling := c.o.MinBackoff, c.o.MaxBackoff
		if refused {
			base, ceiling = c.o.RefusedBackoff, 10*c.o.RefusedBackoff
		}
		wait := backoff(base, ceiling, failures)
		failures++
		level := slog.LevelInfo
		if refused {
			level = slog.LevelWarn
		}
		c.log.Log(ctx, level, "Policy stream ended, keeping the last policy", "policy", c.o.Namespace+"/"+c.o.Name,
			"enforcing", c.o.Engine.Policy().Hash, "err", errString(err), "retryIn", wait.Round(time.Millisecond).String())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// backoff is min(ceiling, base*2^n), with full jitter over its upper half
// so that sidecars cut off together do not come back together.
func backoff(base, ceiling time.Duration, n int) time.Duration {
	d := base
	for i := 0; i < n && d < ceiling; i++ {
		d *= 2
	}
	d = min(d, ceiling)
	return d/2 + rand.N(d/2+1)
}

func (c *Client) transport() http.RoundTripper {
	if c.o.Transport != nil {
		return c.o.Transport
	}
	c.mu.Lock()
	roots := c.roots
	c.mu.Unlock()
	t := &http.Transport{
		// Verification is never skipped: with no bundle, the system roots.
		TLSClientConfig:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:     true,
		DialContext:           (&net.Dialer{Timeout: c.o.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   c.o.ConnectTimeout,
		ResponseHeaderTimeout: c.o.HeaderTimeout,
		HTTP2:                 &http.HTTP2Config{SendPingTimeout: 15 * time.Second, PingTimeout: 5 * time.Second},
	}
	return t
}

// session runs one stream; got says whether it delivered a snapshot.
func (c *Client) session(ctx context.Context) (got bool, err error) {
	token, err := c.o.Token()
	if err != nil {
		return false, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(c.o.Endpoint, "/")+policywire.StreamPath(c.o.Namespace, c.o.Name), pr)
	if err != nil {
		return false, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", policywire.ContentType)
	if c.ticket != "" && c.ticketToken == token {
		req.Header.Set(policywire.ReviewTicketHeader, c.ticket)
	}
	rt := c.transport()
	if t, ok := rt.(*http.Transport); ok && c.o.Transport == nil {
		defer t.CloseIdleConnections()
	}
	reports := make(chan policywire.Report, 4)
	writeErr := make(chan error, 1)
	go func() {
		enc := json.NewEncoder(pw)
		for {
			select {
			case <-ctx.Done():
				return
			case r := <-reports:
				if err := enc.Encode(r); err != nil {
					writeErr <- err
					return
				}
			}
		}
	}()
	// The first report says what this sidecar enforces, before any
	// snapshot: a new leader learns it at once.
	reports <- c.report("", "", "")
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return false, err
	}
	defer func() { _ = resp.Body.Close() }()
	// Over HTTP/2 a cancelled context does not end a response body while
	// the request body is still open: close both, or an idle stream
	// outlives the sidecar's shutdown.
	stop := context.AfterFunc(ctx, func() {
		_ = pw.CloseWithError(ctx.Err())
		_ = resp.Body.Close()
	})
	defer stop()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return false, &statusError{code: resp.StatusCode, body: string(body)}
	}
	if t := resp.Header.Get(policywire.ReviewTicketHeader); t != "" {
		c.ticket, c.ticketToken = t, token
	}
	c.setConnected(true)
	defer c.setConnected(false)
	// Every report after the first waits for the writer, which waits for
	// the manager to read: each wait is bounded, so that a manager that
	// stopped reading ends the stream instead of stopping this loop.
	timer := time.NewTimer(c.o.ReportTimeout)
	defer timer.Stop()
	var sendMu sync.Mutex
	send := func(r policywire.Report) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		timer.Reset(c.o.ReportTimeout)
		select {
		case reports <- r:
			return nil
		case err := <-writeErr:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
			return fmt.Errorf("the manager took no report for %v; reconnecting", c.o.ReportTimeout)
		}
	}
	// The last answer, repeated with new tool decisions when they change.
	var lastMu sync.Mutex
	var lastNonce, lastRestart, lastNack string
	answer := func(nonce, restart, nack string) error {
		lastMu.Lock()
		lastNonce, lastRestart, lastNack = nonce, restart, nack
		r := c.report(nonce, restart, nack)
		lastMu.Unlock()
		return send(r)
	}
	if tr, ok := c.o.Engine.(ToolReporter); ok {
		sent := tr.ToolsVersion()
		toolsErr := make(chan error, 1)
		go func() {
			t := time.NewTicker(toolsCheck)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				if v := tr.ToolsVersion(); v != sent {
					sent = v
					lastMu.Lock()
					r := c.report(lastNonce, lastRestart, lastNack)
					lastMu.Unlock()
					if err := send(r); err != nil {
						toolsErr <- err
						cancel()
						return
					}
				}
			}
		}()
		defer func() {
			select {
			case err = <-toolsErr:
			default:
			}
		}()
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 16<<10), policywire.MaxMessageBytes)
	for sc.Scan() {
		var snap policywire.Snapshot
		if err := policywire.Decode(sc.Bytes(), &snap); err != nil {
			if err := answer("", "", err.Error()); err != nil {
				return got, err
			}
			continue
		}
		if snap.Keys != nil {
			if err := send(c.keysReport(ctx, snap.Keys)); err != nil {
				return got, err
			}
			continue
		}
		got = true
		if snap.CABundle != "" && c.addCAs([]byte(snap.CABundle)) {
			c.log.Info("Trusting the manager's current CA bundle for the next connections")
		}
		restart, nack := c.apply(&snap)
		if err := answer(snap.Nonce, restart, nack); err != nil {
			return got, err
		}
	}
	if err := sc.Err(); err != nil {
		return got, err
	}
	return got, io.ErrUnexpectedEOF
}

func (c *Client) setConnected(v bool) {
	c.mu.Lock()
	c.connected = v
	if v {
		c.sessions++
	}
	c.mu.Unlock()
}

// apply compiles and installs a snapshot. It returns why a restart is
// required (the store changed), or why the snapshot was refused.
func (c *Client) apply(snap *policywire.Snapshot) (restart, nack string) {
	if snap.Policy == nil {
		return "", "the snapshot holds no policy"
	}
	p, err := policy.Compile(snap.Policy.Spec)
	if err != nil {
		return "", fmt.Sprintf("policy %s does not compile here: %v", snap.Version, err)
	}
	if p.Hash != snap.Version {
		return "", fmt.Sprintf("policy %s compiles to %s here: the sidecar's version differs from the manager's; roll the pods to the manager's image", snap.Version, p.Hash)
	}
	p.Name, p.Namespace = snap.Policy.Name, snap.Policy.Namespace
	if p.Name != c.o.Name || p.Namespace != c.o.Namespace {
		return "", fmt.Sprintf("the snapshot is for policy %s/%s, not %s/%s", p.Namespace, p.Name, c.o.Namespace, c.o.Name)
	}
	old := c.o.Engine.Policy()
	enforced := ""
	if old != nil {
		enforced = old.Hash
	}
	same := enforced == p.Hash
	if snap.Order != nil && c.order != nil && policywire.Older(*snap.Order, *c.order) && !same {
		// An earlier generation of the object enforced: a manager
		// replica whose cache is behind, whose snapshot would undo a
		// change. Or the API server's data was restored from a backup,
		// which sets the generation back under the same UID: then this
		// holds until the pod restarts (or the generation passes the one
		// enforced), and the NACK, shown in the policy's status, says so.
		return "", fmt.Sprintf("policy %s (generation %d of %s) is older than the one this sidecar enforces (%s, generation %d of %s); keeping it. "+
			"If the policy was restored from a backup (an etcd restore sets its generation back), restart the pods to take it, or change its spec until its generation passes %d",
			p.Hash, snap.Order.Generation, snap.Order.UID, enforced, c.order.Generation, c.order.UID, c.order.Generation)
	}
	if c.o.StoreIdentity != "" && policywire.StoreIdentity(p.Spec.Store) != c.o.StoreIdentity {
		restart = "the policy's store changed; this sidecar keeps the store it started with until its pod restarts"
	}
	switch {
	case snap.Order == nil:
		// A manager that does not order its snapshots: what it sends is
		// applied, and no order is known until one that does.
		c.order = nil
	case c.order == nil || !policywire.Older(*snap.Order, *c.order):
		o := *snap.Order
		c.order = &o
	}
	if !same {
		// One atomic swap: a call already planned finishes under the
		// policy it started with, the next one takes this.
		c.o.Engine.SetPolicy(p)
		if c.o.OnApply != nil {
			c.o.OnApply(p)
		}
		c.log.Info("Applied policy", "policy", c.o.Namespace+"/"+c.o.Name, "hash", p.Hash, "restartRequired", restart != "")
	}
	if ls, ok := c.o.Engine.(LegacyKeySetter); ok && snap.LegacyKeys != nil {
		l := engine.LegacyKeys{Writers: snap.LegacyKeys.Writers, Until: snap.LegacyKeys.Until}
		if was := ls.LegacyKeys(); was.Writers != l.Writers || !was.Until.Equal(l.Until) {
			ls.SetLegacyKeys(l)
			c.log.Info("Applied the policy's legacy keys", "policy", c.o.Namespace+"/"+c.o.Name, "legacyWriters", l.Writers, "legacyKeysUntil", l.Until)
		}
	}
	select {
	case <-c.applied:
	default:
	}
	c.applied <- p.Hash
	return restart, ""
}

func (c *Client) report(nonce, restart, nack string) policywire.Report {
	r := policywire.Report{Version: c.o.Engine.Policy().Hash, Nonce: nonce, RestartRequired: restart, Error: nack, Keys: c.o.Keys != nil}
	if restart == "" && c.o.StoreIdentity != "" && policywire.StoreIdentity(c.o.Engine.Policy().Spec.Store) != c.o.StoreIdentity {
		r.RestartRequired = "the policy's store changed; this sidecar keeps the store it started with until its pod restarts"
	}
	if u, ok := c.o.Engine.(UnscopedCounter); ok {
		n := u.UnscopedCalls()
		r.UnscopedCalls = &n
	}
	if tr, ok := c.o.Engine.(ToolReporter); ok {
		r.Tools, r.ToolsOmitted = tr.ToolDecisions(policywire.MaxReportedTools)
	}
	return r
}
