// E2B's own JavaScript SDK (@e2b/code-interpreter 2.8.0 on e2b 2.51.0, pinned in package.json),
// unchanged, against the gateway's E2B layer (docs/e2b.md) and a real worker, in a namespace of
// their own: create a sandbox, run code and read its value, a chart as a PNG, live stdout, a
// context's variables kept apart from the default one's, kill. Pointed at the gateway as an E2B
// user would: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (`e2b_` and the key's hex).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { loadConfig } from "../dist/index.js";
import { createKey, startGateway, startWorker } from "./harness.mjs";

const NAMESPACE = "sandq-test-sdk-node-e2b";
let worker;
let gateway;
let Sandbox;

before(async () => {
  const config = { ...loadConfig(), namespace: NAMESPACE };
  worker = await startWorker({ config, workerId: "test-sdk-node-e2b" });
  gateway = await startGateway({ namespace: NAMESPACE, name: "e2b-gateway" });
  const tenant = `e2bjs${randomUUID().replaceAll("-", "").slice(0, 8)}`;
  const key = createKey({ namespace: NAMESPACE, tenant, args: ["--jobs-per-minute", "600"] });
  process.env.E2B_API_KEY = `e2b_${Buffer.from(key).toString("hex")}`;
  process.env.E2B_API_URL = gateway.url;
  process.env.E2B_SANDBOX_URL = gateway.url;
  delete process.env.E2B_DEBUG;
  ({ Sandbox } = await import("@e2b/code-interpreter"));
});

after(async () => {
  await gateway?.stop();
  await worker?.stop();
});

test("a sandbox runs code, keeps its variables, streams stdout and is killed", { timeout: 240_000 }, async () => {
  const sandbox = await Sandbox.create({ timeoutMs: 120_000 });
  try {
    assert.match(sandbox.sandboxId, /^i[0-9a-f]{32}$/);
    const first = await sandbox.runCode("x = 6 * 7\nx");
    assert.equal(first.error, undefined, JSON.stringify(first.error));
    assert.equal(first.text, "42");
    const lines = [];
    const second = await sandbox.runCode("print('hello', x + 1)", { onStdout: (m) => lines.push(m.line) });
    assert.deepEqual(second.logs.stdout, ["hello 43\n"]);
    assert.deepEqual(lines, ["hello 43\n"]);
    const failed = await sandbox.runCode("1 / 0");
    assert.equal(failed.error.name, "ZeroDivisionError");
    assert.match(failed.error.traceback, /ZeroDivisionError/);
    assert.equal(await sandbox.isRunning(), true);
  } finally {
    await sandbox.kill();
  }
  assert.equal(await sandbox.isRunning(), false);
  assert.equal((await Sandbox.list().nextItems()).some((s) => s.sandboxId === sandbox.sandboxId), false);
});

test("a chart comes back as a PNG", { timeout: 240_000 }, async () => {
  const sandbox = await Sandbox.create({ timeoutMs: 120_000 });
  try {
    const code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')\nplt.show()\n";
    const execution = await sandbox.runCode(code);
    assert.equal(execution.error, undefined, JSON.stringify(execution.error));
    const png = Buffer.from(execution.results[0].png, "base64");
    // The PNG signature, then the IHDR chunk's width and height (matplotlib's default 640 x 480).
    assert.deepEqual([...png.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
    assert.equal(png.readUInt32BE(16), 640);
    assert.equal(png.readUInt32BE(20), 480);
  } finally {
    await sandbox.kill();
  }
});

test("a context has variables of its own; restarting it empties them", { timeout: 240_000 }, async () => {
  const sandbox = await Sandbox.create({ timeoutMs: 120_000 });
  try {
    const context = await sandbox.createCodeContext({ language: "python" });
    assert.ok((await sandbox.listCodeContexts()).some((c) => c.id === context.id));
    await sandbox.runCode("x = 'default'");
    await sandbox.runCode("x = 'mine'", { context });
    assert.equal((await sandbox.runCode("x")).text, "default");
    assert.equal((await sandbox.runCode("x", { context })).text, "mine");
    await sandbox.restartCodeContext(context);
    const gone = await sandbox.runCode("x", { context });
    assert.equal(gone.error?.name, "NameError");
    await sandbox.removeCodeContext(context);
    assert.equal((await sandbox.listCodeContexts()).some((c) => c.id === context.id), false);
  } finally {
    await sandbox.kill();
  }
});
