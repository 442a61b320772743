package e2e_test

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/test/procs"
)

// hostileSSE is a stateless Streamable HTTP server that answers every
// request as an event stream framed its own way: line endings, a missing
// blank line after the last event, gzip whatever the client accepts.
type hostileSSE struct {
	nl         string
	finalBlank bool
	gzip       bool
	runs       sync.Map // arguments -> *atomic.Int64
}

func (h *hostileSSE) ran(args string) int64 {
	v, _ := h.runs.LoadOrStore(args, new(atomic.Int64))
	return v.(*atomic.Int64).Load()
}

func (h *hostileSSE) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.WriteHeader(http.StatusMethodNotAllowed)
		return
	}
	var m struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
		Params struct {
			Arguments json.RawMessage `json:"arguments"`
		} `json:"params"`
	}
	if err := json.NewDecoder(r.Body).Decode(&m); err != nil || len(m.ID) == 0 {
		w.WriteHeader(http.StatusAccepted)
		return
	}
	var result string
	switch m.Method {
	case "initialize":
		result = `{"protocolVersion":"2025-11-25","capabilities":{"tools":{}},"serverInfo":{"name":"hostile","version":"1"}}`
	case "tools/list":
		result = `{"tools":[{"name":"charge","inputSchema":{"type":"object"}}]}`
	case "tools/call":
		v, _ := h.runs.LoadOrStore(string(m.Params.Arguments), new(atomic.Int64))
		n := v.(*atomic.Int64).Add(1)
		time.Sleep(50 * time.Millisecond) // long enough for duplicates to overlap
		result = fmt.Sprintf(`{"content":[{"type":"text","text":"run %d"}]}`, n)
	default:
		result = `{}`
	}
	ev := "event: message" + h.nl + `data: {"jsonrpc":"2.0","id":` + string(m.ID) + `,"result":` + result + "}" + h.nl
	if h.finalBlank {
		ev += h.nl
	}
	w.Header().Set("Content-Type", "text/event-stream")
	var out io.Writer = w
	if h.gzip {
		w.Header().Set("Content-Encoding", "gzip")
		gz := gzip.NewWriter(w)
		defer func() { _ = gz.Close() }()
		out = gz
	}
	_, _ = io.WriteString(out, ev)
}

// startSidecarBinary runs the built idemcp sidecar in front of upstream;
// its stderr collects while it runs.
func startSidecarBinary(t *testing.T, upstream string) (string, *procs.Process, *lockedBuffer) {
	t.Helper()
	bins := buildWrapBins(t)
	addr := freeport.Loopback(t)
	var stderr lockedBuffer
	p := procs.New(procs.Spec{
		Name: "the sidecar", Path: bins.idemcp,
		Args:   []string{"sidecar", "--listen", addr, "--upstream", upstream, "--admin-listen", "", "--log-level", "error"},
		Stderr: &stderr, Ready: procs.Listening(addr),
	})
	if err := p.Start(); err != nil {
		t.Fatalf("%v: %s", err, stderr.String())
	}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("sidecar stderr:\n%s", stderr.String())
		}
	})
	return "http://" + addr, p, &stderr
}

// rawCall sends one tools/call with id and returns the response's raw id
// and text, read with a spec-conforming SSE parser.
func rawCall(ctx context.Context, base, id, args string) (string, string, error) {
	body := `{"jsonrpc":"2.0","id":` + id + `,"method":"tools/call","params":{"name":"charge","arguments":` + args + `}}`
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/mcp", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer hostile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", "", err
	}
	defer func() { _ = resp.Body.Close() }()
	var msgs [][]byte
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		er := mcpmsg.NewEventReader(resp.Body, 1<<20)
		for {
			ev, err := er.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return "", "", err
			}
			if ev.HasData {
				msgs = append(msgs, ev.Data)
			}
		}
	} else {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return "", "", err
		}
		msgs = append(msgs, b)
	}
	for _, msg := range msgs {
		var m struct {
			ID     json.RawMessage `json:"id"`
			Result struct {
				Content []struct{ Text string } `json:"content"`
			} `json:"result"`
			Error json.RawMessage `json:"error"`
		}
		if json.Unmarshal(msg, &m) == nil && len(m.ID) > 0 {
			if len(m.Error) > 0 || len(m.Result.Content) == 0 {
				return string(m.ID), "", fmt.Errorf("response %s", msg)
			}
			return string(m.ID), m.Result.Content[0].Text, nil
		}
	}
	return "", "", fmt.Errorf("HTTP %d with no response among %q", resp.StatusCode, msgs)
}

var hostileVariants = []struct {
	name       string
	nl         string
	finalBlank bool
	gzip       bool
	sdk        bool // the Go SDK's client reads this framing when it talks to the server directly
}{
	{"LF", "\n", true, false, true},
	{"CRLF", "\r\n", true, false, true},
	{"bare CR", "\r", true, false, false},
	{"no final blank line", "\n", false, false, true},
	{"bare CR, no final blank line", "\r", false, false, false},
	{"gzip", "\n", true, true, true},
	{"gzip, CRLF, no final blank line", "\r\n", false, true, true},
}

// Ids of every JSON type a JSON-RPC id may have, each with its own retry.
var hostileIDs = []string{`1`, `"1"`, `"a"`, `""`, `-7`, `9007199254740993`, `"\u00e9t\u00e9"`, `0`}

func TestHostileSSEFramingRunsOnceAndAnswersEveryID(t *testing.T) {
	const bound = 10 * time.Second
	for _, v := range hostileVariants {
		t.Run(v.name, func(t *testing.T) {
			srv := &hostileSSE{nl: v.nl, finalBlank: v.finalBlank, gzip: v.gzip}
			up := httptest.NewServer(srv)
			t.Cleanup(up.Close)
			base, sidecar, _ := startSidecarBinary(t, up.URL)

			// Control: the server alone runs every retry.
			for _, id := range hostileIDs[:3] {
				ctx, cancel := context.WithTimeout(context.Background(), bound)
				if _, _, err := rawCall(ctx, up.URL, id, `{"control":true}`); err != nil {
					t.Fatalf("direct control call: %v", err)
				}
				cancel()
			}
			if n := srv.ran(`{"control":true}`); n != 3 {
				t.Fatalf("direct control: 3 calls ran %d times", n)
			}

			// Through the sidecar: one logical call, retried with every id
			// type, concurrently and then again in sequence.
			args := `{"amount":5}`
			var wg sync.WaitGroup
			for round := range 2 {
				for _, id := range hostileIDs {
					call := func() {
						ctx, cancel := context.WithTimeout(context.Background(), bound)
						defer cancel()
						gotID, text, err := rawCall(ctx, base, id, args)
						switch {
						case err != nil:
							t.Errorf("id %s: %v", id, err)
						case gotID != id:
							t.Errorf("call with id %s was answered with id %s", id, gotID)
						case text != "run 1":
							t.Errorf("id %s got %q, want run 1", id, text)
						}
					}
					if round == 0 {
						wg.Go(call)
					} else {
						call()
					}
				}
				wg.Wait()
			}
			if n := srv.ran(args); n != 1 {
				t.Errorf("%d identical calls ran %d times through the sidecar, want 1", 2*len(hostileIDs), n)
			}

			// The Go SDK's client, where it reads the framing directly.
			if v.sdk {
				for i, target := range []string{up.URL, base} {
					cs := connectSDK(t, target)
					sdkArgs := map[string]any{"sdk": i}
					for range 3 {
						ctx, cancel := context.WithTimeout(context.Background(), bound)
						res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "charge", Arguments: sdkArgs})
						cancel()
						if err != nil {
							t.Fatalf("Go SDK client via %s: %v", []string{"the server", "the sidecar"}[i], err)
						}
						if text := res.Content[0].(*mcp.TextContent).Text; i == 1 && text != "run 1" {
							t.Errorf("Go SDK client via the sidecar got %q, want run 1", text)
						}
					}
					want := []int64{3, 1}[i]
					if n := srv.ran(fmt.Sprintf(`{"sdk":%d}`, i)); n != want {
						t.Errorf("Go SDK client via %s: 3 calls ran %d times, want %d",
							[]string{"the server", "the sidecar"}[i], n, want)
					}
				}
			}
			select {
			case <-sidecar.Exited():
				t.Fatal("the sidecar exited")
			default:
			}
		})
	}
}

func connectSDK(t *testing.T, url string) *mcp.ClientSession {
	t.Helper()
	client := mcp.NewClient(&mcp.Implementation{Name: "hostile-e2e", Version: "1"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   url + "/mcp",
		HTTPClient: &http.Client{Transport: &headerTransport{headers: http.Header{"Authorization": {"Bearer sdk"}}, next: http.DefaultTransport}},
		MaxRetries: -1,
	}, &mcp.ClientSessionOptions{ProtocolVersion: "2025-11-25"})
	if err != nil {
		t.Fatalf("connecting the Go SDK client to %s: %v", url, err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}
