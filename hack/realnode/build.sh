#!/usr/bin/env bash
# Builds (once, cached outside the checkout) the binaries of the real-node e2e
# cluster: kubelet, kube-proxy, kube-controller-manager and kube-scheduler from
# k8s.io/kubernetes, and containerd, ctr and containerd-shim-runc-v2 from
# github.com/containerd/containerd/v2. kube-apiserver, etcd and kubectl come
# from hack/setup-envtest.sh (the same cache the envtest tests use). Debian
# packages supply runc, the CNI plugins, iptables, nftables and conntrack.
#
# The only line on stdout is the directory holding every binary (the envtest
# ones are symlinked in); progress goes to stderr.
#
# Environment:
#   IDEMCP_REALNODE_CACHE       cache root (default $HOME/.local/share/idemcp/realnode)
#   IDEMCP_ENVTEST_K8S_VERSION  Kubernetes version (default 1.37.2)
#   IDEMCP_CONTAINERD_VERSION   containerd version (default 2.4.2)
#   IDEMCP_REALNODE_NO_APT=1    do not apt-get install missing Debian packages
#
# A cold build takes 20-30 minutes on 2 quiet cores; a warm one exits at once.
set -euo pipefail
exec 3>&1 1>&2

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
k8s_version="${IDEMCP_ENVTEST_K8S_VERSION:-1.37.2}"
k8s_version="${k8s_version#v}"
ctrd_version="${IDEMCP_CONTAINERD_VERSION:-2.4.2}"
ctrd_version="${ctrd_version#v}"
cache="${IDEMCP_REALNODE_CACHE:-${HOME:?}/.local/share/idemcp/realnode}"
dir="$cache/bin-k8s${k8s_version}-containerd${ctrd_version}"
log() { echo "realnode build: $*"; }
now() { date +%s; }
t0=$(now)

# Debian packages.
need_pkgs=()
command -v runc >/dev/null || need_pkgs+=(runc)
[[ -x /usr/lib/cni/bridge ]] || need_pkgs+=(containernetworking-plugins)
command -v iptables >/dev/null || need_pkgs+=(iptables)
command -v nft >/dev/null || need_pkgs+=(nftables)
command -v conntrack >/dev/null || need_pkgs+=(conntrack)
command -v redis-server >/dev/null || need_pkgs+=(redis-server)
if ((${#need_pkgs[@]})); then
	if [[ "${IDEMCP_REALNODE_NO_APT:-0}" == 1 ]]; then
		log "missing Debian packages: ${need_pkgs[*]}"
		exit 1
	fi
	log "installing Debian packages: ${need_pkgs[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y --no-install-recommends "${need_pkgs[@]}" ||
		{ apt-get update && apt-get install -y --no-install-recommends "${need_pkgs[@]}"; }
fi

kube_bins=(kubelet kube-proxy kube-controller-manager kube-scheduler)
ctrd_bins=(containerd ctr containerd-shim-runc-v2)
kube_ok() { [[ -x "$1" ]] && "$1" --version 2>/dev/null | grep -qxF "Kubernetes v${k8s_version}"; }
ctrd_ok() { [[ -x "$1" ]] && "$1" --version 2>/dev/null | grep -qF "v${ctrd_version}"; }

mkdir -p "$dir"
exec 9>"$cache/.build.lock"
flock 9
rm -rf "$dir"/.build.*

need_kube=()
for b in "${kube_bins[@]}"; do kube_ok "$dir/$b" || need_kube+=("$b"); done
need_ctrd=()
for b in containerd ctr; do ctrd_ok "$dir/$b" || need_ctrd+=("$b"); done
[[ -x "$dir/containerd-shim-runc-v2" ]] || need_ctrd+=(containerd-shim-runc-v2)

export GOWORK=off GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
unset GOOS GOARCH
gover="$(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+(\.[0-9]+)?).*/\1/')"
work="$(mktemp -d "${TMPDIR:-/tmp}/idemcp-realnode-build.XXXXXX")"
out="$(mktemp -d "$dir/.build.XXXXXX")"
trap 'rm -rf "$work" "$out"' EXIT

if ((${#need_kube[@]})); then
	start=$(now)
	[[ "$k8s_version" =~ ^1\.([0-9]+)\.([0-9]+)$ ]]
	k8s_minor="${BASH_REMATCH[1]}"
	staging_version="v0.${k8s_minor}.${BASH_REMATCH[2]}"
	gomod_file="$(go mod download -json "k8s.io/kubernetes@v${k8s_version}" |
		sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
	mapfile -t staging < <(awk '
		/^require[[:space:]]*\(/ { inreq = 1; next }
		inreq && /^\)/ { inreq = 0; next }
		inreq && $1 ~ /^k8s\.io\// && $2 == "v0.0.0" { print $1 }
		/^require[[:space:]]+k8s\.io\// && $3 == "v0.0.0" { print $2 }
	' "$gomod_file" | sort -u)
	kmod="$work/kube"
	mkdir -p "$kmod"
	{
		echo "module idemcp.local/realnode-kube"
		echo
		echo "go $gover"
		echo
		echo "require k8s.io/kubernetes v${k8s_version}"
		echo
		echo "replace ("
		for m in "${staging[@]}"; do echo "	$m => $m $staging_version"; done
		echo ")"
		echo
		for b in "${need_kube[@]}"; do echo "tool k8s.io/kubernetes/cmd/$b"; done
	} >"$kmod/go.mod"
	(cd "$kmod" && go mod tidy)
	build_date="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${gomod_file%.mod}.info" 2>/dev/null || true)"
	[[ -n "$build_date" ]] || build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldflags+=" -X $pkg.gitVersion=v${k8s_version} -X $pkg.gitMajor=1 -X $pkg.gitMinor=${k8s_minor}"
		ldflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=${build_date}"
	done
	log "building ${need_kube[*]} v${k8s_version}"
	pkgs=()
	for b in "${need_kube[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
	(cd "$kmod" && go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
	for b in "${need_kube[@]}"; do
		kube_ok "$out/$b" || { log "$b does not report v${k8s_version}"; exit 1; }
		mv -f "$out/$b" "$dir/$b"
	done
	log "built ${need_kube[*]} in $(($(now) - start))s"
fi

if ((${#need_ctrd[@]})); then
	start=$(now)
	cmod="$work/containerd"
	mkdir -p "$cmod"
	{
		echo "module idemcp.local/realnode-containerd"
		echo
		echo "go $gover"
		echo
		echo "require github.com/containerd/containerd/v2 v${ctrd_version}"
		echo
		for b in "${need_ctrd[@]}"; do echo "tool github.com/containerd/containerd/v2/cmd/$b"; done
	} >"$cmod/go.mod"
	(cd "$cmod" && go mod tidy)
	ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=v${ctrd_version}"
	ldflags+=" -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
	log "building ${need_ctrd[*]} v${ctrd_version}"
	pkgs=()
	for b in "${need_ctrd[@]}"; do pkgs+=("github.com/containerd/containerd/v2/cmd/$b"); done
	(cd "$cmod" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
	for b in "${need_ctrd[@]}"; do mv -f "$out/$b" "$dir/$b"; done
	ctrd_ok "$dir/containerd" || { log "containerd does not report v${ctrd_version}"; "$dir/containerd" --version; exit 1; }
	log "built ${need_ctrd[*]} in $(($(now) - start))s"
fi

# kube-apiserver, etcd, kubectl (last: it may wait for another build).
envtest_dir="$("$repo/hack/setup-envtest.sh")"
for b in kube-apiserver etcd kubectl; do ln -sfn "$envtest_dir/$b" "$dir/$b"; done
log "binaries ready in $dir ($(($(now) - t0))s)"
echo "$dir" >&3
