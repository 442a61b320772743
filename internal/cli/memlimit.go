package cli

import (
	"errors"
	"log/slog"
	"math"
	"os"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// MemoryLimitShare is the share of the container's memory limit the Go
// runtime is given as its soft limit: the rest is for what the runtime
// does not count (the binary's pages, the kernel's socket buffers). The
// webhook gives an injected sidecar the same share as its GOMEMLIMIT.
const MemoryLimitShare = 0.8

// SetMemoryLimit gives the Go runtime a soft memory limit (GOMEMLIMIT) of
// MemoryLimitShare of the container's memory limit, read from its cgroup.
//
// Without one, the collector lets the heap grow to twice what was live at
// its last cycle, whatever the container's limit: a manager whose
// sidecars all reconnect at once (a failover, a rollout) holds about as
// much garbage of the reconnect as it keeps, and the kernel's OOM killer
// ends it before the collector runs. With it, the collector runs harder
// as the process nears the limit.
//
// A GOMEMLIMIT in the environment stands (GOMEMLIMIT=off for none), and
// so does no limit, outside a container or in one that has none. The
// process logs the limit it set. An injected sidecar has the webhook's
// GOMEMLIMIT; this is for the manager, and for a sidecar or wrap run in a
// container by hand.
func SetMemoryLimit(log *slog.Logger) {
	setMemoryLimit(log, memlimit.FromCgroup)
}

func setMemoryLimit(log *slog.Logger, limit memlimit.Provider) {
	if v := os.Getenv("GOMEMLIMIT"); v != "" {
		log.Debug("GOMEMLIMIT is set; the container's memory limit is not read", "GOMEMLIMIT", v)
		return
	}
	set, err := memlimit.Set(memlimit.WithProvider(limit), memlimit.WithRatio(MemoryLimitShare))
	switch {
	case errors.Is(err, memlimit.ErrCgroupsNotSupported), errors.Is(err, memlimit.ErrNoCgroup):
		// Not in a container: no limit to read.
	case err != nil:
		log.Warn("Cannot read the container's memory limit; the Go runtime has no memory limit", "err", err)
	case set > 0 && set < math.MaxInt64:
		log.Info("Go memory limit set from the container's memory limit", "GOMEMLIMIT", set, "share", MemoryLimitShare)
	}
}
