#!/usr/bin/env bash
# usage: [VIA=http] ROUNDS=3 abredis.sh label=BIN ... -- unicast 5,000/s x 100 B to 10,000 connections,
# published by XADD into a redis-server on 127.0.0.1:18082 (VIA=http: through the hub's publish API);
# a fresh hub per run (port 18080). VIA was added in the seventh run; its default is what ran here.
set -u
ulimit -n "$(ulimit -Hn)"
TOOL=${TOOL:-/tmp/exp/posthorn-new}; OUT=/tmp/exp/out; mkdir -p $OUT
redis-server --port 18082 --bind 127.0.0.1 --save '' --appendonly no > $OUT/redis.log 2>&1 &
rp=$!; sleep 0.5
for r in $(seq ${ROUNDS:-3}); do
  for spec in "$@"; do
    label=${spec%%=*}; bin=${spec#*=}
    redis-cli -p 18082 flushall > /dev/null
    POSTHORN_SERVER__LISTEN=127.0.0.1:18080 POSTHORN_BACKEND__KIND=redis POSTHORN_REDIS__URL=redis://127.0.0.1:18082 \
      $bin serve > $OUT/server.log 2>&1 &
    sp=$!
    for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/18080) 2>/dev/null && break; sleep 0.05; done
    sleep 0.3
    $TOOL loadtest fanout --mode unicast -n 10000 --rate 5000 --size 100 --duration 15s --publish-via ${VIA:-redis} \
      --redis 127.0.0.1:18082 --url http://127.0.0.1:18080 --pid $sp --time-limit 120s > $OUT/lt.txt 2>&1
    kill -TERM $sp; wait $sp 2>/dev/null
    tail -n1 $OUT/lt.txt | python3 -c "
import json,sys
r=json.loads(sys.stdin.readline()); c=r['cpu']; n=r['deliveries']['received']
print(json.dumps(dict(label='$label', via='${VIA:-redis}', lossless=r['lossless'], received=n, p50=r['latency']['p50_ms'], p99=r['latency']['p99_ms'], srv_pct=round(c['server_percent'],1), tool_pct=round(c['tool_percent'],1))))"
  done
done
kill $rp
