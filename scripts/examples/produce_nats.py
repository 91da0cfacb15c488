#!/usr/bin/env python3
"""Publish events for posthorn directly to its NATS JetStream stream (an "external producer").

The format is described in docs/stream-format.md (section "NATS JetStream"). Needs Python 3.8+
and nats-py (`pip install nats-py`).

    # one event for one device
    produce_nats.py --url nats://127.0.0.1:4222 --device pos-17 --type order.paid \
        --data '{"order":"A-1001","total":"12.50"}' --key order-A-1001-paid

    # one copy with Posthorn-Dev: * on every shard: every connected device receives it once
    produce_nats.py --broadcast --type price.update --data '{"table":"2026-12"}'

    # not delivered after 10 minutes (Posthorn-Exp), with a supersede name (Posthorn-Supersede)
    produce_nats.py --device pos-17 --type print.receipt --data 'receipt 42' --ttl 10m \
        --supersede receipt

Use the same --shards / --subject-prefix as the hub's [nats] section, otherwise events land on
subjects no device reads. With --key, JetStream drops a repeat within the stream's duplicate
window (publish.dedupe_window) and answers with the original sequence; the message id has the
form the hub uses (d/<device>/<key>, b/<shard>/<key>), so it also deduplicates against the same
key published through POST /v1/events.

--ttl writes Posthorn-Exp (this machine's clock now + ttl, Unix ms): from then on the hub neither
delivers nor replays the event. --supersede writes Posthorn-Supersede; only the hub's own publishes
record which event of a name is the newest, so the versions written here are all replayed until a
newer one of the name is published through POST /v1/events (docs/stream-format.md, section 9).
"""

import argparse
import asyncio
import os
import re
import sys
import time
import zlib

import nats

IDENT = re.compile(r"[A-Za-z0-9._:-]+\Z")


def check(name, value, longest):
    if not (len(value) <= longest and IDENT.match(value)):
        sys.exit(f"produce_nats.py: invalid {name} {value!r}: 1-{longest} characters of "
                 "[A-Za-z0-9._:-] (the hub would skip the message)")


async def publish(args):
    nc = await nats.connect(args.url)
    js = nc.jetstream()
    if args.broadcast:
        copies = [(shard, "*") for shard in range(args.shards)]
    else:
        copies = [(zlib.crc32(args.device.encode("utf-8")) % args.shards, args.device)]
    for shard, dev in copies:
        headers = {"Posthorn-Dev": dev, "Posthorn-Type": args.type}
        if args.ttl_ms is not None:
            headers["Posthorn-Exp"] = str(int(time.time() * 1000) + args.ttl_ms)
        if args.supersede:
            headers["Posthorn-Supersede"] = args.supersede
        if args.key:
            # The hub's own message ids (docs/stream-format.md): scoped to the target, one per
            # broadcast copy, so a repeat here and a retry through POST /v1/events are one event.
            headers["Nats-Msg-Id"] = f"b/{shard}/{args.key}" if args.broadcast else f"d/{dev}/{args.key}"
        subject = f"{args.subject_prefix}.{shard}"
        ack = await js.publish(subject, args.data.encode("utf-8"), headers=headers)
        if not args.broadcast:
            print(f"subject={subject} seq={ack.seq} duplicate={str(bool(ack.duplicate)).lower()}")
    if args.broadcast:
        print(f"broadcast: {len(copies)} copies, {args.subject_prefix}.0 .. "
              f"{args.subject_prefix}.{args.shards - 1}")
    await nc.close()


def duration_ms(text):
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text.strip())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above zero like 250ms, 20s, 15m, 1h")
    return int(match.group(1)) * {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}[match.group(2)]


def main():
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--device", help="device id")
    target.add_argument("--broadcast", action="store_true", help="one copy per shard, to every device")
    parser.add_argument("--type", default="message", help="event type (default: message)")
    parser.add_argument("--data", required=True, help="payload (UTF-8 text)")
    parser.add_argument("--key", help="idempotency key (Nats-Msg-Id)")
    parser.add_argument("--ttl", dest="ttl_ms", type=duration_ms,
                        help="time to live (250ms, 20s, 15m, 1h): Posthorn-Exp = now + ttl")
    parser.add_argument("--supersede", help="supersede name (Posthorn-Supersede)")
    parser.add_argument("--url", default=env("POSTHORN_NATS__URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--subject-prefix",
                        default=env("POSTHORN_NATS__SUBJECT_PREFIX", "posthorn.ev"))
    parser.add_argument("--shards", type=int, default=int(env("POSTHORN_NATS__SHARDS", "64")))
    args = parser.parse_args()
    if args.device is not None:
        check("device id", args.device, 128)
    check("type", args.type, 64)
    if args.supersede is not None:
        check("supersede name", args.supersede, 64)
    asyncio.run(publish(args))


if __name__ == "__main__":
    main()
