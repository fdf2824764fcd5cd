#!/usr/bin/env bash
# The main job end to end, as a user sees it: local services and the sandbox image come up,
# a worker starts, the example analysis (examples/macro_summary.py on examples/macrodata.csv)
# runs through RabbitMQ, a youki container, S3 and Redis, and its stdout, exit code, timings and
# chart (saved under sandq-out/<job id>/) are shown. Then a trivial job, timed end to end.
# Needs root. The first run builds Garage (~15 min) and the image (~3 min); later runs reuse them.
# Exits with the example analysis's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
cargo build --release --bins
# The binaries just built, wherever cargo puts them (CARGO_TARGET_DIR; CI sets it).
bin=${CARGO_TARGET_DIR:-target}/release
log=$(mktemp --tmpdir sandq-demo-worker.XXXXXX.log)
# The worker stops by itself when this script's pipe to it closes (--exit-on-stdin-eof).
exec 3> >(exec "$bin"/sandq-worker --exit-on-stdin-eof 2>"$log")
worker=$!
for _ in $(seq 1 600); do grep -q consuming "$log" 2>/dev/null && break; sleep 0.1; done
grep -q consuming "$log" || { echo "worker did not start:"; cat "$log"; exit 1; }

echo "== sandq run --upload examples/macrodata.csv examples/macro_summary.py"
set +e
"$bin"/sandq run --sku M --upload examples/macrodata.csv examples/macro_summary.py
code=$?
set -e
echo "== exit code: $code"

echo
echo "== a trivial job, end to end (submit -> container -> result):"
time "$bin"/sandq run --sku S -c 'print("hello from the sandbox")'
exec 3>&-
wait "$worker" 2>/dev/null || true   # the worker is gone when the demo returns
echo "worker log: $log"
exit "$code"
