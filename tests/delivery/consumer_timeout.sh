#!/bin/bash
# Exercises a channel the broker closes under a running job (its consumer_timeout) on a
# RabbitMQ node of your own: sets the node-wide consumer_timeout to 5 s (checked once a minute
# by RabbitMQ 3.10), runs a 100 s job, and shows what the worker did. Restores the timeout.
# Needs: a worker of this namespace running with 2 S slots (SANDQ__SKUS__S__SLOTS=2 and the
# other S fields), its log at $WORKER_LOG, `sandq` on PATH or in $SANDQ, RABBITMQ_NODENAME set.
# Right: the first delivery's channel closes at ~60 s and its slot alone is reopened; the
# broker's redelivery to the other slot waits for the running attempt (one attempt of a job id
# at a time on a worker) instead of running the program beside it, then finds its result and is
# acked; no capacity is left held (sandq_capacity_cpus_in_use 0). The automated check, with a
# 4 s timeout, is channel_close::a_channel_closed_by_the_broker_is_reopened_alone_and_the_job_runs_once.
set -eu
SANDQ=${SANDQ:-sandq}
old=$(rabbitmqctl -n "$RABBITMQ_NODENAME" eval 'application:get_env(rabbit, consumer_timeout).' | sed -n 's/{ok,\([0-9]*\)}/\1/p')
trap 'rabbitmqctl -n "$RABBITMQ_NODENAME" eval "application:set_env(rabbit, consumer_timeout, ${old:-1800000})." >/dev/null' EXIT
rabbitmqctl -n "$RABBITMQ_NODENAME" eval 'application:set_env(rabbit, consumer_timeout, 5000).' >/dev/null
echo "restart the worker now (channels read consumer_timeout when opened), then press enter"; read -r _
ID=$(cat /proc/sys/kernel/random/uuid)
$SANDQ submit --sku S --id "$ID" --mode script --timeout 150s -c 'import os, time; print("attempt", os.environ["SANDQ_ATTEMPT"], flush=True); time.sleep(100)' >/dev/null
sleep 170
grep -E "$ID|reopening|not settled|timed out" "$WORKER_LOG" | cut -c1-220
$SANDQ --json status "$ID" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["status"], "attempt", r["attempt"], r["stdout"]["text"])'
