package cli

import (
	"bytes"
	"errors"
	"log/slog"
	"math"
	"math/big"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

type provider = func() (uint64, error)

// keepMemoryLimit restores the process's Go memory limit after the test.
func keepMemoryLimit(t *testing.T) {
	before := debug.SetMemoryLimit(math.MaxInt64)
	t.Cleanup(func() { debug.SetMemoryLimit(before) })
}

func TestSetMemoryLimit(t *testing.T) {
	const gib = 1 << 30
	for _, tc := range []struct {
		name     string
		env      string // GOMEMLIMIT
		provider provider
		want     int64
		// automemlimit is AUTOMEMLIMIT, which automemlimit's own Set reads.
		automemlimit string
		log          string // a line the log must hold, "" for an empty log
	}{
		{name: "container limit", provider: func() (uint64, error) { return gib, nil }, want: 858993459, // 0.8 GiB, rounded down
			log: `"msg":"Go memory limit set from the container's memory limit","GOMEMLIMIT":858993459`},
		{name: "GOMEMLIMIT stands", env: "300MiB", provider: func() (uint64, error) { t.Error("the cgroup was read though GOMEMLIMIT is set"); return gib, nil },
			want: math.MaxInt64, log: `"msg":"Go memory limit as GOMEMLIMIT gives it; the container's memory limit is not read","GOMEMLIMIT":"300MiB"`},
		{name: "AUTOMEMLIMIT is not ours", env: "", automemlimit: "0.5", provider: func() (uint64, error) { return gib, nil }, want: 858993459,
			log: `"GOMEMLIMIT":858993459,"share":0.8`},
		{name: "a limit too large to be one", provider: func() (uint64, error) { return math.MaxUint64, nil }, want: math.MaxInt64},
		{name: "no limit", provider: func() (uint64, error) { return 0, memlimit.ErrNoLimit }, want: math.MaxInt64},
		{name: "not in a container", provider: func() (uint64, error) { return 0, memlimit.ErrCgroupsNotSupported }, want: math.MaxInt64},
		{name: "unreadable cgroup", provider: func() (uint64, error) { return 0, errors.New("permission denied") }, want: math.MaxInt64,
			log: `"msg":"Cannot read the container's memory limit; the Go runtime has no memory limit"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keepMemoryLimit(t)
			t.Setenv("GOMEMLIMIT", tc.env)
			t.Setenv("AUTOMEMLIMIT", tc.automemlimit)
			var out bytes.Buffer
			setMemoryLimit(slog.New(slog.NewJSONHandler(&out, nil)), tc.provider)
			if got := debug.SetMemoryLimit(-1); got != tc.want {
				t.Errorf("Go memory limit %d, want %d", got, tc.want)
			}
			if tc.log == "" && out.Len() > 0 || !strings.Contains(out.String(), tc.log) {
				t.Errorf("log %q, want it to hold %q", out.String(), tc.log)
			}
		})
	}
}

// TestSoftMemoryLimit: 80% of a limit, rounded down, exactly, up to the
// largest limit a quantity holds (8Ei is just past it), where limit*8
// would overflow into a negative GOMEMLIMIT the runtime refuses at start.
func TestSoftMemoryLimit(t *testing.T) {
	for _, limit := range []int64{0, 1, 9, 10, 1 << 30, 256 << 20, 300e6, 1 << 60, math.MaxInt64 / 8, math.MaxInt64/8 + 1, math.MaxInt64} {
		want := new(big.Int).Div(new(big.Int).Mul(big.NewInt(limit), big.NewInt(8)), big.NewInt(10)).Int64()
		if got := SoftMemoryLimit(limit); got != want {
			t.Errorf("SoftMemoryLimit(%d) = %d, want %d", limit, got, want)
		}
	}
}
