#!/usr/bin/env bash
# Builds the envtest control-plane binaries (kube-apiserver and etcd, plus
# kubectl for printer-column tests) from Go modules and caches them outside
# the checkout.
#
# The only thing printed on stdout is the directory to use as
# KUBEBUILDER_ASSETS (its last and only line); all progress goes to stderr:
#
#   export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)
#   go test ./test/envtest/ -v -count=1
#
# Usage: hack/setup-envtest.sh [--no-kubectl] [--force] [-h|--help]
#
#   --no-kubectl  skip kubectl (k8s.io/kubernetes/cmd/kubectl); it costs
#                 ~20s more once kube-apiserver is built, so it is built by
#                 default
#   --force       rebuild even if the cached binaries work
#
# Environment:
#   IDEMCP_ENVTEST_DIR           cache root
#                                (default $HOME/.local/share/idemcp/envtest)
#   IDEMCP_ENVTEST_K8S_VERSION   Kubernetes version (default 1.37.2)
#   IDEMCP_ENVTEST_ETCD_VERSION  etcd version (default 3.6.16)
#   IDEMCP_ENVTEST_KUBECTL       0 for the same effect as --no-kubectl
#
# Binaries land in $IDEMCP_ENVTEST_DIR/<k8s version>/. A rerun whose cached
# binaries exist and report the expected version exits at once. Each binary is
# built under a temporary name in that directory and then renamed into place,
# so an interrupted build never leaves a broken binary behind. Concurrent runs
# are serialised with flock(1) where it is available.
#
# The network needed is the Go module proxy only. The first run takes 5-10
# minutes on 2 cores (kube-apiserver is most of it); a rebuild reuses the Go
# build cache.
set -euo pipefail

# Keep stdout for the final path only.
exec 3>&1 1>&2

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

with_kubectl="${IDEMCP_ENVTEST_KUBECTL:-1}"
force=0
while (($#)); do
	case "$1" in
	--no-kubectl) with_kubectl=0 ;;
	--with-kubectl) with_kubectl=1 ;;
	--force) force=1 ;;
	-h | --help)
		usage >&3
		exit 0
		;;
	*)
		echo "setup-envtest: unknown argument: $1 (see --help)"
		exit 2
		;;
	esac
	shift
done
case "$with_kubectl" in 0 | false | no) with_kubectl=0 ;; *) with_kubectl=1 ;; esac

k8s_version="${IDEMCP_ENVTEST_K8S_VERSION:-1.37.2}"
k8s_version="${k8s_version#v}"
etcd_version="${IDEMCP_ENVTEST_ETCD_VERSION:-3.6.16}"
etcd_version="${etcd_version#v}"
root="${IDEMCP_ENVTEST_DIR:-${HOME:?HOME is unset; set IDEMCP_ENVTEST_DIR}/.local/share/idemcp/envtest}"
dir="$root/$k8s_version"

if ! [[ "$k8s_version" =~ ^1\.([0-9]+)\.([0-9]+)$ ]]; then
	echo "setup-envtest: IDEMCP_ENVTEST_K8S_VERSION must look like 1.37.2, got '$k8s_version'"
	exit 2
fi
k8s_minor="${BASH_REMATCH[1]}"
# The staging modules (k8s.io/api, client-go, ...) are tagged v0.<minor>.<patch>.
staging_version="v0.${k8s_minor}.${BASH_REMATCH[2]}"

log() { echo "setup-envtest: $*"; }

# The binaries are built in throwaway modules: the project's go.mod, GOFLAGS
# and GOWORK must not leak in. A toolchain switch would need a download.
export GOWORK=off GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
unset GOOS GOARCH

# Each takes a binary's path and succeeds if it runs and reports the expected
# version.
reports() { # path expected-line args...
	local bin="$1" want="$2" got
	shift 2
	[[ -x "$bin" ]] || return 1
	got="$("$bin" "$@" 2>/dev/null)" || return 1
	grep -qxF "$want" <<<"$got"
}
kube_ok() { reports "$1" "Kubernetes v${k8s_version}" --version; }
etcd_ok() { reports "$1" "etcd Version: ${etcd_version}" --version; }
kubectl_ok() { reports "$1" "Client Version: v${k8s_version}" version --client; }

need_apiserver=0 need_etcd=0 need_kubectl=0
check() {
	need_apiserver=0 need_etcd=0 need_kubectl=0
	((force)) || kube_ok "$dir/kube-apiserver" || need_apiserver=1
	((force)) || etcd_ok "$dir/etcd" || need_etcd=1
	if ((with_kubectl)); then
		((force)) || kubectl_ok "$dir/kubectl" || need_kubectl=1
	fi
	((force)) && need_apiserver=1 need_etcd=1 need_kubectl=$with_kubectl
	return 0
}

done_print() {
	echo "$dir" >&3
	exit 0
}

check
if ((!need_apiserver && !need_etcd && !need_kubectl)); then
	done_print
fi

if ! command -v go >/dev/null 2>&1; then
	cat <<-EOF
		setup-envtest: 'go' is not on PATH.
		  This script builds kube-apiserver and etcd from source with the Go toolchain.
		  Install Go (see go.mod for the version) and make sure 'go' is on PATH,
		  e.g. export PATH=\$PATH:/usr/local/go/bin
	EOF
	exit 1
fi

mkdir -p "$dir"
if command -v flock >/dev/null 2>&1; then
	exec 9>"$root/.$k8s_version.lock"
	if ! flock -n 9; then
		log "another setup-envtest run is building into $dir; waiting for it"
		flock 9
	fi
	# The other run may have done the work.
	if ((!force)); then
		check
		if ((!need_apiserver && !need_etcd && !need_kubectl)); then done_print; fi
	fi
	# With the lock held, leftovers of a killed run are safe to remove.
	rm -rf "$dir"/.build.*
fi

work="" out=""
# shellcheck disable=SC2317 # called by the trap
cleanup() { rm -rf "$work" "$out"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
work="$(mktemp -d "${TMPDIR:-/tmp}/idemcp-setup-envtest.XXXXXX")"
out="$(mktemp -d "$dir/.build.XXXXXX")"

now() { date +%s; }
install_bin() { # name: move the freshly built binary into place atomically
	chmod 0755 "$out/$1"
	mv -f "$out/$1" "$dir/$1"
}

if ((need_apiserver || need_kubectl)); then
	start=$(now)
	kmod="$work/kube"
	mkdir -p "$kmod"
	log "resolving k8s.io/kubernetes@v${k8s_version}"
	gomod_file="$(go mod download -json "k8s.io/kubernetes@v${k8s_version}" |
		sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
	if [[ -z "$gomod_file" || ! -f "$gomod_file" ]]; then
		log "could not download k8s.io/kubernetes@v${k8s_version} from the module proxy"
		exit 1
	fi
	# k8s.io/kubernetes requires its staging modules as v0.0.0 and replaces
	# them with ./staging/src/... directories, which a dependent module does
	# not see: every one must be replaced by its published v0.<minor>.<patch>.
	mapfile -t staging < <(awk '
		/^require[[:space:]]*\(/ { inreq = 1; next }
		inreq && /^\)/ { inreq = 0; next }
		inreq && $1 ~ /^k8s\.io\// && $2 == "v0.0.0" { print $1 }
		/^require[[:space:]]+k8s\.io\// && $3 == "v0.0.0" { print $2 }
	' "$gomod_file" | sort -u)
	if ((${#staging[@]} == 0)); then
		log "found no k8s.io/* v0.0.0 requirements in $gomod_file"
		exit 1
	fi
	log "replacing ${#staging[@]} staging modules with ${staging_version}"
	{
		echo "module idemcp.local/envtest-kube"
		echo
		echo "go $(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+(\.[0-9]+)?).*/\1/')"
		echo
		echo "require k8s.io/kubernetes v${k8s_version}"
		echo
		echo "replace ("
		for m in "${staging[@]}"; do
			echo "	$m => $m $staging_version"
		done
		echo ")"
		echo
		echo "tool k8s.io/kubernetes/cmd/kube-apiserver"
		if ((with_kubectl)); then echo "tool k8s.io/kubernetes/cmd/kubectl"; fi
	} >"$kmod/go.mod"
	(cd "$kmod" && go mod tidy)
	log "module graph resolved in $(($(now) - start))s"

	# What hack/lib/version.sh stamps into release builds. Without it the
	# binaries say v0.0.0-master and version checks against them go wrong.
	build_date="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${gomod_file%.mod}.info" 2>/dev/null || true)"
	[[ -n "$build_date" ]] || build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldflags+=" -X $pkg.gitVersion=v${k8s_version}"
		ldflags+=" -X $pkg.gitMajor=1"
		ldflags+=" -X $pkg.gitMinor=${k8s_minor}"
		ldflags+=" -X $pkg.gitCommit="
		ldflags+=" -X $pkg.gitTreeState=clean"
		ldflags+=" -X $pkg.buildDate=${build_date}"
	done

	pkgs=()
	if ((need_apiserver)); then pkgs+=(k8s.io/kubernetes/cmd/kube-apiserver); fi
	if ((need_kubectl)); then pkgs+=(k8s.io/kubernetes/cmd/kubectl); fi
	if ((need_apiserver)); then
		log "building ${pkgs[*]##*/} v${k8s_version} (the first build takes 5-10 minutes on 2 cores)"
	else
		log "building ${pkgs[*]##*/} v${k8s_version}"
	fi
	start=$(now)
	(cd "$kmod" && go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
	log "built ${pkgs[*]##*/} in $(($(now) - start))s"
	if ((need_apiserver)); then
		kube_ok "$out/kube-apiserver" || {
			log "built kube-apiserver does not report v${k8s_version}:"
			"$out/kube-apiserver" --version || true
			exit 1
		}
		install_bin kube-apiserver
	fi
	if ((need_kubectl)); then
		kubectl_ok "$out/kubectl" || {
			log "built kubectl does not report v${k8s_version}:"
			"$out/kubectl" version --client || true
			exit 1
		}
		install_bin kubectl
	fi
fi

if ((need_etcd)); then
	start=$(now)
	emod="$work/etcd"
	mkdir -p "$emod"
	# A separate module: k8s.io/kubernetes requires a newer etcd, which would
	# win in a shared module graph. go.etcd.io/etcd/server/v3 is itself the
	# etcd main package (a wrapper of .../server/v3/etcdmain); its own replaces
	# only point at sibling modules of the same tag, which it also requires.
	{
		echo "module idemcp.local/envtest-etcd"
		echo
		echo "go $(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+(\.[0-9]+)?).*/\1/')"
		echo
		echo "require go.etcd.io/etcd/server/v3 v${etcd_version}"
		echo
		echo "tool go.etcd.io/etcd/server/v3"
	} >"$emod/go.mod"
	log "resolving go.etcd.io/etcd/server/v3@v${etcd_version}"
	(cd "$emod" && go mod tidy)
	log "building etcd v${etcd_version}"
	# etcd's version string is in its source (api/v3/version.Version), so it
	# needs no stamp; only its GitSHA stays "Not provided".
	(cd "$emod" && go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
	etcd_ok "$out/etcd" || {
		log "built etcd does not report ${etcd_version}:"
		"$out/etcd" --version || true
		exit 1
	}
	install_bin etcd
	log "built etcd in $(($(now) - start))s"
fi

log "envtest binaries ready in $dir:"
du -h "$dir"/* | sed 's/^/  /'
done_print
