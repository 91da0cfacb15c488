// A clock whose time moves only when a test says so, so that reconnect delays, the watchdog and
// the ack interval can be checked exactly and without waiting.

export class FakeClock {
  #now = 0;
  #sequence = 0;
  #timers = new Map();

  now() {
    return this.#now;
  }

  setTimeout(callback, ms) {
    const id = ++this.#sequence;
    this.#timers.set(id, { at: this.#now + Math.max(0, ms), callback });
    return id;
  }

  clearTimeout(id) {
    this.#timers.delete(id);
  }

  /** The delays of the timers now pending, from now, in ascending order. */
  pending() {
    return [...this.#timers.values()].map((t) => t.at - this.#now).sort((a, b) => a - b);
  }

  /** Moves time forward by `ms`, firing every timer that falls due on the way, in order. */
  advance(ms) {
    const target = this.#now + ms;
    for (;;) {
      let next = null;
      for (const [id, timer] of this.#timers) {
        if (timer.at <= target && (next === null || timer.at < next[1].at)) next = [id, timer];
      }
      if (next === null) break;
      this.#timers.delete(next[0]);
      this.#now = next[1].at;
      next[1].callback();
    }
    this.#now = target;
  }
}

/** A seeded generator of numbers in [0, 1) (mulberry32), for jitter that tests can repeat. */
export function seededRandom(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
