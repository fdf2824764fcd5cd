#!/usr/bin/env bash
# Issue 21's benchmark: what carrying a DataFrame in a session costs a trivial cell, against
# pandas' own pickle round trip of the same frame on the same machine.
#
# For each size (MB of float64, 12 columns): a session whose first cell makes the frame, then
# REPS cells `print(len(df))`; a control session whose first cell makes nothing big, then REPS
# cells `print(1)`; and one job that times `df.to_pickle` + `pd.read_pickle` of the same frame
# inside the sandbox (to /work, the job's disk: a 500 MB pickle does not fit the sandbox's 256 MiB
# /tmp). Overhead = median wall of the frame's trivial cells - median wall
# of the control's, end to end through the CLI (`sandq run`); ratio = overhead / round trip.
# Also prints the runner's restore_ms and save_ms. Needs the services (scripts/services.sh);
# starts a worker of its own with sessions.max_state_bytes = 1 GiB.
# Usage: scripts/bench-session-state.sh [SIZES="10 100"] [REPS=3] [SKU=S]
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-10 100}
reps=${2:-3}
sku=${3:-S}
cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release
export SANDQ__NAMESPACE="sandq-bench-state-$$"
export SANDQ__SESSIONS__MAX_STATE_BYTES=$((1 << 30))
export SANDQ__WARM__PER_SKU=0
# L and XL on a smaller machine (this one has 2 cores): declared capacity, on purpose, so that the
# worker serves them; the sandbox still gets at most the host's cores.
case $sku in
  L) export SANDQ__WORKER__CAPACITY_CPUS=${SANDQ__WORKER__CAPACITY_CPUS:-4} ;;
  XL) export SANDQ__WORKER__CAPACITY_CPUS=${SANDQ__WORKER__CAPACITY_CPUS:-8} ;;
esac
log=$(mktemp)
exec 3> >(SANDQ__WORKER__ID=$SANDQ__NAMESPACE exec "$bin"/sandq-worker --exit-on-stdin-eof 2>"$log")
for _ in $(seq 1 100); do grep -q consuming "$log" 2>/dev/null && break; sleep 0.1; done
out=$(mktemp -d)
cell() {  # session, code, output file: prints the wall ms of `sandq run`
  local start end
  start=$(date +%s%N)
  "$bin"/sandq --json run --wait 300s --timeout 5m --sku "$sku" --session "$1" -c "$2" > "$3"
  end=$(date +%s%N)
  echo $(( (end - start) / 1000000 ))
}
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
printf '| frame | state bytes | trivial cell, frame (ms) | trivial cell, control (ms) | overhead (ms) | restore / save (ms) | pandas pickle round trip (ms) | ratio |\n|---|---|---|---|---|---|---|---|\n'
for mb in $sizes; do
  rows=$(( mb * 1000000 / 96 ))
  make="import numpy as np\nimport pandas as pd\ndf = pd.DataFrame(np.random.default_rng(0).random(($rows, 12)))\n"
  a="bench-frame-$$-$mb" b="bench-control-$$-$mb"
  cell "$a" "$(printf "$make")" "$out/a0.json" >/dev/null
  cell "$b" "$(printf 'import numpy as np\nimport pandas as pd\nx = 1\n')" "$out/b0.json" >/dev/null
  : > "$out/a.ms"; : > "$out/b.ms"; : > "$out/state"
  for i in $(seq 1 "$reps"); do
    cell "$a" 'print(len(df))' "$out/a$i.json" >> "$out/a.ms"
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["session"]["state"]; print(s["bytes"], s.get("restore_ms", 0), s["save_ms"])' "$out/a$i.json" >> "$out/state"
    cell "$b" 'print(1)' "$out/b$i.json" >> "$out/b.ms"
  done
  pickle="import time\nimport numpy as np\nimport pandas as pd\ndf = pd.DataFrame(np.random.default_rng(0).random(($rows, 12)))\nts = []\nfor _ in range($reps):\n    t = time.perf_counter()\n    df.to_pickle('/work/f.pkl')\n    pd.read_pickle('/work/f.pkl')\n    ts.append(time.perf_counter() - t)\nimport os\nos.remove('/work/f.pkl')\nprint(int(sorted(ts)[len(ts) // 2] * 1000))\n"
  "$bin"/sandq --json run --wait 300s --timeout 5m --sku "$sku" --mode script -c "$(printf "$pickle")" > "$out/p.json"
  rt=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["stdout"]["text"].strip())' "$out/p.json")
  ma=$(median < "$out/a.ms"); mbc=$(median < "$out/b.ms")
  bytes=$(awk '{ print $1 }' "$out/state" | median)
  restore=$(awk '{ print $2 }' "$out/state" | median); save=$(awk '{ print $3 }' "$out/state" | median)
  over=$(( ma - mbc ))
  ratio=$(python3 -c "print(f'{$over / max($rt, 1):.2f}')")
  printf '| %s MB | %s | %s | %s | %s | %s / %s | %s | %s |\n' "$mb" "$bytes" "$ma" "$mbc" "$over" "$restore" "$save" "$rt" "$ratio"
done
exec 3>&-
sleep 2
rm -rf "$out" "$log"
