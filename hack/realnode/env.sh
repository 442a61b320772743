# Sourced by the hack/realnode scripts: the names and addresses of the
# real-node e2e cluster. Everything the run makes outside the build cache is
# under $RN_STATE, in the network namespace $RN_NETNS_FILE, or recorded there.
# shellcheck shell=bash
RN_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RN_STATE="${IDEMCP_E2E_STATE:-/run/idemcp-e2e}"
# The cluster's network namespace is a file under the state directory
# (unshare --net=FILE), not a name under /run/netns: `ip netns add` makes
# /run/netns and bind-mounts it onto itself the first time on a machine, and
# both would outlive the run.
RN_NETNS_FILE="$RN_STATE/netns"
# util-linux's mount and umount (run by these scripts, and by kubelet for
# volumes) keep their utab in /run/mount, made on first use: keep it under
# the state directory instead.
export LIBMOUNT_UTAB="$RN_STATE/libmount/utab"
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
# kubelet's cgroup root: every pod's cgroup is under it, in every hierarchy,
# so teardown touches only what this cluster made.
RN_CGROUP_ROOT=idemcp-e2e
# Host directories kubelet, containerd, runc, CNI and util-linux make at fixed
# places (kubelet's device-plugins directory ignores --root-dir; a mount run
# without LIBMOUNT_UTAB, by a library that ignores it, makes /run/mount; the
# opt plugin of a containerd whose config lost its path makes
# /opt/containerd): teardown removes those that were not there before.
RN_HOST_DIRS="/var/lib/kubelet /var/lib/cni /run/containerd /var/log/containers /var/log/pods /etc/cni /run/mount /opt/containerd"
RN_CACHE="${IDEMCP_REALNODE_CACHE:-${HOME:?}/.local/share/idemcp/realnode}"

rn_log() { printf 'realnode %s: %s\n' "$(date -u +%T)" "$*" >&2; }
# rn_in runs a command in the cluster's network namespace, in the host's
# mount namespace (kubelet's volume mounts must be visible to containerd).
rn_in() { nsenter --net="$RN_NETNS_FILE" -- "$@"; }
rn_kubectl() { rn_in "$RN_BIN/kubectl" --kubeconfig "$RN_KUBECONFIG" "$@"; }
rn_ctr() { rn_in timeout 120 "$RN_BIN/ctr" --address "$RN_STATE/containerd/containerd.sock" -n k8s.io "$@"; }
# rn_lock makes this run the only one that starts, tests or stops the
# cluster on this machine (the lock is on the cache directory, so it leaves
# no file behind); the scripts it calls inherit it.
rn_lock() {
	[[ -n "${RN_LOCKED:-}" ]] && return 0
	mkdir -p "$RN_CACHE"
	exec 8<"$RN_CACHE"
	flock -n 8 || { rn_log "another real-node run (make test-e2e, e2e-up or e2e-down) is in progress"; exit 1; }
	export RN_LOCKED=1
}
# rn_cgroups lists the cluster's cgroup root in every mounted hierarchy.
rn_cgroups() {
	local d
	for d in /sys/fs/cgroup/*/"$RN_CGROUP_ROOT" /sys/fs/cgroup/"$RN_CGROUP_ROOT"; do
		[[ -d "$d" ]] && echo "$d"
	done
	return 0
}
# The sysctls kubelet, kube-proxy and the CNI plugins may change in the
# host's namespace (the per-namespace net.* ones change only in ours).
rn_sysctl_keys() {
	sysctl -a 2>/dev/null | awk -F' = ' '$1 ~ /^(vm\.overcommit_memory|vm\.panic_on_oom|kernel\.panic|kernel\.keys\.|net\.netfilter\.|net\.nf_conntrack_max|net\.bridge\.|net\.ipv4\.ip_forward$|net\.ipv4\.conf\.(all|default)\.)/ && $1 != "net.netfilter.nf_conntrack_count" {print $1}'
}
# rn_exe PID prints the executable PID runs, without the " (deleted)" the
# kernel appends to a binary replaced while it runs.
rn_exe() {
	local exe
	exe="$(readlink "/proc/$1/exe" 2>/dev/null)" || return 1
	echo "${exe% (deleted)}"
}
# rn_netns_of PID prints the inode of PID's network namespace.
rn_netns_of() {
	local ns
	ns="$(readlink "/proc/$1/ns/net" 2>/dev/null)" || return 1
	ns="${ns#net:[}"
	echo "${ns%]}"
}
# rn_cluster_netns prints the inodes of the cluster's network namespaces:
# every nsfs mount under the state directory (the cluster's own and the
# pods'), and an older up.sh's /run/netns/idemcp-e2e. A mount pins its
# inode, so a list read now names no namespace the kernel gave to another.
rn_cluster_netns() {
	local m
	awk -v s="$RN_STATE/" '$3 == "nsfs" && index($2, s) == 1 { print $2 }' /proc/self/mounts | while read -r m; do
		stat -L -c %i "$m" 2>/dev/null
	done
	[[ -e /run/netns/idemcp-e2e ]] && stat -L -c %i /run/netns/idemcp-e2e 2>/dev/null
	return 0
}
# rn_in_cluster_netns refuses to go on in a shell inside the cluster's
# network namespace (nsenter --net=/run/idemcp-e2e/netns bash): there the
# cluster's processes look like the host's.
rn_in_cluster_netns() {
	local ns
	ns="$(rn_netns_of $$)"
	if [[ -n "$ns" ]] && grep -qxF -- "$ns" <<<"$(rn_cluster_netns)"; then
		rn_log "this shell is inside the cluster's network namespace: run it from the host's"
		exit 1
	fi
}
# rn_host_state prints what a run must leave as it found it: every process
# running a binary of the realnode cache or the state directory; every
# process in one of the network namespaces RN_CHECK_NETNS names (the
# cluster's and its pods', read by test.sh before the teardown: a process
# in one outlives the namespace's file, and the cluster's kube-apiserver
# and etcd run the envtest cache's binaries, which envtest tests run too,
# in the host's namespace); mounts; network namespaces under /run/netns; the host's
# nftables tables; the sysctls above; the cgroup root; and the entries of
# the host directories kubelet, containerd, runc, CNI and util-linux write
# to. make test-e2e compares it before and after; "before" may be a machine
# that never ran the project. Processes in other namespaces (a browser's
# sandbox, another container runtime) come and go on a developer's machine
# and are not the run's. Process lines name executables and
# namespaces, not PIDs, so that the comparison sees what changed and not
# which PIDs the kernel handed out.
rn_host_state() {
	local p pid exe k d ns
	echo "# processes of the cluster: its binaries, or in its network namespaces"
	for p in /proc/[0-9]*; do
		pid="${p#/proc/}"
		exe="$(rn_exe "$pid")" || exe="(unreadable)"
		ns="$(rn_netns_of "$pid")" || ns=""
		case "$exe" in
		"$RN_STATE"/* | "$RN_CACHE"/*) echo "cluster binary $exe (net:[$ns])" ;;
		*) [[ -n "$ns" && -n "${RN_CHECK_NETNS:-}" ]] && grep -qxF -- "$ns" <<<"$RN_CHECK_NETNS" && echo "in network namespace net:[$ns]: $exe" ;;
		esac
	done | sort | uniq -c
	echo "# mounts"
	awk '{ print $2, $3 }' /proc/self/mounts | sort
	echo "# network namespaces"
	ls /run/netns 2>/dev/null || true
	echo "# host nftables tables"
	nft list tables 2>/dev/null || true
	echo "# sysctls"
	for k in $(rn_sysctl_keys); do printf '%s=%s\n' "$k" "$(sysctl -n "$k" 2>/dev/null)"; done
	echo "# cgroup root"
	rn_cgroups
	for d in /etc /run /var/lib /var/log /var/run /opt /usr/local/bin; do
		echo "# $d"
		ls -A "$d" 2>/dev/null || true
	done
}
