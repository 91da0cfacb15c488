#!/usr/bin/env node
// Drain under load: 2,000 clients of this package (one Node process, one device each) follow
// hub A; events are published to every device once a second while A is drained
// (`POST /admin/drain?exit=false`); each client is given both hubs' URLs and takes the next
// one when its connection ends, so it resumes on hub B from its cursor (A and B share one
// Redis). At the end every device must have received every event published to it exactly
// once, in order. Prints one JSON line; exits 0 when nothing was lost, duplicated or reordered.
//
//   npm run build && ulimit -n 65536 && POSTHORN_BIN=/path/to/posthorn node scripts/drain-load.mjs
//
// Settings (environment): CLIENTS (2000), INTERVAL_MS (1000, between publish rounds),
// ROUNDS_AFTER (3, rounds published once every client is on B), DEADLINE_S (300, the whole run),
// DRAIN_GRACE (20s), DRAIN_RETRY_MAX (10s). Needs redis-server. The hubs and Redis listen on
// free loopback ports and are killed at the end, also when the run fails.

import { execFileSync } from "node:child_process";
import os from "node:os";

import { connect, memoryCursorStore } from "../dist/index.js";
import { publish, startHub, startRedis } from "../test/support/hub.mjs";

const CLIENTS = Number(process.env.CLIENTS ?? 2000);
const INTERVAL_MS = Number(process.env.INTERVAL_MS ?? 1000);
const ROUNDS_AFTER = Number(process.env.ROUNDS_AFTER ?? 3);
const DEADLINE_MS = Number(process.env.DEADLINE_S ?? 300) * 1000;
const DRAIN_GRACE = process.env.DRAIN_GRACE ?? "20s";
const DRAIN_RETRY_MAX = process.env.DRAIN_RETRY_MAX ?? "10s";
const HEARTBEAT_MS = 5000;
/** The hub's `limits.max_batch`. */
const BATCH = 1000;

const started = Date.now();
const deadline = started + DEADLINE_MS;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const log = (text) => process.stderr.write(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${text}\n`);

async function until(predicate, what, timeoutMs = deadline - Date.now()) {
  const end = Math.min(deadline, Date.now() + timeoutMs);
  while (!predicate()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(100);
  }
}

function percentile(sorted, p) {
  if (sorted.length === 0) return null;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

const openFiles = Number(execFileSync("sh", ["-c", "ulimit -n"]).toString().trim());
if (openFiles !== Infinity && openFiles < CLIENTS * 2 + 1000) {
  console.error(`ulimit -n is ${openFiles}; ${CLIENTS} clients and their hubs need more: run \`ulimit -n 65536\` first`);
  process.exit(2);
}

const redis = await startRedis();
const hubEnv = {
  POSTHORN_REDIS__URL: redis.url,
  POSTHORN_SSE__HEARTBEAT: `${HEARTBEAT_MS}ms`,
  POSTHORN_SSE__RETRY_MS: "1000",
  POSTHORN_DRAIN__GRACE: DRAIN_GRACE,
  POSTHORN_DRAIN__RETRY_MIN: "1s",
  POSTHORN_DRAIN__RETRY_MAX: DRAIN_RETRY_MAX,
  RUST_LOG: "warn",
};
const hubs = [];
const subs = [];
let exitCode = 1;
try {
  const a = await startHub({ env: hubEnv, args: ["--backend", "redis"] });
  hubs.push(a);
  const b = await startHub({ env: hubEnv, args: ["--backend", "redis"] });
  hubs.push(b);
  log(`hub A ${a.url}, hub B ${b.url}, redis ${redis.url}`);

  const devices = Array.from({ length: CLIENTS }, (_, i) => `load-${i}`);
  const received = new Map(devices.map((d) => [d, []]));
  const where = new Map();
  const latencies = [];
  let opens = 0;
  let refusals503 = 0;
  let otherErrors = 0;
  const errorKinds = {};
  for (const device of devices) {
    subs.push(
      connect({
        url: [a.url, b.url],
        device,
        cursorStore: memoryCursorStore(),
        ack: false,
        heartbeatMs: HEARTBEAT_MS,
        onEvent: (event) => {
          const { round, at } = JSON.parse(event.data);
          received.get(device).push(round);
          latencies.push(Date.now() - at);
        },
        onStateChange: (state, info) => {
          if (state === "open") {
            opens += 1;
            where.set(device, info.url);
          } else if (state === "failed" || state === "revoked") {
            errorKinds[`final:${info.reason}`] = (errorKinds[`final:${info.reason}`] ?? 0) + 1;
          }
        },
        onError: (error) => {
          if (error.status === 503) refusals503 += 1;
          else otherErrors += 1;
          errorKinds[error.code] = (errorKinds[error.code] ?? 0) + 1;
        },
      }),
    );
  }
  const on = (hub) => [...where.values()].filter((url) => url === hub.url).length;
  await until(() => on(a) === CLIENTS, `${CLIENTS} clients on hub A`, 120_000);
  log(`${CLIENTS} clients connected to A`);

  // Publish rounds: one event per device per round, through B (A is the one drained).
  let round = 0;
  let publishing = true;
  let published = 0;
  const publishErrors = [];
  const publisher = (async () => {
    while (publishing) {
      const begun = Date.now();
      const items = devices.map((device) => ({ device, type: "load", data: { round, at: Date.now() } }));
      for (let i = 0; i < items.length; i += BATCH) {
        try {
          await publish(b, items.slice(i, i + BATCH));
          published += Math.min(BATCH, items.length - i);
        } catch (error) {
          // A publish that failed is not counted as published: it cannot be expected.
          publishErrors.push(String(error));
        }
      }
      round += 1;
      await sleep(Math.max(0, INTERVAL_MS - (Date.now() - begun)));
    }
  })();

  await sleep(2 * INTERVAL_MS);
  const drainAt = Date.now();
  const drain = await fetch(`${a.url}/admin/drain?exit=false`, { method: "POST" });
  if (drain.status !== 202) throw new Error(`drain answered ${drain.status}: ${await drain.text()}`);
  log("hub A draining");
  await until(() => on(b) === CLIENTS, `every client on hub B (now ${on(b)})`);
  const movedAfterMs = Date.now() - drainAt;
  log(`every client on B ${(movedAfterMs / 1000).toFixed(1)} s after the drain began`);
  const lastRoundBefore = round;
  await until(() => round >= lastRoundBefore + ROUNDS_AFTER, "the last rounds");
  publishing = false;
  await publisher;
  const rounds = round;
  if (publishErrors.length > 0) throw new Error(`publishing failed: ${publishErrors.slice(0, 3).join("; ")}`);
  // Delivery of the last round.
  await until(
    () => [...received.values()].every((list) => list.length >= rounds),
    "delivery of every round",
    30_000,
  ).catch(() => {});

  let lost = 0;
  let duplicates = 0;
  let outOfOrder = 0;
  const devicesWithLoss = [];
  for (const [device, list] of received) {
    const seen = new Set(list);
    duplicates += list.length - seen.size;
    for (let r = 0; r < rounds; r++) {
      if (!seen.has(r)) {
        lost += 1;
        if (devicesWithLoss.length < 5) devicesWithLoss.push(device);
      }
    }
    for (let i = 1; i < list.length; i++) if (list[i] <= list[i - 1]) outOfOrder += 1;
  }
  latencies.sort((x, y) => x - y);
  const delivered = [...received.values()].reduce((n, list) => n + list.length, 0);
  const ok = lost === 0 && duplicates === 0 && outOfOrder === 0 && published === rounds * CLIENTS;
  const summary = {
    ok,
    clients: CLIENTS,
    rounds,
    published,
    delivered,
    lost,
    duplicates,
    out_of_order: outOfOrder,
    devices_with_loss: devicesWithLoss,
    connections_opened: opens,
    refused_503: refusals503,
    other_errors: otherErrors,
    errors_by_code: errorKinds,
    all_on_b_after_s: Number((movedAfterMs / 1000).toFixed(1)),
    latency_ms: {
      p50: percentile(latencies, 50),
      p99: percentile(latencies, 99),
      max: latencies.at(-1) ?? null,
    },
    drain: { grace: DRAIN_GRACE, retry_min: "1s", retry_max: DRAIN_RETRY_MAX },
    elapsed_s: Number(((Date.now() - started) / 1000).toFixed(1)),
    node: process.version,
    cpus: os.cpus().length,
  };
  console.log(JSON.stringify(summary));
  exitCode = ok ? 0 : 1;
} catch (error) {
  console.log(JSON.stringify({ ok: false, error: String(error?.stack ?? error), elapsed_s: (Date.now() - started) / 1000 }));
  exitCode = 1;
} finally {
  await Promise.race([Promise.all(subs.map((s) => s.close())), sleep(10_000)]);
  for (const hub of hubs) {
    await hub.stop("SIGKILL");
    hub.cleanup();
  }
  await redis.stop();
}
process.exit(exitCode);
