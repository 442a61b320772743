#!/usr/bin/env bash
# Installs idemcp into the real-node e2e cluster from dist/install.yaml (the
# installer users apply), with the image up.sh imported and the managed
# Redis's image set to the local one, and waits for the manager.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
RN_BIN="$(cat "$RN_STATE/bin")"
t0=$(date +%s)
sed -e "s|image: ghcr.io/idemcp/idemcp:[^[:space:]]*|image: $RN_IDEMCP_IMAGE|" \
	-e "s|^\(\( *\)- --leader-elect\)$|\1\n\2- --redis-image=$RN_REDIS_IMAGE|" \
	"$RN_REPO/dist/install.yaml" >"$RN_STATE/install.yaml"
grep -q -- "--redis-image=$RN_REDIS_IMAGE" "$RN_STATE/install.yaml" || { rn_log "could not set --redis-image in install.yaml"; exit 1; }
rn_kubectl apply --server-side -f "$RN_STATE/install.yaml" >/dev/null
rn_kubectl -n idemcp-system rollout status deployment/idemcp-manager --timeout=300s >&2
# The webhook's CA bundle is written by the manager once it has a certificate.
for ((i = 0; i < 120; i++)); do
	ca="$(rn_kubectl get mutatingwebhookconfiguration idemcp-mutating-webhook-configuration -o jsonpath='{.webhooks[0].clientConfig.caBundle}' 2>/dev/null || true)"
	[[ -n "$ca" ]] && break
	sleep 1
done
[[ -n "$ca" ]] || { rn_log "the webhook never got its CA bundle"; exit 1; }
rn_log "idemcp installed ($(($(date +%s) - t0))s)"
