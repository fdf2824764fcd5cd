// The shared protocol test vectors (schemas/vectors/, see its README.md), run by the SDK: the
// JobResult decoder reads every result vector to its meaning, the JobSpec encoder writes every
// valid vector's meaning as a map that means the same under the rules of docs/protocol.md
// ("Encoding"), and the duration parser agrees with the worker's grammar. No services needed.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { decode, encode } from "@msgpack/msgpack";
import { buildJob, humantimeSeconds, normalizeResult } from "../dist/index.js";

const VECTORS = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "schemas", "vectors");

function vectors(sub) {
  const dir = join(VECTORS, sub);
  const found = readdirSync(dir).filter((f) => f.endsWith(".msgpack")).sort().map((f) => {
    const name = f.slice(0, -".msgpack".length);
    return { name, bytes: readFileSync(join(dir, f)), sidecar: JSON.parse(readFileSync(join(dir, `${name}.json`), "utf8")) };
  });
  assert.ok(found.length > 0, `no vectors in ${sub}`);
  return found;
}

/** Equal under the protocol's rules: nil and absent are the same; keys the vector does not name are ignored. */
function same(actual, expected, where) {
  if (expected === null) {
    assert.ok(actual === null || actual === undefined, `${where}: ${JSON.stringify(actual)} is not nil`);
  } else if (Array.isArray(expected)) {
    assert.ok(Array.isArray(actual) && actual.length === expected.length, `${where}: ${JSON.stringify(actual)}`);
    expected.forEach((e, i) => same(actual[i], e, `${where}[${i}]`));
  } else if (typeof expected === "object") {
    assert.ok(actual !== null && typeof actual === "object", `${where}: ${JSON.stringify(actual)} is not a map`);
    for (const [key, value] of Object.entries(expected)) same(actual[key], value, `${where}.${key}`);
  } else {
    assert.equal(actual, expected, where);
  }
}

for (const { name, bytes, sidecar } of vectors("jobresult")) {
  test(`result vector ${name} decodes to its meaning`, () => {
    same(normalizeResult(decode(bytes)), sidecar.result, name);
  });
}

/** The decoded meaning of a JobSpec map (docs/protocol.md, "Encoding"): nil is absent; an absent
 * list or map is empty; network defaults to "none"; stdin is bytes (bin, or str as UTF-8). */
function meaningOf(m) {
  const get = (k) => m[k] ?? null;
  const stdin = get("stdin");
  return {
    schema_version: get("schema_version"), job_id: get("job_id"), sku: get("sku"), runtime: get("runtime"),
    code: get("code"), entrypoint: get("entrypoint"), args: get("args") ?? [], inputs: get("inputs") ?? [],
    stdin: stdin === null ? null : [...(typeof stdin === "string" ? new TextEncoder().encode(stdin) : stdin)],
    env: get("env") ?? {}, timeout: get("timeout"), result_ttl: get("result_ttl"), network: get("network") ?? "none",
    submitted_at_ms: get("submitted_at_ms"), deadline_ms: get("deadline_ms"), mode: get("mode"), session: get("session"),
  };
}

for (const { name, bytes, sidecar } of vectors("jobspec/valid")) {
  test(`spec vector ${name} means what it says`, () => {
    assert.deepEqual(meaningOf(decode(bytes)), sidecar.spec);
  });
  test(`the encoder writes spec vector ${name}`, () => {
    const s = sidecar.spec;
    const options = { sku: s.sku, runtime: s.runtime, job_id: s.job_id, inputs: s.inputs, args: s.args, env: s.env };
    for (const key of ["code", "entrypoint", "timeout", "result_ttl", "network", "deadline_ms", "mode", "session"]) {
      if (s[key] !== null) options[key] = s[key];
    }
    if (s.stdin !== null) options.stdin = Uint8Array.from(s.stdin);
    const raw = encode(buildJob(options));
    // Integers as MessagePack integers: no float64 (0xcb) or float32 (0xca) marker for them.
    const wire = decode(raw);
    assert.ok(Number.isInteger(wire.submitted_at_ms));
    const got = meaningOf(wire);
    got.submitted_at_ms = s.submitted_at_ms; // the encoder stamps its own time
    assert.deepEqual(got, s);
    const walk = (v) => {
      assert.ok(v !== null && v !== undefined, `${name}: nil in ${JSON.stringify(wire)}`);
      if (typeof v === "number") assert.ok(Number.isInteger(v), `${name}: a float`);
      if (typeof v === "object" && !(v instanceof Uint8Array)) Object.values(v).forEach(walk);
    };
    walk(wire);
    // The integer fields' values are MessagePack integers, not floats (0xca, 0xcb): the marker
    // after each key (a fixstr) in the bytes.
    for (const key of ["schema_version", "submitted_at_ms", "deadline_ms"]) {
      const keyBytes = Buffer.concat([Buffer.from([0xa0 | key.length]), Buffer.from(key)]);
      const at = Buffer.from(raw).indexOf(keyBytes);
      if (at < 0) continue;
      const marker = raw[at + keyBytes.length];
      assert.ok(marker !== 0xca && marker !== 0xcb, `${name}: ${key} encoded as a float`);
    }
  });
}

test("durations parse as the worker parses them", () => {
  const { durations } = JSON.parse(readFileSync(join(VECTORS, "durations.json"), "utf8"));
  for (const { text, seconds } of durations) {
    if (seconds === null) assert.throws(() => humantimeSeconds(text), undefined, JSON.stringify(text));
    else assert.equal(humantimeSeconds(text), Math.max(1, Math.floor(seconds)), JSON.stringify(text));
  }
});
