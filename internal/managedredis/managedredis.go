// Package managedredis owns the contract of a policy's managed Redis that
// crosses the planes: the controller provisions it under these names, the
// webhook points the sidecars at it, and the Secret holds the password
// under this key.
package managedredis

import (
	"net"
	"strconv"
)

// Port is the port the managed Redis serves on.
const Port = 6379

// Keys of the managed Redis's Secret.
const (
	PasswordKey = "password"
	ConfigKey   = "redis.conf"
)

// Name is the name of the Secret, StatefulSet, Service,
// PodDisruptionBudget and NetworkPolicy of a policy's managed Redis.
func Name(policy string) string { return policy + "-redis" }

// Addr is the address the sidecars of a policy in namespace use for its
// managed Redis: its Service.
func Addr(namespace, policy string) string {
	return net.JoinHostPort(Name(policy)+"."+namespace+".svc", strconv.Itoa(Port))
}
