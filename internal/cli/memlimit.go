package cli

import (
	"errors"
	"log/slog"
	"math"
	"os"
	"runtime/debug"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// MemoryLimitShare is the share of the container's memory limit the Go
// runtime is given as its soft limit (SoftMemoryLimit): the rest is for
// what the runtime does not count (the binary's pages, the kernel's socket
// buffers).
const MemoryLimitShare = 0.8

// SoftMemoryLimit is the GOMEMLIMIT for a container memory limit of limit
// bytes: MemoryLimitShare of it, in bytes, rounded down, for any limit a
// quantity can hold (limit*8 would overflow above 1 EiB). The webhook
// gives an injected sidecar this one, and the manager sets it for itself.
func SoftMemoryLimit(limit int64) int64 { return limit/10*8 + limit%10*8/10 }

// SetMemoryLimit gives the Go runtime a soft memory limit (GOMEMLIMIT) of
// MemoryLimitShare of the container's memory limit, read from its cgroup
// once, at start.
//
// Without one, the collector lets the heap grow to twice what was live at
// its last cycle, whatever the container's limit: a manager whose
// sidecars all reconnect at once (a failover, a rollout) holds about as
// much garbage of the reconnect as it keeps, and stalls at its limit or is
// killed there before the collector runs. With it, the collector runs
// harder as the process nears the limit.
//
// A GOMEMLIMIT in the environment stands (GOMEMLIMIT=off for none), and
// so does no limit, outside a container or in one that has none. The
// process logs the limit it has. An injected sidecar has the webhook's
// GOMEMLIMIT; this is for the manager, and for a sidecar run in a
// container by hand.
func SetMemoryLimit(log *slog.Logger) {
	setMemoryLimit(log, memlimit.FromCgroup)
}

// setMemoryLimit is SetMemoryLimit with the limit read by limit. Only the
// reading is automemlimit's: its Set would also obey AUTOMEMLIMIT, a
// second variable this process does not document.
func setMemoryLimit(log *slog.Logger, limit func() (uint64, error)) {
	if v := os.Getenv("GOMEMLIMIT"); v != "" {
		log.Info("Go memory limit as GOMEMLIMIT gives it; the container's memory limit is not read", "GOMEMLIMIT", v)
		return
	}
	l, err := limit()
	switch {
	case errors.Is(err, memlimit.ErrNoLimit), errors.Is(err, memlimit.ErrCgroupsNotSupported), errors.Is(err, memlimit.ErrNoCgroup):
		// No limit, or no container to have one.
		return
	case err != nil:
		log.Warn("Cannot read the container's memory limit; the Go runtime has no memory limit", "err", err)
		return
	}
	if l == 0 || l > math.MaxInt64 {
		return
	}
	set := SoftMemoryLimit(int64(l))
	debug.SetMemoryLimit(set)
	log.Info("Go memory limit set from the container's memory limit", "GOMEMLIMIT", set, "share", MemoryLimitShare)
}
