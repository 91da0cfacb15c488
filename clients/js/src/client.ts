// The connection loop: one event stream per device, read with `fetch` (so that the token can go
// in a header, every byte including heartbeats is seen, and every answer's status and
// `Retry-After` are known, none of which `EventSource` allows), reconnected by the rules of the
// hub's client contract.

import { Acker, describe, errorCode } from "./ack.js";
import { type Clock, systemClock } from "./clock.js";
import { PosthornError } from "./errors.js";
import { EventStreamParser, type ParsedEvent } from "./parser.js";
import { HEALTHY_AFTER_MS, ReconnectPolicy, parseRetryAfter } from "./policy.js";
import type { CursorStore } from "./stores.js";

/** A business event, as the hub published it. */
export interface PosthornEvent {
  /** The cursor after this event: unique within a deployment, opaque. */
  id: string;
  /** The event type (`message` unless the producer chose one). */
  type: string;
  /** The payload text (often JSON), line breaks as LF. */
  data: string;
}

export type ResyncReason = "expired" | "invalid" | "data_lost" | "unknown" | (string & {});

/**
 * `connecting`: a request is on its way. `open`: the hub answered 200 and the stream runs.
 * `reconnecting`: the connection ended; the next attempt comes after `delayMs`.
 * The three others are final, and `finished` resolves with them: `closed` (by `close()`),
 * `revoked` (the device's tokens were revoked), `failed` (a configuration error or an unusable
 * cursor store: retrying could not help).
 */
export type ConnectionState = "connecting" | "open" | "reconnecting" | "closed" | "revoked" | "failed";
export type FinalState = "closed" | "revoked" | "failed";

export interface StateInfo {
  /** The base URL of the attempt. */
  url: string;
  /** `connecting`, `open`: the cursor sent as `Last-Event-ID` (null: none). */
  resumedFrom?: string | null;
  /** `reconnecting`: the wait before the next attempt. */
  delayMs?: number;
  /** `reconnecting` and final states: why. */
  reason?: string;
  /** `reconnecting` and final states, when an error caused them. */
  error?: PosthornError;
}

export interface Finished {
  state: FinalState;
  reason: string;
  error?: PosthornError;
}

export type TokenSource = string | (() => string | Promise<string>);

export interface ConnectOptions {
  /**
   * The hub's base URL (`https://hub.example`, a path prefix is kept). Several URLs are tried in
   * turn, one per connection attempt, for hubs without a load balancer in front.
   */
  url: string | readonly string[];
  /** The device id: 1-128 characters of `[A-Za-z0-9._:-]`. */
  device: string;
  /**
   * The bearer token (jwt auth), or a function returning one, called before every connection:
   * after `event: token_expired` or a 401 it must return a fresh token. Omit with auth `none`.
   */
  token?: TokenSource | null;
  /** Groups to join (auth `none` only; with jwt auth the token's `groups` claim decides). */
  groups?: readonly string[];
  /**
   * Where the cursor is kept: at-least-once delivery across restarts. Without one the cursor
   * lives in memory: reconnects lose nothing, a restart of the application starts live.
   */
  cursorStore?: CursorStore | null;
  /**
   * Called once per event, in order. The next event waits until the returned promise resolves;
   * then the cursor is persisted. If it throws or rejects, the cursor does not move: the
   * connection is dropped and the event is delivered again after the reconnect delay.
   */
  onEvent?: (event: PosthornEvent) => void | Promise<void>;
  /**
   * The hub cannot resume from the cursor (`expired`, `invalid`, `data_lost`): events were
   * missed and will not be replayed, so reload state from the source of truth here. The resync's
   * id is persisted once the returned promise resolves (a crash mid-reload reloads again).
   */
  onResync?: (reason: ResyncReason, id: string) => void | Promise<void>;
  onStateChange?: (state: ConnectionState, info: StateInfo) => void;
  /** Every problem, also those the client recovers from by itself (for logs and metrics). */
  onError?: (error: PosthornError) => void;
  /**
   * Acknowledge persisted cursors to the hub (`POST /v1/devices/{device}/ack`, at most one a
   * second, the newest). Default: on when a `cursorStore` is given.
   */
  ack?: boolean;
  /** The hub's `sse.heartbeat` (default 20 s); three of them without a byte mean a dead connection. */
  heartbeatMs?: number;
  /** The base reconnect delay until the hub sends `retry:` (default 3000, the hub's default). */
  retryMs?: number;
  /** Events read ahead of `onEvent` before reading pauses (default 1000). */
  maxBufferedEvents?: number;
  /** Replaces the global `fetch` (tests, proxies, instrumentation). */
  fetch?: typeof globalThis.fetch;
  /** Replaces the timers (tests). */
  clock?: Clock;
  /** Replaces `Math.random` for the jitter (tests); must return a number in [0, 1). */
  random?: () => number;
}

export interface Subscription {
  /**
   * Stops for good: the stream is closed, no callback starts after this, the last ack is sent.
   * Resolves when all that is done. A callback already running is not waited for, so `close()`
   * may be awaited inside `onEvent`; when that callback returns, its cursor is persisted as
   * usual and `finished` resolves.
   */
  close(): Promise<void>;
  /** The cursor: the id of the last event (or resync) processed and persisted; null if none. */
  readonly lastEventId: string | null;
  readonly state: ConnectionState;
  /**
   * Resolves once the subscription reached a final state and nothing of it runs any more (after
   * `close()`: once a callback that was running has returned and its cursor is persisted).
   */
  readonly finished: Promise<Finished>;
}

const IDENT = /^[A-Za-z0-9._:-]{1,128}$/;
const EVENT_STREAM = /^text\/event-stream\b/i;
const MAX_ERROR_BODY = 4096;

/** Opens the device's event stream and keeps it open until `close()` or a final state. */
export function connect(options: ConnectOptions): Subscription {
  return new Client(options);
}

/** How one connection ended. */
type Ended =
  | { kind: "closed" }
  | { kind: "final"; state: "revoked" | "failed"; reason: string; error?: PosthornError }
  | {
      kind: "retry";
      reason: string;
      error?: PosthornError;
      healthy: boolean;
      retryAfterMs?: number;
      /** Reconnect without waiting: the token expired, or a 401 asks for a fresh one. */
      immediate?: boolean;
    };

class Client implements Subscription {
  readonly #urls: readonly string[];
  readonly #device: string;
  readonly #options: ConnectOptions;
  readonly #fetch: typeof globalThis.fetch;
  readonly #clock: Clock;
  readonly #random: () => number;
  readonly #silenceMs: number;
  readonly #maxBuffered: number;
  readonly #policy: ReconnectPolicy;
  readonly #acker: Acker | null;
  readonly finished: Promise<Finished>;
  #resolveFinished!: (finished: Finished) => void;

  #state: ConnectionState = "connecting";
  #cursor: string | null = null;
  #token: string | undefined;
  /** The token a 401 refused: if the source hands out the same one again, stop. */
  #refusedToken: string | undefined;
  /** Reconnects made at once (token expiry, 401) since the last healthy connection. */
  #immediateStreak = 0;
  #closing = false;
  /** `onEvent` or `onResync` is running. */
  #inCallback = false;
  #abort: AbortController | null = null;
  #wakeSleep: (() => void) | null = null;
  #stopped: Promise<void>;

  constructor(options: ConnectOptions) {
    const urls = typeof options.url === "string" ? [options.url] : [...options.url];
    if (urls.length === 0 || urls.some((url) => typeof url !== "string" || url === "")) {
      throw new TypeError("connect: `url` must be a base URL or a non-empty list of them");
    }
    if (typeof options.device !== "string" || !IDENT.test(options.device)) {
      throw new TypeError(
        `connect: invalid device id ${JSON.stringify(options.device)}: 1-128 characters of [A-Za-z0-9._:-]`,
      );
    }
    for (const group of options.groups ?? []) {
      if (typeof group !== "string" || !IDENT.test(group)) {
        throw new TypeError(
          `connect: invalid group ${JSON.stringify(group)}: 1-128 characters of [A-Za-z0-9._:-]`,
        );
      }
    }
    const heartbeatMs = options.heartbeatMs ?? 20_000;
    if (!(heartbeatMs > 0)) throw new TypeError("connect: `heartbeatMs` must be positive");
    this.#urls = urls.map((url) => url.replace(/\/+$/, ""));
    this.#device = options.device;
    this.#options = options;
    const fetchFunction = options.fetch ?? globalThis.fetch;
    if (typeof fetchFunction !== "function") {
      throw new TypeError("connect: no global fetch here; pass one as `fetch`");
    }
    // Called unbound, a browser's fetch throws "Illegal invocation".
    this.#fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
    this.#clock = options.clock ?? systemClock;
    this.#random = options.random ?? Math.random;
    this.#silenceMs = Math.max(3 * heartbeatMs, 1_000);
    this.#maxBuffered = Math.max(1, options.maxBufferedEvents ?? 1_000);
    this.#policy = new ReconnectPolicy(options.retryMs);
    const ack = options.ack ?? (options.cursorStore !== undefined && options.cursorStore !== null);
    this.#acker = ack
      ? new Acker({
          fetch: this.#fetch,
          clock: this.#clock,
          token: () => this.#token,
          onError: (error) => this.#report(error),
        })
      : null;
    this.finished = new Promise((resolve) => {
      this.#resolveFinished = resolve;
    });
    this.#stopped = this.#run();
  }

  get lastEventId(): string | null {
    return this.#cursor;
  }

  get state(): ConnectionState {
    return this.#state;
  }

  async close(): Promise<void> {
    if (!this.#closing) {
      this.#closing = true;
      this.#abort?.abort();
      this.#wakeSleep?.();
    }
    if (this.#inCallback) {
      // The caller may be that very callback: waiting for it would never end. What it
      // handles is persisted when it returns (see `finished`).
      await this.#acker?.flush();
      return;
    }
    await this.#stopped;
  }

  async #run(): Promise<void> {
    let outcome: Finished;
    try {
      outcome = await this.#loop();
    } catch (error) {
      // A bug, not a network condition: surface it rather than spin.
      const wrapped = new PosthornError("network", `posthorn-client stopped: ${describe(error)}`, {
        cause: error,
      });
      outcome = { state: "failed", reason: wrapped.message, error: wrapped };
    }
    if (this.#acker) {
      if (outcome.state === "closed") await this.#acker.flush();
      this.#acker.stop();
    }
    this.#setState(outcome.state, {
      url: this.#urls[0]!,
      reason: outcome.reason,
      ...(outcome.error ? { error: outcome.error } : {}),
    });
    this.#resolveFinished(outcome);
  }

  async #loop(): Promise<Finished> {
    const store = this.#options.cursorStore;
    if (store) {
      try {
        const stored = await store.get();
        this.#cursor = typeof stored === "string" && stored.trim() !== "" ? stored.trim() : null;
      } catch (cause) {
        const error = new PosthornError("cursor_store", `cannot read the cursor: ${describe(cause)}`, { cause });
        this.#report(error);
        return { state: "failed", reason: error.message, error };
      }
    }
    for (let attempt = 0; ; attempt++) {
      if (this.#closing) return { state: "closed", reason: "closed by the application" };
      const url = this.#urls[attempt % this.#urls.length]!;
      const ended = await this.#connectOnce(url);
      if (ended.kind === "closed" || this.#closing) {
        return { state: "closed", reason: "closed by the application" };
      }
      if (ended.kind === "final") {
        if (ended.error) this.#report(ended.error);
        return { state: ended.state, reason: ended.reason, ...(ended.error ? { error: ended.error } : {}) };
      }
      if (ended.error) this.#report(ended.error);
      let delayMs: number;
      if (ended.immediate && this.#immediateStreak === 0) {
        this.#immediateStreak += 1;
        delayMs = 0;
      } else {
        delayMs = this.#policy.nextDelay(ended.healthy, ended.retryAfterMs, this.#random);
      }
      this.#setState("reconnecting", {
        url,
        delayMs,
        reason: ended.reason,
        ...(ended.error ? { error: ended.error } : {}),
      });
      await this.#sleep(delayMs);
    }
  }

  #sleep(ms: number): Promise<void> {
    if (this.#closing) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = this.#clock.setTimeout(() => {
        this.#wakeSleep = null;
        resolve();
      }, ms);
      this.#wakeSleep = () => {
        this.#clock.clearTimeout(timer);
        this.#wakeSleep = null;
        resolve();
      };
    });
  }

  async #nextToken(): Promise<string | undefined> {
    const source = this.#options.token;
    if (source === undefined || source === null) return undefined;
    const token = typeof source === "function" ? await source() : source;
    if (typeof token !== "string" || token === "" || /[\r\n]/.test(token)) {
      throw new TypeError("the token source gave no usable token (an empty string, not a string, or one with a line break)");
    }
    return token;
  }

  async #connectOnce(url: string): Promise<Ended> {
    let token: string | undefined;
    try {
      token = await this.#nextToken();
    } catch (cause) {
      const error = new PosthornError("token", `cannot get a token: ${describe(cause)}`, { cause });
      return { kind: "retry", reason: error.message, error, healthy: false };
    }
    if (this.#closing) return { kind: "closed" };
    if (this.#refusedToken !== undefined && token === this.#refusedToken) {
      const error = new PosthornError(
        "unauthorized",
        "the hub refused the token with 401 and the token source has no other one",
        { status: 401 },
      );
      return { kind: "final", state: "failed", reason: error.message, error };
    }
    this.#refusedToken = undefined;
    this.#token = token;

    const resumedFrom = this.#cursor;
    this.#setState("connecting", { url, resumedFrom });
    const controller = new AbortController();
    this.#abort = controller;
    if (this.#closing) controller.abort();
    let dead = false;
    let watchdog: unknown;
    const stopWatchdog = () => {
      if (watchdog !== undefined) this.#clock.clearTimeout(watchdog);
      watchdog = undefined;
    };
    // Any byte, or the response head, re-arms it: silence is what it measures.
    const armWatchdog = () => {
      stopWatchdog();
      watchdog = this.#clock.setTimeout(() => {
        dead = true;
        controller.abort();
      }, this.#silenceMs);
    };
    const deadError = () =>
      new PosthornError(
        "dead",
        `no data for ${Math.round(this.#silenceMs / 1000)} s: connection presumed dead`,
      );

    const started = this.#clock.now();
    armWatchdog();
    let response: Response;
    try {
      response = await this.#fetch(this.#streamUrl(url), {
        method: "GET",
        headers: this.#headers(token, resumedFrom),
        // Instead of a `Cache-Control` request header, which a cross-origin request would have
        // to clear with the hub's CORS preflight.
        cache: "no-store",
        signal: controller.signal,
      });
    } catch (cause) {
      stopWatchdog();
      if (this.#closing) return { kind: "closed" };
      const error = dead
        ? new PosthornError("dead", `no answer within ${Math.round(this.#silenceMs / 1000)} s`)
        : new PosthornError("network", `cannot connect: ${describe(cause)}`, { cause });
      return { kind: "retry", reason: error.message, error, healthy: false };
    }

    if (response.status !== 200) {
      let body = "";
      try {
        body = (await response.text()).slice(0, MAX_ERROR_BODY);
      } catch {
        // The status alone decides.
      }
      stopWatchdog();
      if (this.#closing) return { kind: "closed" };
      return this.#refusal(response, body, token);
    }
    const contentType = response.headers.get("content-type") ?? "";
    if (!EVENT_STREAM.test(contentType) || response.body === null) {
      stopWatchdog();
      controller.abort();
      const error = new PosthornError(
        "content_type",
        `the answer is not an event stream (Content-Type: ${contentType || "none"})`,
        { status: 200 },
      );
      return { kind: "retry", reason: error.message, error, healthy: false };
    }
    armWatchdog();
    this.#setState("open", { url, resumedFrom });
    const result = await this.#read(response.body, controller, armWatchdog, stopWatchdog, url);
    stopWatchdog();
    if (this.#closing) return { kind: "closed" };
    if (result.final) return result.final;
    const lasted = this.#clock.now() - started;
    const longEnough = result.delivered > 0 || lasted >= HEALTHY_AFTER_MS;
    if (longEnough) this.#immediateStreak = 0;
    if (result.tokenExpired) {
      return { kind: "retry", reason: "the token expired", healthy: true, immediate: true };
    }
    if (result.callbackError) {
      return {
        kind: "retry",
        reason: result.callbackError.message,
        error: result.callbackError,
        healthy: longEnough,
      };
    }
    if (result.clean && !dead) {
      return { kind: "retry", reason: "the hub ended the stream", healthy: true };
    }
    const error = dead
      ? deadError()
      : new PosthornError("network", `the stream broke: ${describe(result.readError)}`, {
          cause: result.readError,
        });
    return { kind: "retry", reason: error.message, error, healthy: longEnough };
  }

  #refusal(response: Response, body: string, token: string | undefined): Ended {
    const status = response.status;
    const code = errorCode(body);
    if (status === 401 && code === "token_revoked") {
      const error = new PosthornError("revoked", "the hub refused the token: the device's tokens are revoked", {
        status,
        body,
      });
      return { kind: "final", state: "revoked", reason: error.message, error };
    }
    if (status === 401) {
      const error = new PosthornError("unauthorized", `the hub refused the token with 401: ${body}`, {
        status,
        body,
      });
      if (typeof this.#options.token !== "function") {
        return { kind: "final", state: "failed", reason: error.message, error };
      }
      this.#refusedToken = token;
      return { kind: "retry", reason: error.message, error, healthy: false, immediate: true };
    }
    if (status === 400 || status === 403 || status === 404) {
      const error = new PosthornError("refused", `the hub refused the stream with ${status}: ${body}`, {
        status,
        body,
      });
      return { kind: "final", state: "failed", reason: error.message, error };
    }
    const retryAfterMs = parseRetryAfter(response.headers.get("retry-after"), Date.now());
    const error = new PosthornError("status", `the hub answered ${status}: ${body}`, { status, body });
    return {
      kind: "retry",
      reason: error.message,
      error,
      healthy: false,
      ...(retryAfterMs === undefined ? {} : { retryAfterMs }),
    };
  }

  /**
   * Reads the body while a second loop hands events to the application, so that a slow
   * `onEvent` does not stop the socket from being read (the hub evicts clients that do not read)
   * and the watchdog measures the network's silence, not the application's. Reading pauses, and
   * the watchdog with it, once `maxBufferedEvents` wait.
   */
  async #read(
    body: ReadableStream<Uint8Array>,
    controller: AbortController,
    armWatchdog: () => void,
    stopWatchdog: () => void,
    url: string,
  ): Promise<{
    delivered: number;
    clean: boolean;
    readError?: unknown;
    tokenExpired?: boolean;
    callbackError?: PosthornError;
    final?: Ended;
  }> {
    const parser = new EventStreamParser();
    const queue: ParsedEvent[] = [];
    let ended: { clean: boolean; error?: unknown } | null = null;
    // Properties rather than variables: TypeScript does not see the closures assign them.
    const waiting: { wake: (() => void) | null; room: (() => void) | null } = { wake: null, room: null };
    const aborted = new Promise<void>((resolve) => {
      if (controller.signal.aborted) resolve();
      controller.signal.addEventListener("abort", () => resolve(), { once: true });
    });
    const reader = body.getReader();
    // A fetch aborts its body by itself; a body from elsewhere (a wrapped or fake fetch) may
    // not, and a read must never outlive its connection.
    void aborted.then(() => reader.cancel().catch(() => {}));

    const reading = (async () => {
      try {
        for (;;) {
          if (queue.length >= this.#maxBuffered) {
            stopWatchdog();
            await Promise.race([new Promise<void>((resolve) => (waiting.room = resolve)), aborted]);
            waiting.room = null;
            if (controller.signal.aborted) throw new Error("aborted");
            armWatchdog();
          }
          const { done, value } = await reader.read();
          if (done) {
            ended = controller.signal.aborted ? { clean: false, error: new Error("aborted") } : { clean: true };
            return;
          }
          armWatchdog();
          for (const parsed of parser.push(value)) {
            if (parsed.kind === "retry") this.#policy.retryMs = parsed.ms;
            else queue.push(parsed);
          }
          waiting.wake?.();
        }
      } catch (error) {
        ended = { clean: false, error };
      } finally {
        stopWatchdog();
        waiting.wake?.();
        reader.cancel().catch(() => {});
      }
    })();

    let delivered = 0;
    let outcome: { tokenExpired?: boolean; callbackError?: PosthornError; final?: Ended } = {};
    for (;;) {
      while (queue.length === 0 && ended === null) {
        await new Promise<void>((resolve) => (waiting.wake = resolve));
        waiting.wake = null;
      }
      if (this.#closing || queue.length === 0) break;
      const event = queue.shift()!;
      waiting.room?.();
      const step = await this.#handle(event, url);
      if (step === "delivered") delivered += 1;
      else if (step !== "resynced") {
        outcome = step;
        controller.abort();
        break;
      }
      if (this.#closing) break;
    }
    if (this.#closing) controller.abort();
    await reading;
    const end = ended as { clean: boolean; error?: unknown } | null;
    return {
      delivered,
      clean: end?.clean ?? false,
      ...(end?.error === undefined ? {} : { readError: end.error }),
      ...outcome,
    };
  }

  /** One dispatched event: a control event of the hub, a resync, or one for the application. */
  async #handle(
    event: ParsedEvent,
    url: string,
  ): Promise<"delivered" | "resynced" | { tokenExpired?: boolean; callbackError?: PosthornError; final?: Ended }> {
    // The hub's own notices carry no id; a published event always has one, so a producer's
    // event that happens to be called `revoked` still reaches the application.
    if (!event.hasOwnId && event.type === "token_expired") return { tokenExpired: true };
    if (!event.hasOwnId && event.type === "revoked") {
      const error = new PosthornError("revoked", "the hub revoked this device's tokens");
      return { final: { kind: "final", state: "revoked", reason: error.message, error } };
    }
    const resync = event.type === "resync";
    this.#inCallback = true;
    try {
      if (resync) {
        await this.#options.onResync?.(resyncReason(event.data), event.id);
      } else {
        await this.#options.onEvent?.({ id: event.id, type: event.type, data: event.data });
      }
    } catch (cause) {
      const what = resync ? "onResync" : "onEvent";
      return {
        callbackError: new PosthornError(
          "callback",
          `${what} failed for ${event.id}: ${describe(cause)}; it comes again after the reconnect`,
          { cause },
        ),
      };
    } finally {
      this.#inCallback = false;
    }
    if (event.id !== "") {
      const failed = await this.#persist(event.id, url);
      if (failed) return { final: failed };
    }
    return resync ? "resynced" : "delivered";
  }

  async #persist(cursor: string, url: string): Promise<Ended | null> {
    const store = this.#options.cursorStore;
    if (store) {
      try {
        await store.set(cursor);
      } catch (cause) {
        // Going on without a durable cursor would quietly turn at-least-once into at-most-once.
        const error = new PosthornError("cursor_store", `cannot store the cursor: ${describe(cause)}`, { cause });
        return { kind: "final", state: "failed", reason: error.message, error };
      }
    }
    this.#cursor = cursor;
    this.#acker?.persisted(cursor, `${url}/v1/devices/${this.#device}/ack`);
    return null;
  }

  #streamUrl(url: string): string {
    const groups = this.#options.groups;
    const query = groups && groups.length > 0 ? `?groups=${groups.join(",")}` : "";
    return `${url}/v1/devices/${this.#device}/events${query}`;
  }

  #headers(token: string | undefined, cursor: string | null): Record<string, string> {
    const headers: Record<string, string> = { Accept: "text/event-stream" };
    if (token !== undefined) headers["Authorization"] = `Bearer ${token}`;
    if (cursor !== null && !/[\r\n\0]/.test(cursor)) headers["Last-Event-ID"] = cursor;
    return headers;
  }

  #setState(state: ConnectionState, info: StateInfo): void {
    this.#state = state;
    try {
      this.#options.onStateChange?.(state, info);
    } catch {
      // A failing observer must not stop the connection loop.
    }
  }

  #report(error: PosthornError): void {
    try {
      this.#options.onError?.(error);
    } catch {
      // As above.
    }
  }
}

/** The `reason` of a resync's JSON, `unknown` if there is none; unknown fields are ignored. */
function resyncReason(data: string): ResyncReason {
  try {
    const parsed: unknown = JSON.parse(data);
    const reason = (parsed as { reason?: unknown } | null)?.reason;
    if (typeof reason === "string") return reason;
  } catch {
    // Not JSON.
  }
  return "unknown";
}
