// Real posthorn hubs (and Redis servers) for the tests, each on a free loopback port, killed
// when the test ends. The hub binary is $POSTHORN_BIN (the Rust test tests/js_client.rs passes
// the one cargo just built; by hand: `POSTHORN_BIN=target/debug/posthorn npm test`).
//
// `startHub({ env, args })` is the one way in: a test of another hub feature (jwt auth, token
// expiry, revocation, groups) passes its settings as POSTHORN_* variables or `serve` arguments.
// `startJwtHub` adds an HS256 secret and mints tokens with `posthorn token`.

import { execFile, spawn } from "node:child_process";
import { accessSync, constants, mkdtempSync, readFileSync, rmSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";

const READY_TIMEOUT_MS = 30_000;
const STOP_TIMEOUT_MS = 15_000;
/** Short timings so that reconnects and drains take seconds, not minutes. */
export const HEARTBEAT_MS = 2_000;
const FAST = {
  POSTHORN_SSE__HEARTBEAT: `${HEARTBEAT_MS}ms`,
  POSTHORN_SSE__RETRY_MS: "1000",
  POSTHORN_DRAIN__GRACE: "5s",
  POSTHORN_DRAIN__RETRY_MIN: "1s",
  POSTHORN_DRAIN__RETRY_MAX: "2s",
};

const children = new Set();
// A test that fails half-way must not leave hubs or Redis servers behind.
process.on("exit", () => {
  for (const child of children) child.kill("SIGKILL");
});

export function posthornBin() {
  const bin = process.env.POSTHORN_BIN;
  if (!bin) {
    throw new Error(
      "POSTHORN_BIN is not set: it must name a posthorn binary (cargo build --bin posthorn; then POSTHORN_BIN=target/debug/posthorn)",
    );
  }
  accessSync(bin, constants.X_OK);
  return bin;
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** The environment of a child: ours without POSTHORN_* (a developer's shell may set some), plus `env`. */
function childEnv(env) {
  const base = {};
  for (const [key, value] of Object.entries(process.env)) {
    if (!key.startsWith("POSTHORN_")) base[key] = value;
  }
  return { ...base, RUST_LOG: "info", ...env };
}

function tail(path, bytes = 4000) {
  try {
    const text = readFileSync(path, "utf8");
    return text.slice(-bytes);
  } catch {
    return "(no log)";
  }
}

/** Spawns a process with its output in a log file; `exited` resolves with its status. */
function launch(command, args, env, dir, name) {
  const log = join(dir, `${name}.log`);
  const child = spawn("sh", ["-c", 'exec "$0" "$@" >"$LOGFILE" 2>&1', command, ...args], {
    env: { ...env, LOGFILE: log },
    stdio: "ignore",
  });
  children.add(child);
  const exited = new Promise((resolve) =>
    child.once("exit", (code, signal) => {
      children.delete(child);
      resolve({ code, signal });
    }),
  );
  return { child, exited, log };
}

async function waitUntil(ready, exited, what, log) {
  const deadline = Date.now() + READY_TIMEOUT_MS;
  let gone = null;
  exited.then((status) => (gone = status));
  for (;;) {
    if (gone) throw new Error(`${what} exited before it was ready (${JSON.stringify(gone)}):\n${tail(log)}`);
    if (await ready().catch(() => false)) return;
    if (Date.now() > deadline) throw new Error(`${what} not ready after ${READY_TIMEOUT_MS} ms:\n${tail(log)}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/**
 * Starts `posthorn serve --listen 127.0.0.1:PORT ...args` with the fast timings above and `env`,
 * waits for /healthz. `port` pins the port (to restart a hub where its clients look for it).
 */
export async function startHub({ env = {}, args = [], port } = {}) {
  const bin = posthornBin();
  const dir = mkdtempSync(join(tmpdir(), "posthorn-js-hub-"));
  for (let attempt = 1; ; attempt++) {
    const listen = port ?? (await freePort());
    const url = `http://127.0.0.1:${listen}`;
    const proc = launch(bin, ["serve", "--listen", `127.0.0.1:${listen}`, ...args], childEnv({ ...FAST, ...env }), dir, `hub-${listen}-${attempt}`);
    try {
      await waitUntil(async () => (await fetch(`${url}/healthz`)).ok, proc.exited, `posthorn on ${listen}`, proc.log);
    } catch (error) {
      proc.child.kill("SIGKILL");
      // Another process took the port between freePort() and the bind: try another one.
      if (port === undefined && attempt < 3 && /Address already in use|os error 98/.test(tail(proc.log))) continue;
      throw error;
    }
    let stopped = false;
    return {
      url,
      port: listen,
      log: () => tail(proc.log, 20_000),
      /** SIGTERM (a drain, then exit), SIGKILL if it has not exited in time; the exit status. */
      async stop(signal = "SIGTERM") {
        if (!stopped) {
          stopped = true;
          proc.child.kill(signal);
          const timer = setTimeout(() => proc.child.kill("SIGKILL"), STOP_TIMEOUT_MS);
          const status = await proc.exited;
          clearTimeout(timer);
          return status;
        }
        return proc.exited;
      },
      /** Removes the log directory; call after stop() when the test passed. */
      cleanup() {
        rmSync(dir, { recursive: true, force: true });
      },
    };
  }
}

/** A Redis server without persistence on a free port: `redis-server --port P --save '' --appendonly no`. */
export async function startRedis() {
  const dir = mkdtempSync(join(tmpdir(), "posthorn-js-redis-"));
  const port = await freePort();
  const proc = launch(
    "redis-server",
    ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir],
    childEnv({}),
    dir,
    "redis",
  );
  const redis = {
    url: `redis://127.0.0.1:${port}`,
    port,
    /** One command, answered by a one-line reply (`+OK`, `:1`, `-ERR ...`). */
    command: (...words) => respCommand(port, words),
    async stop() {
      proc.child.kill("SIGKILL");
      await proc.exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
  await waitUntil(async () => (await redis.command("PING")) === "+PONG", proc.exited, `redis-server on ${port}`, proc.log);
  return redis;
}

function respCommand(port, words) {
  return new Promise((resolve, reject) => {
    const socket = net.connect(port, "127.0.0.1");
    let reply = "";
    socket.setTimeout(5000, () => socket.destroy(new Error("redis command timed out")));
    socket.on("error", reject);
    socket.on("connect", () => {
      socket.write(`*${words.length}\r\n` + words.map((w) => `$${Buffer.byteLength(w)}\r\n${w}\r\n`).join(""));
    });
    socket.on("data", (data) => {
      reply += data.toString("utf8");
      const end = reply.indexOf("\r\n");
      if (end !== -1) {
        socket.end();
        resolve(reply.slice(0, end));
      }
    });
  });
}

/** POST /v1/events; returns the ids of the results, in order; throws on any other status than 201. */
export async function publish(hub, items, token) {
  const headers = { "content-type": "application/json" };
  if (token) headers.authorization = `Bearer ${token}`;
  const response = await fetch(`${hub.url}/v1/events`, { method: "POST", headers, body: JSON.stringify(items) });
  const text = await response.text();
  if (response.status !== 201) throw new Error(`publish answered ${response.status}: ${text}`);
  return JSON.parse(text).results.map((r) => r.id);
}

/** GET /v1/devices/{device}: the device's record in the fleet API. */
export async function deviceRecord(hub, device, token) {
  const headers = token ? { authorization: `Bearer ${token}` } : {};
  const response = await fetch(`${hub.url}/v1/devices/${device}`, { headers });
  const text = await response.text();
  if (response.status !== 200) throw new Error(`GET /v1/devices/${device} answered ${response.status}: ${text}`);
  return JSON.parse(text);
}

export const JWT_SECRET = "posthorn-js-client-tests-secret-0123456789abcdef";

/** `posthorn token --device D` / `--scope S` with the test secret (HS256). */
export async function mintToken({ device, scope, ttl } = {}) {
  const args = ["token"];
  if (device) args.push("--device", device);
  if (scope) args.push("--scope", scope);
  if (ttl) args.push("--ttl", ttl);
  const { stdout } = await promisify(execFile)(posthornBin(), args, {
    env: childEnv({ POSTHORN_AUTH__JWT_SECRET: JWT_SECRET }),
  });
  return stdout.trim();
}

/** A hub with jwt auth and the test secret; `env` adds or overrides settings. */
export function startJwtHub({ env = {}, args = [] } = {}) {
  return startHub({
    env: { POSTHORN_AUTH__MODE: "jwt", POSTHORN_AUTH__JWT_SECRET: JWT_SECRET, ...env },
    args,
  });
}
