#!/usr/bin/env bash
# Issue 23's benchmark (docs/benchmarks.md "HTTP gateway"): the gateway's overhead on a
# submission and on a read against the direct Rust client, alternated in one run; reads per
# second through it against direct reads; its memory with 1,000 idle event streams. Needs the
# services (scripts/services.sh); starts a gateway of its own in a namespace of its own with no
# worker (jobs stay queued), release build; deletes the namespace's queues at the end.
# Usage: scripts/bench-gateway.sh [REQUESTS=300] [STREAMS=1000]
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-300}
streams=${2:-1000}
[ -n "${SANDQ_BENCH_NO_BUILD:-}" ] || cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release
ns="sandq-bench-gw-$$"
export SANDQ__NAMESPACE=$ns
# Each idle event stream holds two descriptors in the gateway (its socket, its Redis
# connection) and one here.
ulimit -n "$(ulimit -Hn)"
log=$(mktemp)
SANDQ__GATEWAY__LISTEN=127.0.0.1:0 SANDQ__GATEWAY__METRICS_LISTEN=127.0.0.1:0 SANDQ__GATEWAY__MAX_STREAMS=$((streams + 10)) SANDQ__GATEWAY__MAX_STREAMS_PER_KEY=$((streams + 10)) "$bin"/sandq-gateway 2>"$log" &
gateway=$!
trap 'kill $gateway 2>/dev/null; wait $gateway 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 300); do grep -q 'serving the API' "$log" && break; sleep 0.1; done
addr=$(sed -n 's/.*serving the API.*addr=\([0-9.:]*\).*/\1/p' "$log" | head -1)
[ -n "$addr" ] || { cat "$log" >&2; exit 1; }
"$bin"/sandq-loadtest gateway --url "http://$addr" --pid "$gateway" --requests "$requests" --streams "$streams"
