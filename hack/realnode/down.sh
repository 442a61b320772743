#!/usr/bin/env bash
# Stops the real-node e2e cluster and removes everything up.sh made outside
# the build cache: its processes (by the PIDs it recorded, then every process
# running one of the cluster's binaries, in the cluster's or a pod's network
# namespace, or in kubelet's cgroup root idemcp-e2e, whatever PID it has),
# mounts under /run/idemcp-e2e (the cluster's and the pods' network
# namespaces are there too), the cgroup root, the host sysctls kubelet
# changed, the host directories kubelet, CNI and util-linux made, and
# /run/idemcp-e2e. Safe to run again, or when up.sh stopped half way.
set -uo pipefail
rc=0
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
t0=$(date +%s)
rn_lock
# /run/netns/idemcp-e2e: the namespace of a cluster started by an older
# up.sh (ip netns add).
[[ -d "$RN_STATE" || -e /run/netns/idemcp-e2e || -n "$(rn_cgroups)" ]] || { rn_log "nothing to tear down"; exit 0; }
# Act only on a state directory root made (up.sh makes it 0700): what it
# records is run as root here.
if [[ -e "$RN_STATE" ]] && { [[ -L "$RN_STATE" ]] || [[ "$(stat -c %u "$RN_STATE")" != 0 ]]; }; then
	rn_log "$RN_STATE is a symlink or not owned by root; not trusting it: remove it by hand"
	exit 1
fi
rn_in_cluster_netns
RN_BIN="$(cat "$RN_STATE/bin" 2>/dev/null || true)"
host_ns="$(rn_netns_of $$)"

# ours PID: PID is one of the cluster's processes: it runs a binary of the
# realnode cache or the state directory, or it is in the cluster's or a
# pod's network namespace (kube-apiserver and etcd run the envtest cache's
# binaries, which envtest tests also run, in the host's namespace).
# The namespaces are read afresh for each look (netns=...): a namespace
# freed meanwhile may be handed to another process at once.
ours() {
	local exe ns
	if exe="$(rn_exe "$1")"; then
		case "$exe" in "$RN_STATE"/* | "$RN_CACHE"/bin-*/*) return 0 ;; esac
	fi
	ns="$(rn_netns_of "$1")" || return 1
	[[ "$ns" != "$host_ns" && -n "${netns:-}" ]] && grep -qxF -- "$ns" <<<"$netns"
}
# cluster_pids: every process the cluster started, found by executable, by
# network namespace and by cgroup, whatever PID up.sh recorded.
cluster_pids() {
	local p pid c netns
	netns="$(rn_cluster_netns)"
	for p in /proc/[0-9]*; do
		pid="${p#/proc/}"
		ours "$pid" && echo "$pid"
	done
	for c in $(rn_cgroups); do find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null; done
	return 0
}
# sweep: SIGTERM every process of the cluster, SIGKILL what is left after a
# short grace (an apiserver whose etcd is gone ignores SIGTERM), and wait
# until none runs.
sweep() {
	local pids i
	pids="$(cluster_pids | sort -u)"
	[[ -n "$pids" ]] || return 0
	# shellcheck disable=SC2086
	kill $pids 2>/dev/null
	for ((i = 0; i < 10; i++)); do
		sleep 0.3
		pids="$(cluster_pids | sort -u)"
		[[ -n "$pids" ]] || return 0
	done
	for ((i = 0; i < 20; i++)); do
		pids="$(cluster_pids | sort -u)"
		[[ -n "$pids" ]] || return 0
		# shellcheck disable=SC2086
		kill -9 $pids 2>/dev/null
		sleep 0.25
	done
	pids="$(cluster_pids | sort -u)"
	[[ -n "$pids" ]] || return 0
	rn_log "processes of the cluster still running after SIGKILL: $(tr '\n' ' ' <<<"$pids")"
	return 1
}
stop() { # name: SIGTERM, then SIGKILL after 15 s
	local f="$RN_STATE/pids/$1.pid" p
	[[ -f "$f" ]] || return 0
	p="$(cat "$f")"
	# Only if the PID still runs a binary of this cluster (not a reused PID).
	if netns="$(rn_cluster_netns)" ours "$p" && kill -0 "$p" 2>/dev/null; then
		kill "$p" 2>/dev/null
		for ((i = 0; i < 30; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
		kill -9 "$p" 2>/dev/null
	fi
	rm -f "$f"
}

# kubelet first, so that nothing restarts the containers removed below.
for n in kubelet kube-proxy kube-scheduler kube-controller-manager dns; do stop "$n"; done
# The containers and their shims: a shim whose task is gone exits.
if [[ -n "$RN_BIN" && -S "$RN_STATE/containerd/containerd.sock" ]]; then
	for c in $(rn_ctr tasks ls -q 2>/dev/null); do rn_ctr tasks kill -s KILL "$c" >/dev/null 2>&1; done
	sleep 1
	for c in $(rn_ctr containers ls -q 2>/dev/null); do
		rn_ctr tasks delete -f "$c" >/dev/null 2>&1
		rn_ctr containers rm "$c" >/dev/null 2>&1
	done
fi
stop containerd
stop kube-apiserver
stop etcd
# Whatever is left: a shim whose containerd died first, a container process,
# a component whose PID file was lost, anything started in the namespace.
sweep || rc=1

# Mounts: kubelet's volumes, containerd's rootfs and shm, the pods' network
# namespaces (deepest first).
for ((i = 0; i < 3; i++)); do
	mapfile -t mnts < <(awk -v s="$RN_STATE/" 'index($2, s) == 1 { print $2 }' /proc/self/mounts | sort -r)
	((${#mnts[@]})) || break
	for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
done
[[ -e /run/netns/idemcp-e2e ]] && ip netns del idemcp-e2e 2>/dev/null
# kubelet's cgroup root, in every hierarchy (deepest first).
for c in $(rn_cgroups); do
	find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
	[[ -d "$c" ]] && rn_log "cgroup $c remains"
done
# Host sysctls kubelet changed.
if [[ -f "$RN_STATE/sysctls.saved" ]]; then
	while IFS='=' read -r k v; do
		[[ "$(sysctl -n "$k" 2>/dev/null)" == "$v" ]] || sysctl -qw "$k=$v" 2>/dev/null || rn_log "could not restore $k=$v"
	done <"$RN_STATE/sysctls.saved"
fi
# Directories runc, CNI and kubelet make at fixed places, unless they were
# there before.
# Without the record of what was there before, remove none of them.
# Only those up.sh looked at: one started by an older up.sh did not record
# the directories added to RN_HOST_DIRS since (they may be the host's own).
if [[ -f "$RN_STATE/preexisting" ]]; then
	checked="/var/lib/kubelet /var/lib/cni /run/containerd /var/log/containers /var/log/pods /etc/cni"
	[[ -f "$RN_STATE/host-dirs-checked" ]] && checked="$(cat "$RN_STATE/host-dirs-checked")"
	for p in $checked; do
		grep -qxF "$p" "$RN_STATE/preexisting" || rm -rf "$p"
	done
fi
if awk -v s="$RN_STATE/" 'index($2, s) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
	rn_log "mounts remain under $RN_STATE; leaving it"
	exit 1
fi
rm -rf "$RN_STATE"
rn_log "down ($(($(date +%s) - t0))s)"
exit "$rc"
