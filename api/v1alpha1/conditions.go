package v1alpha1

// Condition types of an IdempotencyPolicy.
const (
	// ConditionStoreReady says whether the store the policy names can be used.
	ConditionStoreReady = "StoreReady"
	// ConditionSidecarsSynced says whether every sidecar applied the
	// current policy.
	ConditionSidecarsSynced = "SidecarsSynced"
	// ConditionToolsAnnotated says whether every tool Auto decides for
	// carries the server's annotations; the policy stream writes it from
	// the sidecars' reports. Ready does not depend on it: it is a warning.
	ConditionToolsAnnotated = "ToolsAnnotated"
	// ConditionReady sums the others up: the policy is enforced as written.
	ConditionReady = "Ready"
)

// Condition reasons.
const (
	// ReasonMemoryStore: each sidecar keeps its own records; nothing to run.
	ReasonMemoryStore = "MemoryStore"
	// ReasonMemoryStoreShared: several pods use a Memory policy, so a retry
	// that reaches another replica runs again.
	ReasonMemoryStoreShared = "MemoryStoreShared"
	// ReasonRedisAvailable: the managed Redis has an available replica.
	ReasonRedisAvailable = "RedisAvailable"
	// ReasonRedisProvisioning: the managed Redis is not available yet.
	ReasonRedisProvisioning = "RedisProvisioning"
	// ReasonProvisioningFailed: creating or updating the managed Redis failed.
	ReasonProvisioningFailed = "ProvisioningFailed"
	// ReasonExternalRedis: an external Redis is configured and its Secret exists.
	ReasonExternalRedis = "ExternalRedisConfigured"
	// ReasonExternalPostgres: a PostgreSQL store is configured and its
	// Secret holds a connection string.
	ReasonExternalPostgres = "ExternalPostgresConfigured"
	// ReasonInvalidSecret: the Secret's value is not what the field needs
	// (a connection string that does not parse).
	ReasonInvalidSecret = "InvalidSecret"
	// ReasonSecretNotFound: the Secret named by passwordSecretRef or
	// urlSecretRef is missing.
	ReasonSecretNotFound = "SecretNotFound"
	// ReasonSecretKeyMissing: the Secret exists but lacks the key.
	ReasonSecretKeyMissing = "SecretKeyMissing"
	// ReasonInvalidSpec: the spec does not compile (the API server's
	// validation normally refuses such a spec first).
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonReady: everything the policy needs is in place.
	ReasonReady = "Ready"
	// ReasonStoreNotReady: Ready is False because the store is not.
	ReasonStoreNotReady = "StoreNotReady"
	// ReasonSidecarsNotSynced: Ready is False because SidecarsSynced is.
	ReasonSidecarsNotSynced = "SidecarsNotSynced"
	// ReasonRedisObjectConflict: an object the managed Redis needs (its
	// Secret, StatefulSet, Service, PodDisruptionBudget, NetworkPolicy or
	// volume claim) exists and is not owned by this policy; idemcp never
	// adopts it.
	ReasonRedisObjectConflict = "RedisObjectConflict"
	// ReasonRedisReplacing: an older managed Redis (a Deployment made by an
	// earlier idemcp) is shutting down; the new one starts once its pods
	// are gone, so two never run at once.
	ReasonRedisReplacing = "RedisReplacing"
	// ReasonRedisPasswordReset: the managed Redis's Secret was lost and a
	// new password was made; Redis restarts with it, and the pods that use
	// the policy need a restart to get it.
	ReasonRedisPasswordReset = "RedisPasswordReset"
	// ReasonRedisPasswordChanged: the managed Redis's password was changed
	// by hand in its Secret; Redis restarts with it, and the message names
	// the pods that still hold the old one and how to restart them.
	ReasonRedisPasswordChanged = "RedisPasswordChanged"
	// ReasonSecretNotLabelled: a Secret the policy names (passwordSecretRef,
	// urlSecretRef) lacks the label idemcp.io/credentials: "true" that opts
	// it in to idemcp; the webhook refuses the policy's new pods meanwhile.
	ReasonSecretNotLabelled = "SecretNotLabelled"
	// ReasonStoreSharedByWorkloads: pods of more than one top-level
	// workload use one Redis policy, so different MCP servers share one key
	// space and may replay each other's results.
	ReasonStoreSharedByWorkloads = "StoreSharedByWorkloads"
	// ReasonPolicyInUse: the policy is being deleted, and the finalizer
	// holds it (and its Redis) until no pod uses it.
	ReasonPolicyInUse = "PolicyInUse"
)

// Reasons of the SidecarsSynced condition, which the policy stream writes.
const (
	// ReasonAllSynced: every injected pod holds a stream and its sidecar
	// applied the current policyHash.
	ReasonAllSynced = "AllSynced"
	// ReasonNoInjectedPods: no running pod uses the policy; nothing to sync.
	ReasonNoInjectedPods = "NoInjectedPods"
	// ReasonSidecarsNotConnected: some injected pods hold no policy
	// stream, so what they enforce is not known (False); the message
	// names them.
	ReasonSidecarsNotConnected = "SidecarsNotConnected"
	// ReasonSyncNotObserved: the manager runs without the policy stream
	// (--policy-stream-bind-address=0), so no sidecar reports what it
	// applied (Unknown); each enforces the snapshot its pod started with.
	// Ready is Unknown too.
	ReasonSyncNotObserved = "SyncNotObserved"
	// ReasonSyncing: some connected sidecars have not acknowledged the
	// current policyHash yet.
	ReasonSyncing = "Syncing"
	// ReasonPolicyRejected: a sidecar could not apply the policy (a NACK);
	// the message carries its reason. It keeps enforcing its last good policy.
	ReasonPolicyRejected = "PolicyRejected"
	// ReasonRestartRequired: the policy changed its store, which a running
	// sidecar cannot switch; the message names the pods' count and the
	// kubectl rollout restart to run.
	ReasonRestartRequired = "RestartRequired"
	// ReasonStreamUnavailable: the manager does not serve the policy
	// stream (no leader); sidecars keep enforcing their last policy.
	ReasonStreamUnavailable = "StreamUnavailable"
)

// Reasons of the ToolsAnnotated condition, which the policy stream writes.
const (
	// ReasonToolsAnnotated: every tool the sidecars have seen is decided
	// by a rule or by the server's annotations (True).
	ReasonToolsAnnotated = "ToolsAnnotated"
	// ReasonToolsUnannotated: Auto deduplicates some tools only because
	// the server gives them no annotations, or because no listing named
	// them (False, with a Warning event); the message names them, the
	// workloads that reported them, and the rule that would pass them
	// through.
	ReasonToolsUnannotated = "ToolsUnannotated"
	// ReasonNoToolsReported: no connected sidecar has reported a tool yet
	// (Unknown).
	ReasonNoToolsReported = "NoToolsReported"
)

// Field managers of the status: each writer applies its own fields with
// server-side apply, so neither overwrites the other's conditions.
const (
	// FieldManagerController owns observedGeneration, policyHash, store and
	// the StoreReady and Ready conditions.
	FieldManagerController = "idemcp-controller"
	// FieldManagerPolicyStream owns sidecars, tools, toolsOmitted and the
	// SidecarsSynced and ToolsAnnotated conditions.
	FieldManagerPolicyStream = "idemcp-policy-stream"
)

// Labels and annotations idemcp writes or reads.
const (
	// LabelPolicy is set on the pods the webhook injects and on the
	// objects the controller creates for a policy.
	LabelPolicy = "idemcp.io/policy"
	// LabelComponent names what a created object is for.
	LabelComponent = "idemcp.io/component"
	// LabelInject opts a pod in to injection ("true"); the pods idemcp
	// creates carry "false".
	LabelInject = "idemcp.io/inject"
	// LabelCredentials opts a Secret in to use by idemcp: a policy's
	// passwordSecretRef may only name a Secret that carries it with "true".
	LabelCredentials = "idemcp.io/credentials"
	// AnnotationKeySpace on a pod (template) names the key space its
	// sidecar uses: workloads whose pods carry the same value are one MCP
	// server and share results (blue/green). Without it each workload
	// (Deployment, StatefulSet, ...) has its own.
	AnnotationKeySpace = "idemcp.io/key-space"
	// AnnotationStatus is the webhook's mark on a pod it injected.
	AnnotationStatus = "idemcp.io/status"
	// FinalizerInUse holds a policy being deleted while pods use it, and
	// the managed Redis's Secret while its Redis runs.
	FinalizerInUse = "idemcp.io/in-use"
)
