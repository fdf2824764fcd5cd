#!/usr/bin/env bash
# Issue 24's benchmark (docs/benchmarks.md "MCP"): a trivial run_code through the gateway's /mcp
# against the same notebook job through its REST API, and get_job against GET /v1/jobs/{id},
# alternated in one run (sandq-loadtest mcp). Needs the services (scripts/services.sh); starts a
# worker (one warm sandbox per SKU) and a gateway of their own in a namespace of their own.
# Usage: scripts/bench-mcp.sh [CELLS=60] [READS=300] [PROFILE=release]
set -euo pipefail
cd "$(dirname "$0")/.."
cells=${1:-60}
reads=${2:-300}
profile=${3:-release}
if [ "$profile" = release ]; then cargo build --release --bins -q; else cargo build --bins -q; fi
bin=${CARGO_TARGET_DIR:-target}/$([ "$profile" = release ] && echo release || echo debug)
ns="sandq-bench-mcp-$$"
export SANDQ__NAMESPACE=$ns SANDQ__WARM__PER_SKU=1
worker_log=$(mktemp) gateway_log=$(mktemp)
trap 'exec 3>&- 4>&-; wait; rm -f "$worker_log" "$gateway_log"' EXIT
exec 3> >(SANDQ__WORKER__ID=$ns SANDQ__WORKER__METRICS_ADDR=127.0.0.1:0 "$bin"/sandq-worker --exit-on-stdin-eof 2>"$worker_log")
exec 4> >(SANDQ__GATEWAY__LISTEN=127.0.0.1:0 SANDQ__GATEWAY__METRICS_LISTEN=127.0.0.1:0 "$bin"/sandq-gateway --exit-on-stdin-eof 2>"$gateway_log")
for _ in $(seq 1 600); do grep -q consuming "$worker_log" && grep -q 'serving the API' "$gateway_log" && break; sleep 0.1; done
addr=$(sed -n 's/.*serving the API.*addr=\([0-9.:]*\).*/\1/p' "$gateway_log" | head -1)
[ -n "$addr" ] || { cat "$worker_log" "$gateway_log" >&2; exit 1; }
"$bin"/sandq-loadtest mcp --url "http://$addr" --cells "$cells" --reads "$reads"
