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
# inputs DIR: how many inputs a fuzz corpus holds (0 when it has none yet).
inputs() { if [ -d "$1" ]; then find "$1" -type f | wc -l; else echo 0; fi; }
for pkg in $($GO list ./...); do
	dir=$($GO list -f '{{.Dir}}' "$pkg")
	grep -lq '^func Fuzz' "$dir"/*_test.go 2>/dev/null || continue
	for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go | sed 's/^func //' | sort -u); do
		echo "fuzz: $pkg $target for $FUZZTIME"
		corpus="$dir/testdata/fuzz/$target"
		inputs_before=$(inputs "$corpus")
		log=$(mktemp)
		if ! $GO test -run='^$' -fuzz="^${target}\$" -fuzztime="$FUZZTIME" "$pkg" 2>&1 | tee "$log"; then
			# go test -fuzz can end with "context deadline exceeded" when
			# -fuzztime runs out while a worker is busy on a loaded machine,
			# without a failing input. A real finding writes its input to
			# the corpus and fails otherwise: only that case runs again.
			if grep -q 'context deadline exceeded' "$log" && [ "$(inputs "$corpus")" -eq "$inputs_before" ]; then
				echo "fuzz: $target ended with 'context deadline exceeded' and no failing input; running it once more"
				$GO test -run='^$' -fuzz="^${target}\$" -fuzztime="$FUZZTIME" "$pkg" || { rm -f "$log"; exit 1; }
			else
				rm -f "$log"
				exit 1
			fi
		fi
		rm -f "$log"
		n=$((n + 1))
	done
done
echo "fuzz: $n targets in $(( $(date +%s) - start ))s"
if [ "$n" -eq 0 ] && [ "${CI:-}" = "true" ]; then
	echo "fuzz: no targets found" >&2
	exit 1
fi
