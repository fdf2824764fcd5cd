// The SDK's HTTP mode against a real sandq-gateway and a real worker, in a namespace of their own
// (sandq-test-sdk-node-gw), with keys of two tenants made by `sandq key create`. Expected values
// are computed here (the CSV's sum and mean in plain JS, the artifact's bytes, the events as a
// direct-mode client reads them from Redis); a loopback TCP proxy between client and gateway
// records the requests and cuts connections, to see the event stream resumed.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomUUID } from "node:crypto";
import { createConnection, createServer } from "node:net";
import {
  artifactAt, Client, Conflict, ForbiddenByQuota, GatewayError, InvalidRequest, JobNotFound, loadConfig, NotFound, raiseForStatus, Unauthorized,
} from "../dist/index.js";
import { createKey, startGateway, startWorker } from "./harness.mjs";

const NAMESPACE = "sandq-test-sdk-node-gw";
const WAIT = { timeoutMs: 180_000 };
const S = { sku: "S" };
let worker;
let gateway;
let proxy;
let client; // tenant A
let other; // tenant B
let direct; // the same namespace, read directly (Redis), to compare
let tenantA;
let keyA;

const tenant = (label) => `${label}${randomUUID().replaceAll("-", "").slice(0, 8)}`;

/** A loopback proxy to `port`: `url`; `requests()`, what clients sent (latin1, every
 * connection's bytes); `cut()`, every open connection destroyed. */
async function startProxy(port) {
  const sockets = new Set();
  const sent = [];
  const server = createServer((downstream) => {
    const upstream = createConnection({ host: "127.0.0.1", port });
    const record = { text: "" };
    sent.push(record);
    sockets.add(downstream);
    sockets.add(upstream);
    downstream.on("data", (d) => { record.text += d.toString("latin1"); });
    downstream.pipe(upstream);
    upstream.pipe(downstream);
    const drop = () => { downstream.destroy(); upstream.destroy(); sockets.delete(downstream); sockets.delete(upstream); };
    downstream.on("error", drop).on("close", drop);
    upstream.on("error", drop).on("close", drop);
  });
  await new Promise((done) => server.listen(0, "127.0.0.1", done));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    requests: () => sent.map((r) => r.text).join(""),
    cut: () => { for (const s of sockets) s.destroy(); },
    close: () => { for (const s of sockets) s.destroy(); server.close(); },
  };
}

before(async () => {
  const config = { ...loadConfig(), namespace: NAMESPACE };
  worker = await startWorker({ config, workerId: "test-sdk-node-gw" });
  gateway = await startGateway({ namespace: NAMESPACE, env: { SANDQ__GATEWAY__KEEP_ALIVE: "1s" } });
  proxy = await startProxy(Number(new URL(gateway.url).port));
  tenantA = tenant("nodea");
  keyA = createKey({ namespace: NAMESPACE, tenant: tenantA });
  client = new Client({ url: gateway.url, apiKey: keyA });
  other = new Client({ url: gateway.url, apiKey: createKey({ namespace: NAMESPACE, tenant: tenant("nodeb") }) });
  direct = await Client.connect({ config });
});

after(async () => {
  await client?.close();
  await other?.close();
  await direct?.close();
  proxy?.close();
  await gateway?.stop();
  await worker?.stop();
});

test("the mode: url and key from the options or the environment, explicit options first", async () => {
  assert.equal(client.mode, "http");
  assert.equal(client.url, gateway.url);
  assert.equal(direct.mode, "direct");
  assert.throws(() => client.names, /direct mode/);
  const saved = { url: process.env.SANDQ_URL, key: process.env.SANDQ_API_KEY };
  try {
    process.env.SANDQ_URL = gateway.url;
    process.env.SANDQ_API_KEY = "sq_000000000000_not-a-key";
    const fromEnv = await Client.connect();
    assert.equal(fromEnv.mode, "http");
    await assert.rejects(fromEnv.status("x"), Unauthorized);
    await fromEnv.close();
    // An explicit config is direct mode whatever the environment says.
    const explicit = await Client.connect({ config: { ...loadConfig(), namespace: NAMESPACE } });
    assert.equal(explicit.mode, "direct");
    await explicit.close();
    delete process.env.SANDQ_API_KEY;
    assert.throws(() => new Client(), /SANDQ_API_KEY/);
    delete process.env.SANDQ_URL;
    assert.throws(() => new Client(), /Client\.connect/);
  } finally {
    for (const [name, value] of [["SANDQ_URL", saved.url], ["SANDQ_API_KEY", saved.key]]) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  }
});

test("run a job and read its stdout", async () => {
  const result = raiseForStatus(await client.run({ code: "import sys\nprint(6 * 7)\nprint(sys.stdin.read()[::-1])", stdin: "olleh", ...S }, WAIT));
  assert.equal(result.stdout.text, "42\nhello\n");
  assert.equal(result.exit_code, 0);
  // The tenant's own id (the queue's is `<tenant>_<id>`), and the same result as stored.
  assert.ok(!result.job_id.startsWith(`${tenantA}_`), result.job_id);
  const stored = await direct.status(`${tenantA}_${result.job_id}`);
  assert.equal(stored.stdout.text, result.stdout.text);
  assert.deepEqual((await client.status(result.job_id)).usage, stored.usage);
});

test("an uploaded CSV, read by the job", async () => {
  const rows = Array.from({ length: 40 }, (_, i) => ({ day: i + 1, value: ((i * 37) % 23) + i / 4 }));
  const csv = Buffer.from(`day,value\n${rows.map((r) => `${r.day},${r.value}`).join("\n")}\n`);
  const upload = await client.upload(csv, "data/values.csv");
  assert.equal(upload.sha256, createHash("sha256").update(csv).digest("hex"));
  assert.equal(upload.size, csv.length);
  assert.deepEqual(await client.upload(csv, "data/values.csv"), upload, "uploading the same bytes again: the same file");
  const code = "import csv, json\nrows = list(csv.DictReader(open('data/values.csv')))\n"
    + "values = [float(r['value']) for r in rows]\nprint(json.dumps({'n': len(rows), 'sum': sum(values), 'max_day': int(max(rows, key=lambda r: float(r['value']))['day'])}))";
  const result = raiseForStatus(await client.run({ code, inputs: [upload], ...S }, WAIT));
  const got = JSON.parse(result.stdout.text);
  const sum = rows.reduce((s, r) => s + r.value, 0);
  const best = rows.reduce((b, r) => (r.value > b.value ? r : b));
  assert.equal(got.n, 40);
  assert.ok(Math.abs(got.sum - sum) < 1e-9, `${got.sum} != ${sum}`);
  assert.equal(got.max_day, best.day);
});

const TICKS = "import time\nfor i in range(10):\n    print('tick', i, flush=True); time.sleep(0.2)";

test("live events come while the job runs, and resume from a cursor with no gap or duplicate", async () => {
  const id = await client.submit({ code: TICKS, ...S });
  const first = [];
  let statusAtFirst = null;
  let firstAt = 0;
  for await (const event of client.events(id)) {
    first.push(event);
    if (event.type === "stdout" && statusAtFirst === null) {
      firstAt = Date.now();
      statusAtFirst = (await client.status(id)).status;
    }
    if (first.filter((e) => e.type === "stdout").length === 3) break;
  }
  assert.equal(statusAtFirst, "running", "the first stdout event came before the job ended");
  const cursor = first.at(-1).id;
  const rest = [];
  for await (const event of client.events(id, { cursor })) rest.push(event);
  const endedAt = Date.now();
  assert.ok(endedAt - firstAt >= 1000, `the first line came ${endedAt - firstAt} ms before the end`);
  assert.equal(rest.at(-1).type, "end");
  assert.equal(rest.at(-1).status, "succeeded");
  const result = await client.wait(id, WAIT);
  // Together: every event once, in order, as a direct-mode client reads them from Redis.
  const all = [];
  for await (const event of direct.events(`${tenantA}_${id}`)) all.push(event);
  assert.deepEqual([...first, ...rest], all);
  const stdout = [...first, ...rest].filter((e) => e.type === "stdout").map((e) => e.data).join("");
  assert.equal(stdout, result.stdout.text);
  assert.equal(stdout, Array.from({ length: 10 }, (_, i) => `tick ${i}\n`).join(""));
  // run's callbacks, through the same stream.
  const chunks = [];
  const again = await client.run({ code: TICKS, ...S }, { ...WAIT, onStdout: (text) => chunks.push(text) });
  assert.equal(chunks.join(""), again.stdout.text);
});

test("a stream cut mid-job is resumed with Last-Event-ID: no gap, no duplicate", async () => {
  const viaProxy = new Client({ url: proxy.url, apiKey: keyA });
  try {
    const id = await viaProxy.submit({ code: TICKS, ...S });
    const post = proxy.requests().split("POST /v1/jobs ").at(-1).split("\r\n\r\n")[0].toLowerCase();
    assert.match(post, new RegExp(`\r\nidempotency-key: ${id}\r\n`), "the submission's Idempotency-Key is its job id");
    const got = [];
    let cut = false;
    for await (const event of viaProxy.events(id)) {
      got.push(event);
      if (!cut && got.filter((e) => e.type === "stdout").length === 2) {
        proxy.cut();
        cut = true;
      }
    }
    assert.ok(cut);
    const all = [];
    for await (const event of direct.events(`${tenantA}_${id}`)) all.push(event);
    assert.deepEqual(got.map((e) => e.id), all.map((e) => e.id));
    assert.deepEqual(got, all);
    const heads = proxy.requests().split(`GET /v1/jobs/${id}/events`).slice(1).map((r) => r.split("\r\n\r\n")[0].toLowerCase());
    assert.ok(heads.length >= 2, `${heads.length} event requests`);
    const resumedFrom = heads.at(-1).match(/last-event-id: (\S+)/)?.[1];
    const at = all.findIndex((e) => e.id === resumedFrom);
    assert.ok(at >= 2 && at < all.length - 1, `resumed from ${resumedFrom}, event ${at} of ${all.length}`);
  } finally {
    await viaProxy.close();
  }
});

test("display events and an output's image, as direct mode reads them", async () => {
  const code = "import matplotlib.pyplot as plt\nimport pandas as pd\nplt.plot([1, 2, 3])\nplt.show()\npd.DataFrame({'a': [1, 2]})";
  const id = await client.submit({ code, ...S });
  const displays = [];
  const result = await client.run({ code, ...S }, { ...WAIT, onDisplay: (output) => displays.push(output) });
  // (The worker stamps an event's URL expiry a few ms apart from the result's.)
  const stamped = (value) => JSON.parse(JSON.stringify(value, (k, v) => (k === "url_expires_at_ms" ? undefined : v)));
  assert.deepEqual(stamped(displays), stamped(result.outputs), "every output, as the result has it");
  const http = [];
  for await (const event of client.events(id)) http.push(event);
  const raw = [];
  for await (const event of direct.events(`${tenantA}_${id}`)) raw.push(event);
  assert.deepEqual(http.map((e) => e.type), raw.map((e) => e.type));
  assert.equal(raw.filter((e) => e.type === "display").length, 2);
  // The same events; a display's JSON text is the gateway's serialization, the same value.
  const value = (e) => (e.type === "display" ? { ...e, data: JSON.parse(e.data), fields: { ...e.fields, data: JSON.parse(e.fields.data) } } : e);
  assert.deepEqual(http.map(value), raw.map(value));
  // An image of the outputs is no artifact of the job: it comes through its own presigned URL.
  const image = result.outputs.flatMap((o) => Object.entries(o.data)).find(([mime]) => mime === "image/png")[1];
  const png = await client.download(image.artifact);
  assert.equal(png.length, image.size);
  assert.equal(png.subarray(1, 4).toString("latin1"), "PNG");
});

test("a session keeps a variable", async () => {
  const session = client.session();
  const first = raiseForStatus(await session.run({ code: "x = 40", ...S }, WAIT));
  const second = raiseForStatus(await session.run({ code: "x += 2\nprint(x)", ...S }, WAIT));
  assert.equal(second.stdout.text, "42\n");
  assert.deepEqual([first.execution_count, second.execution_count], [1, 2]);
  assert.equal(second.session.name, session.name);
  assert.equal(first.session.fresh, true);
  assert.equal(second.session.fresh, false);
  const listed = (await client.sessions()).find((s) => s.name === session.name);
  assert.ok(listed, "the tenant's sessions list it");
  assert.equal(listed.executionCount, 2);
  assert.ok(listed.expiresAtMs > Date.now());
  assert.ok(!(await other.sessions()).some((s) => s.name === session.name), "not another tenant's");
});

test("a cancel of a running job", async () => {
  const id = await client.submit({ code: "import time\nprint('up', flush=True)\ntime.sleep(120)", ...S, timeout: "5m" });
  for await (const event of client.events(id)) if (event.type === "stdout") break;
  assert.equal((await client.status(id)).status, "running");
  assert.equal(await client.cancel(id), true);
  const result = await client.wait(id, WAIT);
  assert.equal(result.status, "cancelled");
  assert.ok(result.finished_at_ms - result.started_at_ms < 60_000, "killed, not left to run");
  assert.equal(await client.cancel(id), false, "over: nothing to cancel");
});

test("an artifact's bytes, through the gateway's redirect", async () => {
  const viaProxy = new Client({ url: proxy.url, apiKey: keyA });
  try {
    const expected = Buffer.alloc(100_000);
    for (let i = 0; i < expected.length; i++) expected[i] = (i * 31 + 7) % 251;
    const code = "with open('out/data.bin', 'wb') as f:\n    f.write(bytes((i * 31 + 7) % 251 for i in range(100000)))";
    const result = raiseForStatus(await viaProxy.run({ code: `import os\nos.makedirs('out')\n${code}`, ...S }, WAIT));
    const artifact = artifactAt(result, "out/data.bin");
    assert.ok(artifact, JSON.stringify(result.artifacts));
    assert.deepEqual(await viaProxy.download(artifact), expected);
    assert.match(proxy.requests(), new RegExp(`GET /v1/jobs/${result.job_id}/artifacts/out/data\\.bin `));
    // By job id, from another client; not another tenant's.
    assert.deepEqual(await client.download({ ...artifact }, result.job_id), expected);
    await assert.rejects(other.download({ ...artifact }, result.job_id), NotFound);
    await assert.rejects(client.download({ ...artifact, path: "out/none.bin" }, result.job_id), NotFound);
  } finally {
    await viaProxy.close();
  }
});

test("a wrong key is Unauthorized; refused jobs are typed errors", async () => {
  const wrong = new Client({ url: gateway.url, apiKey: `sq_${"a".repeat(12)}_${"b".repeat(43)}` });
  await assert.rejects(wrong.submit({ code: "print(1)", ...S }), (e) => {
    assert.ok(e instanceof Unauthorized && e instanceof GatewayError, String(e));
    assert.equal(e.status, 401);
    assert.equal(e.type, "urn:sandq:problem:unauthorized");
    return true;
  });
  await assert.rejects(wrong.status("anything"), Unauthorized);
  await assert.rejects(wrong.upload(Buffer.from("x"), "x.txt"), Unauthorized);
  // The key's largest SKU is M.
  await assert.rejects(client.submit({ code: "print(1)", sku: "XL" }), (e) => e instanceof ForbiddenByQuota && e.status === 403);
  await assert.rejects(client.submit({ code: "print(1)", env: { "1BAD": "x" }, ...S }), (e) => e instanceof InvalidRequest && /1BAD/.test(e.detail));
  // The same job id: the same job; with another body, a conflict.
  const jobId = `same-${randomUUID()}`;
  assert.equal(await client.submit({ code: "print(1)", job_id: jobId, ...S }), jobId);
  await assert.rejects(client.submit({ code: "print(2)", job_id: jobId, ...S }), Conflict);
  assert.equal((await client.wait(jobId, WAIT)).stdout.text, "1\n");
});

test("another tenant's job is not found", async () => {
  const id = await client.submit({ code: "print('mine')", ...S });
  assert.equal((await client.wait(id, WAIT)).stdout.text, "mine\n");
  assert.equal(await other.status(id), null);
  await assert.rejects(other.wait(id, { timeoutMs: 5000 }), (e) => {
    assert.ok(e instanceof JobNotFound, String(e));
    assert.equal(e.problem.type, "urn:sandq:problem:not-found");
    return true;
  });
  await assert.rejects((async () => { for await (const _ of other.events(id)) { /* none */ } })(), JobNotFound);
  assert.equal(await other.cancel(id), false);
  assert.equal(await other.status(randomUUID()), null);
  assert.equal((await client.status(id)).status, "succeeded", "still its own tenant's");
});
