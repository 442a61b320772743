//go:build !unix

package httpproxy

// usable cannot tell a connection the server closed here: none is reused.
func (c *directConn) usable() bool { return false }
