// The Node.js SDK against the real services and a real worker. Expected values are computed
// here, from the data the tests make (the CSV's statistics in plain JS, PNG sizes read from the
// header by hand, hashes with node:crypto).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomUUID } from "node:crypto";
import { createServer } from "node:net";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  amqpAddresses, artifactAt, Client, loadConfig, images, JobCancelled, JobNotFound, JobRejected, JobTimedOut, outputText, raiseForStatus, SubmitError,
} from "../dist/index.js";
import { config, startWorker } from "./harness.mjs";

const WAIT = { timeoutMs: 180_000 };
let worker;
let client;

before(async () => {
  worker = await startWorker();
  client = await Client.connect({ config: config() });
});

after(async () => {
  await client?.close();
  await worker?.stop();
});

const ANALYSIS = `\
import json
import matplotlib.pyplot as plt
import pandas as pd

df = pd.read_csv('data/sales.csv')
df['profit'] = df['sales'] - df['cost']
stats = {
    'rows': int(len(df)),
    'sales_sum': float(df['sales'].sum()),
    'profit_mean': float(df['profit'].mean()),
    'best_day': int(df.loc[df['profit'].idxmax(), 'day']),
}
with open('stats.json', 'w') as f:
    json.dump(stats, f)
fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
ax.bar(df['day'], df['profit'])
print('rows', len(df))
df.describe()
`;

function salesRows() {
  const rows = [];
  for (let day = 1; day <= 45; day++) {
    rows.push({ day, sales: 200 + 4 * day + ((day * 17) % 9) * 1.5, cost: 150 + 3 * day + ((day * 5) % 4) * 2.25 });
  }
  return rows;
}

function pngSize(data) {
  assert.deepEqual([...data.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a], "PNG signature");
  assert.equal(data.subarray(12, 16).toString("latin1"), "IHDR");
  assert.equal(data.subarray(data.length - 8, data.length - 4).toString("latin1"), "IEND");
  return [data.readUInt32BE(16), data.readUInt32BE(20)];
}

test("a CSV job: the chart and the artifact, downloaded and checked", async () => {
  const rows = salesRows();
  const csv = Buffer.from(`day,sales,cost\n${rows.map((r) => `${r.day},${r.sales},${r.cost}`).join("\n")}\n`);
  const upload = await client.upload(csv, "data/sales.csv");
  assert.equal(upload.sha256, createHash("sha256").update(csv).digest("hex"));
  assert.equal(upload.key, `inputs/sha256/${upload.sha256}`);

  const result = await client.run({ code: ANALYSIS, inputs: [upload], sku: "M" }, WAIT);
  assert.equal(result.status, "succeeded", result.stderr.text);
  assert.equal(result.exit_code, 0);
  assert.equal(result.stdout.text, "rows 45\n");
  assert.equal(result.execution_count, 1);
  assert.ok(result.sandbox && result.sandbox.sandbox_wait_ms >= 0, JSON.stringify(result.sandbox));
  assert.ok(result.usage && result.usage.wall_ms > 0);

  const [table] = result.outputs.filter((o) => o.output_type === "execute_result");
  assert.deepEqual(table.table, { rows: 8, columns: 4 });
  assert.match(outputText(table), /profit/);

  const [chart] = images(result);
  assert.equal(chart.output.output_type, "display_data");
  assert.equal(chart.mime, "image/png");
  assert.ok(chart.value.artifact.url, "a presigned URL");
  const png = await client.download(chart.value.artifact);
  assert.deepEqual(pngSize(png), [500, 400], "figsize (5, 4) at 100 dpi");
  assert.deepEqual(chart.output.image, { width: 500, height: 400 });
  assert.equal(chart.value.size, png.length);

  const statsArtifact = artifactAt(result, "stats.json");
  assert.ok(statsArtifact, JSON.stringify(result.artifacts));
  const got = JSON.parse((await client.download(statsArtifact)).toString());
  const profits = rows.map((r) => r.sales - r.cost);
  const best = profits.indexOf(Math.max(...profits));
  assert.equal(got.rows, 45);
  assert.equal(got.best_day, rows[best].day);
  assert.ok(Math.abs(got.sales_sum - rows.reduce((s, r) => s + r.sales, 0)) < 1e-6, String(got.sales_sum));
  assert.ok(Math.abs(got.profit_mean - profits.reduce((s, p) => s + p, 0) / rows.length) < 1e-6, String(got.profit_mean));
  assert.deepEqual(result.artifacts.map((a) => a.path), ["stats.json"]);
});

test("run streams stdout while the job runs", async () => {
  // A line every 200 ms for 2 s: onStdout gets the first long before the result, and the chunks
  // make up the result's stdout.
  const chunks = [];
  const code = "import time\nfor i in range(10):\n    print(i, flush=True); time.sleep(0.2)";
  const result = await client.run({ code, sku: "S" }, { ...WAIT, onStdout: (text) => chunks.push([Date.now(), text]) });
  const returned = Date.now();
  assert.equal(result.status, "succeeded", result.stderr.text);
  assert.ok(chunks.length > 0, "no stdout event came");
  assert.ok(returned - chunks[0][0] >= 1000, `the first chunk came ${returned - chunks[0][0]} ms before run returned`);
  assert.equal(chunks.map(([, text]) => text).join(""), result.stdout.text);
});

test("a session keeps variables across jobs", async () => {
  const session = client.session();
  const first = raiseForStatus(await session.run({ code: "x = 1" }, WAIT));
  const second = raiseForStatus(await session.run({ code: "x += 1\nprint(x)" }, WAIT));
  assert.equal(second.stdout.text, "2\n");
  assert.deepEqual([first.execution_count, second.execution_count], [1, 2]);
  assert.equal(first.session.name, session.name);
  assert.equal(first.session.fresh, true);
  assert.equal(second.session.fresh, false);
  assert.ok(second.session.state.variables.includes("x"));
  assert.ok((await client.sessions()).some((s) => s.name === session.name));
});

test("a timeout", async () => {
  const result = await client.run({ code: "import time\nprint('started', flush=True)\ntime.sleep(60)", sku: "S", timeout: "2s" }, WAIT);
  assert.equal(result.status, "timed_out");
  assert.equal(result.signal, "SIGKILL");
  assert.equal(result.stdout.text, "started\n");
  assert.throws(() => raiseForStatus(result), (e) => e instanceof JobTimedOut && e.result === result);
});

test("a cancel of a running job", async () => {
  const id = await client.submit({ code: "import time\nprint('up', flush=True)\ntime.sleep(120)", sku: "S", timeout: "5m" });
  const started = Date.now();
  for (;;) {
    const current = await client.status(id);
    if (current?.status === "running") break;
    assert.ok(Date.now() - started < 120_000, `still ${current?.status}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(await client.cancel(id), true);
  const result = await client.wait(id, WAIT);
  assert.equal(result.status, "cancelled");
  assert.ok(result.finished_at_ms - result.started_at_ms < 60_000, "killed, not left to run");
  assert.equal(await client.cancel(id), false);
  assert.throws(() => raiseForStatus(result), JobCancelled);
});

test("a rejected job throws with the reason", async () => {
  await assert.rejects(client.run({ code: "print(1)", env: { "1BAD": "x" }, sku: "S" }, WAIT), (e) => {
    assert.ok(e instanceof JobRejected, String(e));
    assert.equal(e.result.status, "rejected");
    assert.match(e.reason, /1BAD/);
    return true;
  });
  const id = await client.submit({ code: "print(1)", env: { PATH: "/evil" }, sku: "S" });
  const result = await client.wait(id, { ...WAIT, raiseOnError: false });
  assert.equal(result.status, "rejected");
  assert.match(result.reason, /PATH/);
});

test("stdin, a notebook value, an unknown job and an unroutable submit", async () => {
  const result = await client.run({ code: "import sys\nprint(sys.stdin.read()[::-1])\n6 * 7", stdin: "olleh", sku: "S" }, WAIT);
  assert.equal(result.stdout.text, "hello\n");
  assert.deepEqual(result.outputs.map(outputText), ["42"]);
  await assert.rejects(client.wait(randomUUID(), { timeoutMs: 5000 }), JobNotFound);
  // A namespace whose exchange nobody declared: the broker refuses, nothing is queued.
  const nowhere = await Client.connect({ config: { ...config(), namespace: `${config().namespace}-nowhere` } });
  try {
    await assert.rejects(nowhere.submit({ code: "print(1)" }), SubmitError);
  } finally {
    await nowhere.close();
  }
});

test("amqp urls as a list or a comma-separated string", () => {
  const dir = mkdtempSync(join(tmpdir(), "sandq-node-config-"));
  const path = join(dir, "sandq.toml");
  writeFileSync(path, '[amqp]\nurl = "amqp://x:9/%2f"\nurls = ["amqp://a:1/%2f", "amqp://b:2/%2f"]\nconfirm_timeout = "5s"\n');
  const saved = process.env.SANDQ__AMQP__URLS;
  try {
    delete process.env.SANDQ__AMQP__URLS;
    const listed = loadConfig(path);
    assert.deepEqual(amqpAddresses(listed), ["amqp://a:1/%2f", "amqp://b:2/%2f"]);
    assert.equal(listed.confirmTimeout, "5s");
    process.env.SANDQ__AMQP__URLS = " amqp://c:3/%2f,, amqp://d:4/%2f ";
    assert.deepEqual(amqpAddresses(loadConfig(path)), ["amqp://c:3/%2f", "amqp://d:4/%2f"]);
    process.env.SANDQ__AMQP__URLS = "";
    assert.deepEqual(amqpAddresses(loadConfig(path)), ["amqp://x:9/%2f"]);
  } finally {
    if (saved === undefined) delete process.env.SANDQ__AMQP__URLS;
    else process.env.SANDQ__AMQP__URLS = saved;
    rmSync(dir, { recursive: true, force: true });
  }
});

/** A loopback port nothing listens on (bound, then released). */
async function closedPort() {
  const server = createServer();
  await new Promise((done) => server.listen(0, "127.0.0.1", done));
  const { port } = server.address();
  await new Promise((done) => server.close(done));
  return port;
}

test("a submit goes past broker addresses that refuse or hang (nodes down or stuck)", async () => {
  // Only loopback: a port nothing listens on, and a listener that accepts and never answers
  // (skipped after 10 s).
  const silent = createServer(() => {});
  await new Promise((done) => silent.listen(0, "127.0.0.1", done));
  const cfg = config();
  const urls = [
    `amqp://guest:guest@127.0.0.1:${await closedPort()}/%2f`,
    `amqp://guest:guest@127.0.0.1:${silent.address().port}/%2f`,
    cfg.amqpUrl,
  ];
  const failover = await Client.connect({ config: { ...cfg, amqpUrls: urls } });
  try {
    const result = await failover.run({ code: "print(6 * 7)", sku: "S" }, WAIT);
    assert.equal(result.status, "succeeded");
    assert.equal(result.stdout.text, "42\n");
  } finally {
    await failover.close();
    silent.close();
  }
});
