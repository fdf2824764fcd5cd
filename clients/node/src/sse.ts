// Server-sent events (the WHATWG HTML standard's "event stream interpretation"), as the gateway
// streams a job's live events (docs/gateway.md "Live events"), and those events read back into the
// SDK's `Event`, the same shape direct mode reads from the Redis Stream.
import type { Event, Output } from "./types.js";

/** One dispatched message: its `event:` type (default `message`), its `data:` lines joined by
 * `\n`, and the last `id:` seen so far (null before any). */
export interface SseMessage {
  event: string;
  data: string;
  id: string | null;
}

/** An incremental event-stream parser: `push` text as it arrives (chunks may split lines, and a
 * `\r\n` pair), get the messages it completed. Comments (`:` lines, the keep-alives) and `retry:`
 * are skipped; a block with no `data:` line dispatches nothing. */
export class SseParser {
  private buffer = "";
  private skipLf = false;
  private first = true;
  private event = "";
  private data: string[] = [];
  private lastId: string | null = null;

  push(text: string): SseMessage[] {
    if (this.first && text.length > 0) {
      this.first = false;
      if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
    }
    if (this.skipLf && text.startsWith("\n")) text = text.slice(1);
    this.skipLf = false;
    this.buffer += text;
    const out: SseMessage[] = [];
    let start = 0;
    for (let i = 0; i < this.buffer.length; i++) {
      const c = this.buffer[i];
      if (c !== "\r" && c !== "\n") continue;
      this.line(this.buffer.slice(start, i), out);
      if (c === "\r") {
        if (i + 1 < this.buffer.length) {
          if (this.buffer[i + 1] === "\n") i++;
        } else {
          this.skipLf = true; // a `\n` may start the next chunk
        }
      }
      start = i + 1;
    }
    this.buffer = this.buffer.slice(start);
    return out;
  }

  private line(line: string, out: SseMessage[]): void {
    if (line === "") {
      if (this.data.length > 0) out.push({ event: this.event || "message", data: this.data.join("\n"), id: this.lastId });
      this.event = "";
      this.data = [];
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.event = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id" && !value.includes("\0")) this.lastId = value;
  }
}

function integer(value: unknown): number | undefined {
  return typeof value === "number" && Number.isInteger(value) ? value : undefined;
}

function text(value: unknown): string {
  return typeof value === "string" ? value : value === undefined || value === null ? "" : JSON.stringify(value);
}

/** A gateway event (`event:` its type, `data:` JSON with `attempt`, `seq` and its fields) as the
 * SDK's `Event`: `started`, `finished` and `requeued` become `status` events with `state`
 * `started`, `finished` and `queued`, `stdout`/`stderr`'s `text` is `data`, a display's output
 * is `output` (and its JSON `data`); `fields` holds the fields as the Redis Stream has them. A
 * type this SDK does not know keeps its name, its data's values in `fields`. Never throws. */
export function parseGatewayEvent(message: SseMessage): Event {
  let body: Record<string, unknown> = {};
  try {
    const value: unknown = JSON.parse(message.data);
    if (value !== null && typeof value === "object" && !Array.isArray(value)) body = value as Record<string, unknown>;
  } catch {
    // not JSON: an event with no fields
  }
  const attempt = integer(body.attempt) ?? 0;
  const seq = integer(body.seq) ?? null;
  const fields: Record<string, string> = { type: "", attempt: String(attempt) };
  if (seq !== null) fields.seq = String(seq);
  const event: Event = { id: message.id ?? "", type: message.event, attempt, seq, fields };
  const status = (state: string) => {
    event.type = "status";
    event.state = state;
    fields.state = state;
  };
  switch (message.event) {
    case "attempt":
      event.attempt_id = fields.attempt_id = text(body.attempt_id);
      break;
    case "started":
      status("started");
      event.warm = body.warm === true;
      fields.warm = String(event.warm);
      break;
    case "finished": {
      status("finished");
      const code = integer(body.exit_code);
      if (code !== undefined) {
        event.exit_code = code;
        fields.exit_code = String(code);
      }
      break;
    }
    case "requeued":
      status("queued");
      event.reason = fields.reason = text(body.reason);
      break;
    case "stdout":
    case "stderr":
      event.data = fields.data = text(body.text);
      break;
    case "display": {
      const output = body.output;
      event.index = integer(body.index) ?? 0;
      fields.index = String(event.index);
      event.output = output !== null && typeof output === "object" && !Array.isArray(output) ? (output as Output) : null;
      event.data = fields.data = JSON.stringify(output ?? null);
      break;
    }
    case "truncated":
      event.stream = fields.stream = text(body.stream);
      event.limit = integer(body.limit) ?? 0;
      fields.limit = String(event.limit);
      break;
    case "end":
      event.status = fields.status = text(body.status);
      break;
    default:
      for (const [k, v] of Object.entries(body)) if (k !== "attempt" && k !== "seq") fields[k] = text(v);
  }
  fields.type = event.type;
  return event;
}
