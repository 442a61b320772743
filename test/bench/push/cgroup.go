package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// memCgroup is a memory cgroup the manager runs in, as in a container
// with a memory limit: everything it maps counts against the limit, the
// pages of its binary included, which the kernel reclaims (and the
// manager reads again) once the limit is reached.
type memCgroup struct {
	dir   string
	v2    bool
	limit int64
}

// newMemCgroup makes a memory cgroup of limit bytes, on cgroup v2 where
// its root gives children the memory controller, else in this process's
// own cgroup of v1's memory hierarchy, so that any limit above it still
// holds. It needs root.
func newMemCgroup(limit int64) (*memCgroup, error) {
	name := fmt.Sprintf("idemcp-bench-push-%d", os.Getpid())
	c := &memCgroup{limit: limit}
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && slices.Contains(strings.Fields(string(b)), "memory") {
		if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control"); err != nil || !slices.Contains(strings.Fields(string(b)), "memory") {
			return nil, errors.New("-manager-memory-limit: cgroup v2 does not give its root's children the memory controller: echo +memory > /sys/fs/cgroup/cgroup.subtree_control")
		}
		c.dir, c.v2 = filepath.Join("/sys/fs/cgroup", name), true
	} else if own, ok := v1MemoryPath(); ok {
		c.dir = filepath.Join("/sys/fs/cgroup/memory", own, name)
	} else {
		return nil, errors.New("-manager-memory-limit needs a cgroup memory controller: neither cgroup v2's nor v1's is mounted under /sys/fs/cgroup")
	}
	if err := os.Mkdir(c.dir, 0o755); err != nil {
		return nil, fmt.Errorf("-manager-memory-limit: making a cgroup (run as root): %w", err)
	}
	file := "memory.limit_in_bytes"
	if c.v2 {
		file = "memory.max"
	}
	if err := os.WriteFile(filepath.Join(c.dir, file), []byte(strconv.FormatInt(limit, 10)), 0o644); err != nil {
		_ = os.Remove(c.dir)
		return nil, fmt.Errorf("-manager-memory-limit: %w", err)
	}
	return c, nil
}

// v1MemoryPath is this process's cgroup in v1's memory hierarchy, if that
// is mounted.
func v1MemoryPath() (string, bool) {
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err != nil {
		return "", false
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", false
	}
	for _, line := range strings.Split(string(b), "\n") {
		// hierarchy-ID:controllers:path
		if f := strings.SplitN(line, ":", 3); len(f) == 3 && slices.Contains(strings.Split(f[1], ","), "memory") {
			return f[2], true
		}
	}
	return "", false
}

// command runs bin in the cgroup, from a copy the cgroup itself wrote, so
// that the binary's pages are charged to it as a container's image is.
func (c *memCgroup) command(bin string, args ...string) *exec.Cmd {
	script := `echo $$ > "$1/cgroup.procs" && cat "$0" > "$0.in-cgroup" && chmod +x "$0.in-cgroup" && shift && exec "$0.in-cgroup" "$@"`
	return exec.Command("sh", append([]string{"-c", script, bin, c.dir}, args...)...)
}

// peak is the most memory the cgroup used, page cache included, in bytes.
func (c *memCgroup) peak() (int64, error) {
	file := "memory.max_usage_in_bytes"
	if c.v2 {
		file = "memory.peak"
	}
	b, err := os.ReadFile(filepath.Join(c.dir, file))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// oomKills is how many processes the kernel's OOM killer ended in the
// cgroup.
func (c *memCgroup) oomKills() int {
	file := "memory.oom_control"
	if c.v2 {
		file = "memory.events"
	}
	b, _ := os.ReadFile(filepath.Join(c.dir, file))
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// summary says the limit, the peak and the OOM kills so far.
func (c *memCgroup) summary() string {
	peak, err := c.peak()
	if err != nil {
		return fmt.Sprintf("limit %d MiB, peak unknown (%v), %d OOM kills", c.limit>>20, err, c.oomKills())
	}
	return fmt.Sprintf("limit %d MiB, peak %.0f MiB (page cache included, which the kernel reclaims at the limit), %d OOM kills", c.limit>>20, float64(peak)/(1<<20), c.oomKills())
}

// remove deletes the cgroup once its processes have ended, or says where
// it was left.
func (c *memCgroup) remove() {
	if err := os.Remove(c.dir); err != nil {
		fmt.Fprintf(os.Stderr, "bench push: the manager's memory cgroup %s is left behind: %v\n", c.dir, err)
	}
}
