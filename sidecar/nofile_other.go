//go:build !unix

package sidecar

func openFileLimit() uint64 { return 0 }
