package engine

import "github.com/idemcp/idemcp/internal/claim"

// renewRetryMin is the first backoff of a failed renewal (claim.RenewRetryMin).
const renewRetryMin = claim.RenewRetryMin
