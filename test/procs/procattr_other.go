//go:build !linux

package procs

import "syscall"

func setDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}
