// Command httpserver serves the counting MCP server of test/mcpserver over
// Streamable HTTP in a process of its own, for the benchmark's
// separate-process section. GET /counts?name=charge_card answers how many
// times that tool ran.
//
//	httpserver -listen 127.0.0.1:8080 [-sessions]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idemcp/idemcp/test/mcpserver"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "address to listen on")
	sessions := flag.Bool("sessions", false, "keep sessions (2025-11-25) instead of serving statelessly (2026-07-28)")
	flag.Parse()
	srv := mcpserver.New()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /counts", func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "%d\n", srv.Counts.Get(r.URL.Query().Get("name")))
	})
	mux.Handle("/", srv.Handler(!*sessions))
	s := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	// On SIGTERM (a pod being deleted) finish the calls in flight, as a
	// well-behaved MCP server does, then exit.
	done := make(chan struct{})
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
		<-sig
		ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
		close(done)
	}()
	if err := s.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, "httpserver:", err)
		os.Exit(1)
	}
	<-done
}
