#!/usr/bin/env bash
# The test suite, against real services: brings them up (scripts/services.sh: RabbitMQ, Redis,
# Garage, the sandbox image, the config), installs the Python client's packages, builds the
# workspace and runs every test: the cargo tests, then the Python SDK's (pytest, in a cached
# virtualenv) and the Node.js SDK's (node --test, after npm ci), each against a worker of its
# own. Needs root (containers). Safe to run repeatedly.
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

# The Python SDK (clients/python): a virtualenv with its dependencies, cached by its
# pyproject.toml and the interpreter; the package itself reinstalled from the tree every run.
sdk_venv_key=$( (cat clients/python/pyproject.toml; python3 -c 'import sys; print(sys.executable, sys.version)') | sha256sum | cut -c1-16)
sdk_venv=${SANDQ_CACHE:-/var/cache/sandq}/python-sdk-$sdk_venv_key
if [ ! -f "$sdk_venv/.complete" ]; then
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
  fi
  rm -rf "$sdk_venv"
  python3 -m venv "$sdk_venv"
  "$sdk_venv/bin/python3" -m pip install --quiet --disable-pip-version-check 'setuptools>=61' wheel
  "$sdk_venv/bin/python3" -m pip install --quiet --disable-pip-version-check './clients/python[test]'
  touch "$sdk_venv/.complete"
fi
"$sdk_venv/bin/python3" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall ./clients/python
rm -rf clients/python/build clients/python/sandq.egg-info
# E2B's SDK and the runner of its test suite (tests/e2b, run by clients/python/tests/test_e2b.py):
# a virtualenv of their own, cached by tests/e2b/requirements.txt and the interpreter.
e2b_venv_key=$( (cat tests/e2b/requirements.txt; python3 -c 'import sys; print(sys.executable, sys.version)') | sha256sum | cut -c1-16)
e2b_venv=${SANDQ_CACHE:-/var/cache/sandq}/e2b-$e2b_venv_key
if [ ! -f "$e2b_venv/.complete" ]; then
  rm -rf "$e2b_venv"
  python3 -m venv "$e2b_venv"
  "$e2b_venv/bin/python3" -m pip install --quiet --disable-pip-version-check -r tests/e2b/requirements.txt
  touch "$e2b_venv/.complete"
fi
export SANDQ_E2B_PYTHON="$e2b_venv/bin/python3"
# The Node.js SDK (clients/node): Node.js 20 or later, the locked packages, compiled by tsc
# (npm ci runs the package's `prepare`).
if ! command -v npm >/dev/null; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >&2
fi
(cd clients/node && npm ci --no-audit --no-fund --loglevel=error)

# Every worker a test starts gives outbound sandboxes one nameserver: the address of the network
# namespace tests/network.rs makes (198.18.0.2), so that no DNS query of a test leaves this
# machine (the default would be the host's resolvers outside the blocked ranges, or public ones).
export SANDQ__WORKER__NAMESERVERS=${SANDQ__WORKER__NAMESERVERS:-198.18.0.2}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The SDKs' tests (after the cargo tests, which leave no worker running); their closing lines
# (pytest's `N passed, M failed in Ts`, node's `# pass N` / `# fail M`) count below.
"$sdk_venv/bin/python3" -m pytest -q -p no:cacheprovider clients/python/tests 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The notebook runner's own tests (its pure parts, and the runner as a subprocess), run by the
# sandbox image's own interpreter and packages, chrooted into the image: none is skipped for want
# of IPython, pandas or matplotlib (scripts/runner-tests.sh). No services, no sandbox.
SANDQ_PIP_PYTHON="$sdk_venv/bin/python3" scripts/runner-tests.sh 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
(cd clients/node && npm test --silent) 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
set -e
# One closing line for the whole suite (cargo prints one per test binary, pytest and node one each).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1) } }
     /^=* *[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)([ ,]|$)/ && / in [0-9.]+s/ { for (i = 2; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^(failed|errors?)/) f += $(i-1) } }
     /^# pass [0-9]+$/ { p += $3 }
     /^# fail [0-9]+$/ { f += $3 }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
