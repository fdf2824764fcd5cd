// HTTP mode's pieces that need no services: the event-stream parser (fed a stream written here by
// hand, split at every point), gateway events read back into the SDK's `Event`, the mode an
// options object and the environment choose, and the body `submit` sends.
import { test } from "node:test";
import assert from "node:assert/strict";
import { clientMode, errorForProblem, gatewayJob, ForbiddenByQuota, GatewayError, parseGatewayEvent, QuotaExceeded, SseParser, Unauthorized } from "../dist/index.js";

const STREAM = ": keep-alive\r\n\r\nevent: stdout\r\nid: 5-0\r\ndata: {\"attempt\":1,\"seq\":2,\"text\":\"a\"}\r\n\r\n"
  + "retry: 10\nevent:end\nid:6-1\ndata: {\"attempt\":1,\r\ndata:\"seq\":null,\"status\":\"succeeded\"}\n\n"
  + "id: 7-0\n\nevent: x\ndata\n\n";
const EXPECTED = [
  { event: "stdout", id: "5-0", data: "{\"attempt\":1,\"seq\":2,\"text\":\"a\"}" },
  { event: "end", id: "6-1", data: "{\"attempt\":1,\n\"seq\":null,\"status\":\"succeeded\"}" },
  // An id-only block dispatches nothing but moves the id; `data` with no colon is an empty line.
  { event: "x", id: "7-0", data: "" },
];

test("the event-stream parser, whole and split at every point", () => {
  assert.deepEqual(new SseParser().push(STREAM), EXPECTED);
  for (let i = 0; i <= STREAM.length; i++) {
    const parser = new SseParser();
    assert.deepEqual([...parser.push(STREAM.slice(0, i)), ...parser.push(STREAM.slice(i))], EXPECTED, `split at ${i}`);
  }
  const bytes = new SseParser();
  assert.deepEqual([...STREAM].flatMap((c) => bytes.push(c)), EXPECTED, "a character at a time");
  assert.deepEqual(new SseParser().push("\ufeffdata: x\n\n"), [{ event: "message", id: null, data: "x" }]);
  assert.deepEqual(new SseParser().push("data: unterminated"), []);
});

test("gateway events read as the Redis Stream's", () => {
  const read = (event, data, id = "1-0") => parseGatewayEvent({ event, id, data: JSON.stringify(data) });
  assert.deepEqual(read("stdout", { attempt: 1, seq: 3, text: "hi\n" }), {
    id: "1-0", type: "stdout", attempt: 1, seq: 3, data: "hi\n", fields: { type: "stdout", attempt: "1", seq: "3", data: "hi\n" },
  });
  assert.deepEqual(read("started", { attempt: 2, seq: 1, warm: true }), {
    id: "1-0", type: "status", attempt: 2, seq: 1, state: "started", warm: true,
    fields: { type: "status", attempt: "2", seq: "1", state: "started", warm: "true" },
  });
  const killed = read("finished", { attempt: 1, seq: 9, exit_code: null });
  assert.equal(killed.state, "finished");
  assert.equal("exit_code" in killed, false);
  assert.equal(read("finished", { attempt: 1, seq: 9, exit_code: 3 }).fields.exit_code, "3");
  assert.deepEqual(read("requeued", { attempt: 1, seq: 4, reason: "worker lost" }).fields, { type: "status", attempt: "1", seq: "4", state: "queued", reason: "worker lost" });
  const output = { output_type: "display_data", data: { "text/plain": { text: "x", size: 1 } } };
  const display = read("display", { attempt: 1, seq: 5, index: 2, output });
  assert.deepEqual([display.index, display.output, JSON.parse(display.data)], [2, output, output]);
  assert.equal(read("display", { attempt: 1, seq: 5, index: 0, output: null }).output, null);
  assert.deepEqual(read("end", { attempt: 1, seq: null, status: "failed" }), {
    id: "1-0", type: "end", attempt: 1, seq: null, status: "failed", fields: { type: "end", attempt: "1", status: "failed" },
  });
  assert.deepEqual(read("truncated", { attempt: 1, seq: 7, stream: "stdout", limit: 1048576 }).limit, 1048576);
  assert.deepEqual(read("newer", { attempt: 1, seq: 8, n: 1, s: "v" }).fields, { type: "newer", attempt: "1", seq: "8", n: "1", s: "v" });
  assert.deepEqual(parseGatewayEvent({ event: "stdout", id: "2-0", data: "not json" }), { id: "2-0", type: "stdout", attempt: 0, seq: null, data: "", fields: { type: "stdout", attempt: "0", data: "" } });
});

test("the mode: explicit options first, then the environment", () => {
  const env = { SANDQ_URL: "http://env:1", SANDQ_API_KEY: "sq_env" };
  assert.deepEqual(clientMode({ url: "http://o:2", apiKey: "sq_o" }, env), { mode: "http", url: "http://o:2", apiKey: "sq_o" });
  assert.deepEqual(clientMode({ url: "http://o:2" }, env), { mode: "http", url: "http://o:2", apiKey: "sq_env" });
  assert.deepEqual(clientMode({}, env), { mode: "http", url: "http://env:1", apiKey: "sq_env" });
  assert.deepEqual(clientMode({ apiKey: "sq_o" }, env), { mode: "http", url: "http://env:1", apiKey: "sq_o" });
  assert.deepEqual(clientMode({ namespace: "ns" }, env), { mode: "direct" });
  assert.deepEqual(clientMode({}, {}), { mode: "direct" });
  assert.deepEqual(clientMode({}, { SANDQ_URL: "" }), { mode: "direct" });
  assert.throws(() => clientMode({}, { SANDQ_URL: "http://env:1" }), /SANDQ_API_KEY/);
  assert.throws(() => clientMode({ apiKey: "sq_o" }, {}), /url/);
  assert.throws(() => clientMode({ url: "http://o:2", namespace: "ns" }, env), /not both/);
});

test("the body a submit sends", () => {
  const input = { key: "inputs/sha256/ab", path: "data/a.csv", size: 3, sha256: "ab".repeat(32) };
  assert.deepEqual(gatewayJob({ code: "1", job_id: "j", inputs: [input], stdin: new TextEncoder().encode("é"), env: { A: "b" }, timeout: "5s", session: "s" }), {
    job_id: "j", runtime: "python", code: "1", sku: "M", inputs: [{ file_id: "ab".repeat(32), path: "data/a.csv" }], stdin: "é", env: { A: "b" }, timeout: "5s", session: "s",
  });
  assert.match(gatewayJob({ code: "1" }).job_id, /^[0-9a-f-]{36}$/);
  assert.throws(() => gatewayJob({ entrypoint: "main.py" }), /entrypoint/);
  assert.throws(() => gatewayJob({ code: "1", stdin: new Uint8Array([0xff]) }), /UTF-8/);
});

test("problem documents become typed errors", () => {
  const e = errorForProblem({ type: "urn:sandq:problem:quota-exceeded", title: "Over quota", status: 429, detail: "at most 60", retry_after: 12 });
  assert.ok(e instanceof QuotaExceeded && e instanceof GatewayError);
  assert.deepEqual([e.status, e.retryAfter, e.detail, e.name], [429, 12, "at most 60", "QuotaExceeded"]);
  assert.ok(errorForProblem({ type: "urn:sandq:problem:unauthorized", title: "", status: 401, detail: "" }) instanceof Unauthorized);
  assert.ok(errorForProblem({ type: "urn:sandq:problem:forbidden-by-quota", title: "", status: 403, detail: "" }) instanceof ForbiddenByQuota);
  const unknown = errorForProblem({ type: "urn:sandq:problem:newer", title: "", status: 418, detail: "" });
  assert.equal(unknown.constructor, GatewayError);
});
