//go:build unix

package sidecar

import "syscall"

// openFileLimit is the process's limit of open files (Go raises the soft
// limit to the hard one at start), or 0 if it cannot be read.
func openFileLimit() uint64 {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return 0
	}
	return uint64(l.Cur) //nolint:unconvert // int64 on some unix systems (FreeBSD)
}
