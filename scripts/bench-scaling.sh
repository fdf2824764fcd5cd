#!/usr/bin/env bash
# How far one machine goes (issue 12 part 3): jobs/s of trivial jobs as the number of worker
# processes grows, with what each run cost the broker, Redis and the S3 server per job.
#
#   scripts/bench-scaling.sh [release|debug] [WORKERS...]      (default: release 1 2 4)
#   env: JOBS (per run, default 300), PER_WORKER (jobs in flight per worker, default 8),
#        MODE (script|notebook, default script), CODE (the Python every job runs, default pass),
#        OUT (default /tmp/sandq-scaling)
#
# Against the services of scripts/services.sh (the config it wrote, or SANDQ_CONFIG). Each run is
# `sandq-loadtest throughput --workers N` (its own namespace, its workers started and stopped by
# it, each with a user namespace range of its own). Around each run:
# - the host's CPU (/proc/stat) and the CPU of the broker (beam.smp), Redis and Garage
#   (/proc/PID/stat of the services' processes);
# - RabbitMQ's global counters (`rabbit_global_counters:overview()`): messages published,
#   delivered, acknowledged;
# - Redis: `CONFIG RESETSTAT` before, `INFO commandstats` and `INFO stats` (network bytes) after;
# - Garage's S3 request counters (its admin API's /metrics, `api_s3_request_counter`);
# - bytes on the loopback to and from the broker's and S3's ports (iptables counters in a chain
#   of its own, SANDQ-BENCH, removed at the end).
# Writes OUT/summary.md (one row per run) and OUT/w<N>/ (the load tool's report).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-release}
shift || true
workers_list=${*:-1 2 4}
jobs=${JOBS:-300}
per_worker=${PER_WORKER:-8}
mode=${MODE:-script}
code=${CODE:-pass}
out=${OUT:-/tmp/sandq-scaling}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/sandq/cargo-target}
config=${SANDQ_CONFIG:-/etc/sandq/sandq.toml}
setting() { python3 -c 'import sys, tomllib; c = tomllib.load(open(sys.argv[1], "rb")); print(eval(sys.argv[2], {}, c))' "$config" "$1"; }
amqp_port=$(setting 'amqp["url"].rsplit(":", 1)[1].split("/")[0]')
redis_port=$(setting 'redis["url"].rsplit(":", 1)[1].split("/")[0]')
s3_port=$(setting 's3["endpoint"].rsplit(":", 1)[1].split("/")[0]')
garage_admin=${SANDQ_GARAGE_ADMIN_PORT:-3903}

case $build in
  release) cargo build -q --release -p sandq-worker -p sandq-loadtest; bin=$CARGO_TARGET_DIR/release ;;
  debug) cargo build -q -p sandq-worker -p sandq-loadtest; bin=$CARGO_TARGET_DIR/debug ;;
  *) echo "usage: $0 [release|debug] [WORKERS...]" >&2; exit 2 ;;
esac
mkdir -p "$out"

chain=SANDQ-BENCH
cleanup() {
  iptables -w -D INPUT -i lo -j "$chain" 2>/dev/null || true
  iptables -w -F "$chain" 2>/dev/null || true
  iptables -w -X "$chain" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
iptables -w -N "$chain"
iptables -w -I INPUT -i lo -j "$chain"
for port in "$amqp_port" "$s3_port"; do
  iptables -w -A "$chain" -p tcp --dport "$port"   # to the server
  iptables -w -A "$chain" -p tcp --sport "$port"   # from the server
done

pid_of_port() { ss -Hltnp "sport = :$1" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2; }
broker_pid=$(pid_of_port "$amqp_port"); redis_pid=$(pid_of_port "$redis_port"); garage_pid=$(pid_of_port "$s3_port")
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }   # utime + stime, clock ticks
host_cpu() { awk '/^cpu / { idle = $5 + $6; total = 0; for (i = 2; i <= NF; i++) total += $i; print total - idle, total }' /proc/stat; }
rabbit() { rabbitmqctl eval 'M = rabbit_global_counters:overview(), Q = maps:get([{protocol,amqp091},{queue_type,rabbit_quorum_queue}], M), G = maps:get([{protocol,amqp091}], M), io:format("~p ~p ~p~n", [maps:get(messages_received_total, G), maps:get(messages_delivered_total, Q), maps:get(messages_acknowledged_total, Q)]).' | head -1; }
s3_requests() { curl -s "127.0.0.1:$garage_admin/metrics" | awk '/^api_s3_request_counter/ { n += $2 } END { print n + 0 }'; }
bytes() { iptables -w -L "$chain" -v -x -n | awk -v p="$1" '$0 ~ "dpt:" p "$" { to = $2 } $0 ~ "spt:" p "$" { from = $2 } END { print to + 0, from + 0 }'; }
hz=$(getconf CLK_TCK)

summary=$out/summary.md
{
  echo "| workers | jobs | jobs/s | p50 / p99 submitted -> finished (ms) | host CPU busy | broker CPU ms/job | Redis CPU ms/job | Garage CPU ms/job | AMQP msgs in / delivered / acked per job | AMQP bytes/job (to / from broker) | Redis cmds/job | Redis bytes/job (in / out) | S3 requests/job | S3 bytes/job (to / from) |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} >"$summary"
for n in $workers_list; do
  echo "bench-scaling: $n worker(s), $jobs jobs, $(( n * per_worker )) in flight, mode $mode, code ${code@Q}" >&2
  redis-cli -p "$redis_port" config resetstat >/dev/null
  iptables -w -Z "$chain"
  read -r r_in0 r_del0 r_ack0 <<<"$(rabbit)"
  s3_0=$(s3_requests)
  b0=$(ticks "$broker_pid"); d0=$(ticks "$redis_pid"); g0=$(ticks "$garage_pid")
  read -r busy0 total0 <<<"$(host_cpu)"
  "$bin/sandq-loadtest" throughput --workers "$n" --jobs "$jobs" --concurrency $(( n * per_worker )) --mode "$mode" --code "$code" \
    --sku S --report "$out/w$n" >"$out/w$n.txt"
  read -r busy1 total1 <<<"$(host_cpu)"
  b1=$(ticks "$broker_pid"); d1=$(ticks "$redis_pid"); g1=$(ticks "$garage_pid")
  s3_1=$(s3_requests)
  read -r r_in1 r_del1 r_ack1 <<<"$(rabbit)"
  read -r amqp_to amqp_from <<<"$(bytes "$amqp_port")"
  read -r s3_to s3_from <<<"$(bytes "$s3_port")"
  redis-cli -p "$redis_port" info commandstats >"$out/w$n-redis-commandstats.txt"
  redis-cli -p "$redis_port" info stats >"$out/w$n-redis-stats.txt"
  python3 - "$out/w$n/report.json" "$out/w$n-redis-commandstats.txt" "$out/w$n-redis-stats.txt" >>"$summary" <<EOF
import json, re, sys
r = json.load(open(sys.argv[1]))
jobs = r["jobs"]
cmds = sum(int(m) for m in re.findall(r"calls=(\d+)", open(sys.argv[2]).read()))
stats = dict(l.strip().split(":", 1) for l in open(sys.argv[3]) if ":" in l)
per = lambda x: x / jobs
ms = lambda t: 1000.0 * t / $hz / jobs
p = r["submitted_to_finished_ms"]
busy = ($busy1 - $busy0) / max(1, $total1 - $total0)
print(f"| $n | {jobs} | {r['jobs_per_second']:.1f} | {p['p50']} / {p['p99']} | {busy:.0%} | {ms($b1 - $b0):.1f} | {ms($d1 - $d0):.1f} | {ms($g1 - $g0):.1f} "
      f"| {per($r_in1 - $r_in0):.1f} / {per($r_del1 - $r_del0):.1f} / {per($r_ack1 - $r_ack0):.1f} | {per($amqp_to):.0f} / {per($amqp_from):.0f} "
      f"| {per(cmds):.1f} | {per(int(stats['total_net_input_bytes'])):.0f} / {per(int(stats['total_net_output_bytes'])):.0f} "
      f"| {per($s3_1 - $s3_0):.1f} | {per($s3_to):.0f} / {per($s3_from):.0f} |")
EOF
  tail -1 "$summary" >&2
done
echo >>"$summary"
echo "Redis commands per job, by command (last run): " >>"$summary"
python3 - "$out/w${workers_list##* }-redis-commandstats.txt" "$jobs" >>"$summary" <<'EOF'
import re, sys
jobs = int(sys.argv[2])
rows = re.findall(r"cmdstat_(\w+(?:\|\w+)?):calls=(\d+)", open(sys.argv[1]).read())
print(", ".join(f"{name} {int(calls) / jobs:.2f}" for name, calls in sorted(rows, key=lambda r: -int(r[1]))))
EOF
cat "$summary"
