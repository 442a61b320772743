package sidecar

import (
	"errors"
	"fmt"

	"github.com/idemcp/idemcp/internal/policy"
)

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
