// The wire types of docs/protocol.md, with the protocol's own (snake_case) field names: a
// `JobResult` is the decoded MessagePack map as the worker wrote it.

/** Every status after which nothing changes. */
export const TERMINAL: ReadonlySet<string> = new Set([
  "succeeded", "failed", "timed_out", "oom_killed", "rejected", "cancelled", "expired", "internal_error",
]);

export type Sku = "S" | "M" | "L" | "XL";

/** What a direct-mode submission does when no worker serves the job's SKU right now (its queue
 * has no consumer; docs/protocol.md "Which SKUs are served"): `"warn"` (the default:
 * `process.emitWarning(message, "SandqUnservedSkuWarning")`, then it publishes), `"refuse"`
 * (rejects with `UnservedSku`, nothing published) or `"ignore"` (it does not ask). */
export type Unserved = "warn" | "refuse" | "ignore";
export type Runtime = "python" | "node";
export type Status =
  | "queued" | "running" | "succeeded" | "failed" | "timed_out" | "oom_killed"
  | "rejected" | "cancelled" | "expired" | "internal_error";

/** An uploaded file and where the job sees it (`/work/<path>`). */
export interface InputFile {
  key: string;
  path: string;
  size: number;
  sha256: string;
}

/** What to run: the JobSpec's fields a client chooses (`job_id` and `submitted_at_ms` are filled in). */
export interface JobOptions {
  code?: string;
  entrypoint?: string;
  /** Default "M". */
  sku?: Sku;
  /** Default "python". */
  runtime?: Runtime;
  inputs?: InputFile[];
  args?: string[];
  stdin?: Uint8Array | string;
  env?: Record<string, string>;
  /** humantime, default "60s". */
  timeout?: string;
  /** humantime, default "24h". */
  result_ttl?: string;
  network?: "none" | "outbound";
  deadline_ms?: number;
  mode?: "notebook" | "script";
  session?: string;
  job_id?: string;
  /** HTTP mode only: where the gateway POSTs the terminal result, signed (docs/gateway.md
   * "Webhooks"); the key must allow the host. */
  callback_url?: string;
}

/** stdout or stderr: the first bytes as text, and where the exact bytes are in S3. */
export interface Stream {
  text: string;
  total_bytes: number;
  truncated: boolean;
  lossy: boolean;
  log_key?: string | null;
  log_bytes: number;
}

/** A file the job wrote, or a stored rich-output representation; `url` is presigned. */
export interface Artifact {
  path: string;
  key: string;
  size: number;
  sha256: string;
  content_type: string;
  url?: string | null;
  url_expires_at_ms?: number | null;
}

export interface SkippedArtifact {
  path: string;
  reason: string;
}

export interface Usage {
  wall_ms: number;
  cpu_ms: number;
  peak_memory_bytes: number;
}

/** A notebook cell's uncaught exception. */
export interface ErrorInfo {
  name: string;
  value: string;
  traceback: string[];
}

/** One representation of an output: inline `text`, or an `artifact` in S3 (binary types). */
export interface MimeValue {
  text?: string | null;
  artifact?: Artifact | null;
  size: number;
}

/** A rich output (notebook mode): a MIME bundle, as in Jupyter. */
export interface Output {
  output_type: "execute_result" | "display_data" | "error" | string;
  data: Record<string, MimeValue>;
  table?: { rows: number; columns: number } | null;
  image?: { width: number; height: number } | null;
  error?: ErrorInfo | null;
  /** The size to show the image at (CSS pixels) when it is not its pixel size (a retina figure). */
  display?: { width: number; height: number } | null;
}

export interface SessionState {
  restored: number;
  not_restored: { name: string; reason: string }[];
  saved: boolean;
  variables: string[];
  unsaved: { name: string; reason: string }[];
  bytes: number;
  save_ms: number;
  /** Time spent restoring the previous state before the cell, ms (0 from older workers). */
  restore_ms: number;
}

/** What happened to the job's session. */
export interface SessionInfo {
  name: string;
  fresh: boolean;
  expired: boolean;
  restored_files: number;
  saved_files: number;
  deleted_files: number;
  files: number;
  bytes: number;
  unsaved_files: number;
  expires_at_ms: number;
  state?: SessionState | null;
}

export interface SandboxInfo {
  warm: boolean;
  /** The warm sandbox's process was forked from a pre-imported template (docs/protocol.md, "Warm starts"). */
  forked?: boolean;
  sandbox_wait_ms: number;
}

/** A job's status and result, as stored in Redis. */
export interface JobResult {
  schema_version: number;
  job_id: string;
  status: Status;
  reason?: string | null;
  sku?: Sku | null;
  exit_code?: number | null;
  signal?: string | null;
  stdout: Stream;
  stderr: Stream;
  artifacts: Artifact[];
  skipped_artifacts: SkippedArtifact[];
  skipped_artifacts_total: number;
  usage?: Usage | null;
  queued_at_ms?: number | null;
  started_at_ms?: number | null;
  finished_at_ms?: number | null;
  worker_id?: string | null;
  attempt: number;
  outputs: Output[];
  execution_count?: number | null;
  sandbox?: SandboxInfo | null;
  outputs_dropped: number;
  error?: ErrorInfo | null;
  session?: SessionInfo | null;
}

const emptyStream = (): Stream => ({ text: "", total_bytes: 0, truncated: false, lossy: false, log_key: null, log_bytes: 0 });

/** A decoded result map with the protocol's defaults filled in (absent lists empty, counts 0). */
export function normalizeResult(raw: Record<string, unknown>): JobResult {
  const r = raw as Partial<JobResult>;
  return {
    ...r,
    schema_version: r.schema_version ?? 1,
    job_id: r.job_id ?? "",
    status: (r.status ?? "queued") as Status,
    stdout: { ...emptyStream(), ...(r.stdout ?? {}) },
    stderr: { ...emptyStream(), ...(r.stderr ?? {}) },
    artifacts: r.artifacts ?? [],
    skipped_artifacts: r.skipped_artifacts ?? [],
    skipped_artifacts_total: r.skipped_artifacts_total ?? 0,
    attempt: r.attempt ?? 0,
    outputs: r.outputs ?? [],
    outputs_dropped: r.outputs_dropped ?? 0,
  } as JobResult;
}

/** The artifact at `path` (relative to /work), or undefined. */
export function artifactAt(result: JobResult, path: string): Artifact | undefined {
  return result.artifacts.find((a) => a.path === path);
}

/** Every image representation of the outputs (`image/png`, ...), with its output. */
export function images(result: JobResult): { output: Output; mime: string; value: MimeValue & { artifact: Artifact } }[] {
  const found = [];
  for (const output of result.outputs) {
    for (const [mime, value] of Object.entries(output.data)) {
      if (mime.startsWith("image/") && value.artifact) found.push({ output, mime, value: value as MimeValue & { artifact: Artifact } });
    }
  }
  return found;
}

/** The `text/plain` representation of an output. */
export function outputText(output: Output): string | undefined {
  return output.data["text/plain"]?.text ?? undefined;
}

/** One entry of a job's live event stream (docs/protocol.md "Live events"); `parseEvent` makes
 * it. `fields` holds every field as sent; the optional properties are the type-specific fields
 * read (present only when the entry has them). */
export interface Event {
  /** The stream entry's id (`"1764680000000-0"`): the cursor to resume after this event. */
  id: string;
  /** `attempt`, `status`, `stdout`, `stderr`, `display`, `truncated`, `end`, or a type this SDK
   * does not know (ignore it). */
  type: "attempt" | "status" | "stdout" | "stderr" | "display" | "truncated" | "end" | string;
  /** The delivery attempt (from 1; 0 when the field is missing or malformed). */
  attempt: number;
  /** The event's number within its attempt (from 0); null on `end` (and when malformed). */
  seq: number | null;
  fields: Record<string, string>;
  /** `stdout`/`stderr`: the chunk's text (at most 8 KiB); `display`: the output's JSON. */
  data?: string;
  /** `end`: the job's terminal status (`succeeded`, `failed`, ...). */
  status?: string;
  /** `status`: `started`, `finished` or `queued` (the attempt failed on infrastructure). */
  state?: string;
  /** `attempt`: the attempt's id (`a<16 hex>`), as in the result's S3 keys. */
  attempt_id?: string;
  /** `status` `started`: a warm sandbox took the job. */
  warm?: boolean;
  /** `status` `finished`: the exit code (absent when the program was killed). */
  exit_code?: number;
  /** `status` `queued`: why the attempt failed. */
  reason?: string;
  /** `display`: the output's place in the result's `outputs` (from 0). */
  index?: number;
  /** `display`: the output, as in the result's `outputs`; null when its JSON is not an object. */
  output?: Output | null;
  /** `truncated`: the kind no longer streamed (`stdout`, `stderr` or `display`). */
  stream?: string;
  /** `truncated`: the cap reached, bytes (events for `display`). */
  limit?: number;
}
