#!/bin/bash
# A duplicate delivery of a running session job must not store `rejected: session busy` over
# it (delivery::a_duplicate_of_a_running_session_job_does_not_reject_it is the automated check).
# Needs a worker with sessions.lock_wait shorter than the job (SANDQ__SESSIONS__LOCK_WAIT=3s) and 2 slots of S.
set -u
SANDQ=${SANDQ:-sandq}
ID=$(cat /proc/sys/kernel/random/uuid); SES=s-$(cat /proc/sys/kernel/random/uuid)
CODE='import time, pathlib; pathlib.Path("/work/ran.txt").write_text("ran"); time.sleep(12); print("the program ran to its end")'
$SANDQ submit --sku S --id "$ID" --session "$SES" --timeout 60s -c "$CODE" >/dev/null
sleep 2
# The same job again: what a client's retried publish, or the broker's redelivery after a
# consumer_timeout closed the first delivery's channel, hands a worker while the first runs.
$SANDQ submit --sku S --id "$ID" --session "$SES" --timeout 60s -c "$CODE" >/dev/null
sleep 20
redis-cli -p ${SANDQ_REDIS_PORT:-6379} --raw keys "*$ID*"

$SANDQ --json status "$ID" 2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin); print(\"first job:\", r[\"status\"], r.get(\"reason\"))"
# What should happen: status succeeded with "the program ran to its end" (the duplicate acked
# without a result). What happens: rejected, and yet the session moved on with the cell's effects:
$SANDQ --json run --sku S --session "$SES" --mode notebook -c 'import os; os.listdir("/work")' 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); print("next cell of the session: execution_count", r.get("execution_count"), "outputs", [o.get("data",{}).get("text/plain") for o in r.get("outputs",[])])'
