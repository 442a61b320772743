// Package mcpserver is a real MCP server, built with the official Go SDK,
// whose tools count what they do. Tests and benchmarks put the sidecar in
// front of it and check how many times each side effect really happened.
package mcpserver

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Counts of what the tools did.
type Counts struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *Counts) add(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[name]++
	return c.m[name]
}

// Get returns how many times name happened.
func (c *Counts) Get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

// Events counted besides each tool's executions.
const (
	// Cancelled counts slow calls whose context was cancelled mid-run.
	Cancelled = "cancelled"
	// AskedForInput counts InputRequiredResults returned.
	AskedForInput = "asked_for_input"
)

// Server is the counting MCP server.
type Server struct {
	Counts Counts
	MCP    *mcp.Server
}

// ChargeArgs are charge_card's arguments.
type ChargeArgs struct {
	Card        string  `json:"card"`
	Amount      float64 `json:"amount"`
	RequestedAt string  `json:"requestedAt,omitempty"`
	// DelayMS makes the charge take this long; a cancelled context stops
	// it before it takes effect.
	DelayMS int `json:"delayMs,omitempty"`
	// Size pads the result with this many bytes.
	Size int `json:"size,omitempty"`
}

// Charged reports whether a charge_card or refund call, answered res and
// err by the server's method handler, took effect: the tool answered a
// result, not an error (its only error is a cancel before it charges),
// whatever became of the request's context after it charged.
func Charged(res mcp.Result, err error) bool {
	r, ok := res.(*mcp.CallToolResult)
	return err == nil && ok && r != nil && !r.IsError
}

// ChargeResult is charge_card's structured result.
type ChargeResult struct {
	ChargeID int    `json:"chargeId"`
	Card     string `json:"card"`
	Padding  string `json:"padding,omitempty"`
}

// New returns a server with its tools:
//   - charge_card: the side effect to deduplicate; counts "charge_card".
//   - refund: like charge_card; a policy names it Passthrough.
//   - get_balance: annotated readOnlyHint, so Auto passes it through.
//   - flaky_charge: answers isError the first time, then succeeds.
//   - confirm_transfer: asks for confirmation with an InputRequiredResult
//     (elicitation) before it runs, after reporting progress.
func New() *Server {
	s := &Server{MCP: mcp.NewServer(&mcp.Implementation{Name: "counting-server", Version: "1.0.0"}, nil)}
	charge := func(tool string) mcp.ToolHandlerFor[ChargeArgs, ChargeResult] {
		return func(ctx context.Context, _ *mcp.CallToolRequest, in ChargeArgs) (*mcp.CallToolResult, ChargeResult, error) {
			if in.DelayMS > 0 {
				select {
				case <-time.After(time.Duration(in.DelayMS) * time.Millisecond):
				case <-ctx.Done():
					s.Counts.add(Cancelled)
					return nil, ChargeResult{}, ctx.Err()
				}
			}
			n := s.Counts.add(tool)
			out := ChargeResult{ChargeID: n, Card: in.Card, Padding: strings.Repeat("x", in.Size)}
			return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{
				Text: fmt.Sprintf("charged %.2f to %s (charge #%d)", in.Amount, in.Card, n),
			}}}, out, nil
		}
	}
	mcp.AddTool(s.MCP, &mcp.Tool{Name: "charge_card", Description: "Charges a card."}, charge("charge_card"))
	mcp.AddTool(s.MCP, &mcp.Tool{Name: "refund", Description: "Refunds a card."}, charge("refund"))
	mcp.AddTool(s.MCP, &mcp.Tool{
		Name:        "get_balance",
		Description: "Reads a balance.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true},
	}, func(_ context.Context, _ *mcp.CallToolRequest, in ChargeArgs) (*mcp.CallToolResult, ChargeResult, error) {
		n := s.Counts.add("get_balance")
		return nil, ChargeResult{ChargeID: n, Card: in.Card}, nil
	})
	mcp.AddTool(s.MCP, &mcp.Tool{Name: "flaky_charge", Description: "Fails once, then charges."},
		func(_ context.Context, _ *mcp.CallToolRequest, in ChargeArgs) (*mcp.CallToolResult, ChargeResult, error) {
			n := s.Counts.add("flaky_charge")
			if n == 1 {
				return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: "card declined, try again"}}}, ChargeResult{}, nil
			}
			return nil, ChargeResult{ChargeID: n, Card: in.Card}, nil
		})
	s.MCP.AddTool(&mcp.Tool{
		Name:        "confirm_transfer",
		Description: "Moves money after the user confirms.",
		InputSchema: map[string]any{"type": "object", "properties": map[string]any{"amount": map[string]any{"type": "number"}}},
	}, func(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		resp, ok := req.Params.InputResponses["confirm"].(*mcp.ElicitResult)
		if !ok {
			s.Counts.add(AskedForInput)
			return &mcp.CallToolResult{
				InputRequests: mcp.InputRequestMap{"confirm": &mcp.ElicitParams{
					Message: "Confirm the transfer?",
					RequestedSchema: map[string]any{
						"type":       "object",
						"properties": map[string]any{"ok": map[string]any{"type": "boolean"}},
					},
				}},
				RequestState: "transfer-1",
			}, nil
		}
		if resp.Action != "accept" {
			return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: "transfer declined"}}}, nil
		}
		if tok := req.Params.GetProgressToken(); tok != nil {
			for i := 1; i <= 3; i++ {
				_ = req.Session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{
					ProgressToken: tok, Progress: float64(i), Total: 3, Message: fmt.Sprintf("step %d", i),
				})
			}
		}
		n := s.Counts.add("confirm_transfer")
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("transfer #%d done", n)}}}, nil
	})
	return s
}

// Handler serves the server over Streamable HTTP. A stateless handler
// speaks 2026-07-28 with clients that offer it; a stateful one keeps
// sessions (2025-11-25 and earlier). Cancellation reaches the tools either
// way, so a test can see what a forwarded cancel would do.
//
// The SDK's DNS rebinding protection is off: in-process tests reach the
// server over loopback with the Hosts they test (such as a Service's
// name), which it refuses (403). ProtectedHandler keeps it.
func (s *Server) Handler(stateless bool) http.Handler {
	return s.handler(stateless, false)
}

// ProtectedHandler is Handler as an unmodified Go SDK server serves it:
// with the SDK's default DNS rebinding protection, which answers 403 to a
// request that arrives on a loopback address with a Host that is not
// loopback. The real-node e2e's server (cmd/httpserver) serves this, so
// that it proves the sidecar reaches the server at the pod's IP with the
// Service's Host.
func (s *Server) ProtectedHandler(stateless bool) http.Handler {
	return s.handler(stateless, true)
}

func (s *Server) handler(stateless, protect bool) http.Handler {
	return mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s.MCP }, &mcp.StreamableHTTPOptions{
		Stateless:                    stateless,
		PropagateRequestCancellation: true,
		DisableLocalhostProtection:   !protect,
	})
}
