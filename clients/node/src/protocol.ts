// The wire protocol of docs/protocol.md: the service config, names, the JobSpec, the
// compare-and-set script.
import { createHash, randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { parse as parseToml } from "smol-toml";
import type { JobOptions, Sku } from "./types.js";

export const SCHEMA_VERSION = 1;
export const DEFAULT_CONFIG_PATH = "/etc/sandq/sandq.toml";
export const APP_ID = "sandq-node";
export const SKUS: readonly Sku[] = ["S", "M", "L", "XL"];
/** Longest single BLPOP on a done list, or XREAD BLOCK on an event stream by default (s): the
 * hash is read again after each. */
export const BLOCK_S = 5;
/** The cursor of a whole event stream (docs/protocol.md "Live events"): XREAD from it returns
 * the first entry on. */
export const EVENTS_START = "0-0";
/** The most entries one XREAD of an event stream returns. */
export const EVENTS_COUNT = 500;

/** The compare-and-set script of docs/protocol.md ("Writing a status"): schemas/protocol/cas.lua,
 * byte for byte (Rust test: every_copy_of_the_cas_script_is_cas_lua). Edit that file, then this. */
export const CAS_SCRIPT = `\
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
`;

/** Where the services are: the sandq config file's `[amqp]`, `[redis]`, `[s3]` and `namespace`. */
export interface Config {
  amqpUrl: string;
  /** `[amqp] urls`: the nodes of a RabbitMQ cluster, tried in order and round-robin after a
   * failure; replaces `amqpUrl` when not empty (docs/protocol.md, "Several broker addresses"). */
  amqpUrls?: string[];
  /** `[amqp] confirm_timeout` (humantime, default "30s"): no publisher confirm within it, the
   * job is published again on the next address. */
  confirmTimeout?: string;
  redisUrl: string;
  /** `[redis] mode`: `single` (`redisUrl`), `cluster` (`redisNodes`: some of the cluster's nodes)
   * or `sentinel` (`redisNodes`: the sentinels; `redisService`: the primary's name); docs/protocol.md
   * "Redis deployments". */
  redisMode: "single" | "cluster" | "sentinel";
  redisNodes: string[];
  redisService: string;
  s3Endpoint: string;
  s3Region: string;
  s3Bucket: string;
  s3AccessKeyId?: string;
  s3SecretAccessKey?: string;
  namespace: string;
  deliveryLimit: number;
  /** `[queues] unserved_ttl`: a job no worker takes within it expires (the queues' x-message-ttl). */
  unservedTtl: string;
}

/** `[redis] mode`, checked. */
function redisMode(mode: string): Config["redisMode"] {
  if (mode === "single" || mode === "cluster" || mode === "sentinel") return mode;
  throw new Error(`redis mode ${JSON.stringify(mode)} is not single, cluster or sentinel`);
}

/** `[redis] nodes`: a TOML array, or one string of comma-separated URLs (an environment variable). */
export function urlList(value: unknown): string[] {
  const items = typeof value === "string" ? value.split(",") : Array.isArray(value) ? value.map(String) : [];
  return items.map((u) => u.trim()).filter((u) => u !== "");
}

/** The broker addresses to try, in order: `amqpUrls` when not empty, else `amqpUrl`. */
export function amqpAddresses(config: Config): string[] {
  return config.amqpUrls && config.amqpUrls.length > 0 ? [...config.amqpUrls] : [config.amqpUrl];
}

/** `[amqp] urls` as a TOML list or one comma-separated string (as `SANDQ__AMQP__URLS` gives
 * it); blank items dropped. */
export function parseUrls(value: unknown): string[] {
  const items = typeof value === "string" ? value.split(",") : Array.isArray(value) ? value.map(String) : [];
  return items.map((i) => i.trim()).filter((i) => i !== "");
}

/** `path`, else `$SANDQ_CONFIG`, else /etc/sandq/sandq.toml. */
export function configPath(path?: string): string {
  return path || process.env.SANDQ_CONFIG || DEFAULT_CONFIG_PATH;
}

/** Reads the sandq config (the file the worker and the `sandq` CLI read); a missing file is an
 * error. `SANDQ__SECTION__KEY` environment variables override its keys, as for the worker. */
export function loadConfig(path?: string): Config {
  const doc = parseToml(readFileSync(configPath(path), "utf8")) as Record<string, unknown>;
  const get = <T>(section: string | null, key: string, fallback: T): T | string => {
    const env = `SANDQ__${section ? `${section.toUpperCase()}__` : ""}${key.toUpperCase()}`;
    if (process.env[env] !== undefined) return process.env[env] as string;
    const table = (section ? doc[section] ?? {} : doc) as Record<string, unknown>;
    return (table[key] as T | undefined) ?? fallback;
  };
  return {
    amqpUrl: String(get("amqp", "url", "amqp://guest:guest@127.0.0.1:5672/%2f")),
    amqpUrls: parseUrls(get<unknown>("amqp", "urls", [])),
    confirmTimeout: String(get("amqp", "confirm_timeout", "30s")),
    redisUrl: String(get("redis", "url", "redis://127.0.0.1:6379/")),
    redisMode: redisMode(String(get("redis", "mode", "single"))),
    redisNodes: urlList(get<unknown>("redis", "nodes", [])),
    redisService: String(get("redis", "service", "mymaster")),
    s3Endpoint: String(get("s3", "endpoint", "http://127.0.0.1:3900")),
    s3Region: String(get("s3", "region", "garage")),
    s3Bucket: String(get("s3", "bucket", "sandq")),
    s3AccessKeyId: get<string | undefined>("s3", "access_key_id", undefined),
    s3SecretAccessKey: get<string | undefined>("s3", "secret_access_key", undefined),
    namespace: String(get(null, "namespace", "sandq")),
    deliveryLimit: Number(get("amqp", "delivery_limit", 5)),
    unservedTtl: String(get("queues", "unserved_ttl", "1h")),
  };
}

/** Queue, exchange and key names of a namespace. */
export class Names {
  readonly exchange: string;
  readonly dlx: string;
  readonly deadQueue: string;
  readonly sessions: string;

  constructor(readonly ns: string) {
    this.exchange = `${ns}.jobs`;
    this.dlx = `${ns}.dlx`;
    this.deadQueue = `${ns}.dead`;
    this.sessions = `${ns}:sessions`;
  }

  queue(sku: string): string { return `${this.ns}.jobs.${sku}`; }
  // Redis key layout 2 (docs/protocol.md "Redis key layout"): `{<id>}` is a Redis Cluster hash
  // tag, so a job's keys share a slot and the CAS script (two keys) runs on a cluster.
  job(id: string): string { return `${this.ns}:job:{${id}}`; }
  done(id: string): string { return `${this.job(id)}:done`; }
  cancel(id: string): string { return `${this.job(id)}:cancel`; }
  /** The job's live events, a Redis Stream (docs/protocol.md "Live events"). */
  events(id: string): string { return `${this.job(id)}:events`; }
}

export function sha256Hex(data: Uint8Array): string {
  return createHash("sha256").update(data).digest("hex");
}

export function inputKey(sha256: string): string {
  return `inputs/sha256/${sha256}`;
}

// The worker's duration grammar (docs/protocol.md, "Durations"): one or more spans, each an
// integer with an optional fraction and a unit, spaces allowed between and within spans.
const UNITS: Record<string, number> = {};
for (const [seconds, names] of [
  [1e-9, ["nanos", "nsec", "ns"]], [1e-6, ["usec", "us", "µs"]], [1e-3, ["millis", "msec", "ms"]],
  [1, ["seconds", "second", "secs", "sec", "s"]], [60, ["minutes", "minute", "min", "mins", "m"]],
  [3600, ["hours", "hour", "hr", "hrs", "h"]], [86400, ["days", "day", "d"]],
  [604800, ["weeks", "week", "wk", "wks", "w"]], [2630016, ["months", "month", "M"]],
  [31557600, ["years", "year", "yr", "yrs", "y"]],
] as const) {
  for (const name of names) UNITS[name] = seconds;
}
const SPAN = /\s*(\d+)(?:\.(\d+))?\s*([A-Za-zµ]+)\s*/y;

/** Seconds of a humantime duration ("60s", "2m 30s", "1.5h", "7days"), for key TTLs: whole
 * seconds, at least 1. Throws for what the worker refuses ("90", "1H", ""). */
export function humantimeSeconds(value: string): number {
  // Past 2^53 ms a double is no longer exact; TTLs are far below.
  return Math.max(1, Math.floor(durationSeconds(value) + 1e-9));
}

/** Whole milliseconds of a humantime duration (0 for "0s"). */
export function durationMs(value: string): number {
  return Math.floor(durationSeconds(value) * 1000 + 1e-6);
}

function durationSeconds(value: string): number {
  if (value.trim() === "") throw new Error(`bad duration ${JSON.stringify(value)}: empty`);
  let total = 0;
  SPAN.lastIndex = 0;
  while (SPAN.lastIndex < value.length) {
    const match = SPAN.exec(value);
    if (!match || !(match[3] in UNITS)) {
      throw new Error(`bad duration ${JSON.stringify(value)}: expected spans such as 60s or 2m 30s`);
    }
    const [, whole, frac, unit] = match;
    total += Number(`${whole}.${frac ?? "0"}`) * UNITS[unit];
  }
  return total;
}

/** The SKU queues' arguments (docs/protocol.md, "Topology"); `x-message-ttl` unless the TTL is 0. */
export function queueArguments(dlx: string, deliveryLimit: number, unservedTtl: string): Record<string, unknown> {
  const args: Record<string, unknown> = { "x-queue-type": "quorum", "x-delivery-limit": deliveryLimit, "x-dead-letter-exchange": dlx };
  const ttl = durationMs(unservedTtl);
  if (ttl > 0) args["x-message-ttl"] = ttl;
  return args;
}

/** A JobSpec map. Only what the protocol requires of a client is checked here (one of code and
 * entrypoint, the SKU); the worker validates the rest and says why in a `rejected` result. */
export function buildJob(options: JobOptions): Record<string, unknown> {
  if ((options.code === undefined) === (options.entrypoint === undefined)) {
    throw new Error("give exactly one of code and entrypoint");
  }
  if (options.callback_url !== undefined) throw new Error("callback_url is the gateway's (HTTP mode): workers send no webhooks");
  const sku = options.sku ?? "M";
  if (!SKUS.includes(sku)) throw new Error(`unknown sku ${sku}: one of ${SKUS.join(", ")}`);
  const job: Record<string, unknown> = {
    schema_version: SCHEMA_VERSION,
    job_id: options.job_id ?? randomUUID(),
    sku,
    runtime: options.runtime ?? "python",
    submitted_at_ms: Date.now(),
  };
  if (options.code !== undefined) job.code = options.code;
  if (options.entrypoint !== undefined) job.entrypoint = options.entrypoint;
  if (options.inputs?.length) job.inputs = options.inputs.map(({ key, path, size, sha256 }) => ({ key, path, size, sha256 }));
  if (options.args?.length) job.args = options.args;
  if (options.stdin !== undefined) {
    job.stdin = typeof options.stdin === "string" ? new TextEncoder().encode(options.stdin) : options.stdin;
  }
  if (options.env && Object.keys(options.env).length) job.env = options.env;
  for (const key of ["timeout", "result_ttl", "network", "deadline_ms", "mode", "session"] as const) {
    if (options[key] !== undefined) job[key] = options[key];
  }
  return job;
}

/** An unguessable session name (the name is the only key to a session's files). */
export function newSessionName(): string {
  return randomUUID();
}
