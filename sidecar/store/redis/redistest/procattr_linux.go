package redistest

import "syscall"

// sysProcAttr kills the server with the test binary, so that a crashed or
// interrupted test run leaves no redis-server behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
