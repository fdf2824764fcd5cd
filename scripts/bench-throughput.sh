#!/usr/bin/env bash
# Throughput of one worker: `sandq-loadtest throughput` (N jobs of `pass` on SKU S, notebook
# mode by default) against a worker it starts in a namespace of its own; prints jobs/s and
# latency percentiles and writes a report directory (report.json, jobs.csv, queue_depth.csv,
# latency.png, throughput.png). Needs the services (scripts/services.sh) and root.
# Usage: scripts/bench-throughput.sh [PROFILE=debug|release] [loadtest options...]
#   e.g. scripts/bench-throughput.sh debug --jobs 200 --concurrency 4 --report /tmp/tput
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-debug}
shift || true
# The plots' text is drawn from this font file (no fontconfig needed).
font=${SANDQ_PLOT_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}
if [ ! -f "$font" ]; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core >&2
fi
if [ "$profile" = release ]; then
  cargo build --release --bins -q
else
  cargo build --bins -q
fi
bin=${CARGO_TARGET_DIR:-target}/$profile   # where cargo put them (CI sets CARGO_TARGET_DIR)
exec "$bin"/sandq-loadtest throughput --font "$font" "$@"
