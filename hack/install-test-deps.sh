#!/usr/bin/env bash
# Installs the programs the tests run for real: redis-server and redis-cli
# (Debian's packages) and Node.js with npm for the TypeScript SDK client.
set -euo pipefail

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)

if ((${#need_apt[@]})); then
	echo "installing ${need_apt[*]}"
	SUDO=""
	[ "$(id -u)" -eq 0 ] || SUDO=sudo
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Debian starts a redis-server service on install; the tests start their own
# on free ports and need none running.
for cmd in redis-server redis-cli node npm; do
	command -v "$cmd" >/dev/null || { echo "missing $cmd after install" >&2; exit 1; }
done
echo "test dependencies: $(redis-server --version | cut -d' ' -f3), node $(node --version), npm $(npm --version)"
