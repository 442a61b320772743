// Command stdioserver serves the counting test server (test/mcpserver)
// over the stdio transport, for tests of `idemcp wrap`.
//
// Environment:
//   - COUNT_FILE: every tools/call that ran to the end appends a line with
//     the tool's name to this file, and one that was cancelled mid-run
//     appends "cancelled TOOL", so a test counts executions across
//     processes. O_APPEND keeps lines whole when several servers share it.
//   - CRASH_TOOL: a call to this tool runs (and is counted), then the
//     server exits with CRASH_CODE (default 3) before answering, as a
//     server that crashes mid-call does.
//   - LINGER=1: the server does not exit when its stdin closes, as many
//     servers do not; a signal ends it.
package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/test/mcpserver"
)

func main() {
	s := mcpserver.New()
	rec := &recorder{path: os.Getenv("COUNT_FILE")}
	crashTool := os.Getenv("CRASH_TOOL")
	crashCode := 3
	if v := os.Getenv("CRASH_CODE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "stdioserver: CRASH_CODE=%q is not a number\n", v)
			os.Exit(2)
		}
		crashCode = n
	}
	s.MCP.AddReceivingMiddleware(func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			res, err := next(ctx, method, req)
			ctr, ok := req.(*mcp.CallToolRequest)
			if method != "tools/call" || !ok {
				return res, err
			}
			name := ctr.Params.Name
			if ctx.Err() != nil {
				rec.record("cancelled " + name)
				return res, err
			}
			rec.record(name)
			if name == crashTool {
				fmt.Fprintf(os.Stderr, "stdioserver: crashing after running %s (CRASH_TOOL), exit code %d\n", name, crashCode)
				os.Exit(crashCode)
			}
			return res, err
		}
	})
	if err := s.MCP.Run(context.Background(), &mcp.StdioTransport{}); err != nil {
		fmt.Fprintf(os.Stderr, "stdioserver: %v\n", err)
		os.Exit(1)
	}
	if os.Getenv("LINGER") == "1" {
		for { // until a signal's default action ends the process
			time.Sleep(time.Hour)
		}
	}
}

type recorder struct {
	mu   sync.Mutex
	path string
}

func (r *recorder) record(line string) {
	if r.path == "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	f, err := os.OpenFile(r.path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err == nil {
		_, err = f.WriteString(line + "\n")
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "stdioserver: recording %q in COUNT_FILE: %v\n", line, err)
		os.Exit(1)
	}
}
