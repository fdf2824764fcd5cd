#!/bin/bash
# Where a warm trivial job spends its time: N (default 10) `sandq run --sku S -c pass` through a
# release worker of its own (warm pool on unless WARM=0; GAP seconds between jobs, default 2),
# printing each run's wall, submitted -> finished, queue wait, program wall and sandbox, then the
# mean of each stage from the worker's `sandq_job_stage_duration_seconds` histograms. Needs the
# services (scripts/services.sh) and `cargo build --release --bins`.
bin=${CARGO_TARGET_DIR:-target}/release
ns=bd-$$
log=/tmp/bd-worker.log
port=19464
exec 3> >(SANDQ__NAMESPACE=$ns SANDQ__WORKER__ID=$ns SANDQ__WARM__PER_SKU=${WARM:-1} SANDQ__WARM__RUNTIMES=python SANDQ__WORKER__METRICS_ADDR=127.0.0.1:$port SANDQ__WORKER__USERNS_HOST_BASE=1950000000 exec $bin/sandq-worker --exit-on-stdin-eof 2>$log)
for _ in $(seq 1 300); do grep -q consuming $log 2>/dev/null && break; sleep 0.1; done
SANDQ__NAMESPACE=$ns $bin/sandq run --sku S -c pass >/dev/null
scrape() { python3 - $port <<'PY'
import sys, urllib.request
t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
out = {}
for l in t.splitlines():
    if l.startswith("sandq_job_stage_duration_seconds_sum") or l.startswith("sandq_job_stage_duration_seconds_count"):
        k, v = l.rsplit(" ", 1); out[k] = float(v)
import json; print(json.dumps(out))
PY
}
before=$(scrape)
n=${N:-10}
for i in $(seq 1 $n); do
  sleep ${GAP:-2}
  s=$(date +%s%N); SANDQ__NAMESPACE=$ns $bin/sandq --json run --sku S ${MODE:+--mode $MODE} -c pass > /tmp/bd.json; e=$(date +%s%N)
  python3 -c 'import json,sys; r=json.load(open("/tmp/bd.json")); print("wall", (int(sys.argv[1])-int(sys.argv[2]))//1000000, "ms; submit->finish", r["finished_at_ms"]-r["queued_at_ms"], "queued->started", r["started_at_ms"]-r["queued_at_ms"], "prog wall", r["usage"]["wall_ms"], "sandbox", r.get("sandbox"))' $e $s
done
after=$(scrape)
python3 - "$before" "$after" $n <<'PY'
import json, sys
b, a, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
for k in a:
    if k.endswith("_sum"+k[k.index("{"):]) or "_sum{" in k:
        c = k.replace("_sum{", "_count{")
        cnt = a[c] - b.get(c, 0)
        if cnt: print(k.split("{")[1].rstrip("}"), "mean %.1f ms over %d" % ((a[k]-b.get(k,0))/cnt*1000, cnt))
PY
exec 3>&-
sleep 2
for q in S M L XL; do rabbitmqctl -q delete_queue "$ns.jobs.$q" >/dev/null 2>&1; done
