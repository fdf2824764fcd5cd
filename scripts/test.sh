#!/usr/bin/env bash
# The test suite, against real services: brings them up (scripts/services.sh: RabbitMQ, Redis,
# Garage, the sandbox image, the config), installs the Python client's packages, builds the
# workspace and runs every test. Needs root (containers). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
# The Python client's packages (the e2e tests run it with `python3`): python3's own when it has
# them, else a virtualenv cached by requirements and interpreter, first on the PATH. Not `pip
# install` into python3: Debian's refuses it (externally managed, PEP 668).
if ! python3 -c 'import pika, msgpack, redis' 2>/dev/null; then
  venv_key=$( (cat clients/python/requirements.txt; python3 -c 'import sys; print(sys.executable, sys.version)') | sha256sum | cut -c1-16)
  venv=${SANDQ_CACHE:-/var/cache/sandq}/python-client-$venv_key
  if [ ! -f "$venv/.complete" ]; then
    if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
      apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check -r clients/python/requirements.txt
    touch "$venv/.complete"
  fi
  export PATH="$venv/bin:$PATH"
fi
# The font `sandq-loadtest throughput` draws its plots' text with (tests/faults.rs runs one).
if [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core >&2
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
