//go:build !notracing

package tracing

// Built reports that this build can trace. A build with the notracing
// tag has no tracing code on a call's path, for the bench to measure
// what tracing off costs against; no release is built so.
const Built = true
