#!/usr/bin/env bash
# Times N trivial jobs (`pass` on SKU S) end to end through the release binaries: the CLI
# process start, connect, publish with confirm, the worker's container cycle, the result in
# Redis, and the CLI's BLPOP wake-up. Prints the median and p90 of the wall time of
# `sandq run`, and the worker-side queued->finished time from the results.
# Needs the services (scripts/services.sh). Usage: scripts/bench-trivial.sh [N=50] [MODE=script]
# (MODE: script = `python3 main.py`; notebook = the IPython runner, Python's default).
# WARM=0 turns the worker's warm sandboxes off (default: 1 per SKU); GAP=1.5 waits that many
# seconds between jobs, so that an idle worker refills its pool (warm starts need notebook mode).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-50}
mode=${2:-script}
cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release   # where cargo put them (CI sets CARGO_TARGET_DIR)
export SANDQ__NAMESPACE="sandq-bench-$$"
export SANDQ__WARM__PER_SKU=${WARM:-1}
gap=${GAP:-0}
log=$(mktemp)
exec 3> >(SANDQ__WORKER__ID=$SANDQ__NAMESPACE exec "$bin"/sandq-worker --exit-on-stdin-eof 2>"$log")
for _ in $(seq 1 100); do grep -q consuming "$log" 2>/dev/null && break; sleep 0.1; done
"$bin"/sandq --json run --wait 60s --sku S --mode "$mode" -c pass >/dev/null  # warm-up
times=$(mktemp)
for _ in $(seq 1 "$n"); do
  start=$(date +%s%N)
  "$bin"/sandq --json run --sku S --mode "$mode" -c pass > "$times.json"
  end=$(date +%s%N)
  server=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["finished_at_ms"]-r["queued_at_ms"], int(bool((r.get("sandbox") or {}).get("warm"))))' "$times.json")
  echo "$(( (end - start) / 1000000 )) $server" >> "$times"
  sleep "$gap"
done
exec 3>&-
sort -n -k1 "$times" | awk -v n="$n" -v mode="$mode" '{ a[NR] = $1 } END { printf "mode " mode ": sandq run, end to end: median %d ms, p90 %d ms (n=%d)\n", a[int((n+1)/2)], a[int(n*0.9)], n }'
sort -n -k2 "$times" | awk -v n="$n" '{ a[NR] = $2; w += $3 } END { printf "submitted -> result written: median %d ms, p90 %d ms; %d of %d started warm\n", a[int((n+1)/2)], a[int(n*0.9)], w, n }'
rm -f "$times" "$times.json" "$log"
for q in S M L XL; do rabbitmqctl -q delete_queue "$SANDQ__NAMESPACE.jobs.$q" >/dev/null 2>&1 || true; done
rabbitmqctl -q delete_queue "$SANDQ__NAMESPACE.dead" >/dev/null 2>&1 || true
