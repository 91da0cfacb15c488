// A scripted stand-in for the hub, written with node:http, for what the real hub cannot be
// made to do on demand (token expiry, revocation, a given status, silence). Every request is
// recorded (method, URL, headers, body) and answered by the test's `respond` function, which
// is called with the request's index among the requests of the same kind ("stream" or "ack").

import http from "node:http";

export async function startFakeHub(respond) {
  const requests = [];
  const sockets = new Set();
  let waiters = [];
  const server = http.createServer(async (req, res) => {
    let body = "";
    for await (const chunk of req) body += chunk;
    const kind = req.url.includes("/ack") ? "ack" : "stream";
    const record = {
      kind,
      index: requests.filter((r) => r.kind === kind).length,
      method: req.method,
      url: req.url,
      headers: req.headers,
      body,
    };
    requests.push(record);
    for (const waiter of [...waiters]) waiter();
    try {
      await respond(record, res);
    } catch (error) {
      if (!res.headersSent) res.writeHead(500);
      res.end(String(error));
    }
  });
  server.on("connection", (socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}`,
    requests,
    of: (kind) => requests.filter((r) => r.kind === kind),
    /** Resolves once `n` requests of `kind` arrived; rejects after `timeoutMs`. */
    until(kind, n, timeoutMs = 10_000) {
      const ready = () => requests.filter((r) => r.kind === kind).length >= n;
      if (ready()) return Promise.resolve();
      return new Promise((resolve, reject) => {
        const check = () => {
          if (!ready()) return;
          clearTimeout(timer);
          waiters = waiters.filter((w) => w !== check);
          resolve();
        };
        const timer = setTimeout(() => {
          waiters = waiters.filter((w) => w !== check);
          reject(new Error(`timed out waiting for ${n} ${kind} requests (have ${requests.filter((r) => r.kind === kind).length})`));
        }, timeoutMs);
        waiters.push(check);
      });
    },
    async close() {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

/** Starts an event stream answer, writing the hub's prelude and `text`. */
export function openStream(res, text = "") {
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  res.write("retry: 3000\n: posthorn\n\n" + text);
}

/** A JSON error answer like the hub's. */
export function refuse(res, status, code, headers = {}) {
  res.writeHead(status, { "content-type": "application/json", ...headers });
  res.end(JSON.stringify({ error: code, message: code }));
}

/** One event as the hub writes it. */
export function frame(id, type, data) {
  return `id: ${id}\nevent: ${type}\n${data.split("\n").map((line) => `data: ${line}\n`).join("")}\n`;
}
