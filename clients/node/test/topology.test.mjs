// Queues declared by an earlier version (without x-message-ttl, docs/operations.md): the SDK's
// topology declaration uses them as they are, and they keep their old arguments. Needs the
// broker only (no worker).
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import * as amqp from "amqplib";
import { Client, loadConfig, Names } from "../dist/index.js";

test("declares over queues of an earlier version", async () => {
  const cfg = { ...loadConfig(), namespace: `sandq-test-sdk-node-legacy-${randomUUID().slice(0, 8)}` };
  const names = new Names(cfg.namespace);
  const connection = await amqp.connect(cfg.amqpUrl);
  try {
    let ch = await connection.createChannel();
    ch.on("error", () => {});
    const old = { "x-queue-type": "quorum", "x-delivery-limit": cfg.deliveryLimit, "x-dead-letter-exchange": names.dlx };
    for (const sku of ["S", "M", "L", "XL"]) await ch.assertQueue(names.queue(sku), { durable: true, arguments: old });
    const client = await Client.connect({ config: cfg });
    try {
      await client.declareTopology(); // throws 406 PRECONDITION_FAILED without the fallback
    } finally {
      await client.close();
    }
    await assert.rejects(
      ch.assertQueue(names.queue("S"), { durable: true, arguments: { ...old, "x-message-ttl": 3600000 } }),
      (e) => e.code === 406,
      "the queue should have kept its old arguments",
    );
    ch = await connection.createChannel();
    for (const sku of ["S", "M", "L", "XL"]) await ch.deleteQueue(names.queue(sku));
    await ch.deleteQueue(names.deadQueue);
  } finally {
    await connection.close();
  }
});
