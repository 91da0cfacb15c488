#!/usr/bin/env bash
# Resume storm through Redis, before and after bounded shared replays, alternating
# binaries, a fresh Redis and hub per run:
#   BEFORE=/tmp/posthorn-before AFTER=/tmp/posthorn-after ROUNDS=2 docs/bench/2026-12-02-resume/run.sh
# 10,000 devices take a cursor, are away 60 s while 5,000 unicast events/s go into Redis (XADD, as
# an external producer), then reconnect at once. The load tool is always AFTER's (the `resume`
# scenario); only the hub differs. Writes one JSON line per run to results.jsonl beside this file.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ulimit -n "$(ulimit -Hn)"
N="${N:-10000}" RATE="${RATE:-5000}" AWAY="${AWAY:-60s}" ROUNDS="${ROUNDS:-2}"
run() {
    local label=$1 binary=$2 redis_port hub_port redis_pid hub_pid
    redis_port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
    hub_port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
    redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
        --logfile "/tmp/resume-redis-$label.log" &
    redis_pid=$!
    sleep 0.5
    POSTHORN_BACKEND__KIND=redis POSTHORN_REDIS__URL="redis://127.0.0.1:$redis_port" \
        RUST_LOG=warn "$binary" serve --listen "127.0.0.1:$hub_port" 2>"/tmp/resume-hub-$label.log" &
    hub_pid=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$hub_port/readyz" >/dev/null && break; sleep 0.1; done
    "$AFTER" loadtest resume --url "http://127.0.0.1:$hub_port" -n "$N" --rate "$RATE" --away "$AWAY" \
        --publish-via redis --redis "127.0.0.1:$redis_port" --pid "$hub_pid" --time-limit 420s \
        | tee "/tmp/resume-$label.txt"
    tail -1 "/tmp/resume-$label.txt" | python3 -c "import json,sys; r=json.load(sys.stdin); r['hub']='$label'; print(json.dumps(r))" >> "$here/results.jsonl"
    kill "$hub_pid" "$redis_pid"; wait "$hub_pid" "$redis_pid" 2>/dev/null || true
}
for round in $(seq "$ROUNDS"); do
    run "before-$round" "$BEFORE"
    run "after-$round" "$AFTER"
done
