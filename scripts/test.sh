#!/usr/bin/env bash
# The test suite, against real services: brings them up (scripts/services.sh: RabbitMQ, Redis,
# Garage, the sandbox image, the config), installs the Python client's packages, builds the
# workspace and runs every test. Needs root (containers). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
if ! python3 -c 'import pika, msgpack, redis' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check -r clients/python/requirements.txt
fi
cargo build --workspace --all-targets
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
