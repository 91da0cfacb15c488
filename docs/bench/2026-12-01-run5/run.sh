#!/usr/bin/env bash
# usage: LTARGS="<loadtest scenario and options>" PEER=posthorn|nchan|floor BIN=... TOOLBIN=...
#        EXTRA="env assignments for posthorn" PERF=0|1 run.sh
set -u
cd /work/main
ulimit -n "$(ulimit -Hn)"
PEER=${PEER:-posthorn}; DUR=${DUR:-20s}; N=${N:-10000}; BIN=${BIN:-/work/target/release/posthorn}
OUT=/tmp/exp/out; mkdir -p $OUT
PORT=18080
LPEER=$PEER
if [ "$PEER" = floor ]; then
  LPEER=nchan
  $(ls -t /work/target/release/deps/sse_floor-* | grep -v '\.d$' | head -1) --listen 127.0.0.1:$PORT ${FLOORARGS:-} > $OUT/server.log 2>&1 &
  SP=$!; PIDS=$SP
elif [ "$PEER" = posthorn ]; then
  env ${EXTRA:-} POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > $OUT/server.log 2>&1 &
  SP=$!; PIDS=$SP
else
  run=$OUT/nchan-run; rm -rf $run; mkdir -p $run/logs
  sed -e "s#@RUN@#$run#g" -e "s#@PORT@#$PORT#g" -e "s#@SLOWPORT@#18081#g" scripts/bench/nchan.conf > $run/nginx.conf
  nginx -p $run -c $run/nginx.conf -e $run/logs/error.log & SP=$!
  sleep 0.7; PIDS=$(echo $SP $(pgrep -P $SP) | tr ' ' ',')
fi
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
sleep 0.3
${TOOLBIN:-$BIN} loadtest $LTARGS --url http://127.0.0.1:$PORT --peer $LPEER --pid $PIDS --time-limit 300s ${LTX:-} > $OUT/lt.txt 2>&1 &
LT=$!
if [ "${PERF:-0}" = 1 ]; then
  sleep ${PERFDELAY:-12}
  perf record -e cpu-clock -F 4999 -g -a -o $OUT/perf.data -- sleep ${PERFSECS:-8} > /dev/null 2>&1
fi
wait $LT
kill -TERM $SP 2>/dev/null; sleep 0.5; kill -KILL $SP 2>/dev/null; wait $SP 2>/dev/null
tail -n1 $OUT/lt.txt > $OUT/last.txt
cat $OUT/last.txt | head -c 600; echo
