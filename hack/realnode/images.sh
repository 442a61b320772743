#!/usr/bin/env bash
# Builds the real-node e2e cluster's images as OCI tarballs (no Docker, no
# registry) and imports them into its containerd (called by up.sh):
#   - idemcp's own image, from the binaries `make image` puts in it;
#   - the test MCP server (test/mcpserver/cmd/httpserver), static;
#   - Redis, from Debian's redis-server plus the libraries ldd lists (and sh,
#     grep and redis-cli for the managed Redis's readiness probe);
#   - the pause image, a static Go program.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"
RN_BIN="$(cat "$RN_STATE/bin")"
mkdir -p "$RN_IMAGE_DIR"
cd "$RN_REPO"
export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
b="$RN_STATE/build"
mkdir -p "$b"
go build -o "$b/mkimage" ./hack/realnode/mkimage
go build -trimpath -ldflags "-s -w" -o "$b/pause" ./hack/realnode/pause
go build -trimpath -ldflags "-s -w" -o "$b/httpserver" ./test/mcpserver/cmd/httpserver
make -s build-linux LOCALBIN="$b" >&2
go run ./hack/image --binary "$b/linux-amd64/idemcp" --proxy-binary "$b/linux-amd64/idemcp-proxy" \
	--image "$RN_IDEMCP_IMAGE" --out "$RN_IMAGE_DIR/idemcp.tar"
"$b/mkimage" --image "$RN_PAUSE_IMAGE" --out "$RN_IMAGE_DIR/pause.tar" --file "$b/pause=/pause" --entrypoint /pause --user 65535
"$b/mkimage" --image "$RN_MCP_IMAGE" --out "$RN_IMAGE_DIR/mcpserver.tar" --file "$b/httpserver=/httpserver" \
	--entrypoint /httpserver --user 65532

# Redis with the shared libraries of every binary in it.
files=()
for exe in "$(command -v redis-server)" "$(command -v redis-cli)" /bin/sh /bin/grep; do
	real="$(readlink -f "$exe")"
	files+=(--file "$real=$exe")
	while read -r lib; do
		[[ -n "$lib" ]] && files+=(--file "$(readlink -f "$lib")=$lib")
	done < <(ldd "$real" | awk '/=>/ {print $3} !/=>/ && $1 ~ /^\// {print $1}')
done
mapfile -t files < <(printf '%s\n' "${files[@]}" | awk 'NR % 2 == 1 {flag = $0; next} !seen[$0]++ {print flag; print}')
"$b/mkimage" --image "$RN_REDIS_IMAGE" --out "$RN_IMAGE_DIR/redis.tar" "${files[@]}" --entrypoint "$(command -v redis-server)"

for t in pause idemcp mcpserver redis; do
	rn_ctr images import --platform linux/amd64 "$RN_IMAGE_DIR/$t.tar" >/dev/null
done
rm -rf "$b"
