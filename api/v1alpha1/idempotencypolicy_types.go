package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// StoreType names where claims and results are kept.
// +kubebuilder:validation:Enum=Memory;Redis;Postgres
type StoreType string

const (
	// StoreMemory keeps records inside each sidecar: nothing to run, but
	// replicas do not share results.
	StoreMemory StoreType = "Memory"
	// StoreRedis keeps records in Redis, shared by every sidecar of the policy.
	StoreRedis StoreType = "Redis"
	// StorePostgres keeps records in a PostgreSQL database the user runs,
	// shared by every sidecar of the policy.
	StorePostgres StoreType = "Postgres"
)

// StoreUnavailableAction says what a sidecar does when its store cannot be reached.
// +kubebuilder:validation:Enum=FailClosed;FailOpen
type StoreUnavailableAction string

const (
	// FailClosed answers a JSON-RPC error and runs nothing.
	FailClosed StoreUnavailableAction = "FailClosed"
	// FailOpen forwards the call without deduplication.
	FailOpen StoreUnavailableAction = "FailOpen"
)

// KeyScope says whose calls share a derived key.
// +kubebuilder:validation:Enum=Session;Principal;Global
type KeyScope string

const (
	// ScopeSession shares keys within one principal's MCP session.
	ScopeSession KeyScope = "Session"
	// ScopePrincipal shares keys across all sessions of one principal.
	ScopePrincipal KeyScope = "Principal"
	// ScopeGlobal shares keys across every caller.
	ScopeGlobal KeyScope = "Global"
)

// InFlightAction says what a duplicate does while the first call still runs.
// +kubebuilder:validation:Enum=Wait;Reject
type InFlightAction string

const (
	// InFlightWait waits for the first call's result, up to waitTimeout.
	InFlightWait InFlightAction = "Wait"
	// InFlightReject answers a conflict error at once.
	InFlightReject InFlightAction = "Reject"
)

// AbandonedAction says what happens to a claim whose owner died mid-call.
// +kubebuilder:validation:Enum=Retry;Error
type AbandonedAction string

const (
	// AbandonedRetry lets the next call take the claim over and run the tool.
	AbandonedRetry AbandonedAction = "Retry"
	// AbandonedError answers "outcome unknown" rather than risk a second run.
	AbandonedError AbandonedAction = "Error"
)

// ToolMode says whether calls to a tool are deduplicated.
// +kubebuilder:validation:Enum=Auto;Deduplicate;Passthrough
type ToolMode string

const (
	// ModeAuto follows the server's annotations from tools/list: a tool
	// annotated readOnlyHint: true or idempotentHint: true passes through,
	// every other tool is deduplicated.
	ModeAuto ToolMode = "Auto"
	// ModeDeduplicate deduplicates every call.
	ModeDeduplicate ToolMode = "Deduplicate"
	// ModePassthrough forwards every call untouched.
	ModePassthrough ToolMode = "Passthrough"
)

// IdempotencyPolicySpec is what a sidecar enforces.
// +kubebuilder:validation:XValidation:rule="!has(self.retryWindow) || !has(self.ttl) || duration(self.retryWindow) <= duration(self.ttl)",message="spec.retryWindow must be at most spec.ttl: a derived key cannot be kept longer than an explicit one; shorten retryWindow or lengthen ttl"
// +kubebuilder:validation:XValidation:rule="!has(self.tools) || !has(self.ttl) || self.tools.all(t, !has(t.retryWindow) || duration(t.retryWindow) <= duration(has(t.ttl) ? t.ttl : self.ttl))",message="spec.tools[].retryWindow must be at most the tool's ttl (its own, or spec.ttl): shorten the rule's retryWindow or lengthen its ttl"
type IdempotencyPolicySpec struct {
	// TTL is how long a completed result is replayed for an explicit
	// idempotency key: the caller's promise that calls with that key are
	// one operation.
	// +kubebuilder:default="24h"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('720h')",message="ttl must be between 1s and 720h (30d)"
	// +optional
	TTL *metav1.Duration `json:"ttl,omitempty"`

	// RetryWindow is how long an identical call with a derived key (no
	// explicit idempotency key) counts as a retry and is replayed; after
	// it the same call runs again. At most ttl. Unset: 10m, or ttl if that
	// is shorter (so a policy with a short ttl needs no window of its
	// own). A call still running is never run twice, whatever the window.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('720h')",message="retryWindow must be between 1s and 720h (30d), and at most ttl"
	// +optional
	RetryWindow *metav1.Duration `json:"retryWindow,omitempty"`

	// Store is where claims and results are kept.
	// +kubebuilder:default={type: Memory}
	// +optional
	Store StoreSpec `json:"store,omitempty"`

	// OnStoreUnavailable says what happens when the store cannot be reached.
	// +kubebuilder:default=FailClosed
	// +optional
	OnStoreUnavailable StoreUnavailableAction `json:"onStoreUnavailable,omitempty"`

	// KeyScope is whose calls share a key derived from the arguments.
	// +kubebuilder:default=Session
	// +optional
	KeyScope KeyScope `json:"keyScope,omitempty"`

	// PrincipalHeader is the request header whose hash identifies the caller.
	// +kubebuilder:default=Authorization
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9!#$%&'*+.^_|~-]+$`
	// +kubebuilder:validation:MaxLength=128
	// +optional
	PrincipalHeader string `json:"principalHeader,omitempty"`

	// InFlight says what a duplicate does while the first call still runs.
	// +kubebuilder:default=Wait
	// +optional
	InFlight InFlightAction `json:"inFlight,omitempty"`

	// WaitTimeout is how long a duplicate waits before it gets a conflict error.
	// +kubebuilder:default="30s"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('1h')",message="waitTimeout must be between 0s and 1h"
	// +optional
	WaitTimeout *metav1.Duration `json:"waitTimeout,omitempty"`

	// LeaseDuration is how long a claim lives without renewal; it is renewed
	// while the upstream call runs.
	// +kubebuilder:default="30s"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('1h')",message="leaseDuration must be between 1s and 1h"
	// +optional
	LeaseDuration *metav1.Duration `json:"leaseDuration,omitempty"`

	// OnAbandoned says what happens to a claim whose owner died mid-call.
	// +kubebuilder:default=Retry
	// +optional
	OnAbandoned AbandonedAction `json:"onAbandoned,omitempty"`

	// MaxResultBytes is the largest response that is stored for replay.
	// +kubebuilder:default="1Mi"
	// +kubebuilder:validation:XValidation:rule="quantity(self).isGreaterThan(quantity('0')) && !quantity(self).isGreaterThan(quantity('64Mi'))",message="maxResultBytes must be more than 0 and at most 64Mi, such as 1Mi"
	// +optional
	MaxResultBytes *resource.Quantity `json:"maxResultBytes,omitempty"`

	// DefaultMode applies to tools that no rule names.
	// +kubebuilder:default=Auto
	// +optional
	DefaultMode ToolMode `json:"defaultMode,omitempty"`

	// Tools are per-tool rules; the first rule whose name matches wins.
	// Names are unique. The list is atomic, so its order is the order its
	// writer gave: server-side apply never merges or reorders rules. The
	// policy travels to each sidecar in one environment variable (Linux
	// caps one at 128 KiB), so the rules are bounded: 64 rules, and 8192
	// characters of ignoreArguments pointers in all.
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:XValidation:rule="self.all(x, self.exists_one(y, y.name == x.name))",message="tool rule names must be unique: the first rule whose name matches a tool wins, so a second rule with the same name would never apply"
	// +kubebuilder:validation:XValidation:rule="self.map(t, has(t.ignoreArguments) ? t.ignoreArguments.map(p, size(p)).sum() : 0).sum() <= 8192",message="the ignoreArguments pointers of all tools may have at most 8192 characters together: the policy must fit in one environment variable of the sidecar"
	// +listType=atomic
	// +optional
	Tools []ToolRule `json:"tools,omitempty"`

	// Tracing turns on OpenTelemetry tracing of this policy's calls in its
	// sidecars: a span for each tools/call, exported where their OTEL_*
	// environment says (docs/tracing.md). Tracing can also be turned on
	// for every sidecar of an install (the manager's --tracing).
	// +optional
	Tracing *TracingSpec `json:"tracing,omitempty"`
}

// TracingSpec configures tracing for one policy.
type TracingSpec struct {
	// Enabled exports a span for each tools/call the policy's sidecars
	// see.
	// +optional
	Enabled bool `json:"enabled,omitempty"`
	// StoreSpans adds to a traced call's span a child span for each of
	// its round trips to the store. Off by default: at 100% sampling they
	// cost a few percent more CPU per call than the call's span alone
	// (docs/tracing.md).
	// +optional
	StoreSpans bool `json:"storeSpans,omitempty"`
}

// StoreSpec says where claims and results are kept.
// +kubebuilder:validation:XValidation:rule="self.type != 'Redis' || (has(self.redis) && (has(self.redis.managed) != has(self.redis.external)))",message="type Redis needs exactly one of redis.managed or redis.external"
// +kubebuilder:validation:XValidation:rule="self.type != 'Memory' || !has(self.redis)",message="type Memory takes no redis; set type: Redis or remove redis"
// +kubebuilder:validation:XValidation:rule="self.type == 'Postgres' ? has(self.postgres) : !has(self.postgres)",message="store.postgres goes with type Postgres, and type Postgres needs store.postgres.urlSecretRef"
// +kubebuilder:validation:XValidation:rule="self.type != 'Postgres' || !has(self.redis)",message="type Postgres takes no redis; remove store.redis"
type StoreSpec struct {
	// Type is Memory (per sidecar), Redis or Postgres (shared).
	// +kubebuilder:default=Memory
	// +optional
	Type StoreType `json:"type,omitempty"`

	// Redis configures the Redis store; only with type Redis.
	// +optional
	Redis *RedisStoreSpec `json:"redis,omitempty"`

	// Postgres configures the PostgreSQL store; only with type Postgres.
	// +optional
	Postgres *PostgresStoreSpec `json:"postgres,omitempty"`
}

// PostgresStoreSpec points at a PostgreSQL database the user runs (directly
// or through PgBouncer in transaction mode). The store creates its own
// tables (idemcp_records, idemcp_schema_migrations) on first use.
type PostgresStoreSpec struct {
	// URLSecretRef names the Secret key that holds the connection string
	// (postgres://user:password@host:5432/db?sslmode=verify-full, or the
	// key=value form): it holds the password, so it is never in the policy.
	URLSecretRef SecretKeyRef `json:"urlSecretRef"`
}

// RedisStoreSpec is either a Redis the controller runs or one the user runs.
type RedisStoreSpec struct {
	// Managed asks the controller to provision Redis for this policy.
	// +optional
	Managed *ManagedRedis `json:"managed,omitempty"`

	// External points at a Redis the user runs.
	// +optional
	External *ExternalRedis `json:"external,omitempty"`
}

// ManagedRedis is a Redis the controller provisions and owns.
// +kubebuilder:validation:XValidation:rule="!(has(self.ephemeral) && self.ephemeral && has(self.storage))",message="ephemeral and storage exclude each other: ephemeral keeps Redis's data in an emptyDir, storage sizes its volume"
// +kubebuilder:validation:XValidation:rule="has(self.storage) == has(oldSelf.storage) && (!has(self.storage) || quantity(self.storage).compareTo(quantity(oldSelf.storage)) == 0) && (has(self.ephemeral) && self.ephemeral) == (has(oldSelf.ephemeral) && oldSelf.ephemeral)",message="storage and ephemeral cannot change while the managed Redis exists (its volume would be replaced and every claim lost); expand the claim data-NAME-redis-0 directly, or switch the store away from managed and back to start a new Redis"
type ManagedRedis struct {
	// Image is the Redis container image. Without it a new Redis runs the
	// manager's --redis-image, and keeps running the image it started with
	// (status.store.image) across manager upgrades: set image to change it.
	// +kubebuilder:validation:MaxLength=512
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9._-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$`
	// +optional
	Image string `json:"image,omitempty"`

	// Resources are the Redis container's requests and limits. A request
	// without a limit gets the request as its limit (and the reverse), so
	// Redis runs in the Guaranteed QoS class and always has a maxmemory
	// (75% of the memory limit). Default: 100m CPU and 256Mi memory.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// Storage is the size of Redis's persistent volume (default 1Gi).
	// +kubebuilder:validation:XValidation:rule="quantity(self).isGreaterThan(quantity('0'))",message="storage must be more than 0, such as 1Gi"
	// +optional
	Storage *resource.Quantity `json:"storage,omitempty"`

	// StorageClassName is the StorageClass of Redis's volume (default: the
	// cluster's default class).
	// +kubebuilder:validation:MaxLength=253
	// +optional
	StorageClassName *string `json:"storageClassName,omitempty"`

	// Ephemeral keeps Redis's data in an emptyDir instead of a volume: a
	// restart of its pod loses every stored result and claim in flight, and
	// a retry then runs again. Only when asked for.
	// +optional
	Ephemeral bool `json:"ephemeral,omitempty"`
}

// ExternalRedis is a Redis the user runs: standalone, Sentinel or Cluster.
// +kubebuilder:validation:XValidation:rule="!has(self.minReplicasTimeout) || (has(self.minReplicas) && self.minReplicas > 0)",message="minReplicasTimeout bounds the wait for minReplicas: set minReplicas above 0, or remove minReplicasTimeout"
type ExternalRedis struct {
	// Addresses are host:port pairs: one for standalone, several for Cluster
	// or for the Sentinels.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MaxLength=260
	// +kubebuilder:validation:items:Pattern=`^([^:/ \[\]]+|\[[0-9a-fA-F:.]+\]):[0-9]{1,5}$`
	Addresses []string `json:"addresses"`

	// PasswordSecretRef names the Secret key that holds the Redis password.
	// +optional
	PasswordSecretRef *SecretKeyRef `json:"passwordSecretRef,omitempty"`

	// TLS connects with TLS.
	// +optional
	TLS bool `json:"tls,omitempty"`

	// SentinelMaster is the master name when Addresses are Sentinels.
	// +optional
	SentinelMaster string `json:"sentinelMaster,omitempty"`

	// MinReplicas makes every claim, lease renewal and stored result wait
	// until this many replicas of the primary have it (Redis WAIT), and a
	// retry is replayed only a result that many replicas have. Set to the
	// number of replicas a failover may promote, a failover then loses no
	// claim a call runs under and no result a retry was given. While fewer
	// replicas answer within minReplicasTimeout, new claims fail and
	// onStoreUnavailable decides. The sidecar's --redis-min-replicas may
	// raise it, never lower it. A change applies when the sidecars'
	// pods restart. 0 (the default): writes do not wait for replicas.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=16
	// +optional
	MinReplicas int32 `json:"minReplicas,omitempty"`

	// MinReplicasTimeout bounds each wait for minReplicas (default 1s).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('10ms') && duration(self) <= duration('30s')",message="minReplicasTimeout must be between 10ms and 30s"
	// +optional
	MinReplicasTimeout *metav1.Duration `json:"minReplicasTimeout,omitempty"`
}

// SecretKeyRef names one key of a Secret in the policy's namespace.
type SecretKeyRef struct {
	// Name of the Secret.
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`
	// Key in the Secret.
	// +kubebuilder:validation:MinLength=1
	Key string `json:"key"`
}

// ToolRule overrides the policy for tools whose name matches.
type ToolRule struct {
	// Name is a tool name or a glob (`*` any run of characters, `?` one).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9_./*?-]+$`
	Name string `json:"name"`

	// Mode for matching tools; Auto uses the tool's readOnlyHint and
	// idempotentHint.
	// +kubebuilder:default=Deduplicate
	// +optional
	Mode ToolMode `json:"mode,omitempty"`

	// TTL overrides spec.ttl for matching tools.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('720h')",message="ttl must be between 1s and 720h (30d)"
	// +optional
	TTL *metav1.Duration `json:"ttl,omitempty"`

	// RetryWindow overrides spec.retryWindow for matching tools; at most
	// the tool's ttl. Unset: spec.retryWindow (or its default), capped at
	// the tool's ttl.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('720h')",message="retryWindow must be between 1s and 720h (30d), and at most ttl"
	// +optional
	RetryWindow *metav1.Duration `json:"retryWindow,omitempty"`

	// KeyScope overrides spec.keyScope for matching tools.
	// +optional
	KeyScope KeyScope `json:"keyScope,omitempty"`

	// OnAbandoned overrides spec.onAbandoned for matching tools.
	// +optional
	OnAbandoned AbandonedAction `json:"onAbandoned,omitempty"`

	// CacheToolErrors replays results with isError: true like successes.
	// +optional
	CacheToolErrors bool `json:"cacheToolErrors,omitempty"`

	// IgnoreArguments are JSON pointers (RFC 6901) into the arguments that
	// are left out of the fingerprint, such as a timestamp.
	// +kubebuilder:validation:MaxItems=32
	// +kubebuilder:validation:items:MaxLength=256
	// +kubebuilder:validation:items:Pattern=`^(/([^~/]|~[01])*)+$`
	// +optional
	IgnoreArguments []string `json:"ignoreArguments,omitempty"`
}

// IdempotencyPolicyStatus is what the controller observed.
type IdempotencyPolicyStatus struct {
	// ObservedGeneration is the generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// Conditions: StoreReady, SidecarsSynced, ToolsAnnotated and Ready.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// Store is what the controller knows of the store.
	// +optional
	Store *StoreStatus `json:"store,omitempty"`

	// Sidecars counts the sidecars that use this policy.
	// +optional
	Sidecars *SidecarsStatus `json:"sidecars,omitempty"`

	// PolicyHash is a stable hash of the compiled policy.
	// +optional
	PolicyHash string `json:"policyHash,omitempty"`

	// Tools are the tools the sidecars have seen (listed by the MCP server,
	// or called), each with the mode it gets and why; the policy stream
	// writes them from the sidecars' reports. At most 64 are listed,
	// those Auto deduplicates for want of annotations first.
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=64
	// +optional
	Tools []ToolStatus `json:"tools,omitempty"`

	// ToolsOmitted counts the tools seen beyond those listed in tools.
	// +optional
	ToolsOmitted int32 `json:"toolsOmitted,omitempty"`

	// LegacyKeys is set while records made without a key space (by pods an
	// idemcp before key spaces injected) may still be wanted: while such
	// pods run, and then until the longest a record is kept has passed.
	// Absent: every key has its key space (a fresh install, or the
	// upgrade's records have all expired).
	// +optional
	LegacyKeys *LegacyKeysStatus `json:"legacyKeys,omitempty"`
}

// LegacyKeysStatus is what the controller pushes to the sidecars about
// keys without a key space.
type LegacyKeysStatus struct {
	// Writers counts the live pods of the policy whose sidecar has no key
	// space. While any run, every sidecar derives its keys without its key
	// space, as theirs do, so a retry moved between an old pod and a new
	// one, either way, finds its record.
	// +optional
	Writers int32 `json:"writers,omitempty"`
	// Until is set when the last such pod is gone: the time then plus the
	// policy's longest ttl and leaseDuration. Until it, sidecars use their
	// key spaces, and a call not found under its key is looked for under
	// the key it had without one.
	// +optional
	Until *metav1.Time `json:"until,omitempty"`
}

// ToolStatus is what the sidecars decided for one tool.
type ToolStatus struct {
	// Name is the tool's name.
	// +kubebuilder:validation:MaxLength=128
	Name string `json:"name"`
	// Mode is Deduplicate or Passthrough.
	Mode ToolMode `json:"mode"`
	// Reason is why: rule (a tools[] rule or defaultMode), readOnlyHint,
	// idempotentHint (the server's annotations, under Auto), noAnnotations
	// (the server gave neither, so Auto deduplicates it) or unknown (no
	// listing named it, or named it twice with different annotations).
	// +kubebuilder:validation:MaxLength=32
	Reason string `json:"reason"`
	// Sidecars is how many connected sidecars reported the tool; when they
	// disagree, the mode most of them gave is shown, Deduplicate on a tie.
	// +optional
	Sidecars int32 `json:"sidecars,omitempty"`
}

// StoreStatus describes the store in use.
type StoreStatus struct {
	// Endpoint is the address sidecars connect to.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`

	// Image is the image the managed Redis runs. It changes only when
	// spec.store.redis.managed.image does, never with a manager upgrade.
	// +optional
	Image string `json:"image,omitempty"`
}

// SidecarsStatus counts sidecars in stages; the policy stream writes it.
type SidecarsStatus struct {
	// Injected is how many running pods carry a sidecar for this policy.
	Injected int32 `json:"injected"`
	// Connected is how many of them hold a policy stream.
	Connected int32 `json:"connected"`
	// Synced is how many applied the current policyHash in full.
	Synced int32 `json:"synced"`
	// RestartRequired is how many applied the current policy but keep the
	// store they started with, because the policy changed its store: their
	// pods must be restarted.
	// +optional
	RestartRequired int32 `json:"restartRequired,omitempty"`
	// Ratio is synced/injected, as the Synced column prints it ("3/3").
	// +optional
	Ratio string `json:"ratio,omitempty"`
	// SyncedHash is the policyHash the counts refer to.
	// +optional
	SyncedHash string `json:"syncedHash,omitempty"`
}

// IdempotencyPolicy makes an MCP server's tool calls exactly-once.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=idpol
// +kubebuilder:validation:XValidation:rule="self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter and ending with a letter or digit (it names the Service NAME-redis)"
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 46",message="metadata.name must be at most 46 characters: it names the StatefulSet NAME-redis, whose pods' revision label must fit in 63"
// +kubebuilder:printcolumn:name="Store",type=string,JSONPath=`.spec.store.type`
// +kubebuilder:printcolumn:name="TTL",type=string,JSONPath=`.spec.ttl`
// +kubebuilder:printcolumn:name="Retry-Window",type=string,JSONPath=`.spec.retryWindow`
// +kubebuilder:printcolumn:name="Synced",type=string,JSONPath=`.status.sidecars.ratio`
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.status.store.endpoint`,priority=1
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Store-Reason",type=string,JSONPath=`.status.conditions[?(@.type=="StoreReady")].reason`,priority=1
// +kubebuilder:printcolumn:name="Image",type=string,JSONPath=`.status.store.image`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type IdempotencyPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   IdempotencyPolicySpec   `json:"spec,omitempty"`
	Status IdempotencyPolicyStatus `json:"status,omitempty"`
}

// IdempotencyPolicyList is a list of IdempotencyPolicy.
// +kubebuilder:object:root=true
type IdempotencyPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []IdempotencyPolicy `json:"items"`
}
