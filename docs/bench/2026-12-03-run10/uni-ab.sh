#!/usr/bin/env bash
# usage: ROUNDS=5 RATE=5000 [VIA=redis [PUBLISH=http]] [PER_REQUEST=N] uni-ab.sh label=BIN[@N] ... [nchan]
# (BIN@N: at most N events per publish request, like PER_REQUEST for that label only)
# Unicast to 10,000 streams, 100 B events for 15 s; alternating servers, a fresh one per run
# (and a fresh redis-server with VIA=redis: events appended by XADD). nchan: nginx with
# scripts/bench/nchan.conf, one message per request. TOOL's load tool for every run.
# One JSON line per run: p50/p99, server CPU per event, lossless.
set -u; ulimit -n "$(ulimit -Hn)"
TOOL=${TOOL:-/tmp/exp/posthorn-new}; PORT=18080; RPORT=18082; OUT=/tmp/exp/uni; mkdir -p $OUT
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
for r in $(seq ${ROUNDS:-5}); do
  for spec in "$@"; do
    label=${spec%%=*}; bin=${spec#*=}; extra=(); per=${PER_REQUEST:-}
    case $bin in *@*) per=${bin#*@}; bin=${bin%@*};; esac
    if [ "$label" = nchan ]; then
      run=$OUT/nchan-run; rm -rf $run; mkdir -p $run/logs
      sed -e "s#@RUN@#$run#g" -e "s#@PORT@#$PORT#g" -e "s#@SLOWPORT@#$((PORT+1))#g" $ROOT/scripts/bench/nchan.conf > $run/nginx.conf
      nginx -p $run -c $run/nginx.conf -e $run/logs/error.log & sp=$!; peer=nchan; sig=QUIT
    else
      env=(POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT)
      if [ "${VIA:-}" = redis ]; then
        redis-server --port $RPORT --bind 127.0.0.1 --save '' --appendonly no --dir $OUT --logfile $OUT/redis.log & rp=$!
        sleep 0.5
        env+=(POSTHORN_BACKEND__KIND=redis POSTHORN_REDIS__URL=redis://127.0.0.1:$RPORT)
        [ "${PUBLISH:-}" = http ] || extra=(--publish-via redis --redis 127.0.0.1:$RPORT)
      fi
      [ -n "$per" ] && extra+=(--events-per-request $per)
      env "${env[@]}" $bin serve > $OUT/server.log 2>&1 & sp=$!; peer=posthorn; sig=TERM
    fi
    for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
    sleep 0.5
    pids=$sp; [ $peer = nchan ] && pids=$(echo $sp $(pgrep -P $sp) | tr ' ' ',')
    $TOOL loadtest fanout --peer $peer --url http://127.0.0.1:$PORT -n 10000 --mode unicast --rate ${RATE:-5000} --size 100 \
      --duration 15s "${extra[@]}" --pid $pids --time-limit 120s > $OUT/lt.txt 2>&1
    kill -$sig $sp; for i in $(seq 100); do kill -0 $sp 2>/dev/null || break; sleep 0.1; done; kill -KILL $sp 2>/dev/null; wait $sp 2>/dev/null
    if [ "${VIA:-}" = redis ] && [ $peer = posthorn ]; then kill $rp; wait $rp 2>/dev/null; fi
    python3 -c "
import json
x=json.loads(open('$OUT/lt.txt').read().strip().splitlines()[-1]); c=x['cpu']; n=x['deliveries']['received']
print(json.dumps(dict(label='$label',round=$r,via='${VIA:-memory}',rate=${RATE:-5000},per_request='$per',publish='${PUBLISH:-}',lossless=x['lossless'],p50=x['latency']['p50_ms'],p99=x['latency']['p99_ms'],cpu_us=round(c['server_percent']/100*c['wall_seconds']/n*1e6,1))),flush=True)"
  done
done
