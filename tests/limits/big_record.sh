#!/bin/bash
# A client-written `queued` record of SIZE bytes (the CAS script stores any bytes a client
# passes as ARGV[2]), then a job of that id: the worker taking the job must not read and decode
# the record whole. Prints the worker's peak RSS (VmHWM) before and after (the automated check
# is limits::a_huge_client_written_record_costs_the_worker_little_memory). Needs WORKER_PID, SANDQ_REDIS_PORT,
# `sandq` on PATH or in $SANDQ. Written here with HSET, as the CAS script would store it.
set -eu
SANDQ=${SANDQ:-sandq}; SIZE=${SIZE:-200000000}; NS=${NS:-sandq}
ID=$(cat /proc/sys/kernel/random/uuid)
python3 - "$ID" "$SIZE" > /tmp/big_record.$$ <<'PY'
import struct, sys
job_id, size = sys.argv[1], int(sys.argv[2])
def s(x):
    b = x.encode() if isinstance(x, str) else x
    return (bytes([0xa0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b if len(b) < 256 else b"\xdb" + struct.pack(">I", len(b)) + b
body = b"\x84" + s("schema_version") + b"\x01" + s("job_id") + s(job_id) + s("status") + s("queued") + s("reason") + s(b"x" * size)
sys.stdout.buffer.write(body)
PY
hwm() { grep VmHWM /proc/$WORKER_PID/status; }
echo "before: $(hwm)"
redis-cli -p "$SANDQ_REDIS_PORT" HSET "$NS:job:$ID" status queued >/dev/null
redis-cli -p "$SANDQ_REDIS_PORT" -x HSET "$NS:job:$ID" result < /tmp/big_record.$$ >/dev/null
rm -f /tmp/big_record.$$
redis-cli -p "$SANDQ_REDIS_PORT" EXPIRE "$NS:job:$ID" 600 >/dev/null
# Right: the worker reads at most a bounded prefix of a record (a valid result is well under a
# few MiB) and treats a larger one as unreadable: its RSS barely moves (it once grew by 2x SIZE).
$SANDQ submit --sku S --id "$ID" --mode script -c 'print("ok")' >/dev/null 2>&1 || true
sleep 8
echo "after:  $(hwm)"
