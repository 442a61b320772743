#!/usr/bin/env bash
# make test-e2e: builds the cluster's binaries (cached), brings the cluster
# up, installs idemcp, runs the e2e suite (test/realnode, build tag e2e)
# inside the cluster's network namespace, and tears everything down, also on
# failure, then checks that the host is as it was (rn_host_state). That
# check is itself tested first (check-selftest.sh: a leftover it cannot see
# fails the run). Prints each phase's time. E2E_RUN=regexp runs only some
# steps.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
t0=$(date +%s)
phase() { rn_log "phase $1: $(($(date +%s) - $2))s"; }
rn_lock
rn_in_cluster_netns
"$here/check-selftest.sh"
t=$(date +%s)
"$here/build.sh" >/dev/null
phase build "$t"
rc=0
host_before="$(rn_host_state)"
teardown() {
	local st=$? t left
	((st == 0)) || rc=$st
	t=$(date +%s)
	# The cluster's and its pods' namespaces, while their mounts pin them:
	# a process left in one after the teardown is the run's.
	RN_CHECK_NETNS="$(rn_cluster_netns)"
	"$here/down.sh" || rc=1
	phase down "$t"
	# Nothing the run made may outlive it.
	if left="$(diff <(echo "$host_before") <(RN_CHECK_NETNS="$RN_CHECK_NETNS" rn_host_state))"; then
		rn_log "nothing left behind (processes of the cluster or in its network namespaces, mounts, network namespaces, nftables, sysctls, cgroups, host directories)"
	else
		rn_log "left behind on the host (< before, > after):"
		echo "$left" >&2
		rc=1
	fi
	rn_log "make test-e2e total: $(($(date +%s) - t0))s"
	exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM
t=$(date +%s)
"$here/up.sh"
phase up "$t"
t=$(date +%s)
"$here/install.sh"
phase install "$t"
t=$(date +%s)
(cd "$RN_REPO" && go test -c -tags e2e -o "$RN_STATE/realnode.test" ./test/realnode)
RN_BIN="$(cat "$RN_STATE/bin")"
rn_in env KUBECONFIG="$RN_KUBECONFIG" IDEMCP_E2E_NODE=1 IDEMCP_E2E_DISRUPTIVE=1 PATH="$RN_BIN:$PATH" \
	"$RN_STATE/realnode.test" -test.v -test.count=1 -test.timeout=20m ${E2E_RUN:+-test.run "$E2E_RUN"} || rc=$?
phase suite "$t"
