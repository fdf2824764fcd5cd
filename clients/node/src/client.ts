// The client, in either mode: direct (the broker, Redis and S3 of a sandq config: direct.ts) or
// HTTP (sandq-gateway with an API key: gateway.ts). The same calls, the same results and events.
import type { S3Client } from "@aws-sdk/client-s3";
import { errorFor, RAISED_BY_WAIT, SandqError } from "./errors.js";
import { callbacksFor, type EventCallbacks, hasCallbacks, Transcript } from "./events.js";
import { DirectTransport } from "./direct.js";
import { GatewayTransport } from "./gateway.js";
import { type Config, EVENTS_START, type Names, newSessionName } from "./protocol.js";
import type { EventsOptions, SessionSummary, Transport, WaitOptions } from "./transport.js";
import type { Artifact, Event, InputFile, JobOptions, JobResult, Stream, Unserved } from "./types.js";

export { connectAny, redisClient } from "./direct.js";
export type { EventsOptions, SessionSummary, WaitOptions } from "./transport.js";

/** `run`'s options: how to wait, and callbacks on the job's live events while it runs. */
export interface RunOptions extends WaitOptions, EventCallbacks {}

export interface ClientOptions {
  /** HTTP mode: the gateway's base URL (`https://sandq.example.com`); default `$SANDQ_URL`. */
  url?: string;
  /** HTTP mode: the API key (`sq_<id>_<secret>`, `sandq key create`); default `$SANDQ_API_KEY`. */
  apiKey?: string;
  /** HTTP mode: longest time of one request, ms (default 60000; a `wait` adds what it waits; an
   * event stream's body is not bounded). */
  requestTimeoutMs?: number;
  /** Direct mode: the service config; default `loadConfig()` ($SANDQ_CONFIG, else
   * /etc/sandq/sandq.toml). */
  config?: Config;
  /** Direct mode: another namespace than the config's. */
  namespace?: string;
  /** Direct mode: what `submit` does when no worker serves the job's SKU right now (before the
   * publish it asks the broker: the SKU queue's consumer count). `"warn"` (default):
   * `process.emitWarning(message, "SandqUnservedSkuWarning")` naming the job id, the SKU and its
   * queue, then it submits (the job waits in its queue until a worker comes, or expires after
   * `queues.unserved_ttl`); `"refuse"`: rejects with `UnservedSku`, nothing published, no status
   * written; `"ignore"`: no question asked. A SKU seen served is not asked about again for 10 s;
   * a broker that cannot answer does not stop the submission. Given in HTTP mode: an error. */
  unserved?: Unserved;
}

/** The mode `options` (and the environment) choose:
 *
 * 1. `options.url`: HTTP, with `options.apiKey`, else `$SANDQ_API_KEY`;
 * 2. else `options.config` or `options.namespace`: direct (the environment's URL is ignored);
 * 3. else `$SANDQ_URL` (not empty): HTTP, with `options.apiKey`, else `$SANDQ_API_KEY`;
 * 4. else direct, with the config file.
 *
 * Throws for HTTP without a key, a URL with a config, a key without a URL. */
export function clientMode(options: ClientOptions = {}, env: NodeJS.ProcessEnv = process.env): { mode: "http"; url: string; apiKey: string } | { mode: "direct" } {
  const direct = options.config !== undefined || options.namespace !== undefined;
  if (options.url && direct) throw new Error("give url (HTTP mode) or config/namespace (direct mode), not both");
  const url = options.url || (direct ? "" : env.SANDQ_URL ?? "");
  if (!url) {
    if (options.apiKey !== undefined) throw new Error("an apiKey needs a gateway url (options.url or $SANDQ_URL)");
    return { mode: "direct" };
  }
  const apiKey = options.apiKey ?? env.SANDQ_API_KEY ?? "";
  if (!apiKey) throw new Error(`no API key for the gateway at ${url}: give apiKey or set $SANDQ_API_KEY`);
  return { mode: "http", url, apiKey };
}

/** A direct transport `Client.connect` hands to the constructor it calls next (synchronously). */
let handed: Transport | undefined;

/** A sandq client. HTTP mode: `new Client({ url, apiKey })` (or `new Client()` with `$SANDQ_URL`
 * and `$SANDQ_API_KEY`); direct mode: `await Client.connect()`, which makes either (`clientMode`
 * says which). `close()` when done. */
export class Client {
  private readonly transport: Transport;

  /** An HTTP-mode client (nothing is connected before the first call). Throws when neither
   * `options` nor the environment name a gateway (direct mode is `await Client.connect()`), or
   * as `clientMode` does. */
  constructor(options: ClientOptions = {}) {
    if (handed !== undefined) {
      this.transport = handed;
      handed = undefined;
      return;
    }
    const mode = clientMode(options);
    if (mode.mode !== "http") throw new Error("no gateway url (options.url or $SANDQ_URL); direct mode: await Client.connect()");
    if (options.unserved !== undefined) throw new Error("unserved is direct mode's (the client asks the broker); not for HTTP mode");
    this.transport = new GatewayTransport(mode.url, mode.apiKey, options.requestTimeoutMs);
  }

  /** A client of the mode `clientMode(options)` chooses; direct mode connects to Redis first
   * (the broker is connected on the first submit). */
  static async connect(options: ClientOptions = {}): Promise<Client> {
    if (clientMode(options).mode === "http") return new Client(options);
    handed = await DirectTransport.connect(options);
    return new Client(options);
  }

  /** `http` (through sandq-gateway) or `direct` (the broker, Redis and S3). */
  get mode(): "direct" | "http" {
    return this.transport.mode;
  }

  /** HTTP mode: the gateway's base URL; null in direct mode. */
  get url(): string | null {
    return this.transport instanceof GatewayTransport ? this.transport.url : null;
  }

  private direct(what: string): DirectTransport {
    if (this.transport instanceof DirectTransport) return this.transport;
    throw new SandqError(`${what} is direct mode's; this client speaks to the gateway at ${this.url}`);
  }

  /** Direct mode: the service config (throws in HTTP mode). */
  get config(): Config {
    return this.direct("config").config;
  }

  /** Direct mode: the namespace's queue and key names (throws in HTTP mode). */
  get names(): Names {
    return this.direct("names").names;
  }

  /** Direct mode: the S3 client (throws in HTTP mode). */
  get s3(): S3Client {
    return this.direct("s3").s3;
  }

  // --- files ---------------------------------------------------------------------------------

  /** Uploads a file (a path, or bytes) under its content address, unless it is there already
   * (HTTP: `POST /v1/files`, its id checked); the job sees it at `/work/<path>` (default: the
   * file's name). */
  upload(source: string | Uint8Array, path?: string): Promise<InputFile> {
    return this.transport.upload(source, path);
  }

  /** An artifact's bytes, checked against its size and sha256: direct, through its presigned URL
   * (from S3 by key when it has none); HTTP, through the gateway's redirect to a fresh URL when it
   * is one of a job's `artifacts` (the job known from the result it came in, or `jobId`), else
   * through its own `url` (a rich output's image). */
  download(artifact: Artifact, jobId?: string): Promise<Buffer> {
    return this.transport.download(artifact, jobId);
  }

  /** The exact bytes of stdout or stderr (up to 8 MiB), from S3; the inline text when empty.
   * HTTP mode has no S3: the text when it is exact, else throws. */
  readLog(stream: Stream): Promise<Buffer> {
    return this.transport.readLog(stream);
  }

  // --- jobs ----------------------------------------------------------------------------------

  /** Submits a job and resolves to its id once it is queued: direct, once the broker confirmed
   * it; HTTP, once the gateway accepted it (`Idempotency-Key`: the job's id; sent again on
   * failures, never two jobs). Throws SubmitError when it is not known to be queued (submit again
   * with the same `job_id`); over HTTP also the gateway's typed errors (Unauthorized,
   * InvalidRequest, ForbiddenByQuota, QuotaExceeded, Conflict...). Direct mode first asks whether
   * a worker serves the SKU (`ClientOptions.unserved`): a `SandqUnservedSkuWarning`, or
   * `UnservedSku` with `unserved: "refuse"`. */
  submit(options: JobOptions): Promise<string> {
    return this.transport.submit(options);
  }

  /** Declares the namespace's exchanges and queues with exactly the workers' arguments (workers
   * declare them too; a client may rely on them existing). Direct mode only. */
  declareTopology(): Promise<void> {
    return this.direct("declareTopology").declareTopology();
  }

  /** The job's current result (`queued`, `running` or terminal); null when unknown (over HTTP
   * also another tenant's job). */
  status(jobId: string): Promise<JobResult | null> {
    return this.transport.status(jobId);
  }

  /** Resolves when the job's result is terminal (direct: BLPOP on its done list; HTTP: `?wait=`).
   * Throws WaitTimeout, JobNotFound, and unless `raiseOnError` is false JobRejected, JobExpired
   * or JobInternalError. */
  async wait(jobId: string, options: WaitOptions = {}): Promise<JobResult> {
    const result = await this.transport.wait(jobId, options.timeoutMs);
    if ((options.raiseOnError ?? true) && RAISED_BY_WAIT.has(result.status)) throw errorFor(result);
    return result;
  }

  /** `submit` then `wait`; resolves to the stored result, throws as `wait` does.
   *
   * With any callback in `wait` (`onStdout`, `onStderr`, `onDisplay`, `onEvent`: see
   * `EventCallbacks`), the job's live events are read between the two (`follow`): the program's
   * output as it writes it, its rich outputs as it displays them. A redelivered job's callbacks go
   * on with the new attempt's output (the earlier attempt's was abandoned). The events are best
   * effort (a slow Redis drops some, the worker caps them at 1 MiB): the result is the
   * authoritative record. `timeoutMs` bounds the whole. */
  async run(options: JobOptions, wait: RunOptions = {}): Promise<JobResult> {
    const id = await this.submit(options);
    if (hasCallbacks(wait)) {
      const started = Date.now();
      await this.follow(id, { ...wait, cursor: EVENTS_START });
      if (wait.timeoutMs !== undefined) wait = { ...wait, timeoutMs: Math.max(0, wait.timeoutMs - (Date.now() - started)) };
    }
    return this.wait(id, wait);
  }

  // --- live events ---------------------------------------------------------------------------

  /** The job's live events after `cursor`, in order, as they come (docs/protocol.md "Live
   * events"): `for await (const event of client.events(id)) ...`. Ends after yielding the `end`
   * event, or once the job is no longer queued or running and no event is left (a stream without
   * `end`: expired, or an older worker; in direct mode also an unknown job); or, without error,
   * after `timeoutMs`.
   *
   * To resume after an interruption, pass the `id` of the last event processed as `cursor`: the
   * events after it come, with no gap and no duplicate (unless the stream was trimmed: it keeps
   * about 10,000 entries). Direct mode reads on a Redis connection of its own (XREAD BLOCK), closed
   * when the loop ends (`break` included); throws RangeError for a `blockMs` out of range, and
   * node-redis' errors. HTTP mode reads the gateway's server-sent events and, when the connection
   * drops or the gateway ends the stream while the job runs, reconnects with `Last-Event-ID` (the
   * last event yielded): no gap, no duplicate. It throws JobNotFound for a job the tenant does not
   * have, the gateway's typed errors, and a SandqError after 8 failed connections in a row. */
  events(jobId: string, options: EventsOptions = {}): AsyncGenerator<Event, void, undefined> {
    return this.transport.events(jobId, options);
  }

  /** Reads the job's `events` (same options) into the callbacks, as `run` does (`EventCallbacks`
   * says which event goes where, awaiting what they return), and resolves to what they made: the
   * newest attempt's stdout, stderr and displays, the terminal status when `end` came. */
  async follow(jobId: string, options: EventsOptions & EventCallbacks = {}): Promise<Transcript> {
    const transcript = new Transcript();
    for await (const event of this.events(jobId, options)) {
      for (const call of callbacksFor(options, event, transcript.push(event))) await call();
    }
    return transcript;
  }

  /** Asks the workers to cancel the job (skipped when queued, killed when running); false when
   * it is unknown or already finished. The result then becomes `cancelled`. */
  cancel(jobId: string): Promise<boolean> {
    return this.transport.cancel(jobId);
  }

  // --- sessions ------------------------------------------------------------------------------

  /** A session: its jobs share `/work` and (Python notebook) variables. A new unguessable
   * name unless one is given. */
  session(name?: string): Session {
    return new Session(this, name ?? newSessionName());
  }

  /** The sessions and their expiry (Unix ms), soonest first: direct, the namespace's; HTTP, the
   * tenant's (with their files, bytes and cells; a session no job used yet last, expiry null). */
  sessions(): Promise<SessionSummary[]> {
    return this.transport.sessions();
  }

  // --- lifetime ------------------------------------------------------------------------------

  /** Closes the connections (direct), or cuts the requests and streams under way (HTTP). */
  close(): Promise<void> {
    return this.transport.close();
  }
}

/** Jobs of one session (`session` set on each). */
export class Session {
  constructor(readonly client: Client, readonly name: string) {}

  submit(options: JobOptions): Promise<string> {
    return this.client.submit({ ...options, session: this.name });
  }

  /** `Client.run` in the session (the same options, the callbacks included). */
  run(options: JobOptions, wait: RunOptions = {}): Promise<JobResult> {
    return this.client.run({ ...options, session: this.name }, wait);
  }
}
