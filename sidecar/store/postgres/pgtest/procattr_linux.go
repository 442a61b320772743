package pgtest

import "syscall"

// setDeathSignal shuts the server down with the test binary (SIGQUIT is
// PostgreSQL's immediate shutdown), so that a crashed or interrupted test
// run leaves no server behind.
func setDeathSignal(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGQUIT }
