#!/usr/bin/env bash
# p99 of unicast 5,000/s appended by XADD into Redis, presence on (default) and off, alternating;
# a fresh redis-server and hub per run.
set -u; ulimit -n "$(ulimit -Hn)"
BIN=/work/main/target/release/posthorn; PORT=18480; RPORT=18482; OUT=/tmp/exp/rp; mkdir -p $OUT
for r in $(seq ${ROUNDS:-2}); do for presence in true false; do
  redis-server --port $RPORT --bind 127.0.0.1 --save '' --appendonly no --dir $OUT --logfile $OUT/redis.log & rp=$!
  sleep 0.5
  POSTHORN_PRESENCE__ENABLED=$presence POSTHORN_BACKEND__KIND=redis POSTHORN_REDIS__URL=redis://127.0.0.1:$RPORT \
    POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > $OUT/server.log 2>&1 & sp=$!
  for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
  sleep 0.5
  $BIN loadtest fanout --url http://127.0.0.1:$PORT -n 10000 --mode unicast --rate 5000 --size 100 --duration 15s \
    --publish-via redis --redis 127.0.0.1:$RPORT --pid $sp --time-limit 120s > $OUT/lt.txt 2>&1
  python3 -c "
import json,sys
x=json.loads(open('$OUT/lt.txt').read().strip().splitlines()[-1]); c=x['cpu']; n=x['deliveries']['received']
print(json.dumps(dict(presence='$presence',round=$r,lossless=x['lossless'],p50=x['latency']['p50_ms'],p99=x['latency']['p99_ms'],cpu_us=round(c['server_percent']/100*c['wall_seconds']/n*1e6,1))))"
  kill $sp; wait $sp 2>/dev/null; kill $rp; wait $rp 2>/dev/null
done; done
