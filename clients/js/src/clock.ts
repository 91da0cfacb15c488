// Time as the client sees it, replaceable so that tests can drive reconnect delays, the
// watchdog and the ack interval without waiting for them.

export interface Clock {
  /** Milliseconds on a monotonic scale (only differences are used). */
  now(): number;
  setTimeout(callback: () => void, ms: number): unknown;
  clearTimeout(handle: unknown): void;
}

export const systemClock: Clock = {
  now: () => globalThis.performance?.now() ?? Date.now(),
  setTimeout: (callback, ms) => globalThis.setTimeout(callback, ms),
  clearTimeout: (handle) => globalThis.clearTimeout(handle as ReturnType<typeof setTimeout>),
};
