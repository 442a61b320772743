// Command httpserver serves the counting MCP server of test/mcpserver over
// Streamable HTTP in a process of its own, for the benchmark's
// separate-process section and the real-node e2e's image. GET
// /counts?name=charge_card answers how many times that tool ran.
//
// It keeps the Go SDK's default DNS rebinding protection, as an unmodified
// server does (a request on a loopback address whose Host is not loopback
// gets 403): in a pod the sidecar must reach it at the pod's IP.
// -localhost-protection=false turns it off.
//
//	httpserver -listen 127.0.0.1:8080 [-sessions] [-localhost-protection=false]
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
	protect := flag.Bool("localhost-protection", true, "keep the Go SDK's default DNS rebinding protection: 403 for a request on a loopback address whose Host is not loopback")
	flag.Parse()
	srv := mcpserver.New()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /counts", func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "%d\n", srv.Counts.Get(r.URL.Query().Get("name")))
	})
	handler := srv.ProtectedHandler(!*sessions)
	if !*protect {
		handler = srv.Handler(!*sessions)
	}
	mux.Handle("/", handler)
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
