// An event-stream parser that follows the WHATWG "server-sent events" interpretation rules.
//
// It works on bytes, not on decoded text, because a network read can end in the middle of a
// multi-byte UTF-8 character or between the CR and the LF of one line end; lines are decoded
// whole, once complete. The hub itself writes a small subset (LF, `field: value`), but proxies
// and other servers may use everything the standard allows.

/** One event dispatched by a blank line. */
export interface ParsedEvent {
  kind: "event";
  /** The last event id in effect (the standard's "last event ID buffer"); `""` when none yet. */
  id: string;
  /** The `event:` field, or `message` when the block had none. */
  type: string;
  /** The `data:` lines joined with LF. */
  data: string;
  /**
   * Whether this block carried an `id:` field itself. Every event the hub publishes does; its
   * control events `token_expired` and `revoked` do not, which is how they are told apart from
   * business events a producer happened to give the same type.
   */
  hasOwnId: boolean;
}

/** A valid `retry:` field: the new reconnect delay, effective at once. */
export interface ParsedRetry {
  kind: "retry";
  ms: number;
}

export type Parsed = ParsedEvent | ParsedRetry;

const CR = 0x0d;
const LF = 0x0a;
const COLON = 0x3a;
const SPACE = 0x20;

export class EventStreamParser {
  // ignoreBOM keeps a U+FEFF that starts a later line; only the stream's first one is dropped.
  readonly #decoder = new TextDecoder("utf-8", { ignoreBOM: true });
  #partial: Uint8Array[] = [];
  #partialLength = 0;
  #afterCR = false;
  #started = false;
  #lastId = "";
  #type = "";
  #data = "";
  #ownId = false;

  /** Feeds the next bytes of the stream; returns what they completed, in order. */
  push(chunk: Uint8Array): Parsed[] {
    const out: Parsed[] = [];
    let start = 0;
    if (this.#afterCR && chunk.length > 0) {
      this.#afterCR = false;
      if (chunk[0] === LF) start = 1;
    }
    for (let i = start; i < chunk.length; i++) {
      const byte = chunk[i];
      if (byte !== CR && byte !== LF) continue;
      this.#line(this.#take(chunk.subarray(start, i)), out);
      if (byte === CR) {
        if (i + 1 < chunk.length) {
          if (chunk[i + 1] === LF) i++;
        } else {
          this.#afterCR = true;
        }
      }
      start = i + 1;
    }
    if (start < chunk.length) {
      // Copied: the caller may reuse its buffer for the next read.
      const rest = chunk.slice(start);
      this.#partial.push(rest);
      this.#partialLength += rest.length;
    }
    return out;
  }

  /** The bytes of the line that ends here: what was kept from earlier reads, then `tail`. */
  #take(tail: Uint8Array): Uint8Array {
    if (this.#partialLength === 0) return tail;
    const line = new Uint8Array(this.#partialLength + tail.length);
    let at = 0;
    for (const part of this.#partial) {
      line.set(part, at);
      at += part.length;
    }
    line.set(tail, at);
    this.#partial = [];
    this.#partialLength = 0;
    return line;
  }

  #line(bytes: Uint8Array, out: Parsed[]): void {
    let text = this.#decoder.decode(bytes);
    if (!this.#started) {
      // The BOM may have arrived split over reads, so it is taken off the first whole line.
      this.#started = true;
      if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
    }
    if (text.length === 0) {
      this.#dispatch(out);
      return;
    }
    if (text.charCodeAt(0) === COLON) return;
    const colon = text.indexOf(":");
    let name: string;
    let value: string;
    if (colon === -1) {
      name = text;
      value = "";
    } else {
      name = text.slice(0, colon);
      value = text.charCodeAt(colon + 1) === SPACE ? text.slice(colon + 2) : text.slice(colon + 1);
    }
    switch (name) {
      case "event":
        this.#type = value;
        break;
      case "data":
        this.#data += value + "\n";
        break;
      case "id":
        if (!value.includes("\0")) {
          this.#lastId = value;
          this.#ownId = true;
        }
        break;
      case "retry":
        if (/^[0-9]+$/.test(value)) out.push({ kind: "retry", ms: Number(value) });
        break;
      default:
        break;
    }
  }

  #dispatch(out: Parsed[]): void {
    const data = this.#data;
    const type = this.#type;
    const ownId = this.#ownId;
    this.#data = "";
    this.#type = "";
    this.#ownId = false;
    // No data line at all: nothing is dispatched (a `data` line with an empty value is data).
    if (data === "") return;
    out.push({
      kind: "event",
      id: this.#lastId,
      type: type === "" ? "message" : type,
      data: data.slice(0, -1),
      hasOwnId: ownId,
    });
  }
}
