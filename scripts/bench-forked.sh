#!/usr/bin/env bash
# Issue 26's side-by-side benchmark, in one run on one machine: jobs that arrive BACK TO BACK
# (no idle time for a warm pool to refill) and sustained throughput, for the forked path (a
# warm sandbox whose process is forked from a pre-imported template), the unforked warm path
# (`warm.forked = false`: each warm sandbox preloads on its own) and a cold start, against
#   (a) `runc run` of `python3 -c pass` on the same rootfs (Debian's runc, its default spec),
#       one at a time (latency) and two at a time (throughput: this is a 2-core machine);
#   (b) plain `python3` chrooted into the rootfs for the main job (examples/macro_summary.py).
# Then the CPU a trivial notebook cell costs the machine (all of it: /proc/stat) and the
# worker's process tree, and the memory of an idle template and of a running job.
#
# Needs root and the services (scripts/services.sh); installs hyperfine and runc (Debian) when
# missing. Usage: scripts/bench-forked.sh [RUNS=30] [JOBS=300]. Writes hyperfine's JSON and
# markdown and the other numbers to $OUT (default /tmp/sandq-bench-forked). PARTS (default
# "1 2 3 4 5 6 7") picks the parts below to run.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-30}
jobs=${2:-300}
out=${OUT:-/tmp/sandq-bench-forked}
config=${SANDQ_CONFIG:-/etc/sandq/sandq.toml}
mkdir -p "$out"
parts=" ${PARTS:-1 2 3 4 5 6 7} "
want() { [[ "$parts" == *" $1 "* ]]; }

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
bench_tools
cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release
rootfs=$(sed -n 's/^rootfs = "\(.*\)"$/\1/p' "$config")
[ -d "$rootfs/usr/bin" ] || { echo "no rootfs in $config" >&2; exit 1; }

work=$(mktemp -d /tmp/sandq-bench.XXXXXX)
chmod 755 "$work"
ns=sandq-bench-$$
cleanup() {
  set +e
  exec 3>&- 4>&- 5>&- 6>&-
  sleep 1
  for w in forked unforked cold node; do
    for q in S M L XL; do rabbitmqctl -q delete_queue "$ns-$w.jobs.$q" >/dev/null 2>&1; done
    rabbitmqctl -q delete_queue "$ns-$w.dead" >/dev/null 2>&1
  done
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/job"
cp examples/macrodata.csv examples/macro_summary.py "$work/job/"
chmod -R a+rwX "$work/job"

# (a) the runc bundle: the default spec, the rootfs read-only, /tmp a tmpfs.
b=$work/runc
runc_bundle "$b" "$rootfs" / python3 -c pass

# Three release-build workers, Python warm sandboxes only, each in a namespace of its own.
start_worker() {  # $1: name, $2: fd, $3: user namespace base, $4...: settings
  local name=$1 fd=$2 base=$3
  shift 3
  local log=$work/worker-$name.log
  eval "exec $fd> >(env SANDQ__NAMESPACE=$ns-$name SANDQ__WORKER__ID=$ns-$name SANDQ__WARM__RUNTIMES=python \
    SANDQ__WORKER__USERNS_HOST_BASE=$base SANDQ__WORKER__METRICS_ADDR=127.0.0.1:0 $* $bin/sandq-worker --exit-on-stdin-eof 2>$log)"
  for _ in $(seq 1 300); do grep -q consuming "$log" 2>/dev/null && return; sleep 0.1; done
  echo "worker $name did not start: $(tail -5 "$log")" >&2
  exit 1
}
start_worker forked 3 1879048192 SANDQ__WARM__PER_SKU=1
start_worker unforked 4 1885601792 SANDQ__WARM__PER_SKU=1 SANDQ__WARM__FORKED=false
start_worker cold 5 1892155392 SANDQ__WARM__PER_SKU=0
# The templates are ready (a forked sandbox of S and M exists) before anything is timed.
for _ in $(seq 1 600); do
  [ "$(grep -c 'forked=true' "$work/worker-forked.log")" -ge 2 ] && break
  sleep 0.1
done
sandq() {  # $1: worker, then the CLI's arguments
  local w=$1
  shift
  echo "env SANDQ__NAMESPACE=$ns-$w $bin/sandq run --wait 120s --out $work/out $*"
}
trivial_args="--sku S --mode notebook -c pass"
script_args="--sku S --mode script -c pass"
main_args="--sku M --upload $work/job/macrodata.csv $work/job/macro_summary.py"
for w in forked unforked cold; do
  eval "$(sandq $w "$trivial_args")" >/dev/null
  eval "$(sandq $w "$main_args")" >/dev/null
done

if want 1; then
# 1. The trivial notebook cell, back to back (hyperfine runs each command's runs in a row).
hyperfine --runs "$runs" --warmup 3 -N --style basic \
  --export-json "$out/trivial.json" --export-markdown "$out/trivial.md" \
  -n 'sandq forked' "$(sandq forked "$trivial_args")" \
  -n 'sandq warm unforked' "$(sandq unforked "$trivial_args")" \
  -n 'sandq cold' "$(sandq cold "$trivial_args")" \
  -n 'sandq script warm' "$(sandq forked "$script_args")" \
  -n 'sandq script cold' "$(sandq cold "$script_args")" \
  -n 'runc run' "runc run --bundle $b bench-$$-t" 2>&1 | tee "$out/trivial.txt"
fi

if want 2; then
# 2. The main job (SKU M), back to back, against chrooted python.
hyperfine --runs "$(( (runs + 2) / 3 ))" --warmup 1 -N --style basic \
  --export-json "$out/main.json" --export-markdown "$out/main.md" \
  -n 'sandq forked' "$(sandq forked "$main_args")" \
  -n 'sandq cold' "$(sandq cold "$main_args")" \
  -n 'chroot python3' "$(chroot_cmd "$rootfs" "$work/job" 'python3 macro_summary.py')" 2>&1 | tee "$out/main.txt"
fi

if want 3; then
# 3. CPU per trivial notebook cell, 50 back to back: the whole machine's busy time (/proc/stat;
# the broker, Redis and the CLI included), the worker's process tree (the worker, its helpers
# and what they reaped: utime + stime + cutime + cstime) and the sandboxes' own (the results'
# cgroup cpu_ms).
pid_of() {  # $1: worker name
  for p in $(pgrep -f 'sandq-worker --exit-on-stdin-eof'); do
    tr '\0' '\n' < "/proc/$p/environ" | grep -qx "SANDQ__WORKER__ID=$ns-$1" && echo "$p"
  done
}
cpu_of() {  # $1: worker name
  python3 - "$(pid_of "$1" | head -1)" <<'EOF'
import os, sys
hz = os.sysconf("SC_CLK_TCK")
pid = sys.argv[1]
f = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()
busy = [int(x) for x in open("/proc/stat").readline().split()[1:]]
print(sum(int(f[i]) for i in (11, 12, 13, 14)) * 1000 // hz, (sum(busy) - busy[3] - busy[4]) * 1000 // hz)
EOF
}
for w in forked cold; do
  read -r tree0 machine0 < <(cpu_of $w)
  : > "$work/cpu-$w.jsonl"
  for _ in $(seq 1 50); do
    env SANDQ__NAMESPACE=$ns-$w "$bin"/sandq --json run --sku S --mode notebook -c pass >> "$work/cpu-$w.jsonl"
    echo >> "$work/cpu-$w.jsonl"
  done
  read -r tree1 machine1 < <(cpu_of $w)
  python3 - "$w" "$work/cpu-$w.jsonl" $((tree1 - tree0)) $((machine1 - machine0)) <<'EOF' | tee -a "$out/cpu.txt"
import json, sys
name, path, tree, machine = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text, results, at = open(path).read(), [], 0
decoder = json.JSONDecoder()
while text[at:].strip():
    obj, end = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
    results.append(obj)
    at = end
sandbox = sum((r.get("usage") or {}).get("cpu_ms", 0) for r in results)
forked = sum(1 for r in results if (r.get("sandbox") or {}).get("forked"))
n = len(results)
print("%s: %d cells (%d forked): machine %.0f ms/cell, worker tree %.0f ms/cell, sandbox %.0f ms/cell"
      % (name, n, forked, machine / n, tree / n, sandbox / n))
EOF
done
fi

if want 4; then
# 4. Memory: each idle template (RSS, PSS, private), and a running job's peak (its cgroup).
# The templates only: the worker's children (the processes forked from them, waiting in their
# sandboxes, run the same command line).
for pid in $(pgrep -f 'sandq_runner.py --template'); do
  parent=$(awk '{ print $4 }' "/proc/$pid/stat")
  tr '\0' ' ' < "/proc/$parent/cmdline" | grep -q sandq-worker || continue
  python3 - "$pid" <<'EOF' | tee -a "$out/memory.txt"
import sys
pid = sys.argv[1]
rollup = dict(l.split(":", 1) for l in open("/proc/%s/smaps_rollup" % pid) if ":" in l and not l.startswith("0"))
kb = lambda k: int(rollup[k].split()[0]) if k in rollup else 0
env = open("/proc/%s/environ" % pid, "rb").read().split(b"\0")
sku = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SANDQ_SKU=")), "?")
print("template %s (pid %s): RSS %d MiB, PSS %d MiB, private %d MiB" % (sku, pid, kb("Rss") // 1024, kb("Pss") // 1024,
      (kb("Private_Clean") + kb("Private_Dirty")) // 1024))
EOF
done
for w in forked cold; do
  env SANDQ__NAMESPACE=$ns-$w "$bin"/sandq --json run --sku S --mode notebook -c 'import numpy, pandas, matplotlib.pyplot' > "$work/mem-$w.json"
  python3 -c 'import json,sys; r=json.load(open(sys.argv[2])); print("%s job peak memory (cgroup): %d MiB, forked=%s" % (sys.argv[1], r["usage"]["peak_memory_bytes"] >> 20, (r.get("sandbox") or {}).get("forked")))' \
    "$w" "$work/mem-$w.json" | tee -a "$out/memory.txt"
done
fi

if want 5; then
# 5. Sustained throughput, one worker each (sandq-loadtest starts it): JOBS jobs of `pass`,
# notebook and script, 4 in flight; against runc run two at a time. ("forked" is each mode's
# default warm path, "unforked" its other: preloading warm sandboxes, or script jobs cold.)
font=${SANDQ_PLOT_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}
for mode in notebook script; do
  # Notebook: forked (the default) or each warm sandbox preloading on its own; script: a warm
  # sandbox whose waiter execs the job (the default) or every job cold.
  for variant in forked unforked; do
    extra=()
    [ "$mode/$variant" = notebook/unforked ] && extra=(--worker-env SANDQ__WARM__FORKED=false)
    [ "$mode/$variant" = script/unforked ] && extra=(--worker-env SANDQ__WARM__SCRIPT=false)
    "$bin"/sandq-loadtest throughput --font "$font" --jobs "$jobs" --concurrency 4 --mode "$mode" \
      --worker-env SANDQ__WARM__RUNTIMES=python "${extra[@]}" --report "$out/tput-$mode-$variant" --json > "$out/tput-$mode-$variant.json"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[3])); print("sandq %s %s: %.1f jobs/s" % (sys.argv[1], sys.argv[2], r["jobs_per_second"]))' \
      "$mode" "$variant" "$out/tput-$mode-$variant.json" | tee -a "$out/throughput.txt"
  done
done
start=$(date +%s%N)
seq 1 "$jobs" | xargs -P 2 -I{} runc run --bundle "$b" "bench-$$-{}" >/dev/null
end=$(date +%s%N)
python3 -c 'import sys; n, ns = int(sys.argv[1]), int(sys.argv[2]); print("runc run two at a time: %.1f runs/s" % (n / (ns / 1e9)))' \
  "$jobs" $((end - start)) | tee -a "$out/throughput.txt"
fi

if want 6; then
# 6. The trivial cell back to back from a client that stays connected (the Python SDK, one
# connection for every cell: no process start, AMQP handshake or topology per cell), against
# part 1's runc run.
sdk_venv=$(find "${SANDQ_CACHE:-/var/cache/sandq}" -maxdepth 2 -path '*/python-sdk-*/.complete' -printf '%T@ %h\n' | sort -rn | head -1 | cut -d' ' -f2)
[ -x "$sdk_venv/bin/python3" ] || { echo "part 6 needs the SDK's virtualenv, which scripts/test.sh makes (python-sdk-* under the cache)" >&2; exit 1; }
SANDQ__NAMESPACE=$ns-forked PYTHONPATH=clients/python "$sdk_venv/bin/python3" - "$runs" <<'EOF' | tee "$out/connected.txt"
import statistics, sys, time
import sandq
runs = int(sys.argv[1])
with sandq.Client() as client:
    for _ in range(3):
        client.run("pass", sku="S", mode="notebook")
    times, forked = [], 0
    for _ in range(runs):
        t = time.perf_counter()
        result = client.run("pass", sku="S", mode="notebook")
        times.append((time.perf_counter() - t) * 1000)
        forked += bool(result.sandbox and result.sandbox.forked)
print("connected client (Python SDK), trivial notebook cell back to back: mean %.1f ms, median %.1f, sd %.1f, %d runs (%d forked)"
      % (statistics.mean(times), statistics.median(times), statistics.stdev(times), runs, forked))
EOF
fi

if want 7; then
# 7. Node.js: a trivial notebook cell back to back on a worker keeping Node.js warm sandboxes
# (a started runner each, refilled while jobs run; no template: see docs/benchmarks.md) and on
# the cold worker, against `runc run` of `node -e 0` on the same rootfs.
start_worker node 6 1898708992 SANDQ__WARM__PER_SKU=1 SANDQ__WARM__RUNTIMES=node SANDQ__WARM__SCRIPT=false
runc_bundle "$work/runc-node" "$rootfs" / node -e 0
node_args="--sku S --runtime node --mode notebook -c 1"
for w in node cold; do eval "$(sandq $w "$node_args")" >/dev/null; done
hyperfine --runs "$runs" --warmup 3 -N --style basic \
  --export-json "$out/node.json" --export-markdown "$out/node.md" \
  -n 'sandq node warm' "$(sandq node "$node_args")" \
  -n 'sandq node cold' "$(sandq cold "$node_args")" \
  -n 'runc run node' "runc run --bundle $work/runc-node bench-$$-n" 2>&1 | tee "$out/node.txt"
fi

echo "results in $out" >&2
