// Direct mode: the broker (amqplib: confirm channel, mandatory), Redis (node-redis) and S3 (the
// AWS SDK) of a sandq config, as docs/protocol.md says a client uses them.
import { readFile } from "node:fs/promises";
import { basename } from "node:path";
import * as amqp from "amqplib";
import { createClient, createCluster, createSentinel, RESP_TYPES } from "redis";
import { GetObjectCommand, HeadObjectCommand, PutObjectCommand, S3Client } from "@aws-sdk/client-s3";
import { decode, encode } from "@msgpack/msgpack";
import { JobNotFound, SandqError, SubmitError, UnservedSku, WaitTimeout } from "./errors.js";
import { ACTIVE, parseXRead } from "./events.js";
import {
  amqpAddresses, APP_ID, BLOCK_S, buildJob, CAS_SCRIPT, type Config, durationMs, EVENTS_COUNT, EVENTS_START, humantimeSeconds, inputKey, loadConfig, Names,
  queueArguments, SCHEMA_VERSION, sha256Hex, SKUS,
} from "./protocol.js";
import type { EventsOptions, SessionSummary, Transport } from "./transport.js";
import {
  type Artifact, type Event, type InputFile, type JobOptions, type JobResult, normalizeResult, type Stream, TERMINAL, type Unserved,
} from "./types.js";

const UNSERVED: readonly Unserved[] = ["warn", "refuse", "ignore"];

/** How long (ms) a SKU seen served is taken to stay so before a submission asks the broker again
 * (the Rust client's `SERVED_RECHECK`); a SKU seen unserved is asked again every time. */
export const SERVED_RECHECK_MS = 10_000;

// eslint-disable-next-line @typescript-eslint/no-explicit-any
type Redis = any;

/** A node-redis client of the Redis `config` names (`redisMode`): one server, a Redis Cluster
 * (`createCluster`: routes each command by its key's slot, follows MOVED/ASK, rediscovers the
 * topology after a failover) or the primary the sentinels name (`createSentinel`). Not connected.
 * docs/protocol.md "Redis deployments". */
export function redisClient(config: Config): Redis {
  if (config.redisMode === "cluster") {
    const first = new URL(config.redisNodes[0] ?? "redis://127.0.0.1:6379/");
    const auth = first.password ? { username: decodeURIComponent(first.username) || undefined, password: decodeURIComponent(first.password) } : {};
    return createCluster({ rootNodes: config.redisNodes.map((url) => ({ url })), defaults: auth });
  }
  if (config.redisMode === "sentinel") {
    const sentinelRootNodes = config.redisNodes.map((u) => {
      const url = new URL(u);
      return { host: url.hostname, port: Number(url.port || 26379) };
    });
    return createSentinel({ name: config.redisService, sentinelRootNodes });
  }
  return createClient({ url: config.redisUrl });
}

/** A connection to the first broker address that answers, trying `amqpAddresses(config)` from
 * index `start` (modulo their count) round the list, each once and each within 10 s; with the
 * index used. Rejects with the last address's error when none answers. */
export async function connectAny(config: Config, start: number): Promise<[amqp.ChannelModel, number]> {
  const addresses = amqpAddresses(config);
  let last: unknown = new Error("no AMQP address configured");
  for (let offset = 0; offset < addresses.length; offset++) {
    const index = (start + offset) % addresses.length;
    try {
      const connection = await amqp.connect(addresses[index], { timeout: 10_000, clientProperties: { connection_name: "sandq-node" } });
      return [connection, index];
    } catch (e) {
      last = e;
    }
  }
  throw last;
}

/** Direct mode: the broker, Redis and S3 of a sandq config (docs/protocol.md). `Client.connect`
 * makes one; `Client` delegates to it. */
export class DirectTransport implements Transport {
  readonly mode = "direct";
  readonly config: Config;
  readonly names: Names;
  readonly s3: S3Client;
  private amqp: amqp.ChannelModel | null = null;
  private channel: amqp.ConfirmChannel | null = null;
  /** Index in `amqpAddresses(config)` of the node `amqp` is (or was last) on. */
  private amqpIndex = -1;
  private returned = new Set<string>();
  private publishing: Promise<unknown> = Promise.resolve();
  /** What `submit` does with a job whose SKU no worker serves (`ClientOptions.unserved`). */
  readonly unserved: Unserved;
  /** SKU -> when (`Date.now()`) its queue was last seen with a consumer. */
  private servedAt = new Map<string, number>();

  private constructor(config: Config, private readonly redis: Redis, private readonly blocking: Redis, unserved: Unserved) {
    this.config = config;
    this.unserved = unserved;
    this.names = new Names(config.namespace);
    this.s3 = new S3Client({
      endpoint: config.s3Endpoint,
      region: config.s3Region,
      forcePathStyle: true,
      credentials: config.s3AccessKeyId
        ? { accessKeyId: config.s3AccessKeyId, secretAccessKey: config.s3SecretAccessKey ?? "" }
        : undefined,
    });
  }

  /** Connects to Redis (the broker is connected on the first submit). */
  static async connect(options: { config?: Config; namespace?: string; unserved?: Unserved } = {}): Promise<DirectTransport> {
    const unserved = options.unserved ?? "warn";
    if (!UNSERVED.includes(unserved)) throw new RangeError(`unserved must be "warn", "refuse" or "ignore", not ${JSON.stringify(unserved)}`);
    let config = options.config ?? loadConfig();
    if (options.namespace) config = { ...config, namespace: options.namespace };
    // Results are MessagePack: bulk strings come back as Buffers.
    const base = redisClient(config);
    base.on("error", () => {});
    // BLPOP blocks its connection: a connection of its own.
    const blocking = base.duplicate();
    blocking.on("error", () => {});
    await Promise.all([base.connect(), blocking.connect()]);
    const mapping = { [RESP_TYPES.BLOB_STRING]: Buffer };
    return new DirectTransport(config, base.withTypeMapping(mapping), blocking.withTypeMapping(mapping), unserved);
  }

  // --- files ---------------------------------------------------------------------------------

  /** Uploads a file (a path, or bytes) under its content address, unless it is there already;
   * the job sees it at `/work/<path>` (default: the file's name). */
  async upload(source: string | Uint8Array, path?: string): Promise<InputFile> {
    const data = typeof source === "string" ? await readFile(source) : source;
    if (path === undefined) {
      if (typeof source !== "string") throw new Error("give the path inside /work for bytes");
      path = basename(source);
    }
    const sha256 = sha256Hex(data);
    const key = inputKey(sha256);
    let exists = false;
    try {
      const head = await this.s3.send(new HeadObjectCommand({ Bucket: this.config.s3Bucket, Key: key }));
      exists = head.ContentLength === data.length;
    } catch {
      exists = false;
    }
    if (!exists) await this.s3.send(new PutObjectCommand({ Bucket: this.config.s3Bucket, Key: key, Body: data }));
    return { key, path, size: data.length, sha256 };
  }

  /** An artifact's bytes, through its presigned URL (from S3 by key when it has none), checked
   * against its size and sha256. */
  async download(artifact: Artifact): Promise<Buffer> {
    let data: Buffer;
    if (artifact.url) {
      const response = await fetch(artifact.url);
      if (!response.ok) throw new SandqError(`artifact ${artifact.path}: HTTP ${response.status}`);
      data = Buffer.from(await response.arrayBuffer());
    } else {
      data = await this.getObject(artifact.key);
    }
    if (data.length !== artifact.size || sha256Hex(data) !== artifact.sha256) {
      throw new SandqError(`artifact ${artifact.path}: downloaded ${data.length} bytes that do not match its size or sha256`);
    }
    return data;
  }

  /** The exact bytes of stdout or stderr (up to 8 MiB), from S3; the inline text when empty. */
  async readLog(stream: Stream): Promise<Buffer> {
    return stream.log_key ? this.getObject(stream.log_key) : Buffer.from(stream.text);
  }

  private async getObject(key: string): Promise<Buffer> {
    const object = await this.s3.send(new GetObjectCommand({ Bucket: this.config.s3Bucket, Key: key }));
    if (!object.Body) throw new SandqError(`s3 object ${key} has no body`);
    return Buffer.from(await object.Body.transformToByteArray());
  }

  // --- submitting ----------------------------------------------------------------------------

  private async openChannel(): Promise<amqp.ConfirmChannel> {
    if (this.channel) return this.channel;
    const [connection, index] = await connectAny(this.config, this.amqpIndex + 1);
    this.amqpIndex = index;
    connection.on("error", () => {});
    connection.on("close", () => { if (this.amqp === connection) { this.amqp = null; this.channel = null; } });
    const channel = await connection.createConfirmChannel();
    channel.on("error", () => {});
    channel.on("close", () => { if (this.channel === channel) this.channel = null; });
    // A mandatory message no queue took comes back before its confirm.
    channel.on("return", (message: amqp.Message) => {
      if (message.properties.messageId) this.returned.add(String(message.properties.messageId));
    });
    this.amqp = connection;
    this.channel = channel;
    return channel;
  }

  private async publishOnce(job: Record<string, unknown>): Promise<void> {
    const channel = await this.openChannel();
    const id = String(job.job_id);
    const body = Buffer.from(encode(job));
    const confirmMs = humantimeSeconds(this.config.confirmTimeout ?? "30s") * 1000;
    await new Promise<void>((resolve, reject) => {
      // No confirm in time: give up on this node (the caller publishes again on the next).
      const timer = setTimeout(() => reject(new Error(`no publisher confirm within ${confirmMs} ms`)), confirmMs);
      const settle = (err: unknown) => { clearTimeout(timer); if (err) reject(err); else resolve(); };
      channel.publish(this.names.exchange, String(job.sku), body, {
        mandatory: true,
        deliveryMode: 2,
        contentType: "application/msgpack",
        messageId: id,
        timestamp: Math.floor(Number(job.submitted_at_ms) / 1000),
        type: "sandq.job",
        appId: APP_ID,
        headers: { schema_version: SCHEMA_VERSION },
      }, settle);
    });
    if (this.returned.delete(id)) throw new SubmitError(`job ${id} not accepted by the broker: returned (no queue for sku ${String(job.sku)})`);
  }

  /** The consumer count of the SKU's queue: a passive declare (`checkQueue`) on a channel of its
   * own, closed after; 0 when the queue does not exist (404 closes that channel), null when the
   * broker did not answer (the publish then connects again and reports). */
  private async consumers(sku: string): Promise<number | null> {
    let channel: amqp.Channel;
    try {
      await this.openChannel();
      if (!this.amqp) return null;
      channel = await this.amqp.createChannel();
    } catch {
      await this.closeAmqp();
      return null;
    }
    channel.on("error", () => {});
    try {
      return (await channel.checkQueue(this.names.queue(sku))).consumerCount;
    } catch (e) {
      return (e as { code?: number }).code === 404 ? 0 : null;
    } finally {
      // Already closed by the broker after a 404.
      await channel.close().catch(() => {});
    }
  }

  /** Applies `unserved` to the job before it is published: throws `UnservedSku` ("refuse") or
   * emits a `SandqUnservedSkuWarning` ("warn") when the SKU's queue has no consumer. */
  private async checkServed(job: Record<string, unknown>): Promise<void> {
    const sku = String(job.sku);
    const at = this.servedAt.get(sku);
    if (this.unserved === "ignore" || (at !== undefined && Date.now() - at < SERVED_RECHECK_MS)) return;
    const count = await this.consumers(sku);
    if (count === null) return;
    if (count > 0) {
      this.servedAt.set(sku, Date.now());
      return;
    }
    const id = String(job.job_id);
    const queue = this.names.queue(sku);
    if (this.unserved === "refuse") throw new UnservedSku(id, sku, queue);
    const ttl = this.config.unservedTtl;
    const fate = durationMs(ttl) > 0 ? `or expires after ${ttl} (queues.unserved_ttl)` : "with no expiry";
    process.emitWarning(`no worker serves SKU ${sku} right now (queue ${queue} has no consumer): job ${id} waits in the queue until one does, ${fate}`,
      "SandqUnservedSkuWarning");
  }

  private async publish(job: Record<string, unknown>): Promise<void> {
    const id = String(job.job_id);
    // A nack, a closed channel (e.g. no such exchange), a lost connection or a confirm that
    // does not come: publish again, same body and job id, on the next broker address; at most
    // once per address plus once. A duplicate is harmless (docs/protocol.md, "Several broker
    // addresses").
    const attempts = amqpAddresses(this.config).length + 1;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.publishOnce(job);
      } catch (e) {
        if (e instanceof SubmitError) throw e;
        await this.closeAmqp();
        if (attempt >= attempts) throw new SubmitError(`job ${id} not submitted: ${e instanceof Error ? e.message : String(e)}`);
      }
    }
  }

  /** Submits a job and resolves to its id once the broker confirmed it. Before the publish,
   * unless `unserved` is "ignore", it asks whether a worker serves the SKU (`checkServed`). */
  async submit(options: JobOptions): Promise<string> {
    const job = buildJob(options);
    // One publish at a time on the channel (confirms are matched to their publish in order);
    // the question about the SKU, on the same connection, in the same turn.
    const published = this.publishing.then(async () => {
      await this.checkServed(job);
      await this.publish(job);
    });
    this.publishing = published.catch(() => {});
    await published;
    const id = String(job.job_id);
    const record = encode({
      schema_version: SCHEMA_VERSION, job_id: id, status: "queued", sku: job.sku,
      queued_at_ms: job.submitted_at_ms, attempt: 0,
    });
    const ttl = humantimeSeconds(String(job.result_ttl ?? "24h"));
    await this.redis.eval(CAS_SCRIPT, {
      keys: [this.names.job(id), this.names.done(id)],
      arguments: ["queued", Buffer.from(record), String(ttl)],
    });
    return id;
  }

  /** Declares the namespace's exchanges and queues with exactly the workers' arguments (workers
   * declare them too; a client may rely on them existing). */
  async declareTopology(): Promise<void> {
    const [connection] = await connectAny(this.config, 0);
    try {
      let ch = await connection.createChannel();
      // A refused declaration closes the channel with an error event, answered below.
      ch.on("error", () => {});
      const n = this.names;
      await ch.assertExchange(n.dlx, "fanout", { durable: true });
      await ch.assertQueue(n.deadQueue, { durable: true, arguments: { "x-queue-type": "quorum" } });
      await ch.bindQueue(n.deadQueue, n.dlx, "");
      await ch.assertExchange(n.exchange, "direct", { durable: true });
      for (const sku of SKUS) {
        const args = queueArguments(n.dlx, this.config.deliveryLimit, this.config.unservedTtl);
        try {
          await ch.assertQueue(n.queue(sku), { durable: true, arguments: args });
        } catch (e) {
          // 406 PRECONDITION_FAILED: declared by an earlier version with other arguments
          // (docs/operations.md); it is used as it is. The broker closed the channel.
          if ((e as { code?: number }).code !== 406) throw e;
          ch = await connection.createChannel();
          ch.on("error", () => {});
          await ch.checkQueue(n.queue(sku));
        }
        await ch.bindQueue(n.queue(sku), n.exchange, sku);
      }
    } finally {
      await connection.close();
    }
  }

  // --- results -------------------------------------------------------------------------------

  /** The job's current result (`queued`, `running` or terminal); null when unknown. */
  async status(jobId: string): Promise<JobResult | null> {
    const raw: Buffer | null = await this.redis.hGet(this.names.job(jobId), "result");
    return raw == null ? null : normalizeResult(decode(raw) as Record<string, unknown>);
  }

  /** Resolves to the job's terminal result (BLPOP on its done list, reading the hash before and
   * after every wait). Throws WaitTimeout and JobNotFound. */
  async wait(jobId: string, timeoutMs?: number): Promise<JobResult> {
    const deadline = timeoutMs === undefined ? undefined : Date.now() + timeoutMs;
    for (;;) {
      const result = await this.status(jobId);
      if (result === null) throw new JobNotFound(`job ${jobId} is unknown (never submitted, or its result expired)`);
      if (TERMINAL.has(result.status)) return result;
      const left = deadline === undefined ? BLOCK_S : Math.min(BLOCK_S, (deadline - Date.now()) / 1000);
      if (left <= 0) throw new WaitTimeout(`job ${jobId} is still ${result.status} after ${timeoutMs} ms`);
      await this.blocking.blPop(this.names.done(jobId), Math.max(left, 0.01));
    }
  }

  // --- live events ---------------------------------------------------------------------------

  /** The job's live events after `cursor`, in order, as they come (docs/protocol.md "Live
   * events"): `for await (const event of client.events(id)) ...`. Ends after yielding the `end`
   * event, or when a read that waited `blockMs` found nothing new and the job is no longer queued
   * or running (a stream without `end`: expired, or an older worker; an unknown job), after the
   * events still unread; or, without error, after `timeoutMs`.
   *
   * To resume after an interruption, pass the `id` of the last event processed as `cursor`: the
   * events after it come, with no gap and no duplicate (unless the stream was trimmed: it keeps
   * about 10,000 entries). Each iteration reads on a Redis connection of its own (XREAD BLOCK
   * holds it), closed when the loop ends (`break` included). Throws RangeError for a `blockMs`
   * out of range, and node-redis' errors. */
  async *events(jobId: string, options: EventsOptions = {}): AsyncGenerator<Event, void, undefined> {
    const blockMs = options.blockMs ?? BLOCK_S * 1000;
    if (!(blockMs > 0 && Number.isFinite(blockMs))) throw new RangeError(`blockMs must be more than 0, not ${blockMs}`);
    const key = this.names.events(jobId);
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    let cursor = options.cursor ?? EVENTS_START;
    const reader = redisClient(this.config);
    reader.on("error", () => {});
    try {
      await reader.connect();
      let over = false; // the job is over: read what is left without waiting
      for (;;) {
        let batch: Event[];
        if (over) {
          batch = parseXRead(await reader.xRead({ key, id: cursor }, { COUNT: EVENTS_COUNT }));
          if (batch.length === 0) return;
        } else {
          const left = deadline === undefined ? blockMs : Math.min(blockMs, deadline - Date.now());
          if (left <= 0) return;
          batch = parseXRead(await reader.xRead({ key, id: cursor }, { COUNT: EVENTS_COUNT, BLOCK: Math.max(1, Math.round(left)) }));
          if (batch.length === 0) {
            over = !(await this.active(jobId));
            continue;
          }
        }
        for (const event of batch) {
          cursor = event.id;
          yield event;
          if (event.type === "end") return;
        }
      }
    } finally {
      // Closed gracefully when it is idle (it is, between reads); dropped when it never opened.
      await reader.close().catch(() => { try { reader.destroy(); } catch { /* never opened */ } });
    }
  }

  /** The job's hash says `queued` or `running`. */
  private async active(jobId: string): Promise<boolean> {
    const status: Buffer | null = await this.redis.hGet(this.names.job(jobId), "status");
    return status != null && ACTIVE.has(status.toString());
  }

  /** Asks the workers to cancel the job (skipped when queued, killed when running); false when
   * it is unknown or already finished. The result then becomes `cancelled`. */
  async cancel(jobId: string): Promise<boolean> {
    const key = this.names.job(jobId);
    const status: Buffer | null = await this.redis.hGet(key, "status");
    if (status == null || TERMINAL.has(status.toString())) return false;
    const ttl = Number(await this.redis.ttl(key));
    await this.redis.set(this.names.cancel(jobId), "1", { expiration: { type: "EX", value: ttl > 0 ? ttl : 86400 } });
    return true;
  }

  // --- sessions ------------------------------------------------------------------------------

  /** The namespace's sessions and their expiry (Unix ms), soonest first. */
  async sessions(): Promise<SessionSummary[]> {
    const rows: { value: Buffer; score: number }[] = await this.redis.zRangeWithScores(this.names.sessions, 0, -1);
    return rows.map((r) => ({ name: r.value.toString(), expiresAtMs: Number(r.score) }));
  }

  // --- lifetime ------------------------------------------------------------------------------

  private async closeAmqp(): Promise<void> {
    const connection = this.amqp;
    this.amqp = null;
    this.channel = null;
    if (connection) await connection.close().catch(() => {});
  }

  async close(): Promise<void> {
    await this.closeAmqp();
    await Promise.all([this.redis.close(), this.blocking.close()]);
  }
}
