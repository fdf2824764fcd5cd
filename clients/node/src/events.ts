// A job's live events (docs/protocol.md "Live events"): what the worker appends to the Redis
// Stream `<ns>:job:{<job_id>}:events` while the job runs, and what a reader makes of them.
// `Client.events` yields the `Event`s; `Transcript` folds them into the newest attempt's text and
// displays (what `run` with callbacks follows); `callbacksFor` says which callback an event goes
// to. The stream is best effort: the job's stored result stays authoritative.
import type { Event, Output } from "./types.js";

/** The statuses of a job still under way: a reader keeps waiting for events while the job's hash
 * says one of them (anything else, an unknown job included, is over). */
export const ACTIVE: ReadonlySet<string> = new Set(["queued", "running"]);

/** A decimal field as a number; undefined when absent or not a decimal. */
function decimal(value: string | undefined): number | undefined {
  return value !== undefined && /^-?\d+$/.test(value) ? Number(value) : undefined;
}

/** Reads a stream entry (its id and field/value pairs, strings or UTF-8 Buffers). Never throws:
 * what it cannot read is left out (`attempt` 0, `seq` null). */
export function parseEvent(id: string | Buffer, raw: Record<string, string | Buffer>): Event {
  const fields: Record<string, string> = {};
  for (const [k, v] of Object.entries(raw)) fields[k] = v.toString();
  const event: Event = { id: id.toString(), type: fields.type ?? "", attempt: decimal(fields.attempt) ?? 0, seq: decimal(fields.seq) ?? null, fields };
  for (const name of ["data", "status", "state", "attempt_id", "reason", "stream"] as const) {
    if (fields[name] !== undefined) event[name] = fields[name];
  }
  for (const name of ["exit_code", "index", "limit"] as const) {
    const n = decimal(fields[name]);
    if (n !== undefined) event[name] = n;
  }
  if (fields.warm !== undefined) event.warm = fields.warm === "true";
  if (event.type === "display" && fields.data !== undefined) {
    try {
      const value: unknown = JSON.parse(fields.data);
      event.output = value !== null && typeof value === "object" && !Array.isArray(value) ? (value as Output) : null;
    } catch {
      event.output = null;
    }
  }
  return event;
}

/** The events of node-redis' `xRead` reply of one stream (`[{name, messages: [{id, message}]}]`,
 * or a map of name to messages), in order; none for null (nothing new in time). */
export function parseXRead(reply: unknown): Event[] {
  if (reply == null) return [];
  const streams: unknown[] = Array.isArray(reply)
    ? reply.map((s) => (s as { messages: unknown }).messages)
    : reply instanceof Map ? [...reply.values()] : Object.values(reply as object);
  const events: Event[] = [];
  for (const messages of streams) {
    for (const m of (messages ?? []) as ({ id: string | Buffer; message: Record<string, string | Buffer> } | null)[]) {
      if (m && m.message) events.push(parseEvent(m.id, m.message));
    }
  }
  return events;
}

/** What a reader makes of a job's events so far (docs/protocol.md "Live events"): the text and
 * displays of the newest attempt, the gaps, the caps reached, the end. Feed it every event in
 * stream order with `push`.
 *
 * A later attempt's `attempt` event means the earlier attempt was abandoned (its worker died, or
 * it failed on infrastructure and the job was requeued): its text, displays and caps are dropped
 * here, as they are not in the result. */
export class Transcript {
  /** Attempts seen, in order (1 for the first delivery). */
  attempts: number[] = [];
  /** stdout of the newest attempt: its chunks' text concatenated. */
  stdout = "";
  /** stderr of the newest attempt. */
  stderr = "";
  /** Displays of the newest attempt, in order: the index in the result's `outputs`, the output
   * (null when its JSON was not an object). */
  displays: { index: number; output: Output | null }[] = [];
  /** Events the worker dropped, before the last one seen of each attempt. */
  missing: { attempt: number; seq: number }[] = [];
  /** Kinds whose cap was reached in the newest attempt (`stdout`, `stderr`, `display`). */
  truncated: string[] = [];
  /** The terminal status, once `end` was read. */
  status: string | null = null;
  /** The cursor to resume from: the last event's id (null before any). */
  lastId: string | null = null;
  private nextSeq = new Map<number, number>();

  /** The newest attempt seen (0 before any). */
  get attempt(): number {
    return this.attempts.at(-1) ?? 0;
  }

  /** Folds one event in. True when it belongs to the newest attempt (or is the `end`); false for
   * a late event of an abandoned attempt (ignored, but for its `seq`). */
  push(event: Event): boolean {
    this.lastId = event.id;
    if (event.attempt > this.attempt) {
      this.attempts.push(event.attempt);
      this.stdout = "";
      this.stderr = "";
      this.displays = [];
      this.truncated = [];
    }
    if (event.seq !== null) {
      const expected = this.nextSeq.get(event.attempt) ?? 0;
      for (let seq = expected; seq < event.seq; seq++) this.missing.push({ attempt: event.attempt, seq });
      this.nextSeq.set(event.attempt, Math.max(expected, event.seq + 1));
    }
    if (event.type === "end") {
      // The job's end, whatever attempt it names (the script writes 0 when it knows none).
      this.status = event.status ?? null;
      return true;
    }
    if (event.attempt < this.attempt) return false;
    if (event.type === "stdout") this.stdout += event.data ?? "";
    else if (event.type === "stderr") this.stderr += event.data ?? "";
    else if (event.type === "display") this.displays.push({ index: event.index ?? 0, output: event.output ?? null });
    else if (event.type === "truncated" && event.stream) this.truncated.push(event.stream);
    return true;
  }
}

/** Callbacks on a job's live events (`run(options, { onStdout, ... })`, `follow`). Each may return
 * a promise, which is awaited before the next event is read; what one throws propagates (the job
 * keeps running).
 *
 * When a job is delivered again (its worker died, or it failed on infrastructure), an `attempt`
 * event with a higher number arrives and the callbacks carry on with the new attempt's output:
 * what they got from the earlier attempt was abandoned and is not in the result (watch `onEvent`
 * for `event.type === "attempt"` to mark the restart). */
export interface EventCallbacks {
  /** Each stdout chunk of the newest attempt, in order (at most 8 KiB, cut on characters). */
  onStdout?: (text: string) => unknown;
  /** Each stderr chunk of the newest attempt, in order. */
  onStderr?: (text: string) => unknown;
  /** Each rich output of the newest attempt, as in the result's `outputs` (a display whose JSON
   * is not an object goes to `onEvent` only). */
  onDisplay?: (output: Output) => unknown;
  /** Every event, first: unknown types and late events of abandoned attempts included. */
  onEvent?: (event: Event) => unknown;
}

/** Whether any callback is set. */
export function hasCallbacks(callbacks: EventCallbacks): boolean {
  return Boolean(callbacks.onStdout || callbacks.onStderr || callbacks.onDisplay || callbacks.onEvent);
}

/** The calls `event` makes, in order (`onEvent` first); `current`: it belongs to the newest
 * attempt (`Transcript.push`'s answer). */
export function callbacksFor(callbacks: EventCallbacks, event: Event, current: boolean): (() => unknown)[] {
  const calls: (() => unknown)[] = [];
  const { onStdout, onStderr, onDisplay, onEvent } = callbacks;
  if (onEvent) calls.push(() => onEvent(event));
  if (!current) return calls;
  if (event.type === "stdout" && onStdout && event.data) calls.push(() => onStdout(event.data as string));
  else if (event.type === "stderr" && onStderr && event.data) calls.push(() => onStderr(event.data as string));
  else if (event.type === "display" && onDisplay && event.output) calls.push(() => onDisplay(event.output as Output));
  return calls;
}
