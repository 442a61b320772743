package procs

import "syscall"

// setDeathSignal has the kernel send sig to the process when the test
// binary dies, so that a crashed or interrupted test run leaves no server
// behind (SIGQUIT is PostgreSQL's immediate shutdown).
func setDeathSignal(a *syscall.SysProcAttr, sig syscall.Signal) { a.Pdeathsig = sig }
