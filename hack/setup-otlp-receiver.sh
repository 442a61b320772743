#!/usr/bin/env bash
# Builds the OTLP receiver the tracing tests export to (hack/otlp-receiver:
# the OpenTelemetry Collector's otlpreceiver with a file sink) once, and
# caches it outside the checkout. The only thing printed on stdout is the
# binary's path; progress goes to stderr:
#
#   IDEMCP_OTLP_RECEIVER=$(hack/setup-otlp-receiver.sh) go test ./test/tracing/
#
# Environment:
#   IDEMCP_OTLP_RECEIVER_DIR  cache root
#                             (default $HOME/.local/share/idemcp/otlp-receiver)
#
# The binary lands in $IDEMCP_OTLP_RECEIVER_DIR/<hash of its sources>/, so
# a change to hack/otlp-receiver builds a new one. The network needed is
# the Go module proxy only; the first build takes a few minutes on 2 cores.
set -euo pipefail
exec 3>&1 1>&2

src="$(cd "$(dirname "$0")/otlp-receiver" && pwd)"
root="${IDEMCP_OTLP_RECEIVER_DIR:-${HOME:?HOME is unset; set IDEMCP_OTLP_RECEIVER_DIR}/.local/share/idemcp/otlp-receiver}"
sum="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)"
dir="$root/$sum"
bin="$dir/otlp-receiver"

if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
	echo "$bin" >&3
	exit 0
fi
mkdir -p "$dir"
exec 9>"$dir/.lock"
if command -v flock >/dev/null; then flock 9; fi
if ! { [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; }; then
	echo "setup-otlp-receiver: building $bin"
	start=$(date +%s)
	# Its own module: the project's go.mod, GOFLAGS and GOWORK stay out.
	(cd "$src" && GOWORK=off GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0 go build -o "$bin.tmp" .)
	mv "$bin.tmp" "$bin"
	echo "setup-otlp-receiver: built in $(($(date +%s) - start))s"
fi
echo "$bin" >&3
