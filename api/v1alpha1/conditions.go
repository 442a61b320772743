package v1alpha1

// Condition types of an IdempotencyPolicy.
const (
	// ConditionStoreReady says whether the store the policy names can be used.
	ConditionStoreReady = "StoreReady"
	// ConditionSidecarsSynced says whether every sidecar applied the
	// current policy.
	ConditionSidecarsSynced = "SidecarsSynced"
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
	// ReasonSecretNotFound: the Secret named by passwordSecretRef is missing.
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
)

// Labels and annotations idemcp writes or reads.
const (
	// LabelPolicy is set on the pods the webhook injects and on the
	// objects the controller creates for a policy.
	LabelPolicy = "idemcp.io/policy"
	// LabelComponent names what a created object is for.
	LabelComponent = "idemcp.io/component"
)
