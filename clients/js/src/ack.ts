// Acknowledgements: once a cursor is persisted, the hub is told (`POST /v1/devices/{device}/ack`)
// that the device has processed everything up to it, so a back office can see which terminals
// applied an event. At most one a second, the newest cursor only: an ack covers everything
// before it. A failed ack is not retried on its own (the next cursor's ack covers it); a hub whose
// fleet API is off (404 `fleet_disabled`) is not asked again.

import type { Clock } from "./clock.js";
import { PosthornError } from "./errors.js";

export const ACK_INTERVAL_MS = 1_000;
/** An ack that has not been answered by then is abandoned; the next one covers it. */
export const ACK_TIMEOUT_MS = 5_000;

export interface AckerOptions {
  fetch: typeof globalThis.fetch;
  clock: Clock;
  /** The current bearer token (the stream's), or undefined without one. */
  token: () => string | undefined;
  onError: (error: PosthornError) => void;
}

export class Acker {
  readonly #options: AckerOptions;
  #newest: { cursor: string; url: string } | null = null;
  #sent: string | null = null;
  #lastSendAt = Number.NEGATIVE_INFINITY;
  #timer: unknown = undefined;
  #inFlight: Promise<void> | null = null;
  #disabled = false;
  #stopped = false;

  constructor(options: AckerOptions) {
    this.#options = options;
  }

  /** `cursor` is persisted; `url` is the ack endpoint of the hub it came from. */
  persisted(cursor: string, url: string): void {
    this.#newest = { cursor, url };
    this.#schedule();
  }

  /**
   * Sends the newest cursor if it has not been sent yet, keeping to the interval, and waits
   * for every ack in flight. Used when the subscription closes, so its last second is not lost.
   */
  async flush(): Promise<void> {
    if (this.#inFlight) await this.#inFlight;
    if (this.#disabled || this.#newest === null || this.#newest.cursor === this.#sent) return;
    this.#clearTimer();
    const wait = this.#lastSendAt + ACK_INTERVAL_MS - this.#options.clock.now();
    if (wait > 0) {
      await new Promise<void>((resolve) => {
        this.#timer = this.#options.clock.setTimeout(resolve, wait);
      });
      this.#timer = undefined;
    }
    if (this.#inFlight) await this.#inFlight;
    if (this.#newest.cursor !== this.#sent) await this.#send();
  }

  /** No ack is sent after this (pending ones are dropped). */
  stop(): void {
    this.#stopped = true;
    this.#clearTimer();
  }

  #clearTimer(): void {
    if (this.#timer !== undefined) {
      this.#options.clock.clearTimeout(this.#timer);
      this.#timer = undefined;
    }
  }

  #schedule(): void {
    if (this.#stopped || this.#disabled || this.#timer !== undefined || this.#inFlight) return;
    if (this.#newest === null || this.#newest.cursor === this.#sent) return;
    const wait = this.#lastSendAt + ACK_INTERVAL_MS - this.#options.clock.now();
    if (wait <= 0) {
      void this.#send();
    } else {
      this.#timer = this.#options.clock.setTimeout(() => {
        this.#timer = undefined;
        this.#schedule();
      }, wait);
    }
  }

  #send(): Promise<void> {
    const target = this.#newest!;
    this.#lastSendAt = this.#options.clock.now();
    this.#sent = target.cursor;
    const sending = this.#post(target.cursor, target.url).finally(() => {
      this.#inFlight = null;
      this.#schedule();
    });
    this.#inFlight = sending;
    return sending;
  }

  async #post(cursor: string, url: string): Promise<void> {
    const { fetch, clock, token, onError } = this.#options;
    const controller = new AbortController();
    const timer = clock.setTimeout(() => controller.abort(), ACK_TIMEOUT_MS);
    try {
      const headers: Record<string, string> = { "Content-Type": "application/json" };
      const bearer = token();
      if (bearer !== undefined) headers["Authorization"] = `Bearer ${bearer}`;
      const response = await fetch(url, {
        method: "POST",
        headers,
        body: JSON.stringify({ id: cursor }),
        signal: controller.signal,
      });
      const body = await response.text();
      if (response.status === 404 && errorCode(body) === "fleet_disabled") {
        this.#disabled = true;
        return;
      }
      if (response.status >= 300) {
        onError(
          new PosthornError("ack", `the hub answered the ack with ${response.status}: ${body}`, {
            status: response.status,
            body,
          }),
        );
      }
    } catch (error) {
      onError(new PosthornError("ack", `the ack failed: ${describe(error)}`, { cause: error }));
    } finally {
      clock.clearTimeout(timer);
    }
  }
}

/** The `error` code of a JSON error body, if it is one. */
export function errorCode(body: string): string | undefined {
  try {
    const parsed: unknown = JSON.parse(body);
    if (parsed !== null && typeof parsed === "object") {
      const code = (parsed as { error?: unknown }).error;
      if (typeof code === "string") return code;
    }
  } catch {
    // Not JSON (a proxy's page): no code.
  }
  return undefined;
}

export function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = (error as { cause?: unknown }).cause;
    return cause instanceof Error ? `${error.message} (${cause.message})` : error.message;
  }
  return String(error);
}
