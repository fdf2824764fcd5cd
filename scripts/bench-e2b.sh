#!/usr/bin/env bash
# Issue 25's benchmark (docs/benchmarks.md "E2B's SDK"): a trivial cell through E2B's Python SDK
# against the same cell through sandq's own Python SDK (HTTP mode), alternated in one run
# (scripts/bench_e2b.py). Needs the services (scripts/services.sh); starts a worker (one warm
# sandbox per SKU) and a gateway of their own in a namespace of their own; the two SDKs in a
# virtualenv cached by tests/e2b/requirements.txt and clients/python/pyproject.toml.
# Usage: scripts/bench-e2b.sh [CELLS=40] [PROFILE=release]
set -euo pipefail
cd "$(dirname "$0")/.."
cells=${1:-40}
profile=${2:-release}
if [ "$profile" = release ]; then cargo build --release --bins -q; else cargo build --bins -q; fi
bin=${CARGO_TARGET_DIR:-target}/$([ "$profile" = release ] && echo release || echo debug)
key=$( (cat tests/e2b/requirements.txt clients/python/pyproject.toml; python3 -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
venv=${SANDQ_CACHE:-/var/cache/sandq}/bench-e2b-$key
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/e2b/requirements.txt ./clients/python
  rm -rf clients/python/build clients/python/sandq.egg-info
  touch "$venv/.complete"
fi
ns="sandq-bench-e2b-$$"
export SANDQ__NAMESPACE=$ns SANDQ__WARM__PER_SKU=1
worker_log=$(mktemp) gateway_log=$(mktemp)
trap 'exec 3>&- 4>&-; wait; rm -f "$worker_log" "$gateway_log"' EXIT
exec 3> >(SANDQ__WORKER__ID=$ns SANDQ__WORKER__METRICS_ADDR=127.0.0.1:0 "$bin"/sandq-worker --exit-on-stdin-eof 2>"$worker_log")
exec 4> >(SANDQ__GATEWAY__LISTEN=127.0.0.1:0 SANDQ__GATEWAY__METRICS_LISTEN=127.0.0.1:0 "$bin"/sandq-gateway --exit-on-stdin-eof 2>"$gateway_log")
for _ in $(seq 1 600); do grep -q consuming "$worker_log" && grep -q 'serving the API' "$gateway_log" && break; sleep 0.1; done
addr=$(sed -n 's/.*serving the API.*addr=\([0-9.:]*\).*/\1/p' "$gateway_log" | head -1)
[ -n "$addr" ] || { cat "$worker_log" "$gateway_log" >&2; exit 1; }
api_key=$("$bin"/sandq key create --tenant "bench$$" --jobs-per-minute 10000 2>/dev/null | head -1)
"$venv/bin/python" scripts/bench_e2b.py "http://$addr" "$api_key" "$cells"
