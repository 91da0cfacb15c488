// The compiled ES module in headless Chromium, on a page from another origin than the hub's:
// the stream is opened cross-origin with the token in the Authorization header (a CORS
// preflight the hub must grant for `authorization` and `last-event-id`), events arrive in
// order, the cursor kept in localStorage resumes the next page load with no gap, and the acks
// (another cross-origin POST with a preflight) reach the hub.
//
// The page reports what it sees by POSTing to the static server that served it, so no
// DevTools connection is needed: Chromium runs with the page's URL and is killed at the end.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import http from "node:http";
import { tmpdir } from "node:os";
import { dirname, join, normalize } from "node:path";
import test from "node:test";
import { fileURLToPath } from "node:url";

import { deviceRecord, freePort, mintToken, publish, startJwtHub } from "./support/hub.mjs";
import { Recorder } from "./support/recorder.mjs";

const DIST = join(dirname(fileURLToPath(import.meta.url)), "..", "dist");
const CHROMIUM = process.env.CHROMIUM ?? onPath("chromium");

/** The first executable `name` on $PATH (Debian's chromium is /usr/bin/chromium). */
function onPath(name) {
  for (const dir of (process.env.PATH ?? "").split(":")) {
    const candidate = join(dir, name);
    if (dir && existsSync(candidate)) return candidate;
  }
  return `/usr/bin/${name}`;
}
const DEVICE = "pos-web";

function page(hubUrl) {
  return `<!doctype html>
<meta charset="utf-8">
<title>posthorn-client in a browser</title>
<script type="module">
  let seq = 0;
  const report = (item) =>
    fetch("/report", { method: "POST", body: JSON.stringify({ seq: seq++, phase: location.search, ...item }) });
  window.addEventListener("error", (e) => report({ kind: "page-error", message: String(e.message) }));
  window.addEventListener("unhandledrejection", (e) => report({ kind: "page-error", message: String(e.reason) }));
  const { connect, localStorageCursorStore } = await import("/dist/index.js");
  const second = location.search === "?phase=2";
  let received = 0;
  const sub = connect({
    url: ${JSON.stringify(hubUrl)},
    device: ${JSON.stringify(DEVICE)},
    token: async () => (await fetch("/token")).text(),
    cursorStore: localStorageCursorStore("posthorn-cursor:${DEVICE}"),
    heartbeatMs: 2000,
    onEvent: async (event) => {
      await report({ kind: "event", ...event });
      received += 1;
      if (!second && received === 3) void sub.close();
    },
    onResync: (reason, id) => report({ kind: "resync", reason, id }),
    onStateChange: (state, info) => report({ kind: "state", state, resumedFrom: info.resumedFrom ?? null, reason: info.reason ?? null }),
    onError: (error) => report({ kind: "error", code: error.code, message: error.message }),
  });
  if (!second) {
    // Once the third event's cursor is stored, wait for the test to publish while no page
    // follows the device, then load the page again.
    await sub.finished;
    await report({ kind: "closed", cursor: localStorage.getItem("posthorn-cursor:${DEVICE}") });
    await fetch("/go");
    location.search = "?phase=2";
  }
</script>
`;
}

/** The page's origin: the page, the package's files, tokens, reports, and the go signal. */
async function startPageServer(port, hubUrl, recorder) {
  let release;
  const go = new Promise((resolve) => (release = resolve));
  let tokens = 0;
  const server = http.createServer(async (req, res) => {
    const path = new URL(req.url, "http://x").pathname;
    if (path === "/") {
      res.writeHead(200, { "content-type": "text/html; charset=utf-8" }).end(page(hubUrl));
    } else if (path.startsWith("/dist/")) {
      const file = normalize(join(DIST, path.slice("/dist/".length)));
      if (!file.startsWith(DIST) || !existsSync(file)) return res.writeHead(404).end();
      res.writeHead(200, { "content-type": "text/javascript; charset=utf-8" }).end(readFileSync(file));
    } else if (path === "/token") {
      tokens += 1;
      res.writeHead(200, { "content-type": "text/plain" }).end(await mintToken({ device: DEVICE }));
    } else if (path === "/report") {
      let body = "";
      for await (const chunk of req) body += chunk;
      recorder.record(recorder.events, JSON.parse(body));
      res.writeHead(204).end();
    } else if (path === "/go") {
      await go;
      res.writeHead(204).end();
    } else {
      res.writeHead(404).end();
    }
  });
  await new Promise((resolve) => server.listen(port, "127.0.0.1", resolve));
  return { release, tokens: () => tokens, close: () => new Promise((resolve) => server.close(resolve)) };
}

function startChromium(url) {
  const profile = mkdtempSync(join(tmpdir(), "posthorn-js-chromium-"));
  const child = spawn(
    CHROMIUM,
    [
      "--headless",
      // Tests may run as root in containers, where Chromium's sandbox cannot start.
      "--no-sandbox",
      "--disable-gpu",
      "--disable-dev-shm-usage",
      "--disable-quic",
      "--no-first-run",
      "--no-default-browser-check",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--disable-extensions",
      `--user-data-dir=${profile}`,
      url,
    ],
    { stdio: ["ignore", "ignore", "pipe"], detached: true },
  );
  let log = "";
  child.stderr.on("data", (data) => {
    log = (log + data).slice(-20_000);
  });
  const exited = new Promise((resolve) => child.once("exit", resolve));
  return {
    log: () => log,
    async stop() {
      // Chromium starts helper processes: end its whole process group.
      try {
        process.kill(-child.pid, "SIGKILL");
      } catch {
        // Already gone.
      }
      await exited;
      rmSync(profile, { recursive: true, force: true });
    },
  };
}

test("browser: a page on another origin follows the device with a bearer token, resumes from localStorage, acks", { timeout: 120_000 }, async (t) => {
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: install chromium (scripts/test does)`);
  assert.ok(existsSync(join(DIST, "index.js")), "dist/ is missing: run npm run build first");
  const pagePort = await freePort();
  const pageOrigin = `http://127.0.0.1:${pagePort}`;
  const hub = await startJwtHub({ env: { POSTHORN_SERVER__CORS_ORIGINS: pageOrigin } });
  t.after(async () => {
    await hub.stop("SIGKILL");
    hub.cleanup();
  });
  const recorder = new Recorder();
  const pages = await startPageServer(pagePort, hub.url, recorder);
  t.after(() => pages.close());
  const chromium = startChromium(`${pageOrigin}/`);
  t.after(() => chromium.stop());

  const reports = (kind, phase = "") => recorder.events.filter((r) => r.kind === kind && r.phase === phase);
  const failures = () => recorder.events.filter((r) => r.kind === "page-error" || (r.kind === "state" && r.state === "failed"));
  const wait = (predicate, what, ms = 60_000) =>
    recorder
      .until(() => predicate() || failures().length > 0, what, ms)
      .catch((error) => {
        throw new Error(`${error.message}\npage reports: ${JSON.stringify(recorder.events)}\nchromium log:\n${chromium.log()}`);
      })
      .then(() => {
        assert.deepEqual(failures(), [], `the page failed; chromium log:\n${chromium.log()}`);
      });

  await wait(() => reports("state").some((r) => r.state === "open"), "the page's stream to open");
  const publisher = await mintToken({ scope: "publish" });
  const ids = await publish(
    hub,
    [
      { device: DEVICE, type: "order.paid", data: { total: 1250 } },
      { device: DEVICE, type: "note", data: "line one\r\nline two é€😀" },
      { device: DEVICE, type: "order.paid", data: { total: 99 } },
    ],
    publisher,
  );
  await wait(() => reports("closed").length === 1, "three events and the page's close");
  const firstPage = reports("event").sort((a, b) => a.seq - b.seq);
  assert.deepEqual(firstPage.map((e) => e.id), ids);
  assert.equal(firstPage[1].data, "line one\nline two é€😀");
  assert.equal(firstPage[1].type, "note");
  assert.equal(reports("closed")[0].cursor, ids[2], "the cursor is in localStorage");

  // Published while no page follows the device: the next page load must get them.
  const missed = await publish(
    hub,
    [
      { device: DEVICE, type: "t", data: "missed 1" },
      { device: DEVICE, type: "t", data: "missed 2" },
    ],
    publisher,
  );
  pages.release();
  await wait(() => reports("event", "?phase=2").length >= 2, "the second page load to catch up");
  const secondPage = reports("event", "?phase=2").sort((a, b) => a.seq - b.seq);
  assert.deepEqual(secondPage.map((e) => e.id), missed);
  const opened = reports("state", "?phase=2").find((r) => r.state === "open");
  assert.equal(opened.resumedFrom, ids[2]);
  assert.equal(reports("resync").length + reports("resync", "?phase=2").length, 0);
  assert.ok(pages.tokens() >= 2, "a token was fetched for each connection");

  // Acks: the page's POSTs to the hub (cross-origin, bearer token) moved acked_id.
  const fleet = await mintToken({ scope: "fleet" });
  let record;
  for (let i = 0; i < 50; i++) {
    record = await deviceRecord(hub, DEVICE, fleet);
    if (record.acked_id === missed[1]) break;
    await new Promise((r) => setTimeout(r, 200));
  }
  assert.equal(record.acked_id, missed[1], JSON.stringify(record));
  const errors = [...reports("error"), ...reports("error", "?phase=2")];
  assert.deepEqual(errors, [], "no error on the way");
});
