#!/usr/bin/env bash
# Writes the real-node e2e cluster's CA, the components' certificates and
# their kubeconfigs under /run/idemcp-e2e (called by up.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
# Keys and kubeconfigs are root's alone.
umask 077
cd "$RN_STATE/pki"
openssl genrsa -out ca.key 2048 2>/dev/null
openssl req -x509 -new -nodes -key ca.key -subj "/CN=idemcp-e2e-ca" -days 2 -out ca.crt 2>/dev/null
mk() { # name CN O [subjectAltName]
	local n="$1" cn="$2" o="$3" san="${4:-}" subj="/CN=$2"
	[[ -n "$o" ]] && subj="/O=$o/CN=$cn"
	openssl genrsa -out "$n.key" 2048 2>/dev/null
	openssl req -new -key "$n.key" -subj "$subj" -out "$n.csr" 2>/dev/null
	{
		echo "basicConstraints=CA:FALSE"
		echo "keyUsage=critical,digitalSignature,keyEncipherment"
		if [[ -n "$san" ]]; then
			echo "extendedKeyUsage=serverAuth,clientAuth"
			echo "subjectAltName=$san"
		else
			echo "extendedKeyUsage=clientAuth"
		fi
	} >"$n.ext"
	openssl x509 -req -in "$n.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$n.ext" -out "$n.crt" 2>/dev/null
}
mk apiserver kube-apiserver "" "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$RN_NODE_IP,IP:$RN_API_SVC_IP"
mk admin kubernetes-admin system:masters
mk apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
mk kubelet "system:node:$RN_NODE" system:nodes
mk controller-manager system:kube-controller-manager ""
mk scheduler system:kube-scheduler ""
mk kube-proxy system:kube-proxy ""
openssl genrsa -out sa.key 2048 2>/dev/null
openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
b64() { base64 -w0 <"$1"; }
for u in admin kubelet controller-manager scheduler kube-proxy; do
	cat >"$RN_STATE/$u.kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: idemcp-e2e
  cluster: {server: "https://$RN_NODE_IP:6443", certificate-authority-data: $(b64 ca.crt)}
users:
- name: $u
  user: {client-certificate-data: $(b64 "$u.crt"), client-key-data: $(b64 "$u.key")}
contexts:
- name: idemcp-e2e
  context: {cluster: idemcp-e2e, user: $u}
current-context: idemcp-e2e
YAML
done
