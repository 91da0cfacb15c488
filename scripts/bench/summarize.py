#!/usr/bin/env python3
"""Turns scripts/bench/compare's results.jsonl into a markdown summary with posthorn/nchan ratios,
and posthorn/floor ratios where the bare floor server (benches/sse_floor.rs) was measured."""
import json
import sys


def load(path):
    runs = {}
    with open(path) as lines:
        for line in lines:
            line = line.strip()
            if line:
                record = json.loads(line)
                runs[(record["label"], record["peer"])] = record["result"]
    return runs


def ratio(a, b):
    if a is None or b in (None, 0):
        return "-"
    return f"{a / b:.2f}"


def num(value, digits=0):
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def main(path):
    runs = load(path)
    get = lambda label, peer: runs.get((label, peer))
    rows = []

    def row(name, label, pick, digits=0, better="higher"):
        p, n, f = get(label, "posthorn"), get(label, "nchan"), get(label, "floor")
        pv = pick(p) if p else None
        nv = pick(n) if n else None
        fv = pick(f) if f else None
        rows.append((name, num(pv, digits), num(nv, digits), ratio(pv, nv), num(fv, digits), ratio(pv, fv), better))

    row("bytes per idle connection (PSS)", "idle", lambda r: r["bytes_per_connection"], better="lower")
    row("connections accepted/s while opening (500 in flight)", "idle", lambda r: r["connects_per_second"])
    row("reconnect storm: accepted/s (all at once, with cursor)", "storm", lambda r: r["accepted_per_second"])
    row("broadcast 1/s to all: p50 ms", "broadcast-1ps", lambda r: r["latency"]["p50_ms"], 2, "lower")
    row("broadcast 1/s to all: p99 ms", "broadcast-1ps", lambda r: r["latency"]["p99_ms"], 2, "lower")
    for peer in ("posthorn", "nchan"):
        best = None
        for (label, who), result in runs.items():
            if who == peer and label.startswith("ladder-") and result.get("lossless"):
                deliveries = result["deliveries"]["distinct"] / max(result["published"]["seconds"], 1e-3)
                if best is None or result["rate"] > best[0]:
                    best = (result["rate"], deliveries, result["latency"]["p99_ms"])
        runs[("ladder-best", peer)] = {"best": best}
    row("highest lossless broadcast deliveries/s", "ladder-best",
        lambda r: r["best"][1] if r["best"] else None)
    for rate, size in ((1000, 100), (5000, 100), (10000, 100), (5000, 1024)):
        label = f"unicast-{rate}x{size}"
        row(f"unicast {rate}/s x {size} B (HTTP publish): p50 ms", label, lambda r: r["latency"]["p50_ms"], 2, "lower")
        row(f"unicast {rate}/s x {size} B (HTTP publish): p99 ms", label, lambda r: r["latency"]["p99_ms"], 2, "lower")
        row(f"unicast {rate}/s x {size} B: delivered/s", label, lambda r: r["delivered_per_second"])
        row(f"unicast {rate}/s x {size} B: lost", label, lambda r: r["deliveries"]["lost"], 0, "lower")
    row("slow 10%: never-reading clients closed by the server", "slow", lambda r: r["evicted"])
    row("slow 10%: last eviction, s after start", "slow", lambda r: r["eviction_last_s"], 2, "lower")
    row("slow 10%: healthy clients lost", "slow", lambda r: r["healthy"]["lost"], 0, "lower")
    row("slow 10%: server memory growth KiB", "slow",
        lambda r: (r["memory_peak"]["rss_kib"] - r["memory_before"]["rss_kib"]) if r.get("memory_peak") and r.get("memory_before") else None,
        0, "lower")

    # TLS: the mean of the alternating rounds of each peer.
    for peer in ("posthorn", "nchan"):
        rounds = [result for (label, who), result in runs.items()
                  if who == peer and label.startswith("tls-storm-")]
        if rounds:
            mean = lambda pick: (sum(pick(r) for r in rounds) / len(rounds)
                                 if all(pick(r) is not None for r in rounds) else None)
            runs[("tls-storm", peer)] = {
                "rounds": len(rounds),
                "accepted_per_second": mean(lambda r: r["accepted_per_second"]),
                "server_cpu_ms_per_accept": mean(lambda r: r.get("server_cpu_ms_per_accept")),
                "p99_ms": mean(lambda r: r["time_to_accept"]["p99_ms"]),
                "tls": rounds[0].get("tls"),
            }
    row("TLS reconnect storm: accepted/s (mean of rounds)", "tls-storm", lambda r: r["accepted_per_second"])
    row("TLS reconnect storm: server CPU ms per handshake", "tls-storm",
        lambda r: r["server_cpu_ms_per_accept"], 3, "lower")
    row("TLS reconnect storm: time to accept p99 ms", "tls-storm", lambda r: r["p99_ms"], 1, "lower")
    row("bytes per idle TLS connection (PSS)", "tls-idle", lambda r: r["bytes_per_connection"], better="lower")

    print("| measurement | posthorn | nchan | posthorn/nchan | floor | posthorn/floor | better |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, p, n, r, f, rf, better in rows:
        print(f"| {name} | {p} | {n} | {r} | {f} | {rf} | {better} |")

    extra = []
    for label in ("redis-redis-1000", "redis-http-1000", "nats-http-1000",
                  "redis-redis-5000", "redis-http-5000", "nats-http-5000"):
        r = get(label, "posthorn")
        if r:
            extra.append(f"- {label} (unicast {r['rate']:.0f}/s, {r['connections']} connections): "
                         f"p50 {r['latency']['p50_ms']:.2f} ms, p99 {r['latency']['p99_ms']:.2f} ms, "
                         f"lost {r['deliveries']['lost']}, lossless {r['lossless']}")
    r = get("idle-fill", "posthorn")
    if r:
        extra.append(f"- {r['fill']} events of {r['size']} B waiting per connection: "
                     f"{num(r['bytes_per_connection_full'])} bytes per connection; still open {r['open_after_fill']}")
    r = get("drain", "posthorn")
    if r:
        extra.append(f"- drain of {r['connections']}: last close {r['last_close_s']:.2f} s, exit {r['exit_s']}, "
                     f"{r['closes_per_second']:.0f} closes/s, at most {r['reconnect_peak_per_second']} reconnects in one second")
    for peer in ("posthorn", "nchan"):
        best = runs[("ladder-best", peer)]["best"]
        if best:
            extra.append(f"- {peer}: highest lossless broadcast rate {best[0]}/s (p99 {best[2]:.1f} ms)")
    for peer in ("posthorn", "nchan"):
        r = get("tls-storm", peer)
        if r:
            extra.append(f"- {peer}: TLS storm over {r['rounds']} rounds, negotiated {r['tls']}")
    if extra:
        print()
        print("\n".join(extra))


if __name__ == "__main__":
    main(sys.argv[1])
