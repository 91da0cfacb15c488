// The client against a scripted hub written with node:http: what it sends, when it persists
// and acknowledges the cursor, how it handles resync, token expiry, revocation and refusals.
// These are the cases the real hub cannot be made to produce on demand.

import assert from "node:assert/strict";
import { mkdtemp, readFile, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test as nodeTest } from "node:test";

import { connect, localStorageCursorStore, memoryCursorStore } from "../dist/index.js";
import { fileCursorStore } from "../dist/file-store.js";
import { FakeClock } from "./support/clock.mjs";
import { frame, openStream, refuse, startFakeHub } from "./support/fake-hub.mjs";
import { Recorder, settle, sleep } from "./support/recorder.mjs";

/** Every test has a deadline: a client that never reaches the state a test awaits fails it. */
const test = (name, fn) => nodeTest(name, { timeout: 30_000 }, fn);

const fast = { random: () => 0 };

// What a test that timed out left running, so that the file's process can still exit.
const leftovers = new Set();
after(async () => {
  await Promise.all([...leftovers].map((close) => close()));
});

/** Runs `body` with a fake hub and closes both the subscription and the hub afterwards. */
async function withHub(respond, body) {
  const hub = await startFakeHub(respond);
  const subs = [];
  const cleanup = async () => {
    await Promise.all(subs.map((s) => s.close()));
    await hub.close();
  };
  leftovers.add(cleanup);
  try {
    await body(hub, (options) => {
      const sub = connect({ url: hub.url, device: "pos-1", ...fast, ...options });
      subs.push(sub);
      return sub;
    });
  } finally {
    leftovers.delete(cleanup);
    await cleanup();
  }
}

test("request: path, groups, Accept, bearer token in a header and the stored cursor as Last-Event-ID", async () => {
  await withHub(
    (req, res) => openStream(res),
    async (hub, start) => {
      const recorder = new Recorder();
      start({
        url: `${hub.url}/prefix/`,
        device: "pos-17",
        token: "tok-1",
        groups: ["store-1", "region.eu"],
        cursorStore: memoryCursorStore("k.2.10-0"),
        ...recorder.callbacks(),
      });
      await recorder.state("open");
      const [req] = hub.of("stream");
      assert.equal(req.method, "GET");
      assert.equal(req.url, "/prefix/v1/devices/pos-17/events?groups=store-1,region.eu");
      assert.equal(req.headers["accept"], "text/event-stream");
      assert.equal(req.headers["authorization"], "Bearer tok-1");
      assert.equal(req.headers["last-event-id"], "k.2.10-0");
      assert.ok(!req.url.includes("tok-1"), "the token never goes in the URL");
      assert.equal(recorder.states.find((s) => s.state === "open").resumedFrom, "k.2.10-0");
    },
  );
});

test("request: without token, cursor or groups nothing of them is sent", async () => {
  await withHub(
    (req, res) => openStream(res),
    async (hub, start) => {
      const recorder = new Recorder();
      start({ ...recorder.callbacks() });
      await recorder.state("open");
      const [req] = hub.of("stream");
      assert.equal(req.url, "/v1/devices/pos-1/events");
      assert.equal(req.headers["authorization"], undefined);
      assert.equal(req.headers["last-event-id"], undefined);
    },
  );
});

test("connect: invalid device ids and groups are refused before any request", () => {
  assert.throws(() => connect({ url: "http://x", device: "pos 17" }), TypeError);
  assert.throws(() => connect({ url: "http://x", device: "" }), TypeError);
  assert.throws(() => connect({ url: "http://x", device: "a".repeat(129) }), TypeError);
  assert.throws(() => connect({ url: "http://x", device: "ok", groups: ["a,b"] }), TypeError);
  assert.throws(() => connect({ url: [], device: "ok" }), TypeError);
});

test("cursor: persisted only after onEvent's promise resolved, then acked; heartbeats move nothing", async () => {
  let release;
  const gate = new Promise((resolve) => (release = resolve));
  await withHub(
    (req, res) => {
      if (req.kind === "ack") return res.writeHead(204).end();
      openStream(res, frame("e.1.1-0", "order.paid", '{"total":1}') + ": ping\n\n" + frame("e.1.2-0", "t", "second"));
    },
    async (hub, start) => {
      const store = memoryCursorStore();
      const sets = [];
      const handled = [];
      const sub = start({
        token: "tok",
        cursorStore: { get: () => null, set: async (c) => { sets.push(c); store.set(c); } },
        onEvent: async (event) => {
          handled.push(event);
          if (event.id === "e.1.1-0") await gate;
        },
      });
      const recorder = new Recorder();
      await recorder.until(() => handled.length === 1, "first event");
      await sleep(100);
      assert.deepEqual(sets, [], "nothing persisted while onEvent runs");
      assert.equal(handled.length, 1, "the next event waits for the first");
      assert.equal(sub.lastEventId, null);
      assert.equal(hub.of("ack").length, 0, "no ack before the cursor is persisted");
      release();
      await recorder.until(() => sets.length === 2, "both persisted");
      await hub.until("ack", 1);
      assert.deepEqual(sets, ["e.1.1-0", "e.1.2-0"]);
      assert.deepEqual(handled[0], { id: "e.1.1-0", type: "order.paid", data: '{"total":1}' });
      assert.equal(sub.lastEventId, "e.1.2-0");
      const [ack] = hub.of("ack");
      assert.equal(ack.method, "POST");
      assert.equal(ack.url, "/v1/devices/pos-1/ack");
      assert.equal(ack.headers["authorization"], "Bearer tok");
      assert.match(ack.headers["content-type"], /^application\/json/);
      assert.equal(JSON.parse(ack.body).id.startsWith("e.1."), true);
      // close() sends the newest cursor if the last ack carried an older one.
      await sub.close();
      assert.equal(JSON.parse(hub.of("ack").at(-1).body).id, "e.1.2-0");
    },
  );
});

test("acks: at most one a second, coalesced to the newest cursor, and only when enabled", async () => {
  const clock = new FakeClock();
  let push;
  await withHub(
    (req, res) => {
      if (req.kind === "ack") return res.writeHead(204).end();
      openStream(res);
      push = (text) => res.write(text);
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ clock, ack: true, ...recorder.callbacks() });
      await recorder.state("open");
      push(frame("e.1.1-0", "t", "1"));
      await hub.until("ack", 1);
      for (let i = 2; i <= 6; i++) push(frame(`e.1.${i}-0`, "t", String(i)));
      await recorder.eventCount(6);
      await sleep(200);
      assert.equal(hub.of("ack").length, 1, "no second ack within the second");
      clock.advance(999);
      await sleep(100);
      assert.equal(hub.of("ack").length, 1);
      clock.advance(1);
      await hub.until("ack", 2);
      await sleep(100);
      clock.advance(5000);
      await sleep(100);
      assert.deepEqual(hub.of("ack").map((a) => JSON.parse(a.body).id), ["e.1.1-0", "e.1.6-0"]);
      await sub.close();
    },
  );
  await withHub(
    (req, res) => {
      if (req.kind === "ack") return res.writeHead(204).end();
      openStream(res, frame("e.1.1-0", "t", "1"));
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ cursorStore: memoryCursorStore(), ack: false, ...recorder.callbacks() });
      await recorder.eventCount(1);
      await sub.close();
      assert.equal(hub.of("ack").length, 0, "ack: false sends none");
    },
  );
});

test("acks: a hub with its fleet API off is not asked again", async () => {
  const clock = new FakeClock();
  let push;
  await withHub(
    (req, res) => {
      if (req.kind === "ack") return refuse(res, 404, "fleet_disabled");
      openStream(res);
      push = (text) => res.write(text);
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ clock, ack: true, ...recorder.callbacks() });
      await recorder.state("open");
      push(frame("e.1.1-0", "t", "1"));
      await hub.until("ack", 1);
      await sleep(50);
      clock.advance(2000);
      push(frame("e.1.2-0", "t", "2"));
      await recorder.eventCount(2);
      clock.advance(2000);
      await sleep(100);
      await sub.close();
      assert.equal(hub.of("ack").length, 1);
    },
  );
});

test("resync: handed to onResync with its reason, then its id is persisted and sent on the next connection", async () => {
  await withHub(
    (req, res) => {
      if (req.kind === "ack") return res.writeHead(204).end();
      if (req.index === 0) {
        openStream(res, frame("e.2.9-0", "resync", '{"reason":"data_lost","extra":1}') + frame("e.2.10-0", "t", "after"));
        res.end();
      } else {
        openStream(res);
      }
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const store = memoryCursorStore("old.2.1-0");
      let storedDuringResync;
      start({
        cursorStore: store,
        ...recorder.callbacks(),
        onResync: async (reason, id) => {
          storedDuringResync = store.value;
          recorder.record(recorder.resyncs, { reason, id });
        },
      });
      await recorder.state("open", 2);
      assert.deepEqual(recorder.resyncs, [{ reason: "data_lost", id: "e.2.9-0" }]);
      assert.equal(storedDuringResync, "old.2.1-0", "the resync id is stored after the reload, not before");
      assert.deepEqual(recorder.events.map((e) => e.data), ["after"], "the resync is no business event");
      assert.equal(hub.of("stream")[1].headers["last-event-id"], "e.2.10-0");
      // A resync alone is no delivered event: the hub's clean end made this connection healthy.
      assert.equal(recorder.states.find((s) => s.state === "reconnecting").reason, "the hub ended the stream");
    },
  );
});

test("onEvent failing: the cursor stays, the connection is dropped and the event comes again", async () => {
  await withHub(
    (req, res) => {
      const cursor = req.headers["last-event-id"];
      openStream(res, cursor ? frame("e.1.2-0", "t", "b") : frame("e.1.1-0", "t", "a") + frame("e.1.2-0", "t", "b"));
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const seen = [];
      let failOnce = true;
      const store = memoryCursorStore();
      start({
        cursorStore: store,
        ack: false,
        ...recorder.callbacks(),
        onEvent: (event) => {
          seen.push(event.id);
          if (event.id === "e.1.2-0" && failOnce) {
            failOnce = false;
            throw new Error("printer jammed");
          }
        },
      });
      await recorder.until(() => seen.length === 3, "the event again", 10_000);
      assert.deepEqual(seen, ["e.1.1-0", "e.1.2-0", "e.1.2-0"]);
      assert.equal(hub.of("stream")[1].headers["last-event-id"], "e.1.1-0");
      assert.equal(recorder.errors[0].code, "callback");
      await recorder.until(() => store.value === "e.1.2-0", "persisted after the retry");
    },
  );
});

test("token_expired: a fresh token from the callback and an immediate reconnect with the cursor", async () => {
  await withHub(
    (req, res) => {
      if (req.index === 0) {
        openStream(res, frame("e.1.1-0", "t", "a") + 'event: token_expired\ndata: {"exp":1796070000}\n\n');
        // The hub closes after token_expired; an idle socket shows the client does not wait for it.
        return;
      }
      openStream(res);
    },
    async (hub, start) => {
      const recorder = new Recorder();
      let calls = 0;
      start({
        token: async () => `tok-${++calls}`,
        ...recorder.callbacks(),
      });
      await recorder.state("open", 2);
      const [first, second] = hub.of("stream");
      assert.equal(first.headers["authorization"], "Bearer tok-1");
      assert.equal(second.headers["authorization"], "Bearer tok-2");
      assert.equal(second.headers["last-event-id"], "e.1.1-0");
      const waiting = recorder.states.find((s) => s.state === "reconnecting");
      assert.equal(waiting.delayMs, 0);
      assert.equal(waiting.reason, "the token expired");
      assert.deepEqual(recorder.events.map((e) => e.type), ["t"], "token_expired is no business event");
    },
  );
});

test("a published event named like a control event (it has an id) is a business event", async () => {
  await withHub(
    (req, res) => openStream(res, frame("e.1.1-0", "revoked", "x") + frame("e.1.2-0", "token_expired", "y")),
    async (hub, start) => {
      const recorder = new Recorder();
      start({ ...recorder.callbacks() });
      await recorder.eventCount(2);
      assert.deepEqual(recorder.events.map((e) => e.type), ["revoked", "token_expired"]);
      assert.equal(hub.of("stream").length, 1);
    },
  );
});

test("401: the token callback is asked again and the client reconnects at once; a second 401 backs off", async () => {
  await withHub(
    (req, res) => (req.index < 2 ? refuse(res, 401, "unauthorized", { "www-authenticate": "Bearer" }) : openStream(res)),
    async (hub, start) => {
      const recorder = new Recorder();
      let calls = 0;
      start({ token: () => `tok-${++calls}`, ...recorder.callbacks() });
      await recorder.state("open");
      assert.deepEqual(hub.of("stream").map((r) => r.headers["authorization"]), ["Bearer tok-1", "Bearer tok-2", "Bearer tok-3"]);
      const waits = recorder.states.filter((s) => s.state === "reconnecting");
      assert.equal(waits[0].delayMs, 0, "the first 401: at once");
      assert.ok(waits[1].delayMs >= 1000, "the second in a row: back-off");
      assert.ok(recorder.errors.every((e) => e.code === "unauthorized" && e.status === 401));
    },
  );
});

test("401 with the same token again, or a fixed token string: stop for good", async () => {
  for (const token of ["fixed", () => "same"]) {
    await withHub(
      (req, res) => refuse(res, 401, "unauthorized"),
      async (hub, start) => {
        const recorder = new Recorder();
        const sub = start({ token, ...recorder.callbacks() });
        const finished = await sub.finished;
        assert.equal(finished.state, "failed");
        assert.equal(finished.error.code, "unauthorized");
        await sleep(200);
        assert.equal(hub.of("stream").length, 1, "no second request with a refused token");
        assert.equal(sub.state, "failed");
      },
    );
  }
});

test("revoked: the event or a 401 token_revoked stops for good with the state revoked", async () => {
  await withHub(
    (req, res) => {
      openStream(res, frame("e.1.1-0", "t", "a") + "event: revoked\ndata: {}\n\n");
      res.end();
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ token: () => "tok", ...recorder.callbacks() });
      const finished = await sub.finished;
      assert.equal(finished.state, "revoked");
      assert.equal(recorder.states.at(-1).state, "revoked");
      assert.deepEqual(recorder.events.map((e) => e.id), ["e.1.1-0"], "events before it were processed");
      await sleep(1500);
      assert.equal(hub.of("stream").length, 1, "no reconnect");
    },
  );
  await withHub(
    (req, res) => refuse(res, 401, "token_revoked"),
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ token: () => `tok-${Math.random()}`, ...recorder.callbacks() });
      assert.equal((await sub.finished).state, "revoked");
      assert.equal(recorder.errors.at(-1).code, "revoked");
      await sleep(200);
      assert.equal(hub.of("stream").length, 1);
    },
  );
});

test("400, 403 and 404 are configuration errors: stop at once, no second request", async () => {
  for (const [status, code] of [[400, "invalid_device"], [403, "forbidden"], [404, "not_found"]]) {
    await withHub(
      (req, res) => refuse(res, status, code),
      async (hub, start) => {
        const sub = start({ token: () => "tok" });
        const finished = await sub.finished;
        assert.equal(finished.state, "failed", `status ${status}`);
        assert.equal(finished.error.code, "refused");
        assert.equal(finished.error.status, status);
        assert.match(finished.error.body, new RegExp(code));
        await sleep(100);
        assert.equal(hub.of("stream").length, 1);
      },
    );
  }
});

test("close: stops the stream, no callback after it, and the state is closed", async () => {
  let push;
  await withHub(
    (req, res) => {
      openStream(res);
      push = (text) => res.write(text);
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const sub = start({ ...recorder.callbacks() });
      await recorder.state("open");
      push(frame("e.1.1-0", "t", "a"));
      await recorder.eventCount(1);
      await sub.close();
      assert.equal(sub.state, "closed");
      assert.deepEqual(await sub.finished, { state: "closed", reason: "closed by the application" });
      try {
        push(frame("e.1.2-0", "t", "b"));
      } catch {
        // The socket may already be gone.
      }
      await sleep(100);
      assert.equal(recorder.events.length, 1);
      assert.equal(hub.of("stream").length, 1);
    },
  );
});

test("several URLs are tried in turn", async () => {
  const down = await startFakeHub((req, res) => refuse(res, 503, "draining", { "retry-after": "1" }));
  const closeDown = () => down.close();
  leftovers.add(closeDown);
  try {
    await withHub(
      (req, res) => openStream(res),
      async (hub, start) => {
        const recorder = new Recorder();
        start({ url: [down.url, hub.url], ...recorder.callbacks() });
        await recorder.state("open");
        assert.equal(down.of("stream").length, 1);
        assert.equal(recorder.states.find((s) => s.state === "open").url, hub.url);
      },
    );
  } finally {
    leftovers.delete(closeDown);
    await down.close();
  }
});

test("a cursor store that fails stops the client rather than going on without a durable cursor", async () => {
  await withHub(
    (req, res) => openStream(res, frame("e.1.1-0", "t", "a")),
    async (hub, start) => {
      const sub = start({ cursorStore: { get: () => null, set: () => Promise.reject(new Error("disk full")) } });
      const finished = await sub.finished;
      assert.equal(finished.state, "failed");
      assert.equal(finished.error.code, "cursor_store");
      assert.match(finished.reason, /disk full/);
    },
  );
});

test("file store: atomic replace, trimmed read, none for a missing or empty file, no temporary left", async () => {
  const dir = await mkdtemp(join(tmpdir(), "posthorn-js-store-"));
  try {
    const path = join(dir, "sub", "cursor");
    const store = fileCursorStore(path);
    assert.equal(await store.get(), null, "missing file");
    await store.set("e.1.1-0");
    await store.set("e.1.2-0");
    assert.equal(await readFile(path, "utf8"), "e.1.2-0");
    assert.equal(await store.get(), "e.1.2-0");
    assert.deepEqual(await readdir(join(dir, "sub")), ["cursor"]);
    await writeFile(path, "  e.1.3-0\n");
    assert.equal(await store.get(), "e.1.3-0");
    await writeFile(path, "\n");
    assert.equal(await store.get(), null, "an empty file is no cursor");
    // Many writes at once: the file always holds one whole cursor.
    await Promise.all(Array.from({ length: 20 }, (_, i) => store.set(`e.1.${i}-0`)));
    assert.match(await readFile(path, "utf8"), /^e\.1\.\d+-0$/);
    assert.deepEqual(await readdir(join(dir, "sub")), ["cursor"]);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("localStorage store: reads and writes its key", () => {
  const map = new Map();
  const storage = { getItem: (k) => map.get(k) ?? null, setItem: (k, v) => map.set(k, v) };
  const store = localStorageCursorStore("cursor:pos-1", storage);
  assert.equal(store.get(), null);
  store.set("e.1.1-0");
  assert.equal(map.get("cursor:pos-1"), "e.1.1-0");
  assert.equal(store.get(), "e.1.1-0");
  assert.throws(() => localStorageCursorStore("k", undefined), TypeError);
});

test("a slow onEvent does not stop the socket from being read", async () => {
  let push;
  let release;
  const gate = new Promise((resolve) => (release = resolve));
  await withHub(
    (req, res) => {
      openStream(res);
      push = (text) => res.write(text);
    },
    async (hub, start) => {
      const recorder = new Recorder();
      const clock = new FakeClock();
      const sub = start({
        clock,
        heartbeatMs: 1000,
        ...recorder.callbacks(),
        onEvent: async (event) => {
          recorder.record(recorder.events, event);
          await gate;
        },
      });
      await recorder.state("open");
      push(frame("e.1.1-0", "t", "a"));
      await recorder.eventCount(1);
      // The application is stuck while pings keep arriving: the watchdog sees them.
      for (let i = 0; i < 5; i++) {
        push(": ping\n\n");
        await sleep(30);
        clock.advance(2000);
      }
      await settle();
      assert.equal(recorder.states.filter((s) => s.state === "reconnecting").length, 0);
      release();
      await sub.close();
    },
  );
});
