// The SDK on a Redis Cluster (`[redis] mode = "cluster"`): jobs submitted, waited for with BLPOP
// (routed by key) and a running one cancelled, against a worker configured to the same cluster.
// Three primaries without replicas, started here on loopback with their data in a temp dir and
// killed at the end: failover is tests/redis_cluster.rs's subject. Ports:
// $SANDQ_REDIS_CLUSTER_PORT .. +2 and the bus $SANDQ_REDIS_CLUSTER_BUS_PORT .. +2 (.ci/run
// exports them; else 17110 and 17130); RabbitMQ and S3 are the config's.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Client, loadConfig } from "../dist/index.js";
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
  const ids = [];
  for (let i = 0; i < 6; i++) ids.push(await client.submit({ code: `print(${i} * ${i})`, sku: "S" }));
  const results = await Promise.all(ids.map((id) => client.wait(id, WAIT)));
  assert.deepEqual(results.map((r) => [r.status, r.stdout.text]), ids.map((_, i) => ["succeeded", `${i * i}\n`]));
  // Each job's hash is on the primary of its slot: more than one primary holds them.
  const holders = ports.filter((p) => ids.some((id) => cli(p, "exists", `sandq-test-sdk-node-cluster:job:{${id}}`).trim() === "1"));
  assert.ok(holders.length > 1, `hashes on ${holders}`);
  const id = await client.submit({ code: "import time\nprint('up', flush=True)\ntime.sleep(120)", sku: "S", timeout: "5m" });
  await waitFor(async () => (await client.status(id))?.status === "running", 120_000, "never ran");
  assert.equal(await client.cancel(id), true);
  assert.equal((await client.wait(id, WAIT)).status, "cancelled");
});
