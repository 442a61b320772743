package e2e_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/procs"
)

// TestRedisRoundTrips counts the commands Redis serves for a call that
// runs (at most 2) and for a replay (1).
func TestRedisRoundTrips(t *testing.T) {
	srv := redistest.Start(t)
	f := newFleet(t, revisions[0], "", redisStore(srv), 1)
	cs := f.connect(t, f.proxies[0].URL, clientOpts{})
	mustCall(t, cs, "charge_card", map[string]any{"card": "warm", "amount": 1}, nil) // connections up, scripts loaded
	// A result is stored just after its client is answered: wait for that
	// before and after each measurement.
	idle := func() {
		if err := f.sidecars[0].Engine().Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	measure := func(what string, fn func()) int {
		idle()
		if _, err := redistest.Do(srv.Addr, "CONFIG", "RESETSTAT"); err != nil {
			t.Fatal(err)
		}
		fn()
		idle()
		stats, err := redistest.Do(srv.Addr, "INFO", "commandstats")
		if err != nil {
			t.Fatal(err)
		}
		// Every store operation is one script: a round trip is an EVAL or
		// EVALSHA (the commands a script runs inside Redis are counted
		// too, under their own names, and are not round trips).
		total := 0
		for _, line := range strings.Split(stats, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok || !strings.HasPrefix(name, "cmdstat_") || name == "cmdstat_info" || name == "cmdstat_config|resetstat" {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			n, _ := strconv.Atoi(calls)
			if strings.HasPrefix(name, "cmdstat_eval") {
				total += n
			} else if !scriptCommands[strings.TrimPrefix(name, "cmdstat_")] && !connectionSetup[strings.TrimPrefix(name, "cmdstat_")] {
				t.Errorf("%s: a command outside the scripts reached Redis: %s", what, line)
			}
		}
		t.Logf("%s: %d Redis round trips", what, total)
		return total
	}
	executed := measure("executed call", func() { mustCall(t, cs, "charge_card", card, nil) })
	replay := measure("replay", func() { mustCall(t, cs, "charge_card", card, nil) })
	if executed > 2 || replay != 1 {
		t.Fatalf("an executed call cost %d Redis round trips (want at most 2) and a replay %d (want 1)", executed, replay)
	}
}

// scriptCommands are the commands the store's Lua scripts run.
var scriptCommands = map[string]bool{
	"time": true, "hmget": true, "hset": true, "hexists": true, "hdel": true,
	"pexpire": true, "del": true, "publish": true, "hget": true, "exists": true,
}

// connectionSetup is what go-redis sends when it opens a pooled connection.
var connectionSetup = map[string]bool{"hello": true, "client|setname": true, "client|setinfo": true, "auth": true, "select": true}

func freeAddr(t *testing.T) string { return procs.FreeAddr(t) }
