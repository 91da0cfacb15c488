// The client against real hubs ($POSTHORN_BIN), memory and Redis backends: delivery in order
// with the cursor persisted, resume with no gap and no duplicate (after the client restarts,
// and after the hub restarts while events are published elsewhere), resync after a garbage
// cursor and after Redis lost its data, acks recorded by the hub, a token refreshed across its
// expiry with nothing lost, and a revoked device stopped for good.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test as nodeTest } from "node:test";

import { connect, memoryCursorStore } from "../dist/index.js";
import { fileCursorStore } from "../dist/file-store.js";
import {
  HEARTBEAT_MS,
  JWT_SECRET,
  deviceRecord,
  mintToken,
  publish,
  startHub,
  startRedis,
} from "./support/hub.mjs";
import { Recorder, sleep } from "./support/recorder.mjs";

/** Every test has a deadline: a client that never reaches the state a test awaits fails it. */
const test = (name, fn) => nodeTest(name, { timeout: 120_000 }, fn);

async function tempDir(t) {
  const dir = await mkdtemp(join(tmpdir(), "posthorn-js-"));
  t.after(() => rm(dir, { recursive: true, force: true }));
  return dir;
}

async function hub(t, options) {
  const started = await startHub(options);
  t.after(async () => {
    await started.stop("SIGKILL");
    started.cleanup();
  });
  return started;
}

async function redis(t) {
  const started = await startRedis();
  t.after(() => started.stop());
  return started;
}

function follow(t, options) {
  const recorder = new Recorder();
  const sub = connect({ heartbeatMs: HEARTBEAT_MS, ack: false, ...recorder.callbacks(), ...options });
  t.after(() => sub.close());
  return { sub, recorder };
}

/** The cursor is persisted just after the callback returns: wait for the file to say `cursor`. */
function cursorFileHolds(recorder, path, cursor) {
  return recorder.until(() => readFileSync(path, "utf8") === cursor, `${cursor} in the cursor file`, 5_000);
}

const events = (n, from = 0) =>
  Array.from({ length: n }, (_, i) => ({ device: "pos-1", type: "order.paid", data: { n: from + i } }));

test("memory hub: events in order, the cursor persisted, and a restarted client resumes with no gap", async (t) => {
  const h = await hub(t);
  const dir = await tempDir(t);
  const path = join(dir, "cursor");

  const first = follow(t, { url: h.url, device: "pos-1", cursorStore: fileCursorStore(path) });
  await first.recorder.state("open");
  const tricky = { device: "pos-1", type: "note", data: "line one\nline two\r\nthree é€😀" };
  const ids = await publish(h, [...events(8), tricky, ...events(3, 8)]);
  await first.recorder.eventCount(12);
  assert.deepEqual(first.recorder.events.map((e) => e.id), ids);
  assert.deepEqual(first.recorder.events.slice(0, 8).map((e) => JSON.parse(e.data).n), [0, 1, 2, 3, 4, 5, 6, 7]);
  assert.equal(first.recorder.events[8].data, "line one\nline two\nthree é€😀");
  assert.equal(first.recorder.events[8].type, "note");
  await cursorFileHolds(first.recorder, path, ids.at(-1));
  await first.sub.close();

  // Published while no client runs: a device's own events and a broadcast.
  const missed = await publish(h, [...events(4, 100), { broadcast: true, type: "price.updated", data: { v: 2 } }]);
  const second = follow(t, { url: h.url, device: "pos-1", cursorStore: fileCursorStore(path) });
  await second.recorder.eventCount(5);
  const open = await second.recorder.state("open");
  assert.equal(open.resumedFrom, ids.at(-1));
  assert.deepEqual(second.recorder.events.map((e) => e.id).slice(0, 4), missed.slice(0, 4));
  assert.equal(second.recorder.events[4].type, "price.updated");
  const live = await publish(h, events(1, 200));
  await second.recorder.eventCount(6);
  assert.equal(second.recorder.events[5].id, live[0]);
  await sleep(300);
  assert.equal(second.recorder.events.length, 6, "no duplicate");
  await cursorFileHolds(second.recorder, path, live[0]);
});

test("memory hub: a garbage cursor gets resync invalid; its id becomes the cursor and events follow", async (t) => {
  const h = await hub(t);
  const store = memoryCursorStore("garbage");
  const { recorder } = follow(t, { url: h.url, device: "pos-1", cursorStore: store });
  await recorder.until(() => recorder.resyncs.length === 1, "the resync");
  const [{ reason, id }] = recorder.resyncs;
  assert.equal(reason, "invalid");
  await recorder.until(() => store.value === id, "the resync id stored");
  const [next] = await publish(h, events(1));
  await recorder.eventCount(1);
  assert.equal(recorder.events[0].id, next);
  await recorder.until(() => store.value === next, "the event's id stored");
});

test("memory hub: acks reach the hub (acked_id of GET /v1/devices/{device})", async (t) => {
  const h = await hub(t);
  const dir = await tempDir(t);
  const { sub, recorder } = follow(t, {
    url: h.url,
    device: "pos-ack",
    cursorStore: fileCursorStore(join(dir, "cursor")),
    ack: true,
  });
  await recorder.state("open");
  const ids = await publish(h, events(5).map((e) => ({ ...e, device: "pos-ack" })));
  await recorder.eventCount(5);
  // The newest is acked within the second, or by close() at the latest.
  await sub.close();
  const record = await deviceRecord(h, "pos-ack");
  assert.equal(record.acked_id, ids.at(-1));
});

test("redis hub: resume across a hub restart with no gap, events published meanwhile through another hub", async (t) => {
  const r = await redis(t);
  const env = { POSTHORN_REDIS__URL: r.url };
  const args = ["--backend", "redis"];
  const a = await startHub({ env, args });
  t.after(async () => {
    await a.stop("SIGKILL");
  });
  const dir = await tempDir(t);
  const path = join(dir, "cursor");
  const { recorder } = follow(t, { url: a.url, device: "pos-1", cursorStore: fileCursorStore(path) });
  await recorder.state("open");
  const before = await publish(a, events(2));
  await recorder.eventCount(2);

  // A drains and exits; its client can reach nothing until A is back on the same port.
  const status = await a.stop("SIGTERM");
  assert.equal(status.code, 0, a.log());
  const b = await hub(t, { env, args });
  const meanwhile = await publish(b, events(3, 2));
  const again = await startHub({ env, args, port: a.port });
  t.after(async () => {
    await again.stop("SIGKILL");
    again.cleanup();
  });
  await recorder.eventCount(5, 60_000);
  const after = await publish(again, events(1, 5));
  await recorder.eventCount(6);
  await sleep(300);
  const expected = [...before, ...meanwhile, ...after];
  assert.deepEqual(recorder.events.map((e) => e.id), expected, "in order, no gap, no duplicate");
  assert.deepEqual(recorder.events.map((e) => JSON.parse(e.data).n), [0, 1, 2, 3, 4, 5]);
  await cursorFileHolds(recorder, path, after[0]);
  const resumed = recorder.states.filter((s) => s.state === "open").at(-1);
  assert.equal(resumed.resumedFrom, before.at(-1));
  assert.equal(recorder.resyncs.length, 0);
});

test("redis hub: a FLUSHALL gets resync data_lost on the open stream; the resync id is persisted and events follow", async (t) => {
  const r = await redis(t);
  const h = await hub(t, { env: { POSTHORN_REDIS__URL: r.url }, args: ["--backend", "redis"] });
  const dir = await tempDir(t);
  const path = join(dir, "cursor");
  const { recorder } = follow(t, { url: h.url, device: "pos-1", cursorStore: fileCursorStore(path) });
  await recorder.state("open");
  const [first] = await publish(h, events(1));
  await recorder.eventCount(1);
  assert.equal(recorder.events[0].id, first);

  assert.equal(await r.command("FLUSHALL"), "+OK");
  await recorder.until(() => recorder.resyncs.length === 1, "resync after FLUSHALL", 20_000);
  const [{ reason, id }] = recorder.resyncs;
  assert.equal(reason, "data_lost");
  assert.notEqual(id, first);
  await cursorFileHolds(recorder, path, id);

  const [next] = await publish(h, events(1, 1));
  await recorder.eventCount(2);
  assert.equal(recorder.events[1].id, next);
  await cursorFileHolds(recorder, path, next);
});

test("jwt hub: the token function is asked again after token_expired and nothing published meanwhile is lost", async (t) => {
  const h = await hub(t, { env: { POSTHORN_AUTH__MODE: "jwt", POSTHORN_AUTH__JWT_SECRET: JWT_SECRET, POSTHORN_AUTH__LEEWAY: "0s" } });
  const publisher = await mintToken({ scope: "publish" });
  let asked = 0;
  // The first token lives 2 s; the hub ends the stream with token_expired, the next one lives long.
  const token = async () => (++asked === 1 ? mintToken({ device: "pos-tok", ttl: "2s" }) : mintToken({ device: "pos-tok" }));
  const store = memoryCursorStore();
  const { recorder } = follow(t, { url: h.url, device: "pos-tok", token, cursorStore: store });
  await recorder.state("open");
  const sent = [];
  for (let n = 0; n < 10; n++) {
    sent.push(...(await publish(h, [{ device: "pos-tok", type: "t", data: `e${n}` }], publisher)));
    await sleep(500);
  }
  await recorder.eventCount(10, 30_000);
  assert.deepEqual(recorder.events.map((e) => e.id), sent, "every event once, in order");
  assert.ok(asked >= 2, `the token function was asked again (${asked} times)`);
  await recorder.state("open", 2);
  assert.ok(
    recorder.events.every((e) => e.type === "t"),
    "token_expired is the hub's word, not an event for the application",
  );
});

test("jwt hub: a revoked device stops with the final state revoked and does not reconnect", async (t) => {
  const h = await hub(t, { env: { POSTHORN_AUTH__MODE: "jwt", POSTHORN_AUTH__JWT_SECRET: JWT_SECRET } });
  const admin = await mintToken({ scope: "admin" });
  const device = await mintToken({ device: "pos-rev" });
  const { recorder, sub } = follow(t, { url: h.url, device: "pos-rev", token: device, cursorStore: memoryCursorStore() });
  await recorder.state("open");
  const response = await fetch(`${h.url}/admin/revoke`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${admin}` },
    body: JSON.stringify({ device: "pos-rev" }),
  });
  assert.equal(response.status, 202, await response.text());
  await recorder.state("revoked", 1, 10_000);
  await sub.finished;
  await sleep(1500);
  assert.equal(recorder.states.filter((s) => s.state === "open").length, 1, "no second connection");
});
