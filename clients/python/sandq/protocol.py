"""The wire protocol of docs/protocol.md, shared by the blocking and the asyncio clients: the
service config, names, the JobSpec, the compare-and-set script, the topology."""
from __future__ import annotations

import hashlib
import math
import re
from fractions import Fraction
import os
import urllib.parse
import time
import tomllib
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import msgpack

from .types import InputFile

SCHEMA_VERSION = 1
DEFAULT_CONFIG_PATH = "/etc/sandq/sandq.toml"
APP_ID = "sandq-python"

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

SKUS = ("S", "M", "L", "XL")
# Longest single BLPOP on a done list, or XREAD BLOCK on an event stream (s): the hash is read
# again after each.
BLOCK_S = 5.0
# Reading a job's event stream (docs/protocol.md "Live events"): the cursor of the whole stream,
# and the most entries one XREAD returns.
EVENTS_START = "0-0"
EVENTS_COUNT = 500


@dataclass(frozen=True)
class Config:
    """Where the services are: the `[amqp]`, `[redis]` and `[s3]` sections and `namespace` of the
    sandq config file (the same file the worker and the `sandq` CLI read)."""
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2f"
    # `[amqp] urls`: the nodes of a RabbitMQ cluster, tried in order and round-robin after a
    # failure; replaces `amqp_url` when not empty (docs/protocol.md, "Several broker addresses").
    amqp_urls: tuple[str, ...] = ()
    # `[amqp] confirm_timeout`: no publisher confirm within it, publish again on the next address.
    confirm_timeout: str = "30s"
    redis_url: str = "redis://127.0.0.1:6379/"
    # `[redis] mode`: "single" (redis_url), "cluster" (redis_nodes: some of the cluster's nodes) or
    # "sentinel" (redis_nodes: the sentinels; redis_service: the primary's name); docs/protocol.md
    # "Redis deployments".
    redis_mode: str = "single"
    redis_nodes: tuple[str, ...] = ()
    redis_service: str = "mymaster"
    s3_endpoint: str = "http://127.0.0.1:3900"
    s3_region: str = "garage"
    s3_bucket: str = "sandq"
    s3_access_key_id: Optional[str] = None
    s3_secret_access_key: Optional[str] = None
    namespace: str = "sandq"
    delivery_limit: int = 5
    # `[queues] unserved_ttl`: a job no worker takes within it expires (the queues' x-message-ttl).
    unserved_ttl: str = "1h"

    def with_namespace(self, namespace: str) -> "Config":
        return replace(self, namespace=namespace)

    def amqp_addresses(self) -> list[str]:
        """The broker addresses to try, in order: `amqp_urls` when not empty, else `amqp_url`."""
        return list(self.amqp_urls) or [self.amqp_url]


def parse_urls(value: Any) -> tuple[str, ...]:
    """`[amqp] urls` as a TOML list or one comma-separated string (as `SANDQ__AMQP__URLS` gives
    it); blank items dropped."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(i.strip() for i in items if str(i).strip())


def config_path(path: Union[str, os.PathLike, None] = None) -> Path:
    """`path`, else `$SANDQ_CONFIG`, else /etc/sandq/sandq.toml."""
    return Path(path or os.environ.get("SANDQ_CONFIG") or DEFAULT_CONFIG_PATH)


def url_list(value: Any) -> tuple[str, ...]:
    """`[redis] nodes`: a TOML list, or one string of comma-separated URLs (an environment variable)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(i).strip() for i in items if str(i).strip())


def redis_kwargs(url: str) -> dict[str, Any]:
    """Host, port and credentials of a `redis://[user:password@]host:port/` URL."""
    parsed = urllib.parse.urlsplit(url)
    out: dict[str, Any] = {"host": parsed.hostname or "127.0.0.1", "port": parsed.port or 6379}
    if parsed.username:
        out["username"] = urllib.parse.unquote(parsed.username)
    if parsed.password:
        out["password"] = urllib.parse.unquote(parsed.password)
    return out


def load_config(path: Union[str, os.PathLike, None] = None) -> Config:
    """Reads the sandq config (see `config_path`); a missing file is an error. `SANDQ__SECTION__KEY`
    environment variables override the file's keys, as for the worker."""
    with open(config_path(path), "rb") as f:
        doc: dict[str, Any] = tomllib.load(f)

    def get(section: Optional[str], key: str, default: Any) -> Any:
        env = "SANDQ__" + (f"{section.upper()}__" if section else "") + key.upper()
        if env in os.environ:
            return os.environ[env]
        table = doc.get(section, {}) if section else doc
        return table.get(key, default)

    d = Config()
    return Config(
        amqp_url=get("amqp", "url", d.amqp_url), amqp_urls=parse_urls(get("amqp", "urls", ())),
        confirm_timeout=str(get("amqp", "confirm_timeout", d.confirm_timeout)), redis_url=get("redis", "url", d.redis_url),
        redis_mode=str(get("redis", "mode", d.redis_mode)), redis_nodes=url_list(get("redis", "nodes", [])),
        redis_service=str(get("redis", "service", d.redis_service)),
        s3_endpoint=get("s3", "endpoint", d.s3_endpoint), s3_region=get("s3", "region", d.s3_region),
        s3_bucket=get("s3", "bucket", d.s3_bucket), s3_access_key_id=get("s3", "access_key_id", None),
        s3_secret_access_key=get("s3", "secret_access_key", None), namespace=get(None, "namespace", d.namespace),
        delivery_limit=int(get("amqp", "delivery_limit", d.delivery_limit)),
        unserved_ttl=str(get("queues", "unserved_ttl", d.unserved_ttl)),
    )


class Names:
    """Queue, exchange and key names of a namespace."""

    def __init__(self, namespace: str):
        self.ns = namespace
        self.exchange = f"{namespace}.jobs"
        self.dlx = f"{namespace}.dlx"
        self.dead_queue = f"{namespace}.dead"
        self.sessions = f"{namespace}:sessions"

    def queue(self, sku: str) -> str:
        return f"{self.ns}.jobs.{sku}"

    # Redis key layout 2 (docs/protocol.md "Redis key layout"): `{<job_id>}` is a Redis Cluster
    # hash tag, so a job's keys share a slot and the CAS script (two keys) runs on a cluster.
    def job(self, job_id: str) -> str:
        return f"{self.ns}:job:{{{job_id}}}"

    def done(self, job_id: str) -> str:
        return f"{self.job(job_id)}:done"

    def cancel(self, job_id: str) -> str:
        return f"{self.job(job_id)}:cancel"

    def events(self, job_id: str) -> str:
        """The job's live events, a Redis Stream (docs/protocol.md "Live events")."""
        return f"{self.job(job_id)}:events"


def queue_arguments(names: Names, delivery_limit: int, unserved_ttl: str = "1h") -> dict:
    """The SKU queues' arguments (docs/protocol.md, "Topology"); `x-message-ttl` unless the TTL is 0."""
    args = {"x-queue-type": "quorum", "x-delivery-limit": delivery_limit, "x-dead-letter-exchange": names.dlx}
    ttl_ms = duration_ms(unserved_ttl)
    if ttl_ms:
        args["x-message-ttl"] = ttl_ms
    return args


def now_ms() -> int:
    return int(time.time() * 1000)


def input_key(sha256: str) -> str:
    return f"inputs/sha256/{sha256}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The worker's duration grammar (docs/protocol.md, "Durations"): one or more spans, each an
# integer with an optional fraction and a unit, spaces allowed between and within spans.
_UNITS = {
    **dict.fromkeys(("nanos", "nsec", "ns"), Fraction(1, 10**9)), **dict.fromkeys(("usec", "us", "µs"), Fraction(1, 10**6)),
    **dict.fromkeys(("millis", "msec", "ms"), Fraction(1, 1000)),
    **dict.fromkeys(("seconds", "second", "secs", "sec", "s"), 1), **dict.fromkeys(("minutes", "minute", "min", "mins", "m"), 60),
    **dict.fromkeys(("hours", "hour", "hr", "hrs", "h"), 3600), **dict.fromkeys(("days", "day", "d"), 86400),
    **dict.fromkeys(("weeks", "week", "wk", "wks", "w"), 604800), **dict.fromkeys(("months", "month", "M"), 2630016),
    **dict.fromkeys(("years", "year", "yr", "yrs", "y"), 31557600),
}
_SPAN = re.compile(r"\s*(\d+)(?:\.(\d+))?\s*([A-Za-zµ]+)\s*")


def humantime_seconds(value: str) -> int:
    """Seconds of a humantime duration ("60s", "2m 30s", "1.5h", "7days"), for key TTLs: whole
    seconds, at least 1. Raises ValueError for what the worker refuses ("90", "1H", "")."""
    return max(1, math.floor(_duration(value)))


def duration_ms(value: str) -> int:
    """Whole milliseconds of a humantime duration (0 for "0s")."""
    return math.floor(_duration(value) * 1000)


def _duration(value: str) -> Fraction:
    total, pos = Fraction(0), 0
    if not value.strip():
        raise ValueError(f"bad duration {value!r}: empty")
    while pos < len(value):
        match = _SPAN.match(value, pos)
        if not match or match.group(3) not in _UNITS:
            raise ValueError(f"bad duration {value!r}: expected spans such as 60s or 2m 30s")
        whole, frac, unit = match.groups()
        number = Fraction(int(whole)) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
        total += number * _UNITS[unit]
        pos = match.end()
    return total


def build_job(
    code: Optional[str] = None, *, entrypoint: Optional[str] = None, sku: str = "M", runtime: str = "python",
    inputs: Sequence[InputFile] = (), args: Sequence[str] = (), stdin: Union[bytes, str, None] = None,
    env: Optional[Mapping[str, str]] = None, timeout: Optional[str] = None, result_ttl: Optional[str] = None,
    network: Optional[str] = None, deadline_ms: Optional[int] = None, mode: Optional[str] = None,
    session: Optional[str] = None, job_id: Optional[str] = None,
) -> dict:
    """A JobSpec map. Only what the protocol requires of a client is checked here (one of code and
    entrypoint, the SKU); the worker validates the rest and says why in a `rejected` result."""
    if (code is None) == (entrypoint is None):
        raise ValueError("give exactly one of code and entrypoint")
    if sku not in SKUS:
        raise ValueError(f"unknown sku {sku!r}: one of {', '.join(SKUS)}")
    job: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "job_id": job_id or str(uuid.uuid4()), "sku": sku,
                           "runtime": runtime, "submitted_at_ms": now_ms()}
    if code is not None:
        job["code"] = code
    if entrypoint is not None:
        job["entrypoint"] = entrypoint
    if inputs:
        job["inputs"] = [i.to_wire() for i in inputs]
    if args:
        job["args"] = list(args)
    if stdin is not None:
        job["stdin"] = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    if env:
        job["env"] = dict(env)
    for key, value in (("timeout", timeout), ("result_ttl", result_ttl), ("network", network),
                       ("deadline_ms", deadline_ms), ("mode", mode), ("session", session)):
        if value is not None:
            job[key] = value
    return job


def encode(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def decode(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


def queued_record(job: dict) -> tuple[bytes, int]:
    """The `queued` JobResult a client writes after the broker's confirm, and its TTL (s)."""
    record = {"schema_version": SCHEMA_VERSION, "job_id": job["job_id"], "status": "queued", "sku": job["sku"],
              "queued_at_ms": job["submitted_at_ms"], "attempt": 0}
    return encode(record), humantime_seconds(job.get("result_ttl") or "24h")


def amqp_properties(job: dict) -> dict:
    return {"delivery_mode": 2, "content_type": "application/msgpack", "message_id": job["job_id"],
            "timestamp": job["submitted_at_ms"] // 1000, "type": "sandq.job", "app_id": APP_ID,
            "headers": {"schema_version": SCHEMA_VERSION}}


def new_session_name() -> str:
    """An unguessable session name (the name is the only key to a session's files)."""
    return str(uuid.uuid4())
