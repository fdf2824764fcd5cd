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
cargo test --workspace --no-fail-fast
