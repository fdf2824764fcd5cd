#!/usr/bin/env bash
# Issue 22's benchmark (docs/benchmarks.md "Live output"): live events' latency from the
# program's write to the client's read (p50, p99, the worker's share), the Redis memory of a
# running job's stream, and the cost of streaming on a job printing 200,000 lines against the
# same job on a worker that does not stream (`worker.stream_max_bytes = 0`), run alternately in
# one run. Needs the services (scripts/services.sh); starts two workers of its own (one
# streaming, one not), in namespaces of their own, release build.
# Usage: scripts/bench-live.sh [REPS=5] [SKU=S]
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-5}
sku=${2:-S}
cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release
on="sandq-bench-live-on-$$" off="sandq-bench-live-off-$$"
export SANDQ__WARM__PER_SKU=1
start_worker() {  # namespace, stream_max_bytes, log
  SANDQ__NAMESPACE=$1 SANDQ__WORKER__ID=$1 SANDQ__WORKER__STREAM_MAX_BYTES=$2 SANDQ__WORKER__METRICS_ADDR=127.0.0.1:0 \
    "$bin"/sandq-worker --exit-on-stdin-eof 2>"$3"
}
log_on=$(mktemp) log_off=$(mktemp)
exec 3> >(start_worker "$on" $((1 << 20)) "$log_on")
exec 4> >(start_worker "$off" 0 "$log_off")
for _ in $(seq 1 300); do grep -q consuming "$log_on" && grep -q consuming "$log_off" && break; sleep 0.1; done
SANDQ__NAMESPACE=$on "$bin"/sandq-loadtest live --reps "$reps" --sku "$sku" --off-namespace "$off"
exec 3>&- 4>&-
wait
