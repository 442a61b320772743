#!/usr/bin/env bash
# Stops the real-node e2e cluster and removes everything up.sh made outside
# the build cache: its processes (by the PIDs it recorded, and the container
# shims and containers they started, and anything left in kubelet's cgroup
# root idemcp-e2e), mounts under /run/idemcp-e2e (the pods' network
# namespaces are there too), the cgroup root, the network namespace
# idemcp-e2e, the host sysctls kubelet changed, the host directories kubelet
# and CNI made, and /run/idemcp-e2e. Safe to run again, or when up.sh
# stopped half way.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
t0=$(date +%s)
rn_lock
[[ -d "$RN_STATE" || -e "/run/netns/$RN_NETNS" || -n "$(rn_cgroups)" ]] || { rn_log "nothing to tear down"; exit 0; }
# Act only on a state directory root made (up.sh makes it 0700): what it
# records is run as root here.
if [[ -e "$RN_STATE" ]] && { [[ -L "$RN_STATE" ]] || [[ "$(stat -c %u "$RN_STATE")" != 0 ]]; }; then
	rn_log "$RN_STATE is a symlink or not owned by root; not trusting it: remove it by hand"
	exit 1
fi
RN_BIN="$(cat "$RN_STATE/bin" 2>/dev/null || true)"

ours() { # pid: runs a binary of the build cache or the state directory
	local exe
	exe="$(readlink "/proc/$1/exe" 2>/dev/null)" || return 1
	case "$exe" in
	"$RN_STATE"/* | "${RN_BIN:-/nonexistent}"/*) return 0 ;;
	esac
	return 1
}
stop() { # name: SIGTERM, then SIGKILL after 15 s
	local f="$RN_STATE/pids/$1.pid" p
	[[ -f "$f" ]] || return 0
	p="$(cat "$f")"
	# Only if the PID still runs a binary of this cluster (not a reused PID).
	if ours "$p" && kill -0 "$p" 2>/dev/null; then
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
# Any process still running a binary of the cache or the state directory
# (a shim whose containerd died first) was started by this cluster.
for p in /proc/[0-9]*; do
	ours "${p#/proc/}" && kill -9 "${p#/proc/}" 2>/dev/null
done
# Container processes run in the cgroups kubelet made under its root.
for c in $(rn_cgroups); do
	find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null
done
sleep 0.5

# Mounts: kubelet's volumes, containerd's rootfs and shm, the pods' network
# namespaces (deepest first).
for ((i = 0; i < 3; i++)); do
	mapfile -t mnts < <(awk -v s="$RN_STATE/" 'index($2, s) == 1 { print $2 }' /proc/self/mounts | sort -r)
	((${#mnts[@]})) || break
	for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
done
ip netns del "$RN_NETNS" 2>/dev/null
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
if [[ -f "$RN_STATE/preexisting" ]]; then
	for p in $RN_HOST_DIRS; do
		grep -qxF "$p" "$RN_STATE/preexisting" || rm -rf "$p"
	done
fi
if grep -qxF /run/netns "$RN_STATE/created-dirs" 2>/dev/null; then rmdir /run/netns 2>/dev/null; fi
if grep -q " $RN_STATE" /proc/self/mounts; then
	rn_log "mounts remain under $RN_STATE; leaving it"
	exit 1
fi
rm -rf "$RN_STATE"
rn_log "down ($(($(date +%s) - t0))s)"
