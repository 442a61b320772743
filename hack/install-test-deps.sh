#!/usr/bin/env bash
# Installs the programs the tests run for real: redis-server and redis-cli,
# PostgreSQL and PgBouncer (Debian's packages) and Node.js with npm for the
# TypeScript SDK client. Sentinel (the chaos run's failover, the Sentinel
# store tests) is redis-server --sentinel, the program Debian's
# redis-sentinel package only links and adds a service for, so
# redis-server is all it needs.
set -euo pipefail

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need_apt+=(postgresql)
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || need_apt+=(pgbouncer)
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)

if ((${#need_apt[@]})); then
	echo "installing ${need_apt[*]}"
	SUDO=""
	[ "$(id -u)" -eq 0 ] || SUDO=sudo
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Debian starts redis-server, postgresql and pgbouncer services on install;
# the tests start their own on free ports and need none running.
for cmd in redis-server redis-cli node npm; do
	command -v "$cmd" >/dev/null || { echo "missing $cmd after install" >&2; exit 1; }
done
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$pg_bin/postgres" ] || { echo "missing PostgreSQL after install" >&2; exit 1; }
[ -x /usr/sbin/pgbouncer ] || command -v pgbouncer >/dev/null || { echo "missing pgbouncer after install" >&2; exit 1; }
echo "test dependencies: postgres $("$pg_bin/postgres" --version | awk '{print $3}'), $(redis-server --version | cut -d' ' -f3), node $(node --version), npm $(npm --version)"
