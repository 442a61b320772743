package controllers

import "time"

// The envtest suite's rotations would otherwise keep a retired key for the
// 2 minutes of clock-skew grace past its TTL before the test sees it go.
func init() { sealSkewGrace = time.Second }
