// Command plainproxy is the benchmark's plain Go baseline: an
// httputil.ReverseProxy with a connection pool sized like the sidecar's,
// in a process of its own so that its CPU can be read from /proc.
//
//	plainproxy -listen 127.0.0.1:8081 -upstream http://127.0.0.1:8080
package main

import (
	"flag"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"time"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "address to listen on")
	upstream := flag.String("upstream", "", "URL of the MCP server")
	flag.Parse()
	up, err := url.Parse(*upstream)
	if err != nil || up.Host == "" {
		fmt.Fprintf(os.Stderr, "plainproxy: -upstream %q is not an absolute URL\n", *upstream)
		os.Exit(2)
	}
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(up)
			pr.Out.Host = pr.In.Host
		},
		Transport: &http.Transport{Proxy: nil, MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: 90 * time.Second},
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Go's HTTP/1 server closes the request body once response headers
		// are written unless full duplex is on (golang/go#40747).
		_ = http.NewResponseController(w).EnableFullDuplex()
		p.ServeHTTP(w, r)
	})
	s := &http.Server{Addr: *listen, Handler: h, ReadHeaderTimeout: 10 * time.Second}
	if err := s.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, "plainproxy:", err)
		os.Exit(1)
	}
}
