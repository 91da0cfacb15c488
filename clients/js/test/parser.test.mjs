// The event-stream parser against a corpus of every framing the WHATWG rules allow, each input
// fed whole, split in two at every byte position, and one byte at a time: the events and
// `retry:` values must come out the same however the network cut the bytes.

import assert from "node:assert/strict";
import test from "node:test";

import { EventStreamParser } from "../dist/index.js";

const bytes = (text) => new TextEncoder().encode(text);
const ev = (id, type, data, hasOwnId = true) => ({ kind: "event", id, type, data, hasOwnId });
const retry = (ms) => ({ kind: "retry", ms });

const corpus = [
  {
    name: "CR line ends (checklist: id a, type t, data x LF y)",
    input: "id: a\revent: t\rdata: x\rdata: y\r\r",
    expect: [ev("a", "t", "x\ny")],
  },
  {
    name: "CRLF line ends, one event, no early dispatch",
    input: "id: b\r\ndata: z\r\n\r\n",
    expect: [ev("b", "message", "z")],
  },
  {
    name: "LF, CR and CRLF mixed in one stream",
    input: "data: a\r\ndata: b\rdata: c\n\r\nid: 2\rdata: d\n\n",
    expect: [ev("", "message", "a\nb\nc", false), ev("2", "message", "d")],
  },
  {
    name: "a CR CR is two line ends, a CR LF one",
    input: "data: a\r\rdata: b\r\n\r\n",
    expect: [ev("", "message", "a", false), ev("", "message", "b", false)],
  },
  {
    name: "a leading BOM is dropped",
    input: "\uFEFFid: 1\ndata: x\n\n",
    expect: [ev("1", "message", "x")],
  },
  {
    name: "only the stream's first BOM is dropped: a later one is part of the field name",
    input: "\uFEFFdata: 1\n\n\uFEFFdata: 2\n\n",
    expect: [ev("", "message", "1", false)],
  },
  {
    name: "comments dispatch nothing; the hub's prelude sets retry",
    input: ": ping\n\nretry: 3000\n: posthorn\n\n",
    expect: [retry(3000)],
  },
  {
    name: "a comment inside an event does not end it",
    input: "data: a\n: between\ndata: b\n\n",
    expect: [ev("", "message", "a\nb", false)],
  },
  {
    name: "one space after the colon is dropped, and only one",
    input: "data:  two spaces\n\n",
    expect: [ev("", "message", " two spaces", false)],
  },
  {
    name: "no space after the colon",
    input: "id:7\nevent:t\ndata:x\n\n",
    expect: [ev("7", "t", "x")],
  },
  {
    name: "a colon inside the value is kept",
    input: "data: a:b: c\n\n",
    expect: [ev("", "message", "a:b: c", false)],
  },
  {
    name: "a field without a colon has an empty value: data alone is an empty data line",
    input: "data\n\n",
    expect: [ev("", "message", "", false)],
  },
  {
    name: "several valueless data lines and a valueless event name",
    input: "event\ndata\ndata\n\n",
    expect: [ev("", "message", "\n", false)],
  },
  {
    name: "a block without data dispatches nothing, but its id stays in effect",
    input: "id: 1\n\nevent: x\n\ndata: v\n\n",
    expect: [ev("1", "message", "v", false)],
  },
  {
    name: "an id containing NUL is ignored",
    input: "id: a\ndata: 1\n\nid: n\0l\ndata: 2\n\n",
    expect: [ev("a", "message", "1"), ev("a", "message", "2", false)],
  },
  {
    name: "an empty id resets the last event id",
    input: "id: a\ndata: 1\n\nid\ndata: 2\n\n",
    expect: [ev("a", "message", "1"), ev("", "message", "2")],
  },
  {
    name: "retry takes ASCII digits only",
    input: "retry: 12a\nretry: -5\nretry:\nretry:  5\nretry: 1.5\nretry: 7000\n\n",
    expect: [retry(7000)],
  },
  {
    name: "the event type is reset after every dispatch",
    input: "event: t\ndata: 1\n\ndata: 2\n\n",
    expect: [ev("", "t", "1", false), ev("", "message", "2", false)],
  },
  {
    name: "unknown fields and differently cased names are ignored",
    input: "foo: bar\nData: no\nEVENT: no\ndata: y\n\n",
    expect: [ev("", "message", "y", false)],
  },
  {
    name: "an event not ended by a blank line is not dispatched",
    input: "data: done\n\ndata: x\n",
    expect: [ev("", "message", "done", false)],
  },
  {
    name: "an unterminated last line is not a line",
    input: "data: x",
    expect: [],
  },
  {
    name: "multi-byte UTF-8 (2, 3 and 4 bytes) survives any split",
    input: "id: é\ndata: é€😀 ü\n\n",
    expect: [ev("é", "message", "é€😀 ü")],
  },
  {
    name: "invalid UTF-8 becomes U+FFFD",
    input: new Uint8Array([...bytes("data: a"), 0xff, 0xc3, ...bytes("b\n\n")]),
    expect: [ev("", "message", "a\uFFFD\uFFFDb", false)],
  },
  {
    name: "the hub's control events carry no id of their own",
    input: "id: k.1.5-0\nevent: order.paid\ndata: {}\n\nevent: token_expired\ndata: {\"exp\":1}\n\n",
    expect: [ev("k.1.5-0", "order.paid", "{}"), ev("k.1.5-0", "token_expired", "{\"exp\":1}", false)],
  },
  {
    name: "a whole hub session: prelude, resync, multi-line payload, heartbeat, drain retry",
    input:
      "retry: 3000\n: posthorn\n\nid: e.2.0-0\nevent: resync\ndata: {\"reason\":\"invalid\"}\n\n" +
      "id: e.2.1-0\nevent: note\ndata: line one\ndata: line two\ndata: \n\n: ping\n\nretry: 17000\n\n",
    expect: [
      retry(3000),
      ev("e.2.0-0", "resync", "{\"reason\":\"invalid\"}"),
      ev("e.2.1-0", "note", "line one\nline two\n"),
      retry(17000),
    ],
  },
];

function feed(chunks) {
  const parser = new EventStreamParser();
  const out = [];
  for (const chunk of chunks) out.push(...parser.push(chunk));
  return out;
}

for (const { name, input, expect } of corpus) {
  const all = typeof input === "string" ? bytes(input) : input;
  test(`parser: ${name}`, () => {
    assert.deepEqual(feed([all]), expect, "fed whole");
    for (let split = 0; split <= all.length; split++) {
      assert.deepEqual(feed([all.subarray(0, split), all.subarray(split)]), expect, `split at byte ${split}`);
    }
    assert.deepEqual(
      feed([...all].map((b) => new Uint8Array([b]))),
      expect,
      "one byte at a time",
    );
  });
}

// A reader may hand out the same buffer for every read: the parser must have copied what it
// keeps of an unfinished line.
test("parser: keeps its own copy of an unfinished line", () => {
  const parser = new EventStreamParser();
  const buffer = bytes("data: abc");
  assert.deepEqual(parser.push(buffer), []);
  buffer.fill(0x7a);
  assert.deepEqual(parser.push(bytes("\n\n")), [ev("", "message", "abc", false)]);
});
