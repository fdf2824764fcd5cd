// What `Client` asks of a mode: direct (`DirectTransport`: the broker, Redis and S3) or over HTTP
// (`GatewayTransport`: sandq-gateway). `Client` adds what both share on top (`run`, `follow`,
// sessions, `raiseOnError`); each transport is the same calls done its way.
import type { Artifact, Event, InputFile, JobOptions, JobResult, Stream } from "./types.js";

export interface WaitOptions {
  /** Give up (WaitTimeout) after this many ms; default: wait as long as it takes. */
  timeoutMs?: number;
  /** Throw JobRejected, JobExpired and JobInternalError (default true). */
  raiseOnError?: boolean;
}

/** Which of a job's live events to read, and for how long. */
export interface EventsOptions {
  /** Read the events after this stream id (`Event.id`); default `"0-0"`: from the first. */
  cursor?: string;
  /** Direct mode: longest wait of one read (ms, more than 0; default 5000): after a read that
   * waited this long for nothing, the job's status is checked. Over HTTP the gateway does that
   * (checked, else unused). */
  blockMs?: number;
  /** Stop, without error, after this many ms; default: as long as the job runs. */
  timeoutMs?: number;
}

/** One of `Client.sessions()`. */
export interface SessionSummary {
  name: string;
  /** When its files and state expire, Unix ms; null for a session no job has used yet (HTTP). */
  expiresAtMs: number | null;
  /** HTTP mode: how many files it has, their bytes, its cells so far. */
  files?: number;
  bytes?: number;
  executionCount?: number;
}

/** The calls a mode implements (internal; `Client` is the API). */
export interface Transport {
  readonly mode: "direct" | "http";
  upload(source: string | Uint8Array, path?: string): Promise<InputFile>;
  download(artifact: Artifact, jobId?: string): Promise<Buffer>;
  readLog(stream: Stream): Promise<Buffer>;
  submit(options: JobOptions): Promise<string>;
  status(jobId: string): Promise<JobResult | null>;
  /** The terminal result; throws WaitTimeout, JobNotFound (never for the job's status). */
  wait(jobId: string, timeoutMs?: number): Promise<JobResult>;
  events(jobId: string, options: EventsOptions): AsyncGenerator<Event, void, undefined>;
  cancel(jobId: string): Promise<boolean>;
  sessions(): Promise<SessionSummary[]>;
  close(): Promise<void>;
}
