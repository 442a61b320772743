#!/usr/bin/env bash
# hack/tool.sh DEST PACKAGE VERSION BINARY: puts the pinned tool PACKAGE@VERSION
# (go install's binary BINARY) at DEST, in the checkout's bin/. The build is
# cached outside the checkout (IDEMCP_TOOL_CACHE, default
# ~/.local/share/idemcp/tools, one file per tool and version), so a fresh
# clone copies it instead of building it again (golangci-lint alone takes
# minutes on 2 cores). TOOL_TAGS, if set, are the build tags.
set -euo pipefail
dest=$1 pkg=$2 version=$3 bin=$4
cache="${IDEMCP_TOOL_CACHE:-${HOME:?}/.local/share/idemcp/tools}"
cached="$cache/$(basename "$dest")"
if [[ ! -x "$cached" ]]; then
	mkdir -p "$cache"
	tmp="$(mktemp -d "$cache/.build.XXXXXX")"
	trap 'rm -rf "$tmp"' EXIT
	echo "building $pkg@$version (cached in $cache)" >&2
	GOBIN="$tmp" "${GO:-go}" install ${TOOL_TAGS:+-tags "$TOOL_TAGS"} "$pkg@$version"
	mv -f "$tmp/$bin" "$cached"
fi
mkdir -p "$(dirname "$dest")"
cp -f "$cached" "$dest.tmp" && mv -f "$dest.tmp" "$dest"
