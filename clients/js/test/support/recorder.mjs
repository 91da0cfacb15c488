// Collects what a subscription reports (states, events, resyncs, errors) and lets a test wait
// for the n-th occurrence of something, with a deadline so that a missing one fails the test
// instead of hanging it.

export class Recorder {
  states = [];
  events = [];
  resyncs = [];
  errors = [];
  #waiters = [];

  /** Options for `connect` that feed this recorder; `onEvent` may be wrapped by the caller. */
  callbacks() {
    return {
      onStateChange: (state, info) => this.#push(this.states, { state, ...info }),
      onEvent: (event) => this.#push(this.events, event),
      onResync: (reason, id) => this.#push(this.resyncs, { reason, id }),
      onError: (error) => this.#push(this.errors, error),
    };
  }

  record(list, item) {
    this.#push(list, item);
  }

  #push(list, item) {
    list.push(item);
    for (const waiter of [...this.#waiters]) waiter();
  }

  /**
   * Resolves once `predicate()` is true (checked on every report and every 10 ms, so it may
   * look at state outside the recorder); rejects after `timeoutMs` naming `what`.
   */
  until(predicate, what, timeoutMs = 15_000) {
    if (predicate()) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const check = () => {
        if (!predicate()) return;
        clearTimeout(timer);
        clearInterval(poll);
        this.#waiters = this.#waiters.filter((w) => w !== check);
        resolve();
      };
      const poll = setInterval(check, 10);
      const timer = setTimeout(() => {
        clearInterval(poll);
        this.#waiters = this.#waiters.filter((w) => w !== check);
        reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}; states: ${JSON.stringify(this.states.map((s) => [s.state, s.reason ?? s.delayMs ?? ""]))}`));
      }, timeoutMs);
      this.#waiters.push(check);
    });
  }

  /** Waits for the n-th (1-based) state `name`, counting from the start, and returns it. */
  async state(name, n = 1, timeoutMs) {
    const matching = () => this.states.filter((s) => s.state === name);
    await this.until(() => matching().length >= n, `state ${name} #${n}`, timeoutMs);
    return matching()[n - 1];
  }

  async eventCount(n, timeoutMs) {
    await this.until(() => this.events.length >= n, `${n} events (have ${this.events.length})`, timeoutMs);
  }
}

/** Lets the event loop run queued promise callbacks and I/O a few times. */
export function settle(rounds = 5) {
  let p = Promise.resolve();
  for (let i = 0; i < rounds; i++) p = p.then(() => new Promise((r) => setImmediate(r)));
  return p;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
