#!/usr/bin/env bash
# Runs every Go fuzz target in the module for FUZZTIME each (default 10s),
# one at a time: `go test -fuzz` takes one target per run. Seed corpora live
# in each package's testdata/fuzz and run as plain tests in `make test` too.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME="${FUZZTIME:-10s}"
GO="${GO:-go}"
n=0
start=$(date +%s)
for pkg in $($GO list ./...); do
	dir=$($GO list -f '{{.Dir}}' "$pkg")
	grep -lq '^func Fuzz' "$dir"/*_test.go 2>/dev/null || continue
	for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go | sed 's/^func //' | sort -u); do
		echo "fuzz: $pkg $target for $FUZZTIME"
		$GO test -run='^$' -fuzz="^${target}\$" -fuzztime="$FUZZTIME" "$pkg"
		n=$((n + 1))
	done
done
echo "fuzz: $n targets in $(( $(date +%s) - start ))s"
if [ "$n" -eq 0 ] && [ "${CI:-}" = "true" ]; then
	echo "fuzz: no targets found" >&2
	exit 1
fi
