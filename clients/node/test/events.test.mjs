// Live events (docs/protocol.md "Live events") against the config's real Redis, no worker: each
// test writes a job's stream itself (XADD, with the vectors' ids where it replays
// schemas/vectors/events.json) and the job hash's `status`, then reads it back with the SDK
// (`events`, `follow`, `Transcript`). Expected values come from the vectors file or from what the
// test wrote.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Client, loadConfig, redisClient, Transcript } from "../dist/index.js";

const VECTORS = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "schemas", "vectors", "events.json");
const CASES = JSON.parse(readFileSync(VECTORS, "utf8")).cases;
const NAMESPACE = "sandq-test-sdk-node-events";

let client;
let redis;
const jobs = [];

before(async () => {
  const config = { ...loadConfig(), namespace: NAMESPACE };
  client = await Client.connect({ config });
  redis = redisClient(config);
  redis.on("error", () => {});
  await redis.connect();
});

after(async () => {
  for (const id of jobs) await redis.del([client.names.job(id), client.names.events(id)]);
  await redis?.close();
  await client?.close();
});

/** A fresh job id (its keys deleted after the tests) with its hash `status` and its stream's
 * entries (with their ids when they have one). */
async function job(entries, status) {
  const id = `events-${randomUUID()}`;
  jobs.push(id);
  await redis.hSet(client.names.job(id), "status", status);
  for (const entry of entries) await redis.xAdd(client.names.events(id), entry.id ?? "*", entry.fields);
  // Gone within the hour even when the tests stop before their end.
  await redis.expire(client.names.job(id), 3600);
  if (entries.length > 0) await redis.expire(client.names.events(id), 3600);
  return id;
}

async function collect(iterable) {
  const out = [];
  for await (const item of iterable) out.push(item);
  return out;
}

function fold(events) {
  const transcript = new Transcript();
  for (const event of events) transcript.push(event);
  return transcript;
}

/** A transcript in the vectors' `expect` shape. */
function reading(t) {
  return {
    attempts: t.attempts, final_attempt: t.attempt, stdout: t.stdout, stderr: t.stderr,
    displays: t.displays.map(({ index, output }) => ({
      index, output_type: output?.output_type ?? null, image_key: output?.data?.["image/png"]?.artifact?.key ?? null,
    })),
    missing: t.missing, truncated: t.truncated, status: t.status, last_id: t.lastId,
  };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

for (const c of CASES) {
  test(`vector ${c.name}: read and folded to its meaning`, async () => {
    const id = await job(c.entries, c.expect.status);
    const events = await collect(client.events(id, { blockMs: 500 }));
    assert.deepEqual(events.map((e) => e.id), c.entries.map((e) => e.id), "every entry, in order, up to the end");
    events.forEach((event, i) => {
      const fields = c.entries[i].fields;
      assert.deepEqual(event.fields, fields);
      assert.equal(event.type, fields.type);
      assert.equal(event.attempt, Number(fields.attempt));
      assert.equal(event.seq, fields.seq === undefined ? null : Number(fields.seq));
    });
    assert.deepEqual(reading(fold(events)), c.expect);
  });

  test(`vector ${c.name}: follow calls back with the newest attempt's output`, async () => {
    const id = await job(c.entries, c.expect.status);
    const calls = [];
    const transcript = await client.follow(id, {
      blockMs: 500,
      onEvent: (e) => calls.push(["event", e]),
      onStdout: (t) => calls.push(["stdout", t]),
      // A callback that returns a promise is awaited before the next event.
      onStderr: async (t) => { await sleep(5); calls.push(["stderr", t]); },
      onDisplay: (o) => calls.push(["display", o]),
    });
    assert.deepEqual(reading(transcript), c.expect);
    assert.deepEqual(calls.filter(([k]) => k === "event").map(([, e]) => e.id), c.entries.map((e) => e.id));
    const lastAttempt = calls.findLastIndex(([k, e]) => k === "event" && e.type === "attempt");
    const final = calls.slice(lastAttempt);
    assert.equal(final.filter(([k]) => k === "stdout").map(([, t]) => t).join(""), c.expect.stdout);
    assert.equal(final.filter(([k]) => k === "stderr").map(([, t]) => t).join(""), c.expect.stderr);
    assert.deepEqual(final.filter(([k]) => k === "display").map(([, o]) => o.output_type), c.expect.displays.map((d) => d.output_type));
    const wrote = c.entries.filter((e) => e.fields.type === "stdout").map((e) => e.fields.data);
    assert.deepEqual(calls.filter(([k]) => k === "stdout").map(([, t]) => t), wrote, "earlier attempts' chunks came too, in order");
  });
}

test("resume from an event's id: the rest, no gap, no duplicate", async () => {
  const { entries } = CASES[0];
  const id = await job(entries, "succeeded");
  const first = [];
  for await (const event of client.events(id, { blockMs: 500 })) {
    first.push(event);
    if (first.length === 3) break;
  }
  const rest = await collect(client.events(id, { cursor: first[2].id, blockMs: 500 }));
  assert.deepEqual([...first, ...rest].map((e) => e.id), entries.map((e) => e.id));
});

test("events arrive while they are written", async () => {
  const id = await job([], "running");
  const key = client.names.events(id);
  const chunks = Array.from({ length: 10 }, (_, i) => `line ${i}\n`);
  let finishedAt;
  const produce = (async () => {
    await redis.xAdd(key, "*", { type: "attempt", attempt: "1", seq: "0", attempt_id: "a0000000000000001" });
    for (const [i, data] of chunks.entries()) {
      await sleep(100);
      await redis.xAdd(key, "*", { type: "stdout", attempt: "1", seq: String(i + 1), data });
    }
    await redis.hSet(client.names.job(id), "status", "succeeded");
    await redis.xAdd(key, "*", { type: "end", attempt: "1", status: "succeeded" });
    finishedAt = Date.now();
  })();
  const arrivals = [];
  for await (const event of client.events(id, { blockMs: 500 })) arrivals.push([Date.now(), event]);
  await produce;
  assert.deepEqual(arrivals.map(([, e]) => e.type), ["attempt", ...chunks.map(() => "stdout"), "end"]);
  assert.equal(arrivals.filter(([, e]) => e.type === "stdout").map(([, e]) => e.data).join(""), chunks.join(""));
  const firstChunkAt = arrivals.find(([, e]) => e.type === "stdout")[0];
  assert.ok(finishedAt - firstChunkAt > 500, `the first chunk came ${finishedAt - firstChunkAt} ms before the producer finished`);
});

test("a stream without end stops once the job is over", async () => {
  const entries = CASES[0].entries.filter((e) => e.fields.type !== "end");
  const id = await job(entries, "succeeded");
  let started = Date.now();
  const events = await collect(client.events(id, { blockMs: 500 }));
  assert.ok(Date.now() - started < 2000, `took ${Date.now() - started} ms`);
  assert.deepEqual(events.map((e) => e.id), entries.map((e) => e.id));

  // A running job: the reader waits, and stops once the status turns terminal.
  const running = await job(entries.slice(0, 2), "running");
  let turnedAt;
  const finish = (async () => {
    await sleep(1000);
    await redis.xAdd(client.names.events(running), "*", entries[2].fields);
    await redis.hSet(client.names.job(running), "status", "failed");
    turnedAt = Date.now();
  })();
  started = Date.now();
  const got = await collect(client.events(running, { blockMs: 500 }));
  const stopped = Date.now();
  await finish;
  assert.deepEqual(got.map((e) => e.type), entries.slice(0, 3).map((e) => e.fields.type));
  assert.ok(stopped - turnedAt < 2000, `stopped ${stopped - turnedAt} ms after the status turned terminal`);
});

test("an unknown job has no events; timeoutMs stops a reader without error", async () => {
  assert.deepEqual(await collect(client.events(`events-${randomUUID()}`, { blockMs: 200 })), []);
  const id = await job(CASES[0].entries.slice(0, 2), "running");
  const started = Date.now();
  assert.equal((await collect(client.events(id, { blockMs: 500, timeoutMs: 1000 }))).length, 2);
  const took = Date.now() - started;
  assert.ok(took > 900 && took < 2000, `took ${took} ms`);
  await assert.rejects(collect(client.events(id, { blockMs: 0 })), RangeError);
});
