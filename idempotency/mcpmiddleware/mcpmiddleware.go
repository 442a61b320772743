// Package mcpmiddleware makes the tools/call requests of an MCP server
// written with the official Go SDK (github.com/modelcontextprotocol/go-sdk)
// exactly-once, in process, with the semantics of the idemcp sidecar: the
// same IdempotencyPolicy, the same explicit and derived keys, the same
// scopes, the same errors and the same replay marker
// (result._meta["idemcp.io/replayed"]: true). It runs the sidecar's engine,
// so nothing differs but the missing network hop.
//
//	mw, err := mcpmiddleware.New(mcpmiddleware.Options{Store: st})
//	server.AddReceivingMiddleware(mw.Handler)
//
// Open a shared store with seal keys, as the sidecar's are (the policy's
// seal Secret, IDEMCP_SEAL_KEYS in its format), and the middleware's
// results are sealed: nobody who can write to the store can plant one.
//
//	st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: addrs, Prefix: "payments:"},
//		idempotency.SealKeyring(os.Getenv("IDEMCP_SEAL_KEYS")))
//
// With IDEMCP_SEAL_KEYS unset or empty this fails closed: NewRedisStore
// returns an error ("no seal key given") rather than open unsealed.
//
// Who calls: the principal is the SDK's auth info (TokenInfo.UserID, set by
// auth.RequireBearerToken), else the policy's principal header (default
// Authorization) of the HTTP request; the session is the SDK's session id
// ("" on a stateless server, where Session scope falls back to the
// principal). An Idempotency-Key HTTP header and the _meta keys
// idemcp.io/idempotency-key, idempotency-key and idempotencyKey are
// explicit keys. Over HTTP, an explicit key from a caller with no principal
// is its session's, and with no session either the call is not
// deduplicated (two anonymous callers must never share a result); over
// stdio or in memory the connection's one client owns its explicit keys,
// as with idemcp wrap.
//
// A deduplicated call runs detached from its request: a client that
// cancels, or goes away, does not stop it, and its result is kept for the
// retry. Call Drain before the process exits so that such calls finish.
package mcpmiddleware

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/tracing"
)

// Options configure a Middleware.
type Options struct {
	// Policy is an IdempotencyPolicy spec (nil: the defaults: Session
	// scope, Auto mode, 24h TTL). Its store section is not used: the store
	// is Store.
	Policy *v1alpha1.IdempotencyPolicySpec
	// PolicyYAML is an IdempotencyPolicy manifest, as kubectl applies it;
	// exclusive with Policy.
	PolicyYAML []byte
	// Store keeps claims and results (nil: a memory store). A shared store
	// seals results when it was opened with seal keys
	// (idempotency.SealKeys, idempotency.SealKeyring).
	Store idempotency.Store
	// Logger gets the engine's warnings (nil: none).
	Logger *slog.Logger
	// Registerer, if set, gets the idemcp_* metrics the sidecar exports.
	Registerer prometheus.Registerer
	// LocalClient says the server's only client is local and trusted (a
	// stdio or in-memory transport, as under idemcp wrap): its explicit
	// keys are its own across sessions and restarts, with no principal.
	// Leave it false for a server that network clients reach: the SDK's
	// SSE handler passes no headers or token, so a remote client there
	// cannot be told from a local one, and anonymous explicit keys are
	// scoped to the session instead.
	LocalClient bool
	// TracerProvider, if set, gets an OpenTelemetry span for every
	// tools/call, as the sidecar's (docs/tracing.md): its parent is the
	// trace context of params._meta, else of the traceparent header, else
	// ctx's span. Unset, calls are traced only under a policy with
	// spec.tracing.enabled, to otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
}

// Middleware deduplicates tools/call. It is safe for concurrent use.
type Middleware struct {
	engine *engine.Engine
	store  idempotency.Store
	local  bool
}

// New checks the policy and returns a Middleware.
func New(o Options) (*Middleware, error) {
	var pol *policy.Policy
	var err error
	switch {
	case o.Policy != nil && o.PolicyYAML != nil:
		return nil, errors.New("mcpmiddleware: both Policy and PolicyYAML are set; use one")
	case o.Policy != nil:
		pol, err = policy.Compile(*o.Policy)
	case o.PolicyYAML != nil:
		pol, err = policy.Parse(o.PolicyYAML)
	default:
		pol = policy.Default()
	}
	if err != nil {
		return nil, fmt.Errorf("mcpmiddleware: policy: %w", err)
	}
	st := o.Store
	if st == nil {
		st = idempotency.NewMemoryStore()
	}
	tracing := engine.Tracing{Provider: otel.GetTracerProvider}
	if tp := o.TracerProvider; tp != nil {
		tracing = engine.Tracing{Provider: func() trace.TracerProvider { return tp }, On: true}
	}
	return &Middleware{
		engine: engine.New(engine.Options{Policy: pol, Store: st, Metrics: engine.NewMetrics(o.Registerer), Logger: o.Logger, Tracing: tracing}),
		store:  st,
		local:  o.LocalClient,
	}, nil
}

// Drain waits until every deduplicated call still running (detached from
// a client that went away) has finished and its result is kept, or ctx
// ends.
func (m *Middleware) Drain(ctx context.Context) error { return m.engine.Drain(ctx) }

// Handler is the mcp.Middleware: pass it to Server.AddReceivingMiddleware.
func (m *Middleware) Handler(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		switch method {
		case "tools/call":
			if r, ok := req.(*mcp.CallToolRequest); ok && r.Params != nil {
				return m.call(ctx, next, method, r)
			}
		case "tools/list":
			res, err := next(ctx, method, req)
			if err == nil && res != nil {
				// Auto mode reads the tools' readOnlyHint from here, as the
				// sidecar does from the tools/list responses it relays.
				if b, merr := json.Marshal(res); merr == nil {
					m.engine.Hints().ObserveListResult(b)
				}
			}
			return res, err
		}
		return next(ctx, method, req)
	}
}

func caller(r *mcp.CallToolRequest, p *policy.Policy, local bool) engine.Caller {
	var c engine.Caller
	if r.Session != nil {
		c.Session = r.Session.ID()
	}
	// Only when the server says so (Options.LocalClient): a request with
	// no headers may as well come over the SDK's SSE handler, from anyone.
	c.Local = local
	if r.Extra == nil {
		return c
	}
	if ti := r.Extra.TokenInfo; ti != nil && ti.UserID != "" {
		c.Principal = "user\x00" + ti.UserID
	} else if r.Extra.Header != nil {
		if v := r.Extra.Header.Get(p.PrincipalHeader); v != "" {
			c.Principal = "header\x00" + v
		}
	}
	if r.Extra.Header != nil {
		if vs, ok := r.Extra.Header["Idempotency-Key"]; ok && len(vs) > 0 {
			c.HeaderKey, c.HasHeaderKey = vs[0], true
		}
	}
	return c
}

func (m *Middleware) call(ctx context.Context, next mcp.MethodHandler, method string, r *mcp.CallToolRequest) (mcp.Result, error) {
	tc := &engine.ToolCall{Name: r.Params.Name, Arguments: r.Params.Arguments}
	if len(r.Params.Meta) > 0 {
		tc.Meta = make(map[string]json.RawMessage, len(r.Params.Meta))
		for k, v := range r.Params.Meta {
			tc.Meta[k], _ = json.Marshal(v)
		}
	}
	info := engine.CallInfo{Tool: tc.Name, Meta: tc.Meta}
	if r.Session != nil {
		info.Session = r.Session.ID()
	}
	if r.Extra != nil && r.Extra.Header != nil {
		info.Header = tracing.FromHeader(r.Extra.Header)
	}
	ctx, span := m.engine.StartCall(ctx, info)
	defer span.End()
	plan, err := m.engine.PlanCall(ctx, tc, caller(r, m.engine.Policy(), m.local))
	if err != nil {
		span.Error(mcpErrorCode(err))
		return nil, wireError(err)
	}
	if plan == nil {
		m.engine.CountPassthrough(r.Params.Name)
		span.Forwarded()
		return next(ctx, method, r)
	}
	var res mcp.Result
	var resErr error
	out, err := m.engine.Execute(ctx, plan, func(ctx context.Context) (engine.Upstream, error) {
		res, resErr = next(ctx, method, r)
		if resErr != nil || res == nil {
			// Not kept: the key is released and a retry runs again.
			return engine.Upstream{}, nil
		}
		b, err := json.Marshal(res)
		if err != nil {
			return engine.Upstream{}, nil
		}
		resp := make([]byte, 0, len(b)+32)
		resp = append(resp, `{"jsonrpc":"2.0","id":0,"result":`...)
		resp = append(append(resp, b...), '}')
		return engine.Upstream{Response: resp}, nil
	})
	switch {
	case errors.Is(err, engine.ErrDetached):
		// The caller went away; the call goes on and its result is kept.
		return nil, context.Cause(ctx)
	case err != nil:
		span.Error(mcpErrorCode(err))
		return nil, wireError(err)
	}
	if out.Kind != engine.Replayed {
		return res, resErr
	}
	return replay(out.Response)
}

// replay decodes a kept response: a result carrying the replay marker, or
// the error kept for a result too large to keep.
func replay(stored []byte) (mcp.Result, error) {
	var msg struct {
		Result json.RawMessage `json:"result"`
		Error  *jsonrpc.Error  `json:"error"`
	}
	if err := json.Unmarshal(stored, &msg); err != nil {
		return nil, fmt.Errorf("idemcp: a kept result does not decode: %w", err)
	}
	if msg.Error != nil {
		return nil, msg.Error
	}
	var res mcp.CallToolResult
	if err := json.Unmarshal(msg.Result, &res); err != nil {
		return nil, fmt.Errorf("idemcp: a kept result does not decode: %w", err)
	}
	return &res, nil
}

func wireError(err error) error {
	var e *engine.Error
	if errors.As(err, &e) {
		return &jsonrpc.Error{Code: int64(e.Code), Message: e.Message}
	}
	return err
}

// mcpErrorCode is the JSON-RPC code a refused call is answered with.
func mcpErrorCode(err error) int {
	var e *engine.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}
