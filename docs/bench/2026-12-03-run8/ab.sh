#!/usr/bin/env bash
# usage: ROUNDS=3 ab.sh label=BIN ... [floor=FLOORBIN]
# Alternates the servers; per run a fresh server on 127.0.0.1:18080 and one
# `loadtest fanout --mode broadcast --connections 10000 --rate 1 --duration 30s` (TOOL's load tool
# for every run). One JSON line per run: server CPU per delivery (server_percent x wall / received),
# split into user and system time by the server's /proc/PID/stat utime:stime over the run; p50/p99.
set -u
ulimit -n "$(ulimit -Hn)"
TOOL=${TOOL:-/tmp/exp/posthorn-new}; PORT=18080; OUT=/tmp/exp/out; mkdir -p $OUT
for r in $(seq ${ROUNDS:-3}); do
  for spec in "$@"; do
    label=${spec%%=*}; bin=${spec#*=}
    if [ "$label" = floor ]; then
      $bin --bench --listen 127.0.0.1:$PORT --threads 2 > $OUT/server.log 2>&1 & sp=$!; peer=nchan
    else
      POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $bin serve > $OUT/server.log 2>&1 & sp=$!; peer=posthorn
    fi
    for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
    sleep 0.3
    $TOOL loadtest fanout --peer $peer --mode broadcast --connections 10000 --rate 1 --duration ${DUR:-30s} \
      --url http://127.0.0.1:$PORT --pid $sp --time-limit 300s > $OUT/lt.txt 2>&1
    read -r ut st < <(awk '{print $14, $15}' /proc/$sp/stat)
    kill -TERM $sp; sleep 0.5; kill -KILL $sp 2>/dev/null; wait $sp 2>/dev/null
    tail -n1 $OUT/lt.txt > $OUT/last.txt
    python3 - "$label" "$ut" "$st" "$r" <<'PY'
import json,sys
label,ut,st,rnd=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),sys.argv[4]
r=json.loads(open('/tmp/exp/out/last.txt').readline())
c=r['cpu']; lat=r['latency']; n=r['deliveries']['received']; w=c['wall_seconds']
srv=c['server_percent']/100*w/n*1e6
share=ut/(ut+st) if ut+st else 0
print(json.dumps(dict(label=label, round=int(rnd), received=n, lossless=r.get('lossless'),
  srv_us_per_delivery=round(srv,2), user_us=round(srv*share,2), sys_us=round(srv*(1-share),2),
  tool_us_per_delivery=round(c['tool_percent']/100*w/n*1e6,2), p50_ms=lat['p50_ms'], p99_ms=lat['p99_ms'],
  srv_pct=round(c['server_percent'],1), tool_pct=round(c['tool_percent'],1), ticks=[ut,st])), flush=True)
PY
  done
done
