package store

import "time"

// wallClock is the sidecar's own clock, by which sealed expiries are
// written and checked when SealOptions.Now is not set. A build with the
// faultclock tag (the chaos tests' only) lets a test step it.
var wallClock = time.Now
