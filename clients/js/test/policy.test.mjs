// Reconnect timing. The policy alone, with seeded and fixed random numbers: the 1 s floor, the
// 60 s cap, full jitter over [0, min(cap, retry * 2^n)], the reset after a healthy connection,
// the jittered first reconnect after one, and Retry-After as a minimum. Then the same rules
// seen from outside, through `connect` with a fake fetch and a fake clock: the delays the
// client really waits.

import assert from "node:assert/strict";
import { test as nodeTest } from "node:test";

import { ReconnectPolicy, connect, parseRetryAfter } from "../dist/index.js";
import { FakeClock, seededRandom } from "./support/clock.mjs";
import { Recorder, settle } from "./support/recorder.mjs";

/** Every test has a deadline: a client that never reaches the state a test awaits fails it. */
const test = (name, fn) => nodeTest(name, { timeout: 30_000 }, fn);

const fixed = (value) => () => value;
const JUST_BELOW_ONE = 1 - 2 ** -40;

test("policy: failures back off exponentially from retry, capped at 60 s", () => {
  const policy = new ReconnectPolicy(3000);
  const ceilings = [6000, 12000, 24000, 48000, 60000, 60000, 60000];
  for (const ceiling of ceilings) {
    assert.equal(policy.nextDelay(false, undefined, fixed(JUST_BELOW_ONE)), ceiling);
  }
  assert.equal(policy.failures, ceilings.length);
});

test("policy: full jitter spreads failures over [1 s, ceiling], never below the floor", () => {
  const random = seededRandom(42);
  for (let failures = 1; failures <= 8; failures++) {
    const ceiling = Math.min(60000, 3000 * 2 ** failures);
    const delays = [];
    for (let i = 0; i < 400; i++) {
      const policy = new ReconnectPolicy(3000);
      for (let f = 1; f < failures; f++) policy.nextDelay(false, undefined, random);
      delays.push(policy.nextDelay(false, undefined, random));
    }
    const min = Math.min(...delays);
    const max = Math.max(...delays);
    assert.ok(min >= 1000, `failure ${failures}: ${min} under the floor`);
    assert.ok(max <= ceiling, `failure ${failures}: ${max} over ${ceiling}`);
    // Full jitter, not "equal jitter": the low quarter of the range is used, and the top too.
    assert.ok(delays.some((d) => d < Math.max(1000, ceiling / 4) + 1), `failure ${failures}: nothing low`);
    assert.ok(max > ceiling * 0.9, `failure ${failures}: nothing near the ceiling`);
  }
  const zero = new ReconnectPolicy(3000);
  assert.equal(zero.nextDelay(false, undefined, fixed(0)), 1000, "a draw of 0 still waits 1 s");
});

test("policy: after a healthy connection, retry plus 0-100 % of it, and the failures reset", () => {
  const policy = new ReconnectPolicy(3000);
  for (let i = 0; i < 5; i++) policy.nextDelay(false, undefined, fixed(0.5));
  assert.equal(policy.failures, 5);
  assert.equal(policy.nextDelay(true, undefined, fixed(0)), 3000);
  assert.equal(policy.failures, 0);
  assert.equal(policy.nextDelay(true, undefined, fixed(0.5)), 4500);
  assert.equal(policy.nextDelay(true, undefined, fixed(JUST_BELOW_ONE)), 6000);
  // The back-off starts over from the first ceiling.
  assert.equal(policy.nextDelay(false, undefined, fixed(JUST_BELOW_ONE)), 6000);
  // Two terminals told the same retry come back at different times.
  const random = seededRandom(7);
  const spread = new Set(Array.from({ length: 50 }, () => new ReconnectPolicy(3000).nextDelay(true, undefined, random)));
  assert.ok(spread.size > 40, `only ${spread.size} distinct delays`);
});

test("policy: the server's retry is honoured but never below 1 s", () => {
  const policy = new ReconnectPolicy(3000);
  policy.retryMs = 100;
  assert.equal(policy.nextDelay(true, undefined, fixed(0)), 1000);
  assert.equal(policy.nextDelay(true, undefined, fixed(JUST_BELOW_ONE)), 2000);
  policy.retryMs = 0;
  assert.equal(policy.nextDelay(false, undefined, fixed(JUST_BELOW_ONE)), 2000);
  policy.retryMs = 20000;
  assert.equal(policy.nextDelay(true, undefined, fixed(0.25)), 25000);
  // The cap bounds the healthy wait as well (a drain's large retry).
  policy.retryMs = 45000;
  assert.equal(policy.nextDelay(true, undefined, fixed(0.5)), 60000);
});

test("policy: Retry-After is a minimum, also above the cap", () => {
  const policy = new ReconnectPolicy(3000);
  assert.equal(policy.nextDelay(false, 5000, fixed(0)), 5000);
  assert.equal(policy.nextDelay(false, 5000, fixed(JUST_BELOW_ONE)), 12000);
  assert.equal(policy.nextDelay(false, 90000, fixed(JUST_BELOW_ONE)), 90000);
  assert.equal(parseRetryAfter("5", 0), 5000);
  assert.equal(parseRetryAfter(" 12 ", 0), 12000);
  const now = Date.parse("2030-01-01T00:00:00Z");
  assert.equal(parseRetryAfter("Tue, 01 Jan 2030 00:00:30 GMT", now), 30000);
  assert.equal(parseRetryAfter("Mon, 31 Dec 2029 00:00:00 GMT", now), 0, "a date in the past");
  assert.equal(parseRetryAfter("soon", now), undefined);
  assert.equal(parseRetryAfter(null, now), undefined);
});

/**
 * A fetch whose answers a test scripts one attempt at a time: `next` is a function of the
 * attempt's index returning a Response, or throwing for a connection that failed.
 */
function scriptedFetch(next) {
  const calls = [];
  const fetch = async (url, init) => {
    calls.push({ url, init });
    return next(calls.length - 1, init);
  };
  return { fetch, calls };
}

function stream(text, { end = true } = {}) {
  const body = new ReadableStream({
    start(controller) {
      controller.enqueue(new TextEncoder().encode(text));
      if (end) controller.close();
    },
  });
  return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
}

/** Runs `connect` until `count` waits were scheduled, advancing the fake clock through each. */
async function delays(options, count) {
  const clock = new FakeClock();
  const recorder = new Recorder();
  const sub = connect({ url: "http://hub.test", device: "pos-1", clock, ...recorder.callbacks(), ...options });
  const seen = [];
  for (let n = 1; n <= count; n++) {
    const waiting = await recorder.state("reconnecting", n);
    seen.push(waiting.delayMs);
    await settle();
    clock.advance(waiting.delayMs);
  }
  await sub.close();
  return { seen, recorder };
}

test("client: refused connections back off 6, 12, 24, 48, 60, 60 s from the default retry", async () => {
  const { fetch } = scriptedFetch(() => {
    throw new TypeError("fetch failed: ECONNREFUSED");
  });
  const { seen, recorder } = await delays({ fetch, random: fixed(JUST_BELOW_ONE) }, 6);
  assert.deepEqual(seen, [6000, 12000, 24000, 48000, 60000, 60000]);
  assert.ok(recorder.errors.every((e) => e.code === "network"));
});

test("client: a healthy connection resets the back-off and its reconnect is jittered", async () => {
  // Three refusals, then a stream that delivers one event and ends, then refusals again.
  const { fetch } = scriptedFetch((i) => {
    if (i === 3) return stream("retry: 2000\n\nid: e.1.1-0\nevent: t\ndata: x\n\n");
    throw new TypeError("fetch failed");
  });
  const { seen } = await delays({ fetch, random: fixed(0.5) }, 5);
  // Failures from retry 3000 (half of 6, 12, 24 s); after the stream, retry is the server's
  // 2000: 2000 + 50 %; then the first failure's ceiling again (half of 4 s).
  assert.deepEqual(seen, [3000, 6000, 12000, 3000, 2000]);
});

test("client: a server's tiny retry still waits at least 1 s", async () => {
  const { fetch } = scriptedFetch(() => stream("retry: 10\n\nid: e.1.1-0\ndata: x\n\n"));
  const { seen } = await delays({ fetch, random: fixed(0) }, 3);
  assert.deepEqual(seen, [1000, 1000, 1000]);
});

test("client: a 503's Retry-After is waited for, even beyond the cap", async () => {
  const answers = [
    () => new Response('{"error":"draining"}', { status: 503, headers: { "retry-after": "7" } }),
    () => new Response('{"error":"draining"}', { status: 503, headers: { "retry-after": "90" } }),
    () => new Response("bad gateway", { status: 502 }),
  ];
  const { fetch } = scriptedFetch((i) => answers[i]());
  const { seen, recorder } = await delays({ fetch, random: fixed(0) }, 3);
  assert.deepEqual(seen, [7000, 90000, 1000]);
  assert.deepEqual(
    recorder.errors.map((e) => [e.code, e.status]),
    [["status", 503], ["status", 503], ["status", 502]],
  );
});

test("client: a connection that opens and closes at once, with nothing delivered, counts as a failure", async () => {
  // A takeover or a proxy cutting the stream: no event, not 10 s, not a clean end.
  const { fetch } = scriptedFetch(() => {
    const body = new ReadableStream({
      start(controller) {
        controller.enqueue(new TextEncoder().encode("retry: 3000\n: posthorn\n\n"));
        controller.error(new TypeError("terminated"));
      },
    });
    return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
  });
  const { seen } = await delays({ fetch, random: fixed(JUST_BELOW_ONE) }, 3);
  assert.deepEqual(seen, [6000, 12000, 24000]);
});

test("client: the server's clean end is healthy even without events", async () => {
  const { fetch } = scriptedFetch(() => stream("retry: 4000\n: posthorn\n\n"));
  const { seen } = await delays({ fetch, random: fixed(0.25) }, 2);
  assert.deepEqual(seen, [5000, 5000]);
});

test("client: a 200 that is not an event stream is retried with back-off", async () => {
  const { fetch } = scriptedFetch(
    () => new Response("<html>captive portal</html>", { status: 200, headers: { "content-type": "text/html" } }),
  );
  const { seen, recorder } = await delays({ fetch, random: fixed(JUST_BELOW_ONE) }, 2);
  assert.deepEqual(seen, [6000, 12000]);
  assert.equal(recorder.errors[0].code, "content_type");
});

test("client: silence for three heartbeats is a dead connection, and bytes re-arm the watchdog", async () => {
  const clock = new FakeClock();
  const recorder = new Recorder();
  let push;
  const { fetch, calls } = scriptedFetch((i, init) => {
    if (i > 0) throw new TypeError("fetch failed");
    const body = new ReadableStream({
      start(controller) {
        push = (text) => controller.enqueue(new TextEncoder().encode(text));
        init.signal.addEventListener("abort", () => controller.error(new DOMException("aborted", "AbortError")));
      },
    });
    return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
  });
  const sub = connect({
    url: "http://hub.test",
    device: "pos-1",
    fetch,
    clock,
    heartbeatMs: 2000,
    random: fixed(0),
    ...recorder.callbacks(),
  });
  await recorder.state("open");
  await settle();
  clock.advance(5999);
  await settle();
  push(": ping\n\n");
  await settle();
  clock.advance(5999);
  await settle();
  assert.equal(recorder.states.filter((s) => s.state === "reconnecting").length, 0, "a ping re-armed it");
  clock.advance(1);
  const waiting = await recorder.state("reconnecting");
  assert.equal(waiting.error.code, "dead");
  assert.equal(calls.length, 1);
  await sub.close();
});

test("client: no answer head within three heartbeats is a dead connection too", async () => {
  const clock = new FakeClock();
  const recorder = new Recorder();
  const fetch = (url, init) =>
    new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError"))));
  const sub = connect({ url: "http://hub.test", device: "pos-1", fetch, clock, heartbeatMs: 20000, ...recorder.callbacks() });
  await recorder.state("connecting");
  await settle();
  clock.advance(59999);
  await settle();
  assert.equal(recorder.states.at(-1).state, "connecting");
  clock.advance(1);
  const waiting = await recorder.state("reconnecting");
  assert.equal(waiting.error.code, "dead");
  await sub.close();
});
