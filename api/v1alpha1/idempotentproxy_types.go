package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// HostHeader says which Host the proxy sends upstream.
// +kubebuilder:validation:Enum=Upstream;Client
type HostHeader string

const (
	// HostUpstream sends the upstream's own host: what a remote server
	// (and its TLS virtual hosting and DNS rebinding checks) expects.
	HostUpstream HostHeader = "Upstream"
	// HostClient keeps the Host the client sent to the proxy's Service.
	HostClient HostHeader = "Client"
)

// UpstreamScheme is how the proxy speaks to a Service upstream.
// +kubebuilder:validation:Enum=HTTP;HTTPS
type UpstreamScheme string

// Schemes of a Service upstream.
const (
	SchemeHTTP  UpstreamScheme = "HTTP"
	SchemeHTTPS UpstreamScheme = "HTTPS"
)

// IdempotentProxySpec is a deduplicating proxy, run by idemcp, in front of
// an MCP server it cannot inject a sidecar into.
type IdempotentProxySpec struct {
	// Upstream is the MCP server the proxy forwards to, and only to.
	Upstream ProxyUpstream `json:"upstream"`

	// PolicyRef names the IdempotencyPolicy, in the proxy's namespace,
	// that the proxy enforces.
	PolicyRef PolicyReference `json:"policyRef"`

	// Replicas of the proxy's Deployment. Retries that reach another
	// replica are deduplicated only with a shared store (Redis or
	// Postgres).
	// +kubebuilder:default=2
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// Resources of the proxy container (default: the manager's
	// --sidecar-* defaults).
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// Port of the proxy's Service, which agents connect to over plain
	// HTTP inside the cluster.
	// +kubebuilder:default=8080
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	// +optional
	Port int32 `json:"port,omitempty"`
}

// PolicyReference names an IdempotencyPolicy in the same namespace.
type PolicyReference struct {
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	Name string `json:"name"`
}

// ProxyUpstream is where the proxy forwards: a URL, or a Service of the
// proxy's namespace.
// +kubebuilder:validation:XValidation:rule="has(self.url) != has(self.service)",message="spec.upstream needs exactly one of url (an https:// or http:// URL) or service (a Service name and port in this namespace)"
// +kubebuilder:validation:XValidation:rule="!has(self.tls) || (has(self.url) ? self.url.startsWith('https://') : (has(self.service) && has(self.service.scheme) && self.service.scheme == 'HTTPS'))",message="spec.upstream.tls applies only to an https:// upstream: use an https:// url, or service.scheme HTTPS, or remove tls"
type ProxyUpstream struct {
	// URL of the MCP server, such as https://mcp.example.com/mcp. Its
	// path is the prefix of every request's path.
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.startsWith('https://') || self.startsWith('http://')",message="spec.upstream.url must start with https:// or http://, such as https://mcp.example.com/mcp"
	// +kubebuilder:validation:XValidation:rule="isURL(self) && url(self).getHostname() != ''",message="spec.upstream.url must be an absolute URL with a host, such as https://mcp.example.com/mcp"
	// +kubebuilder:validation:XValidation:rule="!self.contains('@')",message="spec.upstream.url must not carry credentials (user:password@): the caller's own Authorization header is passed through"
	// +kubebuilder:validation:XValidation:rule="!self.contains('#')",message="spec.upstream.url must not have a fragment (#...)"
	// +optional
	URL string `json:"url,omitempty"`

	// Service is a Service in the proxy's namespace.
	// +optional
	Service *ServiceUpstream `json:"service,omitempty"`

	// TLS to an https:// upstream: the system's roots by default.
	// +optional
	TLS *UpstreamTLS `json:"tls,omitempty"`

	// HostHeader is the Host the proxy sends upstream: Upstream (the
	// upstream's host, for remote servers) or Client (the Host the client
	// sent to the proxy's Service).
	// +kubebuilder:default=Upstream
	// +optional
	HostHeader HostHeader `json:"hostHeader,omitempty"`
}

// ServiceUpstream is an MCP server behind a Service of the proxy's
// namespace.
type ServiceUpstream struct {
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z]([-a-z0-9]*[a-z0-9])?$`
	Name string `json:"name"`
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port"`
	// Scheme: HTTP or HTTPS.
	// +kubebuilder:default=HTTP
	// +optional
	Scheme UpstreamScheme `json:"scheme,omitempty"`
	// Path of the MCP endpoint, such as /mcp: the prefix of every
	// request's path.
	// +kubebuilder:validation:MaxLength=1024
	// +kubebuilder:validation:Pattern=`^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*$`
	// +optional
	Path string `json:"path,omitempty"`
}

// UpstreamTLS configures the proxy's TLS client.
// +kubebuilder:validation:XValidation:rule="!has(self.caBundle) || (has(self.caBundle.secretRef) != has(self.caBundle.configMapRef))",message="spec.upstream.tls.caBundle needs exactly one of secretRef or configMapRef"
type UpstreamTLS struct {
	// CABundle is the PEM of the CAs the upstream's certificate must
	// chain to, instead of the system's roots.
	// +optional
	CABundle *CABundleSource `json:"caBundle,omitempty"`
	// ServerName is the name sent in SNI and checked in the upstream's
	// certificate (default: the upstream's host).
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$`
	// +optional
	ServerName string `json:"serverName,omitempty"`
	// ClientCertSecretRef names a kubernetes.io/tls Secret (keys tls.crt
	// and tls.key) whose certificate the proxy presents upstream. Like
	// every Secret idemcp hands to its pods, it must carry the label
	// idemcp.io/credentials: "true".
	// +optional
	ClientCertSecretRef *LocalName `json:"clientCertSecretRef,omitempty"`
}

// CABundleSource is a key of a Secret or a ConfigMap.
type CABundleSource struct {
	// +optional
	SecretRef *SecretKeyRef `json:"secretRef,omitempty"`
	// +optional
	ConfigMapRef *ConfigMapKeyRef `json:"configMapRef,omitempty"`
}

// ConfigMapKeyRef names a key of a ConfigMap in the same namespace.
type ConfigMapKeyRef struct {
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`
	// +kubebuilder:validation:MinLength=1
	Key string `json:"key"`
}

// LocalName names an object in the same namespace.
type LocalName struct {
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`
}

// IdempotentProxyStatus is what the controller observed.
type IdempotentProxyStatus struct {
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Upstream is the URL the proxy forwards to.
	// +optional
	Upstream string `json:"upstream,omitempty"`
	// Replicas and ReadyReplicas of the proxy's Deployment.
	// +optional
	Replicas int32 `json:"replicas"`
	// +optional
	ReadyReplicas int32 `json:"readyReplicas"`
	// Ready is readyReplicas/replicas, for kubectl get.
	// +optional
	Ready string `json:"ready,omitempty"`
	// Synced is how many of the proxy's pods enforce the policy's current
	// version, of how many run ("2/2"; "?/2" when not observed).
	// +optional
	Synced string `json:"synced,omitempty"`
	// PolicyHash is the policy version the pods are to enforce.
	// +optional
	PolicyHash string `json:"policyHash,omitempty"`
	// UpstreamCheckedAt is when the upstream was last dialled.
	// +optional
	UpstreamCheckedAt *metav1.Time `json:"upstreamCheckedAt,omitempty"`
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// IdempotentProxy is an idemcp-run deduplicating proxy in front of an
// MCP server no sidecar can be injected into: a remote server, or one in
// pods that may not be changed.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas
// +kubebuilder:resource:shortName=idpx
// +kubebuilder:validation:XValidation:rule="self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter and ending with a letter or digit (it names the proxy's Service)"
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 47",message="metadata.name must be at most 47 characters: it names the proxy's Deployment, whose pods' names must fit in 63"
// +kubebuilder:validation:XValidation:rule="!has(self.spec.upstream.service) || self.spec.upstream.service.name != self.metadata.name",message="spec.upstream.service.name must differ from metadata.name: the proxy's own Service takes its name, and would forward to itself"
// +kubebuilder:printcolumn:name="Upstream",type=string,JSONPath=`.status.upstream`
// +kubebuilder:printcolumn:name="Policy",type=string,JSONPath=`.spec.policyRef.name`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.ready`
// +kubebuilder:printcolumn:name="Synced",type=string,JSONPath=`.status.synced`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type IdempotentProxy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   IdempotentProxySpec   `json:"spec"`
	Status IdempotentProxyStatus `json:"status,omitempty"`
}

// +kubebuilder:object:root=true

// IdempotentProxyList is a list of IdempotentProxy.
type IdempotentProxyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []IdempotentProxy `json:"items"`
}

// Condition types of an IdempotentProxy.
const (
	// ConditionConfigured: the policy and the Secrets and ConfigMaps the
	// proxy names exist and fit, and its objects are applied.
	ConditionConfigured = "Configured"
	// ConditionUpstreamReachable: the manager's last TCP (and TLS) dial to
	// the upstream succeeded. Nothing is sent: no tool ever runs.
	ConditionUpstreamReachable = "UpstreamReachable"
	// ConditionAvailable: every replica of the proxy is ready.
	ConditionAvailable = "Available"
	// ConditionProxiesSynced: every proxy pod enforces the policy's
	// current version.
	ConditionProxiesSynced = "ProxiesSynced"
)

// Reasons of an IdempotentProxy's conditions (Ready, SecretNotFound,
// SecretKeyMissing, SecretNotLabelled, AllSynced, Syncing,
// SyncNotObserved are shared with the policy's).
const (
	ReasonPolicyNotFound     = "PolicyNotFound"
	ReasonPolicyInvalid      = "PolicyInvalid"
	ReasonConfigMapNotFound  = "ConfigMapNotFound"
	ReasonObjectConflict     = "ObjectConflict"
	ReasonApplied            = "Applied"
	ReasonReachable          = "Reachable"
	ReasonUnreachable        = "UpstreamUnreachable"
	ReasonTLSHandshakeFailed = "TLSHandshakeFailed"
	ReasonNotChecked         = "NotChecked"
	ReasonReplicasReady      = "ReplicasReady"
	ReasonReplicasNotReady   = "ReplicasNotReady"
	ReasonScaledToZero       = "ScaledToZero"
	ReasonNotConfigured      = "NotConfigured"
	ReasonUpstreamDown       = "UpstreamDown"
	ReasonNotAvailable       = "NotAvailable"
	ReasonProxiesNotSynced   = "ProxiesNotSynced"
)

// LabelProxy is on the pods and objects of an IdempotentProxy: its name.
const LabelProxy = "idemcp.io/proxy"
