"""A minimal sandq client in Python, written only from docs/protocol.md.

    pip install -r requirements.txt
    python3 sandq_client.py --code 'print(6 * 7)'

Submits one job (MessagePack, publisher confirms, mandatory), records it as queued with the
documented compare-and-set script, polls the result hash until the status is terminal, and
prints the result as JSON. Exit code: 0 when the job succeeded, 1 otherwise.
"""
import argparse
import json
import sys
import time
import uuid

import msgpack
import pika
import redis

SCHEMA_VERSION = 1
TERMINAL = {"succeeded", "failed", "timed_out", "oom_killed", "rejected", "cancelled", "expired", "internal_error"}

# The compare-and-set script of docs/protocol.md ("Writing a status"): schemas/protocol/cas.lua,
# byte for byte (Rust test: every_copy_of_the_cas_script_is_cas_lua). Edit that file, then this.
CAS_SCRIPT = """\
local function rank(s)
  if not s then return 0 end
  if s == 'queued' then return 1 end
  if s == 'running' then return 2 end
  return 3
end
local current = redis.call('HGET', KEYS[1], 'status')
local cur, new = rank(current), rank(ARGV[1])
if cur == 3 or new < cur or (new == 1 and cur == 1) then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'result', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
if new == 3 and KEYS[2] then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
end
if new == 3 and KEYS[3] then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'type', 'end', 'attempt', ARGV[4] or '0', 'status', ARGV[1])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
end
return 1
"""


class SubmitError(Exception):
    """The broker did not accept the job: it is not queued."""


def submit(code, *, sku="M", runtime="python", stdin=None, timeout="60s", namespace="sandq", mode=None,
           session=None, amqp_url="amqp://guest:guest@127.0.0.1:5672/%2f", redis_url="redis://127.0.0.1:6379/0"):
    job_id = str(uuid.uuid4())
    now_ms = int(time.time() * 1000)
    job = {
        "schema_version": SCHEMA_VERSION,
        "job_id": job_id,
        "sku": sku,
        "runtime": runtime,
        "code": code,
        "timeout": timeout,
        "submitted_at_ms": now_ms,
    }
    if mode is not None:
        job["mode"] = mode  # "notebook" (the default) or "script"
    if session is not None:
        job["session"] = session
    if stdin is not None:
        job["stdin"] = stdin.encode() if isinstance(stdin, str) else stdin
    body = msgpack.packb(job, use_bin_type=True)
    properties = pika.BasicProperties(
        delivery_mode=2,
        content_type="application/msgpack",
        message_id=job_id,
        timestamp=now_ms // 1000,
        type="sandq.job",
        app_id="sandq-python-client",
        headers={"schema_version": SCHEMA_VERSION},
    )
    # Several broker addresses (the nodes of a cluster), comma-separated: each tried in turn
    # until one confirms the publish (docs/protocol.md, "Several broker addresses"); a publish
    # repeated on the next node is absorbed by the job id.
    addresses = [a.strip() for a in amqp_url.split(",") if a.strip()]
    last_error = None
    for address in addresses:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(address))
        except pika.exceptions.AMQPConnectionError as e:
            last_error = e
            continue
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            channel.basic_publish(f"{namespace}.jobs", sku, body, properties, mandatory=True)
            break
        except pika.exceptions.UnroutableError as e:
            raise SubmitError(f"job {job_id} not accepted: {e}") from e
        except (pika.exceptions.NackError, pika.exceptions.AMQPError) as e:
            last_error = e
        finally:
            if connection.is_open:
                connection.close()
    else:
        raise SubmitError(f"job {job_id} not accepted by any of {len(addresses)} broker address(es): {last_error}")
    queued = {"schema_version": SCHEMA_VERSION, "job_id": job_id, "status": "queued", "sku": sku,
              "queued_at_ms": now_ms, "attempt": 0}
    r = redis.Redis.from_url(redis_url)
    key = f"{namespace}:job:{{{job_id}}}"  # hash-tagged: key layout 2 (docs/protocol.md)
    r.eval(CAS_SCRIPT, 2, key, key + ":done", "queued", msgpack.packb(queued, use_bin_type=True), 86400)
    return job_id


def wait(job_id, *, namespace="sandq", redis_url="redis://127.0.0.1:6379/0", timeout_s=120.0, block_s=1.0):
    """Reads the result; blocks on the job's done list (BLPOP) between reads."""
    r = redis.Redis.from_url(redis_url)
    key = f"{namespace}:job:{{{job_id}}}"  # hash-tagged: key layout 2 (docs/protocol.md)
    deadline = time.monotonic() + timeout_s
    while True:
        raw = r.hget(key, "result")
        if raw is not None:
            result = msgpack.unpackb(raw, raw=False)
            if result["status"] in TERMINAL:
                return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
        r.blpop([key + ":done"], timeout=block_s)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True)
    parser.add_argument("--sku", default="M")
    parser.add_argument("--stdin")
    parser.add_argument("--mode", choices=["notebook", "script"])
    parser.add_argument("--session")
    parser.add_argument("--namespace", default="sandq")
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/%2f",
                        help="the broker, or several (a cluster's nodes) comma-separated")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    job_id = submit(args.code, sku=args.sku, stdin=args.stdin, namespace=args.namespace, mode=args.mode,
                    session=args.session,
                    amqp_url=args.amqp_url, redis_url=args.redis_url)
    result = wait(job_id, namespace=args.namespace, redis_url=args.redis_url)
    print(json.dumps(result, indent=2, default=lambda b: b.decode("utf-8", "replace")))
    sys.exit(0 if result["status"] == "succeeded" else 1)


if __name__ == "__main__":
    main()
