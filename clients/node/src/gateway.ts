// HTTP mode: the same calls through sandq-gateway (docs/gateway.md, docs/openapi.json), with
// Node's fetch. An API key instead of the broker's, Redis's and S3's credentials; the tenant's
// own job ids; the gateway's problem documents as typed errors (errors.ts).
import { randomUUID } from "node:crypto";
import { readFile } from "node:fs/promises";
import { basename } from "node:path";
import { Conflict, errorForProblem, GatewayError, JobNotFound, type Problem, SandqError, SubmitError, Unavailable, WaitTimeout } from "./errors.js";
import { EVENTS_START, inputKey, sha256Hex, SKUS } from "./protocol.js";
import { parseGatewayEvent, SseParser } from "./sse.js";
import type { EventsOptions, SessionSummary, Transport } from "./transport.js";
import { type Artifact, type Event, type InputFile, type JobOptions, type JobResult, normalizeResult, type Stream, TERMINAL } from "./types.js";

/** Default longest time of one request (ms); a `wait` adds the time it waits. */
export const REQUEST_TIMEOUT_MS = 60_000;
/** The longest `?wait=` one request asks for (the gateway caps it at its `max_wait`, 60 s by
 * default); `wait` asks again until the job is over or its own time-out. */
const WAIT_CHUNK_MS = 30_000;
/** Attempts of one request when the gateway cannot be reached or answers 502, 503, 504 (or a
 * 409 with `Retry-After`: the same submission under way). */
const ATTEMPTS = 5;
/** Consecutive failed connections of an event stream before `events` gives up. */
const STREAM_ATTEMPTS = 8;
const USER_AGENT = "sandq-node/0.1.0";

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** The pause before retry `attempt` (from 1): the gateway's `Retry-After` (at most 5 s), else
 * 200 ms doubling up to 3.2 s. */
function backoffMs(attempt: number, retryAfterS: number | null): number {
  if (retryAfterS !== null && Number.isFinite(retryAfterS)) return Math.min(5, Math.max(0, retryAfterS)) * 1000;
  return Math.min(3200, 200 * 2 ** (attempt - 1));
}


/** A controller aborted when `parent` is, or after `timeoutMs`; `dispose` unlinks it (so a
 * long-lived client's signal does not collect a listener per request). */
function linked(parent: AbortSignal, timeoutMs?: number): { signal: AbortSignal; abort: () => void; dispose: () => void } {
  const controller = new AbortController();
  const abort = () => controller.abort(parent.reason);
  if (parent.aborted) abort();
  else parent.addEventListener("abort", abort, { once: true });
  const timer = timeoutMs === undefined ? undefined : setTimeout(() => controller.abort(new Error(`no answer within ${timeoutMs} ms`)), timeoutMs);
  return {
    signal: controller.signal,
    abort: () => controller.abort(),
    dispose: () => {
      clearTimeout(timer);
      parent.removeEventListener("abort", abort);
    },
  };
}

/** A response read whole. */
interface Reply {
  status: number;
  statusText: string;
  headers: Headers;
  text: string;
}

function retryAfterOf(headers: Headers): number | null {
  const header = headers.get("retry-after");
  return header !== null && /^\d+$/.test(header.trim()) ? Number(header.trim()) : null;
}

/** The problem document of a reply that is not a success (a body that is not one, a proxy's
 * error page, becomes `about:blank` with the status). */
export function problemOf(reply: Reply): Problem {
  try {
    const value = JSON.parse(reply.text) as Partial<Problem>;
    if (value && typeof value.type === "string" && typeof value.status === "number") {
      return { ...value, title: String(value.title ?? ""), detail: String(value.detail ?? ""), type: value.type, status: value.status } as Problem;
    }
  } catch {
    // not JSON
  }
  const after = retryAfterOf(reply.headers);
  return {
    type: "about:blank", title: reply.statusText, status: reply.status, detail: reply.text.slice(0, 500),
    ...(after !== null ? { retry_after: after } : {}),
  };
}

async function readReply(response: Response): Promise<Reply> {
  return { status: response.status, statusText: response.statusText, headers: response.headers, text: await response.text() };
}

/** `path` relative to /work as a URL path, each segment escaped. */
function pathSegments(path: string): string {
  return path.split("/").map(encodeURIComponent).join("/");
}

/** `POST /v1/jobs`'s body for `options` (the gateway's `SubmitJob`): the same fields as the
 * JobSpec, inputs named by file id, stdin as text, `job_id` always set (new UUID by default). */
export function gatewayJob(options: JobOptions): Record<string, unknown> {
  if (options.entrypoint !== undefined) throw new Error("entrypoint is direct mode's: the gateway runs `code`");
  if (options.code === undefined) throw new Error("give code");
  const sku = options.sku ?? "M";
  if (!SKUS.includes(sku)) throw new Error(`unknown sku ${sku}: one of ${SKUS.join(", ")}`);
  const job: Record<string, unknown> = { job_id: options.job_id ?? randomUUID(), runtime: options.runtime ?? "python", code: options.code, sku };
  if (options.inputs?.length) job.inputs = options.inputs.map(({ sha256, path }) => ({ file_id: sha256, path }));
  if (options.args?.length) job.args = options.args;
  if (options.stdin !== undefined) {
    try {
      job.stdin = typeof options.stdin === "string" ? options.stdin : new TextDecoder("utf-8", { fatal: true }).decode(options.stdin);
    } catch {
      throw new Error("stdin over HTTP is text: these bytes are not UTF-8");
    }
  }
  if (options.env && Object.keys(options.env).length) job.env = options.env;
  for (const key of ["timeout", "result_ttl", "network", "deadline_ms", "mode", "session", "callback_url"] as const) {
    if (options[key] !== undefined) job[key] = options[key];
  }
  return job;
}

interface RequestOptions {
  body?: string | Uint8Array;
  headers?: Record<string, string>;
  /** This request's time-out, ms (default the client's). */
  timeoutMs?: number;
  redirect?: "follow" | "manual";
}

/** The gateway at `url` with one API key. Holds no connection of its own (fetch pools them);
 * `close` cuts what is under way. */
export class GatewayTransport implements Transport {
  readonly mode = "http";
  /** The gateway's base URL, without a trailing `/`. */
  readonly url: string;
  private readonly closed = new AbortController();
  /** The job each artifact of a result this client returned belongs to (`download` asks the
   * gateway for a fresh URL of it). */
  private readonly artifactJobs = new WeakMap<Artifact, string>();

  constructor(url: string, private readonly apiKey: string, private readonly requestTimeoutMs = REQUEST_TIMEOUT_MS) {
    const parsed = new URL(url);
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") throw new Error(`gateway URL ${url}: not http or https`);
    this.url = parsed.href.replace(/\/+$/, "");
  }

  private headers(extra: Record<string, string> = {}): Record<string, string> {
    return { authorization: `Bearer ${this.apiKey}`, "user-agent": USER_AGENT, ...extra };
  }

  /** One request, read whole, sent again (the same body: every call of this client is safe to
   * repeat) when the gateway cannot be reached, answers 502, 503 or 504, or a 409 with
   * `Retry-After`; at most `ATTEMPTS` times. Resolves to the last reply; throws a SandqError when
   * no attempt got one. */
  private async request(method: string, path: string, options: RequestOptions = {}): Promise<Reply> {
    for (let attempt = 1; ; attempt++) {
      if (this.closed.signal.aborted) throw new SandqError("the client is closed");
      const link = linked(this.closed.signal, options.timeoutMs ?? this.requestTimeoutMs);
      let reply: Reply;
      try {
        const response = await fetch(`${this.url}${path}`, {
          method,
          headers: this.headers(options.headers),
          body: options.body,
          redirect: options.redirect ?? "follow",
          signal: link.signal,
        });
        reply = await readReply(response);
      } catch (e) {
        if (this.closed.signal.aborted) throw new SandqError("the client is closed", { cause: e });
        if (attempt >= ATTEMPTS) {
          const why = e instanceof Error ? `${e.message}${e.cause instanceof Error ? ` (${e.cause.message})` : ""}` : String(e);
          throw new SandqError(`${method} ${this.url}${path}: ${why}`, { cause: e });
        }
        await sleep(backoffMs(attempt, null));
        continue;
      } finally {
        link.dispose();
      }
      const after = retryAfterOf(reply.headers);
      const again = [502, 503, 504].includes(reply.status) || (reply.status === 409 && after !== null);
      if (!again || attempt >= ATTEMPTS) return reply;
      await sleep(backoffMs(attempt, after));
    }
  }

  /** The typed error of a reply that is not a success. */
  private fail(reply: Reply, context: string): GatewayError {
    return errorForProblem(problemOf(reply), context);
  }

  private json(reply: Reply): Record<string, unknown> {
    let value: unknown;
    try {
      value = JSON.parse(reply.text);
    } catch {
      throw new SandqError(`the gateway answered ${reply.status} with a body that is not JSON: ${reply.text.slice(0, 200)}`);
    }
    if (value === null || typeof value !== "object" || Array.isArray(value)) throw new SandqError(`the gateway answered ${reply.text.slice(0, 200)}, not an object`);
    return value as Record<string, unknown>;
  }

  private result(raw: Record<string, unknown>): JobResult {
    const result = normalizeResult(raw);
    for (const artifact of result.artifacts) this.artifactJobs.set(artifact, result.job_id);
    return result;
  }

  // --- files -----------------------------------------------------------------------------------

  /** `POST /v1/files`; the gateway's `file_id` (the SHA-256) is checked against the bytes sent. */
  async upload(source: string | Uint8Array, path?: string): Promise<InputFile> {
    const data = typeof source === "string" ? await readFile(source) : source;
    if (path === undefined) {
      if (typeof source !== "string") throw new Error("give the path inside /work for bytes");
      path = basename(source);
    }
    const sha256 = sha256Hex(data);
    const reply = await this.request("POST", "/v1/files", { body: data, headers: { "content-type": "application/octet-stream" } });
    if (reply.status !== 201 && reply.status !== 200) throw this.fail(reply, `upload ${path}`);
    const body = this.json(reply);
    if (body.file_id !== sha256 || body.size !== data.length) {
      throw new SandqError(`upload ${path}: the gateway stored ${String(body.size)} bytes as ${String(body.file_id)}, not ${data.length} as ${sha256}`);
    }
    return { key: inputKey(sha256), path, size: data.length, sha256 };
  }

  /** The artifact's bytes: through the gateway's redirect to a fresh presigned URL when it is one
   * of a job's `artifacts` (the job known from the result it came in, or `jobId`), else (a rich
   * output's image) through its own `url`; checked against its size and sha256. */
  async download(artifact: Artifact, jobId?: string): Promise<Buffer> {
    const job = jobId ?? this.artifactJobs.get(artifact);
    let url = artifact.url ?? null;
    if (job !== undefined) {
      const reply = await this.request("GET", `/v1/jobs/${encodeURIComponent(job)}/artifacts/${pathSegments(artifact.path)}`, { redirect: "manual" });
      const location = reply.headers.get("location");
      if (reply.status < 300 || reply.status >= 400 || !location) throw this.fail(reply, `artifact ${artifact.path} of job ${job}`);
      url = new URL(location, this.url).href;
    }
    if (!url) throw new SandqError(`artifact ${artifact.path}: no URL, and no job to ask the gateway about (give its job id)`);
    // The presigned URL carries its own authorization: the API key is not sent there.
    const link = linked(this.closed.signal, 10 * this.requestTimeoutMs);
    let data: Buffer;
    try {
      const response = await fetch(url, { signal: link.signal });
      if (!response.ok) throw new SandqError(`artifact ${artifact.path}: HTTP ${response.status}`);
      data = Buffer.from(await response.arrayBuffer());
    } finally {
      link.dispose();
    }
    if (data.length !== artifact.size || sha256Hex(data) !== artifact.sha256) {
      throw new SandqError(`artifact ${artifact.path}: downloaded ${data.length} bytes that do not match its size or sha256`);
    }
    return data;
  }

  /** The stream's text when it is the exact bytes (not truncated, not lossy); the log in S3 is
   * out of reach over HTTP. */
  async readLog(stream: Stream): Promise<Buffer> {
    if (!stream.log_key || (!stream.truncated && !stream.lossy)) return Buffer.from(stream.text);
    throw new SandqError("the exact bytes of a truncated or lossy log are in S3, which HTTP mode does not reach: use stream.text");
  }

  // --- jobs ------------------------------------------------------------------------------------

  /** `POST /v1/jobs` with `Idempotency-Key` the job's id, sent again on failures (the same id and
   * body find the first job: never two). */
  async submit(options: JobOptions): Promise<string> {
    const job = gatewayJob(options);
    const id = String(job.job_id);
    const unsure = (why: string) => `job ${id} may not be submitted (submitting again with the same job_id is safe): ${why}`;
    let reply: Reply;
    try {
      reply = await this.request("POST", "/v1/jobs", {
        body: JSON.stringify(job),
        headers: { "content-type": "application/json", "idempotency-key": id },
      });
    } catch (e) {
      throw new SubmitError(unsure(e instanceof Error ? e.message : String(e)), { cause: e });
    }
    if (reply.status === 201 || reply.status === 200) {
      const body = this.json(reply);
      return typeof body.job_id === "string" ? body.job_id : id;
    }
    const error = this.fail(reply, `submit ${id}`);
    if (error instanceof Unavailable || (error instanceof Conflict && error.retryAfter !== null)) throw new SubmitError(unsure(error.message), { cause: error });
    throw error;
  }

  private notFound(jobId: string, reply: Reply): JobNotFound {
    return new JobNotFound(`job ${jobId} is unknown (never submitted, its result expired, or not this tenant's)`, problemOf(reply));
  }

  /** `GET /v1/jobs/{id}`; null on 404 (unknown, expired, or another tenant's). */
  async status(jobId: string): Promise<JobResult | null> {
    const reply = await this.request("GET", `/v1/jobs/${encodeURIComponent(jobId)}`);
    if (reply.status === 404) return null;
    if (reply.status !== 200) throw this.fail(reply, `status of job ${jobId}`);
    return this.result(this.json(reply));
  }

  /** `GET /v1/jobs/{id}?wait=` (at most 30 s a request) until the job is over. */
  async wait(jobId: string, timeoutMs?: number): Promise<JobResult> {
    const deadline = timeoutMs === undefined ? undefined : Date.now() + timeoutMs;
    for (;;) {
      const waitMs = Math.max(0, Math.floor(deadline === undefined ? WAIT_CHUNK_MS : Math.min(WAIT_CHUNK_MS, deadline - Date.now())));
      const asked = Date.now();
      const reply = await this.request("GET", `/v1/jobs/${encodeURIComponent(jobId)}?wait=${waitMs}ms`, { timeoutMs: waitMs + this.requestTimeoutMs });
      if (reply.status === 404) throw this.notFound(jobId, reply);
      if (reply.status !== 200) throw this.fail(reply, `wait for job ${jobId}`);
      const result = this.result(this.json(reply));
      if (TERMINAL.has(result.status)) return result;
      if (deadline !== undefined && Date.now() >= deadline) throw new WaitTimeout(`job ${jobId} is still ${result.status} after ${timeoutMs} ms`);
      // A gateway that answered at once (a shorter max_wait than asked, or none): not a busy loop.
      if (waitMs >= 1000 && Date.now() - asked < 100) await sleep(250);
    }
  }

  /** `GET /v1/jobs/{id}/events`, resumed with `Last-Event-ID` after the last event yielded when
   * the connection drops or the gateway ends the stream while the job is under way. */
  async *events(jobId: string, options: EventsOptions = {}): AsyncGenerator<Event, void, undefined> {
    if (options.blockMs !== undefined && !(options.blockMs > 0 && Number.isFinite(options.blockMs))) {
      throw new RangeError(`blockMs must be more than 0, not ${options.blockMs}`);
    }
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    let cursor = options.cursor ?? EVENTS_START;
    let failures = 0;
    for (;;) {
      const left = deadline === undefined ? undefined : deadline - Date.now();
      if (left !== undefined && left <= 0) return;
      // Aborted by close(), at the deadline, or when the loop ends (`break` included).
      const link = linked(this.closed.signal, left);
      // The head must come within the request time-out; the body may take as long as the job.
      const head = setTimeout(link.abort, this.requestTimeoutMs);
      let dropped: unknown = null;
      let retryAfterS: number | null = null;
      try {
        let response: Response | null = null;
        try {
          response = await fetch(`${this.url}/v1/jobs/${encodeURIComponent(jobId)}/events`, {
            headers: this.headers({ accept: "text/event-stream", "last-event-id": cursor }),
            signal: link.signal,
          });
        } catch (e) {
          dropped = e;
        } finally {
          clearTimeout(head);
        }
        if (response !== null && response.status !== 200) {
          const reply = await readReply(response).catch(() => ({ status: response.status, statusText: response.statusText, headers: response.headers, text: "" }));
          if (reply.status === 404) throw this.notFound(jobId, reply);
          if (![502, 503, 504].includes(reply.status)) throw this.fail(reply, `events of job ${jobId}`);
          retryAfterS = retryAfterOf(reply.headers);
          dropped = this.fail(reply, `events of job ${jobId}`);
        } else if (response !== null && response.body) {
          const parser = new SseParser();
          const decoder = new TextDecoder();
          try {
            for await (const chunk of response.body as AsyncIterable<Uint8Array>) {
              for (const message of parser.push(decoder.decode(chunk, { stream: true }))) {
                if (message.id === null) continue;
                const event = parseGatewayEvent(message);
                cursor = event.id;
                failures = 0;
                yield event;
                if (event.type === "end") return;
              }
            }
          } catch (e) {
            dropped = e;
          }
        }
      } finally {
        clearTimeout(head);
        link.abort();
        link.dispose();
      }
      if (deadline !== undefined && Date.now() >= deadline) return;
      if (this.closed.signal.aborted) throw new SandqError("the client is closed");
      if (dropped === null) {
        // The gateway ended the stream without `end`: over (an expired stream, an older worker)
        // or its stream life is up while the job runs (then: on from the cursor).
        const result = await this.status(jobId);
        if (result === null || TERMINAL.has(result.status)) return;
        continue;
      }
      failures += 1;
      if (failures >= STREAM_ATTEMPTS) {
        if (dropped instanceof SandqError) throw dropped;
        throw new SandqError(`events of job ${jobId}: ${dropped instanceof Error ? dropped.message : String(dropped)}`, { cause: dropped });
      }
      await sleep(failures === 1 && retryAfterS === null ? 50 : backoffMs(failures, retryAfterS));
    }
  }

  /** `DELETE /v1/jobs/{id}`: true on 202; false when the job is over (409) or unknown (404). */
  async cancel(jobId: string): Promise<boolean> {
    const reply = await this.request("DELETE", `/v1/jobs/${encodeURIComponent(jobId)}`);
    if (reply.status === 202 || reply.status === 200) return true;
    if (reply.status === 404 || reply.status === 409) return false;
    throw this.fail(reply, `cancel job ${jobId}`);
  }

  // --- sessions --------------------------------------------------------------------------------

  /** `GET /v1/sessions`: the tenant's sessions, soonest to expire first (unused ones last). */
  async sessions(): Promise<SessionSummary[]> {
    const reply = await this.request("GET", "/v1/sessions");
    if (reply.status !== 200) throw this.fail(reply, "sessions");
    const body = this.json(reply);
    const rows = Array.isArray(body.sessions) ? (body.sessions as Record<string, unknown>[]) : [];
    const listed = rows.map((r) => ({
      name: String(r.name),
      expiresAtMs: typeof r.expires_at_ms === "number" ? r.expires_at_ms : null,
      files: Number(r.files ?? 0),
      bytes: Number(r.bytes ?? 0),
      executionCount: Number(r.execution_count ?? 0),
    }));
    const at = (s: SessionSummary) => s.expiresAtMs ?? Number.MAX_SAFE_INTEGER;
    return listed.sort((a, b) => at(a) - at(b));
  }

  async close(): Promise<void> {
    this.closed.abort();
  }
}
