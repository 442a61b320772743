#!/usr/bin/env bash
# Starts the real-node e2e cluster: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd, kubelet, kube-proxy and a
# small cluster DNS, all inside a network namespace that this creates
# (/run/idemcp-e2e/netns), with the node address on that namespace's loopback, the pod bridge
# idemcp0 and every cluster address inside it, and an nftables rule there
# dropping anything forwarded out of it. Nothing is added to the host's own
# interfaces. Then imports the images (hack/realnode/images.sh) and waits for
# the node to be Ready. hack/realnode/down.sh undoes all of it.
#
# The admin kubeconfig is /run/idemcp-e2e/admin.kubeconfig; the API server is
# reachable only inside the namespace:
#   nsenter --net=/run/idemcp-e2e/netns kubectl --kubeconfig /run/idemcp-e2e/admin.kubeconfig get pods -A
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
t0=$(date +%s)
phase() { rn_log "$1 ($(($(date +%s) - t0))s)"; }

[[ $(id -u) == 0 ]] || { rn_log "needs root (network namespaces, mounts, cgroups)"; exit 1; }
rn_lock
RN_BIN="$("$here/build.sh")"
phase "binaries ready in $RN_BIN"
if [[ -e "$RN_STATE" || -e /run/netns/idemcp-e2e || -n "$(rn_cgroups)" ]]; then
	rn_log "a cluster (or its leftovers) exists: run hack/realnode/down.sh (make e2e-down) first"
	exit 1
fi
# Root's own, made here and now: down.sh acts as root on what it holds.
mkdir -m 0700 "$RN_STATE"
mkdir -p "$RN_STATE"/{logs,pids,pki,cni/net.d,cni/ipam,containerd,kubelet,pv/redis,pod-logs,libmount}
echo "$RN_BIN" >"$RN_STATE/bin"
# What to restore or remove on teardown.
for k in $(rn_sysctl_keys); do printf '%s=%s\n' "$k" "$(sysctl -n "$k" 2>/dev/null)"; done >"$RN_STATE/sysctls.saved"
for p in $RN_HOST_DIRS; do [[ -e $p ]] && echo "$p"; done >"$RN_STATE/preexisting" || true
# Which ones were looked at: a later down.sh may know more of them.
printf '%s\n' $RN_HOST_DIRS >"$RN_STATE/host-dirs-checked"
# kubelet's cgroup root, in every hierarchy; a new cpuset needs CPUs and
# memory nodes before anything can join it.
awk '($3 == "cgroup" || $3 == "cgroup2") && $2 ~ /^\/sys\/fs\/cgroup(\/|$)/ { print $2 }' /proc/self/mounts | sort -u | while read -r m; do
	mkdir "$m/$RN_CGROUP_ROOT"
	if [[ -f "$m/cpuset.cpus" && -f "$m/$RN_CGROUP_ROOT/cpuset.cpus" ]]; then
		cat "$m/cpuset.cpus" >"$m/$RN_CGROUP_ROOT/cpuset.cpus"
		cat "$m/cpuset.mems" >"$m/$RN_CGROUP_ROOT/cpuset.mems"
	fi
done

# The network namespace. There is no dummy driver here, so the node address
# goes on the namespace's own loopback.
touch "$RN_NETNS_FILE"
unshare --net="$RN_NETNS_FILE" true
rn_in ip link set lo up
rn_in ip addr add "$RN_NODE_IP/32" dev lo
# Service addresses need a route for the first lookup; kube-proxy's DNAT
# then sends them on to a pod (or to the node address).
rn_in ip route add "$RN_SVC_CIDR" dev lo
rn_in sysctl -qw net.ipv4.ip_forward=1
rn_in nft -f - <<NFT
table inet idemcp_e2e_guard {
	chain forward {
		type filter hook forward priority -300; policy accept;
		oifname != "$RN_BRIDGE" counter drop
	}
}
NFT
phase "network namespace $RN_NETNS_FILE"

"$here/pki.sh"
phase "certificates"

start() { # name command...: start a component in the namespace, logging to logs/NAME.log
	local name="$1"
	shift
	setsid nsenter --net="$RN_NETNS_FILE" -- "$@" </dev/null >"$RN_STATE/logs/$name.log" 2>&1 8<&- &
	echo $! >"$RN_STATE/pids/$name.pid"
}
wait_for() { # what tries command...
	local what="$1" tries="$2"
	shift 2
	for ((i = 0; i < tries; i++)); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		sleep 0.5
	done
	rn_log "$what did not come up; its log:"
	tail -n 30 "$RN_STATE/logs/$what.log" >&2 || true
	return 1
}
P="$RN_STATE/pki"

start etcd "$RN_BIN/etcd" --data-dir="$RN_STATE/etcd" --listen-client-urls=http://127.0.0.1:2379 \
	--advertise-client-urls=http://127.0.0.1:2379 --listen-peer-urls=http://127.0.0.1:2380 \
	--initial-advertise-peer-urls=http://127.0.0.1:2380 --initial-cluster=default=http://127.0.0.1:2380 \
	--listen-metrics-urls=http://127.0.0.1:2381 --unsafe-no-fsync
start kube-apiserver "$RN_BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
	--bind-address="$RN_NODE_IP" --advertise-address="$RN_NODE_IP" --secure-port=6443 \
	--tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
	--service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
	--service-account-issuer=https://kubernetes.default.svc.cluster.local \
	--service-cluster-ip-range="$RN_SVC_CIDR" --authorization-mode=Node,RBAC --allow-privileged=true \
	--kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key" \
	--enable-admission-plugins=NodeRestriction --kubelet-preferred-address-types=InternalIP --profiling=false
wait_for kube-apiserver 240 rn_kubectl get --raw=/readyz
phase "etcd and kube-apiserver"
start kube-controller-manager "$RN_BIN/kube-controller-manager" --kubeconfig="$RN_STATE/controller-manager.kubeconfig" \
	--authentication-kubeconfig="$RN_STATE/controller-manager.kubeconfig" \
	--authorization-kubeconfig="$RN_STATE/controller-manager.kubeconfig" --bind-address=127.0.0.1 \
	--use-service-account-credentials=true --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
	--cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" --allocate-node-cidrs=false \
	--service-cluster-ip-range="$RN_SVC_CIDR" --leader-elect=false --profiling=false
start kube-scheduler "$RN_BIN/kube-scheduler" --kubeconfig="$RN_STATE/scheduler.kubeconfig" \
	--authentication-kubeconfig="$RN_STATE/scheduler.kubeconfig" --authorization-kubeconfig="$RN_STATE/scheduler.kubeconfig" \
	--bind-address=127.0.0.1 --leader-elect=false --profiling=false
(cd "$RN_REPO" && CGO_ENABLED=0 go build -o "$RN_STATE/dns" ./hack/realnode/dns)
start dns "$RN_STATE/dns" --kubeconfig "$RN_KUBECONFIG" --listen "$RN_NODE_IP:53"

# containerd, with every directory of its own under the state directory.
cat >"$RN_STATE/containerd/config.toml" <<TOML
version = 4
root = '$RN_STATE/containerd/root'
state = '$RN_STATE/containerd/state'
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '$RN_PAUSE_IMAGE'
  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    # The pods' network namespaces are mounted under the state directory,
    # not in the host's /run/netns.
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        disable_pause_image_pull = true
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '$(command -v runc)'
          Root = '$RN_STATE/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['/usr/lib/cni']
      conf_dir = '$RN_STATE/cni/net.d'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  # Managed binaries (ctr install); its default, /opt/containerd, is made
  # at start.
  [plugins.'io.containerd.internal.v1.opt']
    path = '$RN_STATE/containerd/opt'
  [plugins.'io.containerd.server.v1.grpc']
    address = '$RN_STATE/containerd/containerd.sock'
  [plugins.'io.containerd.server.v1.ttrpc']
    address = '$RN_STATE/containerd/containerd.sock.ttrpc'
  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = '$RN_STATE/containerd/s'
  [plugins.'io.containerd.metadata.v1.bolt']
    content_sharing_policy = 'isolated'
TOML
cat >"$RN_STATE/cni/net.d/10-idemcp-e2e.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "idemcp-e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$RN_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$RN_POD_CIDR", "gateway": "$RN_POD_GW"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$RN_STATE/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
JSON
PATH="$RN_BIN:$PATH" start containerd "$RN_BIN/containerd" --config "$RN_STATE/containerd/config.toml"
wait_for containerd 120 rn_ctr version

"$here/images.sh"
phase "containerd and images"

printf 'options ndots:5\n' >"$RN_STATE/resolv.conf"
cat >"$RN_STATE/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $RN_NODE_IP
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $P/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: /$RN_CGROUP_ROOT
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$RN_STATE/containerd/containerd.sock
resolvConf: $RN_STATE/resolv.conf
podLogsDir: $RN_STATE/pod-logs
clusterDomain: cluster.local
clusterDNS: [$RN_NODE_IP]
rotateCertificates: false
serializeImagePulls: false
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
protectKernelDefaults: false
YAML
start kubelet "$RN_BIN/kubelet" --config="$RN_STATE/kubelet/config.yaml" --kubeconfig="$RN_STATE/kubelet.kubeconfig" \
	--root-dir="$RN_STATE/kubelet/root" --cert-dir="$RN_STATE/kubelet/pki" --hostname-override="$RN_NODE" \
	--node-ip="$RN_NODE_IP"
cat >"$RN_STATE/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $RN_STATE/kube-proxy.kubeconfig
mode: iptables
# No br_netfilter here: masquerade every Service connection so that a pod
# reaching a Service backed by a pod on the same bridge gets its reply
# through the namespace's stack.
iptables: {masqueradeAll: true}
clusterCIDR: $RN_POD_CIDR
hostnameOverride: $RN_NODE
bindAddress: $RN_NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["$RN_NODE_IP/32"]
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
YAML
start kube-proxy "$RN_BIN/kube-proxy" --config="$RN_STATE/kube-proxy.yaml"
wait_for kubelet 240 rn_kubectl get node "$RN_NODE"
rn_kubectl wait --for=condition=Ready "node/$RN_NODE" --timeout=180s >/dev/null
wait_for kube-controller-manager 120 rn_kubectl -n default get serviceaccount default
phase "node Ready"

# A volume for the managed Redis's claim (there is no provisioner): the
# claim has no storage class and binds to this.
chmod 0777 "$RN_STATE/pv/redis"
rn_kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata:
  name: idemcp-e2e-redis
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: $RN_STATE/pv/redis, type: Directory}
YAML
phase "cluster up"
