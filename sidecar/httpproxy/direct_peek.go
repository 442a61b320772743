//go:build unix && !aix

package httpproxy

import "syscall"

// canPeek says usable can tell: idle connections are kept.
const canPeek = true

// usable says whether an idle connection can carry a request: the server
// has neither closed it nor sent anything on it. One non-blocking peek, so
// that a request is not written into a connection the server has let go
// (a Node.js server closes an idle one after 5 seconds).
func (c *directConn) usable() bool {
	sc, ok := c.conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	idle := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		idle = rerr == syscall.EAGAIN || rerr == syscall.EWOULDBLOCK
		return true
	})
	return err == nil && idle
}
