//go:build !unix || aix

package httpproxy

// canPeek says usable can tell a connection the server closed: not here
// (no MSG_DONTWAIT), so no connection is kept idle for another request.
const canPeek = false

func (c *directConn) usable() bool { return false }
