// When to reconnect. The server's `retry:` is the base delay but never less than 1 s; after a
// healthy connection the wait is `retry` plus a random 0-100 % of it, so that the terminals of a
// pod that crashed do not all come back in the same instant; after consecutive failures the wait
// is drawn uniformly from [0, min(60 s, retry * 2^failures)] ("full jitter": terminals that
// failed together spread out instead of retrying in lock-step), then raised to the 1 s floor.
// A `Retry-After` is a minimum, even above the cap.

export const FLOOR_MS = 1_000;
export const CAP_MS = 60_000;
/** A connection that lasted this long, delivered an event, or was ended by the server, was healthy. */
export const HEALTHY_AFTER_MS = 10_000;
/** The hub's default `retry:` (`sse.retry_ms`), the base delay until a server sends its own. */
export const DEFAULT_RETRY_MS = 3_000;

export class ReconnectPolicy {
  #retryMs: number;
  #failures = 0;

  constructor(retryMs: number = DEFAULT_RETRY_MS) {
    this.#retryMs = retryMs;
  }

  /** The last `retry:` the server sent; it stays in effect across connections. */
  get retryMs(): number {
    return this.#retryMs;
  }

  set retryMs(ms: number) {
    this.#retryMs = ms;
  }

  /** Consecutive failed or unhealthy connections. */
  get failures(): number {
    return this.#failures;
  }

  /**
   * The wait before the next attempt after a connection ended. `random` returns a number in
   * [0, 1), drawn fresh for every attempt.
   */
  nextDelay(healthy: boolean, retryAfterMs: number | undefined, random: () => number): number {
    const base = Math.max(this.#retryMs, FLOOR_MS);
    let delay: number;
    if (healthy) {
      this.#failures = 0;
      delay = base + base * random();
    } else {
      this.#failures += 1;
      const ceiling = Math.min(CAP_MS, base * 2 ** Math.min(this.#failures, 16));
      delay = ceiling * random();
    }
    const floor = retryAfterMs ?? 0;
    delay = Math.max(delay, floor);
    return Math.round(Math.min(Math.max(delay, FLOOR_MS), Math.max(CAP_MS, floor)));
  }
}

/**
 * A `Retry-After` header in milliseconds: whole seconds (what the hub sends) or an HTTP date
 * (what some proxies send); `undefined` for anything else.
 */
export function parseRetryAfter(value: string | null, nowEpochMs: number): number | undefined {
  if (value === null) return undefined;
  const text = value.trim();
  if (/^[0-9]+$/.test(text)) return Number(text) * 1_000;
  const date = Date.parse(text);
  if (Number.isNaN(date)) return undefined;
  return Math.max(0, date - nowEpochMs);
}
