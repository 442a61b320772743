//go:build !unix

package freeport

// reserve reserves nothing where there is no flock: ports stay unique
// within the process only.
func reserve(int) bool { return true }
