package sidecar

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/idemcp/idemcp/sidecar/policy"
)

// Env returns $IDEMCP_<name>, or def: every flag of the sidecar and of
// wrap can also be set in the environment.
func Env(name, def string) string {
	if v, ok := os.LookupEnv("IDEMCP_" + name); ok {
		return v
	}
	return def
}

// EnvInt is Env for integers; an unparsable value is ignored.
func EnvInt(name string, def int64) int64 {
	if n, err := strconv.ParseInt(os.Getenv("IDEMCP_"+name), 10, 64); err == nil {
		return n
	}
	return def
}

// EnvBool is Env for booleans; an unparsable value is false.
func EnvBool(name string) bool {
	b, _ := strconv.ParseBool(os.Getenv("IDEMCP_" + name))
	return b
}

// EnvDuration is Env for durations; an unparsable value is ignored.
func EnvDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv("IDEMCP_" + name)); err == nil {
		return d
	}
	return def
}

// LoadPolicy compiles the policy given as a file or inline (the webhook's
// snapshot), or returns the defaults when neither is given.
func LoadPolicy(file, inline string) (*policy.Policy, error) {
	switch {
	case file != "" && inline != "":
		return nil, errors.New("--policy-file and --policy (IDEMCP_POLICY) both given; use one")
	case file != "":
		p, err := policy.LoadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--policy-file %s: %w", file, err)
		}
		return p, nil
	case inline != "":
		p, err := policy.Parse([]byte(inline))
		if err != nil {
			return nil, fmt.Errorf("--policy (IDEMCP_POLICY): %w", err)
		}
		return p, nil
	}
	return policy.Default(), nil
}
