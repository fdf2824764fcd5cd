// The SDK's tests run against the services of the sandq config ($SANDQ_CONFIG, else
// /etc/sandq/sandq.toml), with a worker of their own in a namespace of their own
// (sandq-test-sdk-node), as the Rust tests do (tests/harness.rs): the worker binary of
// ${CARGO_TARGET_DIR:-target}/debug, started with --exit-on-stdin-eof so that it stops when the
// tests end; it inherits the environment (SANDQ__WORKER__DATA_DIR/STATE_DIR when CI set them).
import { execFileSync, spawn } from "node:child_process";
import { existsSync, openSync, readFileSync, closeSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, isAbsolute, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import * as amqp from "amqplib";
import { Client, loadConfig } from "../dist/index.js";

export const NAMESPACE = "sandq-test-sdk-node";
const WORKER_ID = "test-sdk-node";
const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");

export function config() {
  return { ...loadConfig(), namespace: NAMESPACE };
}

/** `${CARGO_TARGET_DIR:-target}/debug/<name>`. */
function binaryPath(name) {
  let target = process.env.CARGO_TARGET_DIR || join(REPO, "target");
  if (!isAbsolute(target)) target = join(REPO, target);
  return join(target, "debug", name);
}

function workerBinary() {
  return binaryPath("sandq-worker");
}

async function purgeQueues(cfg) {
  const ns = cfg.namespace;
  const connection = await amqp.connect(cfg.amqpUrl);
  try {
    const channel = await connection.createChannel();
    for (const sku of ["S", "M", "L", "XL"]) await channel.purgeQueue(`${ns}.jobs.${sku}`);
    await channel.purgeQueue(`${ns}.dead`);
  } finally {
    await connection.close();
  }
}

/** Declares the topology, purges the queues, starts the worker and waits until it consumes.
 * `options`: `config` (another namespace or Redis), `workerId`, extra `env`. */
export async function startWorker(options = {}) {
  const cfg = options.config ?? config();
  const workerId = options.workerId ?? WORKER_ID;
  const client = await Client.connect({ config: cfg });
  await client.declareTopology();
  await client.close();
  await purgeQueues(cfg);
  const binary = workerBinary();
  if (!existsSync(binary)) throw new Error(`${binary} missing: build the workspace first (cargo build --workspace)`);
  const logPath = join(tmpdir(), `sandq-${workerId}-worker.log`);
  const log = openSync(logPath, "w");
  const child = spawn(binary, ["--exit-on-stdin-eof"], {
    stdio: ["pipe", "ignore", log],
    env: {
      ...process.env,
      SANDQ__NAMESPACE: cfg.namespace,
      SANDQ__WORKER__ID: workerId,
      SANDQ__WORKER__CAPACITY_CPUS: "16",
      SANDQ__WORKER__CAPACITY_MEMORY_BYTES: String(64 * 2 ** 30),
      // Workers of other tests and instances run beside it (docs/STYLE.md): any free port.
      SANDQ__WORKER__METRICS_ADDR: "127.0.0.1:0",
      ...(options.env ?? {}),
    },
  });
  closeSync(log);
  let exited = false;
  child.on("exit", () => { exited = true; });
  const started = Date.now();
  while (!readFileSync(logPath, "utf8").includes("consuming")) {
    if (exited) throw new Error(`worker exited: ${readFileSync(logPath, "utf8")}`);
    if (Date.now() - started > 60_000) throw new Error(`worker did not start: ${readFileSync(logPath, "utf8")}`);
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    logPath,
    /** Closes the worker's stdin (it shuts down) and waits up to 60 s for it to exit. */
    async stop() {
      if (exited) return;
      const done = new Promise((r) => child.once("exit", r));
      child.stdin.end();
      const timer = setTimeout(() => child.kill("SIGKILL"), 60_000);
      await done;
      clearTimeout(timer);
    },
  };
}

/** Starts a sandq-gateway of ${CARGO_TARGET_DIR:-target}/debug in `namespace` on a free loopback
 * port (`--exit-on-stdin-eof`: it stops when the tests end), with extra `SANDQ__GATEWAY__*`
 * settings in `env`; resolves once it serves, with its base `url` (from its log's "serving the
 * API ... addr=" line). */
export async function startGateway({ namespace, env = {}, name = "gateway" }) {
  const binary = binaryPath("sandq-gateway");
  if (!existsSync(binary)) throw new Error(`${binary} missing: build it first (cargo build -p sandq-gateway)`);
  const logPath = join(tmpdir(), `${namespace}-${name}.log`);
  const log = openSync(logPath, "w");
  const child = spawn(binary, ["--exit-on-stdin-eof"], {
    stdio: ["pipe", "ignore", log],
    env: { ...process.env, SANDQ__NAMESPACE: namespace, SANDQ__GATEWAY__LISTEN: "127.0.0.1:0", SANDQ__GATEWAY__METRICS_LISTEN: "127.0.0.1:0", ...env },
  });
  closeSync(log);
  let exited = false;
  child.on("exit", () => { exited = true; });
  const started = Date.now();
  for (;;) {
    const text = readFileSync(logPath, "utf8");
    const addr = text.split("\n").find((l) => l.includes("serving the API"))?.match(/addr=(\S+)/)?.[1];
    if (addr) {
      return {
        url: `http://${addr}`,
        logPath,
        async stop() {
          if (exited) return;
          const done = new Promise((r) => child.once("exit", r));
          child.stdin.end();
          const timer = setTimeout(() => child.kill("SIGKILL"), 40_000);
          await done;
          clearTimeout(timer);
        },
      };
    }
    if (exited) throw new Error(`gateway exited: ${text}`);
    if (Date.now() - started > 60_000) throw new Error(`gateway did not start: ${text}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** A new API key of `tenant` in `namespace` (`sandq key create`, extra `args`), as printed. */
export function createKey({ namespace, tenant, args = [] }) {
  const out = execFileSync(binaryPath("sandq"), ["key", "create", "--tenant", tenant, ...args], {
    env: { ...process.env, SANDQ__NAMESPACE: namespace },
    stdio: ["ignore", "pipe", "pipe"],
  });
  return out.toString().trim();
}
