//go:build unix

package freeport

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// held keeps every reservation's file open, and so its lock taken, for the
// life of the process.
var held []*os.File

// reserve takes port p for this process unless another process holds it.
// A directory that cannot be made or opened reserves nothing and refuses
// nothing: the listen check that follows still stands.
func reserve(p int) bool {
	dir := filepath.Join(os.TempDir(), "idemcp-freeport")
	if err := os.MkdirAll(dir, 0o1777); err != nil { //nolint:gosec // shared by every user's test runs, like /tmp
		return true
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_RDWR|os.O_CREATE, 0o666) //nolint:gosec // a lock file, no content
	if err != nil {
		return true
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		return false
	}
	held = append(held, f)
	return true
}
