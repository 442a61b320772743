// Package keyapi is the manager's key API, behind kubectl idemcp keys: it
// lists a policy's stored keys and releases or forgets one, for whoever
// Kubernetes RBAC lets, checked with a SubjectAccessReview for the user
// whose bearer token the API server accepts. Shared stores (Redis) are
// read by the manager, which holds their credentials and seal keys; a
// Memory store's records are only in its sidecars, which answer over the
// policy stream.
//
// Permissions are verbs on subresources of idempotencypolicies:
//
//	idempotencypolicies/keys     list, get: the records (tool, state, times, pod, key hash)
//	idempotencypolicies/keys     delete: release a claim, forget a result
//	idempotencypolicies/results  get: read a stored result
//
// Arguments are never stored, so never shown; a result only with
// results get.
package keyapi

import (
	"time"
)

// PathPrefix is where the API is served, on the policy stream's listener:
// PathPrefix + NAMESPACE/idempotencypolicies/NAME/keys[/KEY[/result|/release|/forget]].
const PathPrefix = "/keys/v1/namespaces/"

// KeysPath is a policy's list of keys.
func KeysPath(namespace, name string) string {
	return PathPrefix + namespace + "/idempotencypolicies/" + name + "/keys"
}

// TokenHeader carries the caller's bearer token when the request comes
// through the API server's service proxy, which takes Authorization for
// itself. A direct request uses Authorization.
const TokenHeader = "X-Idemcp-Authorization"

// RBAC: the subresources and verbs a role grants.
const (
	SubresourceKeys    = "keys"
	SubresourceResults = "results"
)

// ShortKeyLen is how many hex digits of a key's hash are shown; a key is
// named by any prefix of at least MinKeyPrefix that only it has.
const (
	ShortKeyLen  = 12
	MinKeyPrefix = 6
)

// Short is the key hash as kubectl idemcp keys shows it.
func Short(key string) string {
	if len(key) > ShortKeyLen {
		return key[:ShortKeyLen]
	}
	return key
}

// Record is one stored key as the API shows it: never its arguments, and
// never its result (Result does, with its own permission).
type Record struct {
	// Key is the key's hash, in full.
	Key  string `json:"key"`
	Tool string `json:"tool,omitempty"`
	// State is pending, outcome-unknown or completed.
	State string `json:"state"`
	// Pod is the pod whose sidecar claimed the key.
	Pod string `json:"pod,omitempty"`
	// Holder is the pod whose sidecar holds the record (Memory store: each
	// sidecar has its own); empty for a shared store.
	Holder     string    `json:"holder,omitempty"`
	Claimed    time.Time `json:"claimed,omitzero"`
	LeaseUntil time.Time `json:"leaseUntil,omitzero"`
	Expires    time.Time `json:"expires,omitzero"`
}

// List is the answer of a list.
type List struct {
	Namespace string   `json:"namespace"`
	Policy    string   `json:"policy"`
	Store     string   `json:"store"`
	Records   []Record `json:"records"`
	// Notes say what could not be read (a sidecar that did not answer).
	Notes []string `json:"notes,omitempty"`
}

// Result is the answer of a result read.
type Result struct {
	Record Record `json:"record"`
	// Response is the stored JSON-RPC response.
	Response string `json:"response"`
}

// Change is the answer of a release or forget: the records dropped.
type Change struct {
	Op      string   `json:"op"`
	Records []Record `json:"records"`
	Notes   []string `json:"notes,omitempty"`
}

// Error is the body of every refusal.
type Error struct {
	Message string `json:"message"`
}
