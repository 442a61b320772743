package chaos_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// Fault kinds of the fault proxy between the sidecars and Redis.
const (
	faultToxicLatency   = "store latency (toxiproxy)"
	faultToxicBlackhole = "store blackhole, no RST (toxiproxy timeout)"
	faultToxicBandwidth = "store bandwidth limit (toxiproxy)"
	faultToxicReset     = "store connections reset (toxiproxy reset_peer)"
)

// TestChaosStoreNetwork runs the sidecars' connections to Redis through a
// fault proxy (toxiproxy, in the test process) and, instead of restarting
// and pausing Redis, makes the network between them misbehave: latency,
// a blackhole (bytes swallowed, no RST, connections left open), a
// bandwidth limit, and connections reset. Retry and at-most-once
// invariants are checked as in the other sections: no call runs while its
// result is stored, no claim is lost with the store in reach, and -32013
// is answered only while the network misbehaves.
func TestChaosStoreNetwork(t *testing.T) {
	r := run(t, section{onAbandoned: "Retry", lease: lease, toxics: true}, envDuration(t, 30*time.Second))
	for _, k := range []string{faultToxicLatency, faultToxicBlackhole, faultToxicBandwidth, faultToxicReset} {
		if r.faults[k] == 0 {
			t.Logf("no %s fault in %v (seed %d)", k, r.duration, r.seed)
		}
	}
	r.write(t)
}

// storeProxy is a toxiproxy proxy in front of Redis.
type storeProxy struct {
	proxy    *toxiproxy.Proxy
	addr     string
	injected int // toxics injected so far, by the fault goroutine
}

func startStoreProxy(t *testing.T, upstream string) *storeProxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	p := toxiproxy.NewProxy(srv, "redis", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatalf("starting toxiproxy in front of %s: %v", upstream, err)
	}
	t.Cleanup(p.Stop)
	return &storeProxy{proxy: p, addr: p.Listen}
}

// toxic adds one toxic, in both directions unless it is latency or a
// bandwidth limit (responses only), and returns a func that removes it.
func (s *storeProxy) toxic(t *testing.T, kind string, attrs string, streams ...string) func() {
	t.Helper()
	var names []string
	for _, stream := range streams {
		name := kind + "_" + stream
		_, err := s.proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
			`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, name, kind, stream, attrs)))
		if err != nil {
			t.Errorf("adding a %s toxic: %v", kind, err)
			continue
		}
		names = append(names, name)
	}
	return func() {
		for _, n := range names {
			if err := s.proxy.Toxics.RemoveToxic(context.Background(), n); err != nil {
				t.Errorf("removing toxic %s: %v", n, err)
			}
		}
	}
}

// injectToxic makes the network to Redis misbehave for a while, and
// records the window in which the store may be unreachable (an outage)
// and in which a claim may lapse.
func (w *world) injectToxic(k int) {
	t := w.t
	var remove func()
	var hold, tail time.Duration
	lapse := false
	switch k % 4 {
	case 0:
		// Small enough that a renewal (bounded by lease/3) still gets
		// through: a claim must not lapse in it.
		w.fault(faultToxicLatency)
		ms := 20 + w.rnd.intn(80)
		remove = w.toxics.toxic(t, "latency", fmt.Sprintf(`{"latency":%d,"jitter":20}`, ms), "downstream")
		hold = time.Duration(1000+w.rnd.intn(2000)) * time.Millisecond
		tail = 200 * time.Millisecond
	case 1:
		// Bytes swallowed both ways and connections left open: commands
		// end at the sidecar's read timeout (1s), not at once.
		w.fault(faultToxicBlackhole)
		remove = w.toxics.toxic(t, "timeout", `{"timeout":0}`, "upstream", "downstream")
		hold = time.Duration(300+w.rnd.intn(2200)) * time.Millisecond
		tail = time.Second + redialProbe
		lapse = true
	case 2:
		w.fault(faultToxicBandwidth)
		kbps := 4 + w.rnd.intn(28)
		remove = w.toxics.toxic(t, "bandwidth", fmt.Sprintf(`{"rate":%d}`, kbps), "downstream")
		hold = time.Duration(1000+w.rnd.intn(2000)) * time.Millisecond
		tail = time.Second
		lapse = true
	default:
		w.fault(faultToxicReset)
		remove = w.toxics.toxic(t, "reset_peer", `{"timeout":0}`, "upstream")
		hold = time.Duration(200+w.rnd.intn(800)) * time.Millisecond
		tail = redialProbe
		lapse = true
	}
	start := time.Now()
	time.Sleep(hold)
	remove()
	end := time.Now().Add(tail)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.outages = append(w.outages, [2]time.Time{start, end})
	if lapse && w.mayLapse(end.Sub(start)) {
		w.pauses = append(w.pauses, [2]time.Time{start, end})
	}
}
