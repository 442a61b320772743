// Package policywire is the policy stream's protocol, shared by the manager
// (controllers/policystream) and the sidecar (sidecar/policysync).
//
// It follows Envoy's xDS: one long-lived HTTPS request per sidecar,
// full duplex. The manager writes Snapshots, the sidecar writes Reports,
// each one JSON object per line. A Snapshot is the whole policy at one
// version (its hash), never a delta; the sidecar answers each with a Report
// carrying the Snapshot's nonce: an ACK names the version it now enforces,
// a NACK keeps the version it enforced and says why in Error. The first
// Report, sent on connect with no nonce, tells a new manager (after a
// restart or a failover) what the sidecar enforces, so no acknowledgement
// is lost with the old one.
package policywire

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// StreamPath is the path of a policy's stream; the sidecar POSTs to it with
// its projected token (audience TokenAudience) as a Bearer token.
func StreamPath(namespace, name string) string {
	return "/v1/namespaces/" + namespace + "/idempotencypolicies/" + name + "/stream"
}

// TokenAudience is the audience of the sidecar's projected token.
const TokenAudience = "idemcp"

// ReviewTicketHeader carries the manager's review ticket: in its answer to
// a stream it accepted, and in the sidecar's next request with the same
// token, so that another replica needs no TokenReview for it.
const ReviewTicketHeader = "Idemcp-Review-Ticket"

// ContentType is the media type of both directions.
const ContentType = "application/x-ndjson"

// MaxMessageBytes bounds one line in either direction: a policy is at most
// 256 rules of small strings.
const MaxMessageBytes = 1 << 20

// Snapshot is the policy at one version, manager to sidecar.
type Snapshot struct {
	// Version is the compiled policy's hash (internal/policy Hash): the
	// same value as status.policyHash.
	Version string `json:"version"`
	// Nonce identifies this Snapshot; the Report that answers it carries it.
	Nonce string `json:"nonce"`
	// Policy is the IdempotencyPolicy (name, namespace and the spec with
	// defaults applied). It never holds a Secret: the Redis password reaches
	// the sidecar as a secretKeyRef env var.
	Policy *v1alpha1.IdempotencyPolicy `json:"policy"`
	// CABundle is the PEM of every CA the manager may serve the stream
	// with: the sidecar adds it to the bundle it got at injection, so a CA
	// rotation does not cut it off.
	CABundle string `json:"caBundle,omitempty"`
	// Order places this Snapshot among the versions of the policy: a
	// sidecar never replaces a policy with one Older than it (an earlier
	// generation of the same object, from a manager replica whose cache is
	// behind). Nil from managers before it was added: such a Snapshot is
	// applied as it comes.
	Order *Order `json:"order,omitempty"`
	// LegacyKeys is what the sidecar does with keys without its key space
	// (the policy's status.legacyKeys). A manager that knows of them
	// always sends it, empty when none are wanted; nil, from a manager
	// before them, leaves what the sidecar knows as it is.
	LegacyKeys *LegacyKeys `json:"legacyKeys,omitempty"`
	// Keys, when set, makes this line a request about the sidecar's own
	// records (kubectl idemcp keys, for the Memory store) instead of a
	// policy: the other fields are empty, and the sidecar answers with a
	// Report whose KeysReply carries the same ID. The manager sends it
	// only to sidecars whose Reports say Keys.
	Keys *KeysRequest `json:"keys,omitempty"`
}

// LegacyKeys is status.legacyKeys as the sidecars get it: while Writers
// (pods without key spaces run under the policy), sidecars derive their
// keys without their key space; after, until Until, a call not found
// under its key is looked for under the key it had without one.
type LegacyKeys struct {
	Writers bool      `json:"writers,omitempty"`
	Until   time.Time `json:"until,omitzero"`
}

// LegacyWritersFlag is the sidecar's --legacy-keys while writers run.
const LegacyWritersFlag = "writers"

// Flag is l as the sidecar's --legacy-keys (IDEMCP_LEGACY_KEYS), which
// the webhook sets: LegacyWritersFlag, the deadline in RFC 3339, or empty.
func (l LegacyKeys) Flag() string {
	switch {
	case l.Writers:
		return LegacyWritersFlag
	case !l.Until.IsZero():
		return l.Until.UTC().Format(time.RFC3339)
	}
	return ""
}

// LegacyKeysOf is the LegacyKeys of a policy's status (nil: none).
func LegacyKeysOf(s *v1alpha1.LegacyKeysStatus) LegacyKeys {
	var l LegacyKeys
	if s == nil {
		return l
	}
	l.Writers = s.Writers > 0
	if !l.Writers && s.Until != nil {
		l.Until = s.Until.UTC()
	}
	return l
}

// Key operations of a KeysRequest.
const (
	KeysList    = "list"
	KeysLookup  = "lookup"  // one record, with its stored response if Response
	KeysRelease = "release" // a claim whose lease ran out
	KeysForget  = "forget"  // a stored result
)

// KeysRequest asks a sidecar about the records of its own store.
type KeysRequest struct {
	ID string `json:"id"`
	Op string `json:"op"`
	// Key is the full store key (lookup, release, forget).
	Key string `json:"key,omitempty"`
	// Response asks lookup for the stored response too.
	Response bool `json:"response,omitempty"`
}

// KeysReply codes: why a KeysRequest on one key did nothing.
const (
	KeysNotFound   = "not_found"
	KeysWrongState = "wrong_state"
	KeysLeaseLive  = "lease_live"
)

// MaxKeysListed bounds the records one sidecar lists in a reply, so that
// the reply fits in MaxMessageBytes.
const MaxKeysListed = 2000

// MaxKeysResponseBytes bounds a stored response sent in a reply (it
// travels in base64).
const MaxKeysResponseBytes = 512 << 10

// KeysReply is a sidecar's answer to a KeysRequest.
type KeysReply struct {
	ID      string      `json:"id"`
	Records []KeyRecord `json:"records,omitempty"`
	// Truncated says the sidecar holds more than MaxKeysListed records.
	Truncated bool   `json:"truncated,omitempty"`
	Response  []byte `json:"response,omitempty"`
	// Code is one of the KeysReply codes, Error any other failure.
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
}

// KeyRecord is one record as a sidecar lists it: never an argument, never
// a response.
type KeyRecord struct {
	Key        string    `json:"key"`
	Tool       string    `json:"tool,omitempty"`
	Pod        string    `json:"pod,omitempty"`
	Completed  bool      `json:"completed,omitempty"`
	Claimed    time.Time `json:"claimed,omitzero"`
	LeaseUntil time.Time `json:"leaseUntil,omitzero"`
	Expires    time.Time `json:"expires,omitzero"`
}

// Order is where a policy's spec stands in its history: the object (its
// UID and creation time) and its metadata.generation, which the API
// server raises with every change of the spec and never with a status
// write. The resourceVersion is not used: every status write raises it,
// so ordering by it would mean sending every sidecar a snapshot for each.
type Order struct {
	UID        string    `json:"uid"`
	Created    time.Time `json:"created"`
	Generation int64     `json:"generation"`
}

// Equal reports whether a and b are the same place in a policy's history.
func (a Order) Equal(b Order) bool {
	return a.UID == b.UID && a.Generation == b.Generation && a.Created.Equal(b.Created)
}

// Older reports whether a is known to come before b: an earlier
// generation of the same object. Objects of different UIDs are never
// Older than each other: their creation times come from API servers whose
// clocks may be skewed (kubectl replace --force, or Argo CD's
// Replace=true, can give the new object an earlier creationTimestamp than
// the one it replaced), and the manager forgets a policy's UID when it is
// deleted, so across UIDs what it sends is the policy.
func Older(a, b Order) bool {
	return a.UID == b.UID && a.Generation < b.Generation
}

// Report is the sidecar's answer, sidecar to manager.
type Report struct {
	// Version is the policy hash the sidecar enforces now.
	Version string `json:"version"`
	// Nonce is the Snapshot this answers; empty on connect.
	Nonce string `json:"nonce,omitempty"`
	// Error, when set, makes this a NACK: the sidecar could not apply the
	// Snapshot and keeps enforcing Version.
	Error string `json:"error,omitempty"`
	// RestartRequired, when set, says the applied policy names a store the
	// sidecar cannot switch to while it runs: it keeps the store it started
	// with until its pod restarts.
	RestartRequired string `json:"restartRequired,omitempty"`
	// UnscopedCalls counts calls forwarded without dedup because they had
	// neither session nor principal; nil when the sidecar cannot tell.
	UnscopedCalls *uint64 `json:"unscopedCalls,omitempty"`
	// Keys says this sidecar answers KeysRequests: its store is its own
	// (Memory), so only it can list and release its records.
	Keys bool `json:"keys,omitempty"`
	// KeysReply, when set, makes this Report an answer to a KeysRequest:
	// it says nothing new of the policy the sidecar enforces.
	KeysReply *KeysReply `json:"keysReply,omitempty"`
	// Tools are what the sidecar decided for the tools it has seen (at
	// most MaxReportedTools), and ToolsOmitted how many more there are;
	// the manager lists them in the policy's status. A sidecar sends a
	// Report again, with its last nonce, whenever they change.
	Tools        []Tool `json:"tools,omitempty"`
	ToolsOmitted int    `json:"toolsOmitted,omitempty"`
}

// Tool is a sidecar's decision for one tool: its mode (Deduplicate or
// Passthrough) and why (rule, readOnlyHint, idempotentHint, noAnnotations
// or unknown).
type Tool struct {
	Name   string `json:"name"`
	Mode   string `json:"mode"`
	Reason string `json:"reason"`
}

// MaxReportedTools bounds the tools of one Report.
const MaxReportedTools = 256

// Decode reads one message. Unknown fields are ignored, as in xDS: a
// policy field this sidecar does not know changes the hash it computes, so
// such a Snapshot is NACKed for its version rather than half applied.
func Decode(line []byte, v any) error {
	if err := json.Unmarshal(line, v); err != nil {
		return fmt.Errorf("policy stream message does not parse: %w", err)
	}
	return nil
}

// StoreIdentity is what of a store a running sidecar cannot change: the
// type and how it reaches Redis. Two specs with the same identity share
// records; managed Redis's image, resources and storage are not part of
// it, nor external Redis's minReplicas and minReplicasTimeout, which a
// sidecar applies live.
func StoreIdentity(s v1alpha1.StoreSpec) string {
	id := struct {
		Type     v1alpha1.StoreType      `json:"type"`
		Managed  bool                    `json:"managed,omitempty"`
		External *v1alpha1.ExternalRedis `json:"external,omitempty"`
	}{Type: s.Type}
	if s.Type == "" {
		id.Type = v1alpha1.StoreMemory
	}
	if s.Redis != nil {
		id.Managed = s.Redis.Managed != nil
		if ext := s.Redis.External; ext != nil {
			e := *ext
			e.MinReplicas, e.MinReplicasTimeout = 0, nil
			id.External = &e
		}
	}
	b, _ := json.Marshal(id)
	return string(b)
}
