#!/usr/bin/env bash
# Tests the leftover check of make test-e2e (rn_host_state in env.sh): a run
# that leaves one process in a network namespace it made, after that
# namespace's file is gone, and one host directory, must fail it, and each
# leftover must be named. A check that cannot fail is not a check. Run by
# hack/realnode/test.sh before the cluster starts; takes about a second and
# leaves nothing behind (it checks that too).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
[[ $(id -u) == 0 ]] || { rn_log "check self-test: needs root (network namespaces)"; exit 1; }
rn_lock

fail() {
	rn_log "check self-test: $*"
	exit 1
}
pristine="$(rn_host_state)"
dir="$(mktemp -d /run/idemcp-e2e-selftest.XXXXXX)"
leak_dir=/opt/idemcp-e2e-selftest
pid=""
cleanup() {
	if [[ -n "$pid" ]]; then
		kill -9 "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	if grep -qF " $dir/netns " /proc/self/mounts; then umount "$dir/netns" || true; fi
	rm -rf "$dir" || true
	if [[ -d "$leak_dir" ]]; then rmdir "$leak_dir" || true; fi
}
trap cleanup EXIT
[[ ! -e "$leak_dir" ]] || fail "$leak_dir exists already; remove it"
before="$(rn_host_state)"

# The leaks: a process in a namespace whose file was unmounted, as a
# teardown that missed a PID would leave it, and a directory under /opt.
touch "$dir/netns"
unshare --net="$dir/netns" true
setsid nsenter --net="$dir/netns" -- sleep 600 </dev/null >/dev/null 2>&1 &
pid=$!
host_ns="$(rn_netns_of $$)"
for ((i = 0; i < 100; i++)); do
	ns="$(rn_netns_of "$pid")" || fail "the leaked process $pid exited"
	[[ "$ns" == "$host_ns" || "$(rn_exe "$pid")" != */sleep ]] || break
	sleep 0.05
done
[[ "$ns" != "$host_ns" ]] || fail "the leaked process never entered its namespace"
umount "$dir/netns"
mkdir "$leak_dir"

if left="$(diff <(echo "$before") <(RN_CHECK_NETNS="$ns" rn_host_state))"; then
	fail "the check found nothing, with a process in net:[$ns] and $leak_dir left behind"
fi
grep -q "^> .*in network namespace net:\[$ns\]: " <<<"$left" ||
	fail "the check did not name the process left in net:[$ns]; it said: $left"
grep -qxF "> ${leak_dir#/opt/}" <<<"$left" ||
	fail "the check did not name $leak_dir; it said: $left"

cleanup
pid=""
trap - EXIT
if left="$(diff <(echo "$pristine") <(rn_host_state))"; then
	rn_log "check self-test: the leftover check names a process left in a network namespace and a host directory"
else
	fail "the self-test itself left behind (< before, > after): $left"
fi
