#!/usr/bin/env python3
"""Append events for posthorn directly to its Redis streams (an "external producer").

The format is described in docs/stream-format.md. Python 3.8+, standard library only: the
script speaks RESP over a plain socket (or TLS for rediss://), so it runs anywhere.

    # one event for one device
    produce.py --url redis://127.0.0.1:6379 --device pos-17 --type order.paid \
        --data '{"order":"A-1001","total":"12.50"}'

    # one copy with dev=* on every shard: every connected device receives it once
    produce.py --broadcast --type price.update --data '{"table":"2026-12"}'

    # one event per line of stdin
    printf 'a\nb\n' | produce.py --device pos-17 --each-line

    # not delivered after 10 minutes; on replay only the newest "prices" of the target is sent
    produce.py --broadcast --type price.table --data '{"v":42}' --ttl 10m --supersede prices

    # where would it go? (no connection; prints the commands)
    produce.py --device pos-17 --data x --dry-run

Use the same --shards / --prefix / --cluster / --groups / --urls as the hub's [redis] section,
otherwise events land on streams no device reads. Every XADD trims by age (MINID ~, like the hub);
after the run each stream written is also capped by length (XTRIM MAXLEN ~).

--ttl writes the field `exp` (this machine's clock now + ttl, Unix ms): from then on the hub
neither delivers nor replays the event. --supersede writes `sup`; but only the hub's own appends
record which event of a name is the newest, so the versions written here are all replayed until a
newer version of the name is published through POST /v1/events (docs/stream-format.md, section 2).

Idempotency keys are NOT supported here on purpose: the hub only deduplicates events published
through its HTTP API (POST /v1/events). A `key` field written with a plain XADD is ignored.
"""

import argparse
import os
import re
import socket
import ssl
import sys
import time
import zlib
from urllib.parse import unquote, urlparse

IDENT = re.compile(r"[A-Za-z0-9._:-]+\Z")
MAX_DEVICE_LEN = 128
MAX_TYPE_LEN = 64


class RedisError(Exception):
    pass


class Connection:
    """A minimal RESP2 client: enough for AUTH, SELECT, XADD and XTRIM."""

    def __init__(self, url):
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss"):
            raise SystemExit(f"produce.py: unsupported URL scheme in {url!r} (redis:// or rediss://)")
        host = parsed.hostname or "127.0.0.1"
        port = parsed.port or 6379
        sock = socket.create_connection((host, port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if parsed.scheme == "rediss":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self.reader = sock.makefile("rb")
        if parsed.password is not None:
            user = unquote(parsed.username) if parsed.username else None
            password = unquote(parsed.password)
            self.call("AUTH", *([user, password] if user else [password]))
        db = parsed.path.lstrip("/")
        if db and db != "0":
            self.call("SELECT", db)

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode("utf-8")
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
        self.sock.sendall(b"".join(out))
        reply = self._read()
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def _read(self):
        line = self.reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed by the server")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = self.reader.read(size + 2)
            return data[:-2].decode("utf-8", "replace")
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self._read() for _ in range(size)]
        raise RedisError(f"unexpected reply {line!r}")


class Producer:
    def __init__(self, args):
        self.args = args
        self.connections = {}
        self.touched = []
        urls = [u.strip() for u in args.urls.split(",") if u.strip()] if args.urls else []
        if urls and args.cluster:
            raise SystemExit("produce.py: --urls and --cluster exclude each other (as in the hub)")
        self.urls = urls
        # Node groups: --groups in cluster mode, one per instance with --urls, else one.
        self.groups = args.groups if args.cluster else max(len(urls), 1)
        if not 1 <= self.groups <= args.shards:
            raise SystemExit("produce.py: --groups must be between 1 and --shards")

    # --- layout (src/model/shard.rs, src/backend/redis/layout.rs) --------------------------

    def shard_of(self, device):
        return zlib.crc32(device.encode("utf-8")) % self.args.shards

    def group_of(self, shard):
        return shard * self.groups // self.args.shards

    def stream_key(self, shard):
        if self.args.cluster:
            return f"{self.args.prefix}:{{g{self.group_of(shard)}}}:{shard}"
        return f"{self.args.prefix}:{shard}"

    def url_of(self, shard):
        return self.urls[self.group_of(shard)] if self.urls else self.args.url

    # --- commands --------------------------------------------------------------------------

    def connection(self, url):
        if url not in self.connections:
            self.connections[url] = Connection(url)
        return self.connections[url]

    def call(self, url, *command):
        if self.args.dry_run:
            print(" ".join(_quote(part) for part in command), f"# {url}")
            return "(dry run)"
        # Redis Cluster: follow MOVED / ASK redirections from the seed node to the slot's owner.
        for _ in range(5):
            try:
                return self.connection(url).call(*command)
            except RedisError as error:
                words = str(error).split()
                if len(words) == 3 and words[0] in ("MOVED", "ASK"):
                    scheme = urlparse(url).scheme
                    netloc = urlparse(url).netloc.rpartition("@")
                    auth = netloc[0] + "@" if netloc[1] else ""
                    url = f"{scheme}://{auth}{words[2]}"
                    if words[0] == "ASK":
                        self.connection(url).call("ASKING")
                    continue
                raise
        raise RedisError("too many cluster redirections")

    def append(self, shard, dev, event_type, data):
        key = self.stream_key(shard)
        now_ms = int(time.time() * 1000)
        minid = now_ms - self.args.retention_ms
        fields = ["dev", dev]
        if event_type:
            fields += ["type", event_type]
        fields += ["data", data]
        if self.args.ttl_ms is not None:
            fields += ["exp", now_ms + self.args.ttl_ms]
        if self.args.supersede:
            fields += ["sup", self.args.supersede]
        entry_id = self.call(self.url_of(shard), "XADD", key, "MINID", "~", minid, "*", *fields)
        if (shard, key) not in self.touched:
            self.touched.append((shard, key))
        return key, entry_id

    def cap_lengths(self):
        for shard, key in self.touched:
            self.call(self.url_of(shard), "XTRIM", key, "MAXLEN", "~", self.args.max_len)


def _quote(part):
    text = str(part)
    if text and re.fullmatch(r"[A-Za-z0-9._:/{}-]+", text):
        return text
    return "'" + text.replace("'", "'\\''") + "'"


def parse_duration_ms(text):
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 250ms, 20s, 15m, 1h")
    value, unit = int(match.group(1)), match.group(2)
    return value * {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}[unit]


def check_ident(name, text, max_len):
    if not IDENT.match(text) or len(text) > max_len:
        raise SystemExit(
            f"produce.py: invalid {name} {text!r}: 1-{max_len} characters of [A-Za-z0-9._:-]"
            " (the hub would skip the entry)"
        )


def main():
    p = argparse.ArgumentParser(
        description="Append posthorn events directly to Redis (see docs/stream-format.md).")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--device", help="device id (1-128 characters of [A-Za-z0-9._:-])")
    target.add_argument("--broadcast", action="store_true",
                        help="append one dev=* copy to every shard")
    p.add_argument("--type", dest="event_type", default=None,
                   help="event type (1-64 characters of [A-Za-z0-9._:-]); omitted = message")
    payload = p.add_mutually_exclusive_group(required=True)
    payload.add_argument("--data", help="payload text (UTF-8; line breaks allowed)")
    payload.add_argument("--each-line", action="store_true",
                         help="read stdin; every line is the payload of one event")
    p.add_argument("--ttl", dest="ttl_ms", type=parse_duration_ms, default=None,
                   help="time to live (250ms, 20s, 15m, 1h): writes exp = now + ttl in Unix ms")
    p.add_argument("--supersede", default=None,
                   help="supersede name (the rules of --type): writes sup")
    p.add_argument("--url", default=os.environ.get("POSTHORN_REDIS__URL", "redis://127.0.0.1:6379"),
                   help="redis:// or rediss:// URL; a seed node with --cluster "
                        "(default: $POSTHORN_REDIS__URL or redis://127.0.0.1:6379)")
    p.add_argument("--urls", default=os.environ.get("POSTHORN_REDIS__URLS", ""),
                   help="comma-separated standalone instances, like redis.urls")
    p.add_argument("--cluster", action="store_true", help="Redis Cluster keys, like redis.cluster")
    p.add_argument("--groups", type=int, default=int(os.environ.get("POSTHORN_REDIS__GROUPS", "1")),
                   help="node groups in cluster mode (redis.groups, default 1)")
    p.add_argument("--shards", type=int, default=int(os.environ.get("POSTHORN_REDIS__SHARDS", "64")),
                   help="redis.shards (default 64)")
    p.add_argument("--prefix", default=os.environ.get("POSTHORN_REDIS__PREFIX", "pos-ev"),
                   help="redis.prefix (default pos-ev)")
    p.add_argument("--retention", dest="retention_ms", type=parse_duration_ms,
                   default=os.environ.get("POSTHORN_REDIS__RETENTION", "15m"),
                   help="redis.retention: XADD trims entries older than this (default 15m)")
    p.add_argument("--max-len", type=int,
                   default=int(os.environ.get("POSTHORN_REDIS__MAX_LEN", "100000")),
                   help="redis.max_len: length cap applied after the run (default 100000)")
    p.add_argument("--max-bytes", type=int, default=65536,
                   help="refuse payloads larger than this (limits.max_event_bytes, default 65536)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands instead of sending them")
    args = p.parse_args()
    if args.shards < 1:
        raise SystemExit("produce.py: --shards must be at least 1")

    if args.device is not None:
        check_ident("device id", args.device, MAX_DEVICE_LEN)
    if args.event_type is not None:
        check_ident("event type", args.event_type, MAX_TYPE_LEN)
    if args.supersede is not None:
        check_ident("supersede name", args.supersede, MAX_TYPE_LEN)
    if args.ttl_ms == 0:
        raise SystemExit("produce.py: --ttl must be above zero")

    if args.each_line:
        try:
            payloads = [line.rstrip("\r\n") for line in sys.stdin]
        except UnicodeDecodeError:
            raise SystemExit("produce.py: stdin is not valid UTF-8 (the hub would skip it)")
    else:
        payloads = [args.data]
    for text in payloads:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise SystemExit("produce.py: the payload is not valid UTF-8 (the hub would skip it)")
        if size > args.max_bytes:
            raise SystemExit(f"produce.py: payload of {size} bytes exceeds --max-bytes {args.max_bytes}")

    producer = Producer(args)
    try:
        for text in payloads:
            if args.broadcast:
                ids = [producer.append(shard, "*", args.event_type, text)
                       for shard in range(args.shards)]
                print(f"broadcast: {len(ids)} copies, {ids[0][0]} {ids[0][1]} .. {ids[-1][0]} {ids[-1][1]}")
            else:
                shard = producer.shard_of(args.device)
                key, entry_id = producer.append(shard, args.device, args.event_type, text)
                print(f"shard={shard} key={key} id={entry_id}")
        producer.cap_lengths()
    except (OSError, RedisError) as error:
        raise SystemExit(f"produce.py: redis: {error}")


if __name__ == "__main__":
    main()
