// Redis key layout 2 (docs/protocol.md "Redis key layout"): a job's keys share one Redis Cluster
// hash slot, computed here with the cluster's own function (the Redis Cluster specification: CRC16
// XMODEM of the hash tag, mod 16384), written from the specification, not from the SDK; and the
// `[redis]` settings of the three deployments are read. No services needed.
import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadConfig, Names, urlList } from "../dist/index.js";

function crc16(bytes) {
  let crc = 0;
  for (const b of bytes) {
    crc ^= b << 8;
    for (let i = 0; i < 8; i++) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
  }
  return crc;
}

function slot(key) {
  const open = key.indexOf("{");
  if (open >= 0) {
    const close = key.indexOf("}", open + 1);
    if (close > open + 1) key = key.slice(open + 1, close);
  }
  return crc16(Buffer.from(key)) % 16384;
}

test("the slot function matches the specification's check value", () => {
  assert.equal(crc16(Buffer.from("123456789")), 0x31c3);
});

test("a job's keys share a slot, and jobs spread over the slots", () => {
  const names = new Names("ns-1");
  assert.equal(names.job("j1"), "ns-1:job:{j1}");
  assert.equal(names.done("j1"), "ns-1:job:{j1}:done");
  assert.equal(names.cancel("j1"), "ns-1:job:{j1}:cancel");
  assert.equal(names.events("j1"), "ns-1:job:{j1}:events");
  const slots = new Set();
  for (let i = 0; i < 50; i++) {
    const id = `job-${i}`;
    const keys = [names.job(id), names.done(id), names.cancel(id), names.events(id)];
    assert.equal(new Set(keys.map(slot)).size, 1, keys.join(" "));
    slots.add(slot(names.job(id)));
  }
  // Layout 1 put a job's hash and its done list in different slots, so a script naming both
  // failed with CROSSSLOT on a Redis Cluster.
  assert.notEqual(slot("ns-1:job:j1"), slot("ns-1:job:j1:done"));
  assert.ok(slots.size > 40, `${slots.size} slots`);
});

test("redis deployment settings", () => {
  const saved = { ...process.env };
  try {
    for (const v of ["SANDQ__REDIS__MODE", "SANDQ__REDIS__NODES", "SANDQ__REDIS__SERVICE"]) delete process.env[v];
    const path = join(mkdtempSync(join(tmpdir(), "sandq-node-")), "sandq.toml");
    writeFileSync(path, '[redis]\nmode = "cluster"\nnodes = ["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"]\n');
    let config = loadConfig(path);
    assert.deepEqual([config.redisMode, config.redisNodes], ["cluster", ["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"]]);
    process.env.SANDQ__REDIS__MODE = "sentinel";
    process.env.SANDQ__REDIS__NODES = "redis://10.0.0.1:26379/, redis://10.0.0.2:26379/";
    process.env.SANDQ__REDIS__SERVICE = "primary-1";
    config = loadConfig(path);
    assert.deepEqual([config.redisMode, config.redisNodes, config.redisService], ["sentinel", ["redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/"], "primary-1"]);
    process.env.SANDQ__REDIS__MODE = "clustered";
    assert.throws(() => loadConfig(path), /not single, cluster or sentinel/);
    writeFileSync(path, "");
    for (const v of ["SANDQ__REDIS__MODE", "SANDQ__REDIS__NODES", "SANDQ__REDIS__SERVICE"]) delete process.env[v];
    config = loadConfig(path);
    assert.deepEqual([config.redisMode, config.redisNodes, config.redisService], ["single", [], "mymaster"]);
    assert.deepEqual(urlList(" a, ,b "), ["a", "b"]);
  } finally {
    process.env = saved;
  }
});
