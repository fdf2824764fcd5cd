// The SDK on a Redis Cluster (`[redis] mode = "cluster"`): jobs submitted, waited for with BLPOP
// (routed by key) and a running one cancelled, against a worker configured to the same cluster;
// a job's live events read with XREAD (routed by key).
// Three primaries without replicas, started here on loopback with their data in a temp dir and
// killed at the end: failover is tests/redis_cluster.rs's subject. Ports:
// $SANDQ_REDIS_CLUSTER_PORT .. +2 and the bus $SANDQ_REDIS_CLUSTER_BUS_PORT .. +2 (.ci/run
// exports them; else 17110 and 17130); RabbitMQ and S3 are the config's.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Client, loadConfig, redisClient } from "../dist/index.js";
import { startWorker } from "./harness.mjs";

const WAIT = 180;
const port = Number(process.env.SANDQ_REDIS_CLUSTER_PORT || 17110);
const bus = Number(process.env.SANDQ_REDIS_CLUSTER_BUS_PORT || port + 20);
const ports = [port, port + 1, port + 2];
const root = mkdtempSync(join(tmpdir(), "sandq-node-cluster-"));
const servers = [];
let worker;
let client;

function cli(p, ...args) {
  try {
    return execFileSync("redis-cli", ["-p", String(p), ...args], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
  } catch {
    return "";
  }
}

// A function from a slot to the port of the primary that serves it, read from each primary's own
// line (`myself`) of CLUSTER NODES: fields 9.. are its slot ranges.
function slotOwners() {
  const ranges = [];
  for (const p of ports) {
    const mine = cli(p, "cluster", "nodes").split("\n").find((line) => line.split(" ")[2]?.includes("myself"));
    for (const part of mine.trim().split(" ").slice(8)) {
      const [low, high] = part.split("-").map(Number);
      ranges.push([low, high ?? low, p]);
    }
  }
  return (slot) => ranges.find(([low, high]) => low <= slot && slot <= high)[2];
}

async function waitFor(check, limitMs, what) {
  const started = Date.now();
  while (!(await check())) {
    if (Date.now() - started > limitMs) throw new Error(what);
    await new Promise((r) => setTimeout(r, 100));
  }
}

before(async () => {
  ports.forEach((p, i) => {
    mkdirSync(join(root, String(p)));
    servers.push(spawn("redis-server", ["--port", String(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
      "--cluster-port", String(bus + i), "--cluster-node-timeout", "1000", "--save", "", "--dir", join(root, String(p))],
      { stdio: "ignore" }));
  });
  for (const p of ports) await waitFor(() => cli(p, "ping").startsWith("PONG"), 20_000, `redis on ${p} did not start`);
  execFileSync("redis-cli", ["--cluster", "create", ...ports.map((p) => `127.0.0.1:${p}`), "--cluster-yes"], { stdio: "ignore" });
  await waitFor(() => ports.every((p) => cli(p, "cluster", "info").includes("cluster_state:ok")), 60_000, "cluster not ready");
  const config = {
    ...loadConfig(),
    namespace: "sandq-test-sdk-node-cluster",
    redisMode: "cluster",
    redisNodes: ports.map((p) => `redis://127.0.0.1:${p}/`),
  };
  worker = await startWorker({
    config,
    workerId: "test-sdk-node-cluster",
    env: { SANDQ__REDIS__MODE: "cluster", SANDQ__REDIS__NODES: config.redisNodes.join(",") },
  });
  client = await Client.connect({ config });
});

after(async () => {
  await client?.close();
  await worker?.stop();
  for (const s of servers) s.kill("SIGKILL");
  rmSync(root, { recursive: true, force: true });
});

test("jobs and a cancel through a Redis Cluster", async () => {
  const key = (id) => `sandq-test-sdk-node-cluster:job:{${id}}`;
  const ownerOf = slotOwners();
  const owner = (id) => ownerOf(Number(cli(ports[0], "cluster", "keyslot", key(id)).trim()));
  // Two job ids per primary, picked by the slot Redis itself computes (CLUSTER KEYSLOT), so the
  // spread is certain: random ids all fell on one primary 1 time in 243 (CI, 2026-11-30).
  const ids = [];
  for (const p of ports) {
    for (let n = 0; n < 2; ) {
      const candidate = `sdk-node-cluster-${randomBytes(6).toString("hex")}`;
      if (owner(candidate) === p) { ids.push(candidate); n++; }
    }
  }
  for (const [i, id] of ids.entries()) assert.equal(await client.submit({ code: `print(${i} * ${i})`, sku: "S", job_id: id }), id);
  const results = await Promise.all(ids.map((id) => client.wait(id, WAIT)));
  assert.deepEqual(results.map((r) => [r.status, r.stdout.text]), ids.map((_, i) => ["succeeded", `${i * i}\n`]));
  // Each job's hash is on the primary that owns its slot, and on no other: two on each primary.
  const holders = ids.map((id) => ports.filter((p) => cli(p, "exists", key(id)).trim() === "1"));
  assert.deepEqual(holders, ids.map((id) => [owner(id)]));
  const id = await client.submit({ code: "import time\nprint('up', flush=True)\ntime.sleep(120)", sku: "S", timeout: "5m" });
  await waitFor(async () => (await client.status(id))?.status === "running", 120_000, "never ran");
  assert.equal(await client.cancel(id), true);
  assert.equal((await client.wait(id, WAIT)).status, "cancelled");
});

test("live events through a Redis Cluster", async () => {
  // XREAD (blocking, then not) routed by the stream's key: entries written here, one appended
  // while the reader blocks, read back whole; no worker involved.
  const writer = redisClient(client.config);
  writer.on("error", () => {});
  await writer.connect();
  try {
    for (let n = 0; n < 6; n++) {
      const id = `sdk-node-cluster-events-${randomBytes(6).toString("hex")}`;
      const chunks = ["a\n", "b\n", "c\n"];
      await writer.hSet(client.names.job(id), "status", "running");
      for (const [seq, data] of chunks.entries()) {
        await writer.xAdd(client.names.events(id), "*", { type: "stdout", attempt: "1", seq: String(seq), data });
      }
      const end = new Promise((r) => setTimeout(r, 300)).then(() =>
        writer.xAdd(client.names.events(id), "*", { type: "end", attempt: "1", status: "succeeded" }));
      const got = [];
      for await (const event of client.events(id, { blockMs: 2000 })) got.push(event);
      await end;
      assert.deepEqual(got.map((e) => e.type), ["stdout", "stdout", "stdout", "end"]);
      assert.equal(got.map((e) => e.data ?? "").join(""), chunks.join(""));
      await writer.del([client.names.job(id), client.names.events(id)]);
    }
  } finally {
    await writer.close();
  }
});
