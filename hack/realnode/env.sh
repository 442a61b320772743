# Sourced by the hack/realnode scripts: the names and addresses of the
# real-node e2e cluster. Everything the run makes outside the build cache is
# under $RN_STATE, in the network namespace $RN_NETNS, or recorded there.
# shellcheck shell=bash
RN_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RN_STATE="${IDEMCP_E2E_STATE:-/run/idemcp-e2e}"
RN_NETNS=idemcp-e2e
RN_NODE=idemcp-e2e-node
RN_NODE_IP=10.201.0.1
RN_POD_CIDR=10.202.0.0/24
RN_POD_GW=10.202.0.1
RN_SVC_CIDR=10.203.0.0/24
RN_API_SVC_IP=10.203.0.1
RN_BRIDGE=idemcp0
RN_KUBECONFIG="$RN_STATE/admin.kubeconfig"
RN_IMAGE_DIR="$RN_STATE/images"
RN_IDEMCP_IMAGE="${IMG:-ghcr.io/idemcp/idemcp:v0.1.0}"
RN_PAUSE_IMAGE=registry.local/pause:e2e
RN_REDIS_IMAGE=registry.local/redis:e2e
RN_MCP_IMAGE=registry.local/mcpserver:e2e

rn_log() { printf 'realnode %s: %s\n' "$(date -u +%T)" "$*" >&2; }
# rn_in runs a command in the cluster's network namespace, in the host's
# mount namespace (kubelet's volume mounts must be visible to containerd).
rn_in() { nsenter --net="/run/netns/$RN_NETNS" -- "$@"; }
rn_kubectl() { rn_in "$RN_BIN/kubectl" --kubeconfig "$RN_KUBECONFIG" "$@"; }
rn_ctr() { rn_in "$RN_BIN/ctr" --address "$RN_STATE/containerd/containerd.sock" -n k8s.io "$@"; }
# The sysctls kubelet, kube-proxy and the CNI plugins may change in the
# host's namespace (the per-namespace net.* ones change only in ours).
rn_sysctl_keys() {
	sysctl -a 2>/dev/null | awk -F' = ' '$1 ~ /^(vm\.overcommit_memory|vm\.panic_on_oom|kernel\.panic|kernel\.keys\.|net\.netfilter\.|net\.nf_conntrack_max|net\.bridge\.|net\.ipv4\.ip_forward$|net\.ipv4\.conf\.(all|default)\.)/ {print $1}'
}
