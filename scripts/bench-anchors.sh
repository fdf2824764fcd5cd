#!/usr/bin/env bash
# Issue 8's side-by-side benchmark: `sandq run` of the trivial cell (`pass`, SKU S, notebook
# mode) and of the README's main job (examples/macro_summary.py on macrodata.csv, SKU M), warm
# and cold, against three anchors on the same machine and the same image's rootfs, in one run:
#   (a) `runc run` of the same command (runc from Debian, its default spec: namespaces, no
#       user namespace, no seccomp), a fresh /tmp tmpfs, the job's dir bind-mounted at /work;
#   (b) plain `python3` chrooted into the rootfs (in a private mount namespace: a fresh /tmp
#       tmpfs and the job's dir bind-mounted at /mnt);
#   (c) a warm Jupyter kernel (ipykernel + jupyter_client, chrooted into the same rootfs) running
#       the same cells: the main job's first run in a fresh kernel and its second run.
# Every command runs with the sandbox's own environment (HOME=/tmp, MPLCONFIGDIR=/tmp/matplotlib,
# MPLBACKEND=Agg, LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1), each timed run after 1 s of idle
# and, for the warm worker, once its pool is full again (hyperfine --prepare polls its
# `sandq_warm_sandboxes_ready`): this measures jobs that arrive at an idle worker. Two
# release-build workers serve the sandq commands, one with `warm.per_sku = 1` (Python only) and
# one with 0, each in a namespace of its own; artifacts are downloaded as `sandq run` does.
#
# Needs root and the services (scripts/services.sh). Installs hyperfine and runc (Debian) when
# missing, and caches ipykernel's wheels for the image's Python under $SANDQ_CACHE.
# Usage: scripts/bench-anchors.sh [RUNS=20]. Writes hyperfine's JSON and markdown, and the
# kernel's numbers, to $OUT (default /tmp/sandq-bench-anchors).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
out=${OUT:-/tmp/sandq-bench-anchors}
cache=${SANDQ_CACHE:-/var/cache/sandq}
config=${SANDQ_CONFIG:-/etc/sandq/sandq.toml}
mkdir -p "$out"

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
bench_tools
cargo build --release --bins -q
bin=${CARGO_TARGET_DIR:-target}/release
rootfs=$(sed -n 's/^rootfs = "\(.*\)"$/\1/p' "$config")
[ -d "$rootfs/usr/bin" ] || { echo "no rootfs in $config" >&2; exit 1; }
image_python=$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# (c)'s packages: ipykernel, jupyter_client and those of their dependencies the image lacks,
# for the image's Python, without dependencies (the image's IPython, traitlets, jupyter_core,
# dateutil... stay the ones the sandbox has), cached by version.
kernel_pkgs="ipykernel==6.29.5 jupyter_client==8.6.3 comm==0.2.3 debugpy==1.8.22 pyzmq==27.1.0 tornado==6.5.2 nest_asyncio==1.6.0 psutil==7.1.3"
kernel_dir=$cache/bench-kernel-$(echo "$kernel_pkgs $image_python" | sha256sum | cut -c1-16)
if [ ! -f "$kernel_dir/.complete" ]; then
  rm -rf "$kernel_dir"
  # shellcheck disable=SC2086
  python3 -m pip install --quiet --disable-pip-version-check --break-system-packages --no-deps --target "$kernel_dir" \
    --python-version "$image_python" --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --only-binary=:all: $kernel_pkgs
  touch "$kernel_dir/.complete"
fi

work=$(mktemp -d /tmp/sandq-bench.XXXXXX)
chmod 755 "$work"
ns=sandq-bench-$$
cleanup() {
  set +e
  exec 3>&- 4>&-
  sleep 1
  for w in warm cold; do
    for q in S M L XL; do rabbitmqctl -q delete_queue "$ns-$w.jobs.$q" >/dev/null 2>&1; done
    rabbitmqctl -q delete_queue "$ns-$w.dead" >/dev/null 2>&1
  done
  rm -rf "$work"
}
trap cleanup EXIT

# The job's files: what the client uploads, and the runc/chroot anchors' working dirs.
mkdir -p "$work/job"
cp examples/macrodata.csv examples/macro_summary.py "$work/job/"
chmod -R a+rwX "$work/job"

# (a) runc bundles: the default spec, the rootfs read-only, /tmp a tmpfs, the job dir at /work.
BENCH_WORK=$work/job runc_bundle "$work/runc-trivial" "$rootfs" / python3 -c pass
BENCH_WORK=$work/job runc_bundle "$work/runc-main" "$rootfs" /work python3 macro_summary.py

# Two workers of the release build: warm pool 1 per SKU, and none.
start_worker() {  # $1: warm|cold, $2: per_sku, $3: fd, $4: user namespace base
  local log=$work/worker-$1.log
  eval "exec $3> >(SANDQ__NAMESPACE=$ns-$1 SANDQ__WORKER__ID=$ns-$1 SANDQ__WARM__PER_SKU=$2 SANDQ__WARM__RUNTIMES=python SANDQ__WORKER__USERNS_HOST_BASE=$4 SANDQ__WORKER__METRICS_ADDR=127.0.0.1:$5 exec $bin/sandq-worker --exit-on-stdin-eof 2>$log)"
  for _ in $(seq 1 300); do grep -q consuming "$log" 2>/dev/null && return; sleep 0.1; done
  echo "worker $1 did not start: $(tail -5 "$log")" >&2
  exit 1
}
metrics_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_worker warm 1 3 1879048192 "$metrics_port"
start_worker cold 0 4 1885601792 0   # 100 ranges above
# hyperfine's --prepare for the warm worker: idle 1 s, then wait (up to 60 s) until its pool
# has the SKU's sandbox ready again.
cat > "$work/ready.py" <<EOF
import sys, time, urllib.request
time.sleep(1)
want = 'sandq_warm_sandboxes_ready{sku="%s"} 1' % sys.argv[1]
for _ in range(600):
    if want in urllib.request.urlopen("http://127.0.0.1:$metrics_port/metrics").read().decode():
        sys.exit(0)
    time.sleep(0.1)
sys.exit("the warm pool did not refill")
EOF
sandq() {  # $1: warm|cold, then the CLI's arguments
  local w=$1
  shift
  echo "env SANDQ__NAMESPACE=$ns-$w $bin/sandq run --wait 120s --out $work/out $*"
}
trivial_args="--sku S -c pass"
main_args="--sku M --upload $work/job/macrodata.csv $work/job/macro_summary.py"
# One of each first: the upload is in S3 and both workers have run a job.
for w in warm cold; do
  eval "$(sandq $w "$trivial_args")" >/dev/null
  eval "$(sandq $w "$main_args")" >/dev/null
done

hyperfine --runs "$runs" --warmup 1 -N --style basic \
  --prepare "python3 $work/ready.py S" --prepare 'sleep 1' --prepare 'sleep 1' --prepare 'sleep 1' \
  --export-json "$out/trivial.json" --export-markdown "$out/trivial.md" \
  -n 'sandq warm' "$(sandq warm "$trivial_args")" \
  -n 'sandq cold' "$(sandq cold "$trivial_args")" \
  -n 'runc run' "runc run --bundle $work/runc-trivial bench-$$-t" \
  -n 'chroot python3' "$(chroot_cmd "$rootfs" "$work/job" 'python3 -c pass')" 2>&1 | tee "$out/trivial.txt"

hyperfine --runs "$(( (runs + 1) / 2 ))" --warmup 1 -N --style basic \
  --prepare "python3 $work/ready.py M" --prepare 'sleep 1' --prepare 'sleep 1' --prepare 'sleep 1' \
  --export-json "$out/main.json" --export-markdown "$out/main.md" \
  -n 'sandq warm' "$(sandq warm "$main_args")" \
  -n 'sandq cold' "$(sandq cold "$main_args")" \
  -n 'runc run' "runc run --bundle $work/runc-main bench-$$-m" \
  -n 'chroot python3' "$(chroot_cmd "$rootfs" "$work/job" 'python3 macro_summary.py')" 2>&1 | tee "$out/main.txt"

# (c) the warm kernel, in the same rootfs, with ipykernel's packages at /media.
unshare -m sh -c "mount -t tmpfs tmpfs $rootfs/tmp && mount --bind $work/job $rootfs/mnt && mount --bind $kernel_dir $rootfs/media \
  && mkdir -p $rootfs/tmp/bench && cp scripts/bench_kernel.py $rootfs/tmp/bench/ \
  && exec chroot $rootfs env -i ${bench_env[*]} PYTHONPATH=/media JUPYTER_RUNTIME_DIR=/tmp/jr IPYTHONDIR=/tmp/ipy \
     python3 /tmp/bench/bench_kernel.py --runs $runs --main /mnt/macro_summary.py --cwd /mnt" | tee "$out/kernel.json"
echo "results in $out" >&2
