//go:build notracing

package tracing

// Built is false in a build with the notracing tag: the bench's build
// without tracing code on a call's path (see built.go).
const Built = false
