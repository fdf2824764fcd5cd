// A direct-mode submission asks the broker whether a worker serves the job's SKU (its queue's
// consumer count; docs/protocol.md "Which SKUs are served") and warns, refuses or ignores as
// `unserved` says. Real broker and Redis: a namespace no worker consumes, and a worker of the
// test's own (in a namespace of its own) for the served case.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import * as amqp from "amqplib";
import { Client, loadConfig, Names, redisClient, SandqError, UnservedSku } from "../dist/index.js";
import { startWorker } from "./harness.mjs";

const UNSERVED_NS = `sandq-test-unserved-node-${randomUUID().slice(0, 8)}`;
const SERVED_NS = "sandq-test-sdk-node27";
const unservedConfig = { ...loadConfig(), namespace: UNSERVED_NS };
const servedConfig = { ...loadConfig(), namespace: SERVED_NS };
let worker;

before(async () => {
  const client = await Client.connect({ config: unservedConfig });
  await client.declareTopology();
  await client.close();
  worker = await startWorker({ config: servedConfig, workerId: "test-sdk-node27" });
});

/** Deletes the namespace's queues, exchanges and Redis keys. */
async function removeNamespace(cfg) {
  const names = new Names(cfg.namespace);
  const connection = await amqp.connect(cfg.amqpUrl);
  try {
    const ch = await connection.createChannel();
    for (const sku of ["S", "M", "L", "XL"]) await ch.deleteQueue(names.queue(sku));
    await ch.deleteQueue(names.deadQueue);
    await ch.deleteExchange(names.exchange);
    await ch.deleteExchange(names.dlx);
  } finally {
    await connection.close();
  }
  const redis = redisClient(cfg);
  await redis.connect();
  for await (const keys of redis.scanIterator({ MATCH: `${cfg.namespace}*` })) {
    for (const key of [keys].flat()) await redis.del(key);
  }
  await redis.close();
}

after(async () => {
  await worker?.stop();
  await removeNamespace(unservedConfig);
  await removeNamespace(servedConfig);
});

/** The ready messages in the SKU's queue (a passive declare of the test's own). */
async function ready(cfg, sku) {
  const connection = await amqp.connect(cfg.amqpUrl);
  try {
    return (await (await connection.createChannel()).checkQueue(new Names(cfg.namespace).queue(sku))).messageCount;
  } finally {
    await connection.close();
  }
}

/** The SandqUnservedSkuWarning messages emitted while `fn` runs, and its result. */
async function warningsOf(fn) {
  const seen = [];
  const listener = (w) => { if (w.name === "SandqUnservedSkuWarning") seen.push(w.message); };
  process.on("warning", listener);
  try {
    const value = await fn();
    // 'warning' is emitted on the next tick.
    await new Promise((r) => setImmediate(r));
    return [seen, value];
  } catch (e) {
    await new Promise((r) => setImmediate(r));
    e.warnings = seen;
    throw e;
  } finally {
    process.off("warning", listener);
  }
}

test("an unserved SKU warns, then the job is queued; 0 is never remembered", async () => {
  const client = await Client.connect({ config: unservedConfig });
  try {
    const queue = `${UNSERVED_NS}.jobs.L`;
    const before = await ready(unservedConfig, "L");
    const [seen, id] = await warningsOf(() => client.submit({ code: "print(1)", sku: "L", result_ttl: "5m" }));
    assert.equal(seen.length, 1, String(seen));
    assert.ok(seen[0].includes(id) && seen[0].includes("SKU L") && seen[0].includes(queue), seen[0]);
    assert.ok(seen[0].includes(`expires after ${unservedConfig.unservedTtl} (queues.unserved_ttl)`), seen[0]);
    assert.equal((await client.status(id))?.status, "queued");
    assert.equal(await ready(unservedConfig, "L"), before + 1);
    const [again, second] = await warningsOf(() => client.submit({ code: "print(2)", sku: "L", result_ttl: "5m" }));
    assert.equal(again.length, 1);
    assert.ok(again[0].includes(second));
    assert.equal(await ready(unservedConfig, "L"), before + 2);
  } finally {
    await client.close();
  }
});

test("refuse rejects with UnservedSku, publishes nothing, writes no status", async () => {
  const client = await Client.connect({ config: unservedConfig, unserved: "refuse" });
  try {
    const jobId = randomUUID();
    const before = await ready(unservedConfig, "M");
    const seen = [];
    await assert.rejects(warningsOf(() => client.submit({ code: "print(1)", sku: "M", job_id: jobId })), (e) => {
      seen.push(...e.warnings);
      assert.ok(e instanceof UnservedSku && e instanceof SandqError);
      assert.deepEqual([e.jobId, e.sku, e.queue], [jobId, "M", `${UNSERVED_NS}.jobs.M`]);
      assert.equal(e.message, `no worker serves sku M right now (queue ${UNSERVED_NS}.jobs.M has no consumer): job ${jobId} not submitted`);
      return true;
    });
    assert.deepEqual(seen, []);
    assert.equal(await client.status(jobId), null);
    assert.equal(await ready(unservedConfig, "M"), before);
    // A queue that does not exist (404 closes the check's channel) is unserved too, every time.
    const nowhere = await Client.connect({ config: { ...unservedConfig, namespace: `${UNSERVED_NS}-nowhere` }, unserved: "refuse" });
    try {
      for (let i = 0; i < 2; i++) {
        await assert.rejects(nowhere.submit({ code: "print(1)", sku: "S" }), (e) => e instanceof UnservedSku && e.queue === `${UNSERVED_NS}-nowhere.jobs.S`);
      }
    } finally {
      await nowhere.close();
    }
  } finally {
    await client.close();
  }
});

test("ignore does not ask; the option is checked", async () => {
  const client = await Client.connect({ config: unservedConfig, unserved: "ignore" });
  try {
    const before = await ready(unservedConfig, "XL");
    const [seen, id] = await warningsOf(() => client.submit({ code: "print(1)", sku: "XL", result_ttl: "5m" }));
    assert.deepEqual(seen, []);
    assert.equal((await client.status(id))?.status, "queued");
    assert.equal(await ready(unservedConfig, "XL"), before + 1);
  } finally {
    await client.close();
  }
  await assert.rejects(Client.connect({ config: unservedConfig, unserved: "never" }), RangeError);
  assert.throws(() => new Client({ url: "http://127.0.0.1:1", apiKey: "sq_x", unserved: "refuse" }), /direct mode's/);
});

test("a served SKU does not warn (a worker consuming)", async () => {
  for (const unserved of ["warn", "refuse"]) {
    const client = await Client.connect({ config: servedConfig, unserved });
    try {
      const [seen, ids] = await warningsOf(async () => [
        await client.submit({ code: "print(6 * 7)", sku: "S" }),
        // Within 10 s: remembered as served.
        await client.submit({ code: "print(1)", sku: "S" }),
      ]);
      assert.deepEqual(seen, []);
      assert.equal((await client.wait(ids[0], { timeoutMs: 120_000 })).stdout.text, "42\n");
      assert.equal((await client.wait(ids[1], { timeoutMs: 120_000 })).status, "succeeded");
    } finally {
      await client.close();
    }
  }
});
