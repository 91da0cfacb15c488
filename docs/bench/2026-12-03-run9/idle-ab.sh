#!/usr/bin/env bash
# usage: ROUNDS=3 idleab.sh label=BIN ... ; hub CPU ms/s while 10,000 streams sit idle (heartbeat 600 s),
# measured over 20 s after the streams have settled; a fresh server per run, alternating.
set -u; ulimit -n "$(ulimit -Hn)"; PORT=18480
for r in $(seq ${ROUNDS:-3}); do for spec in "$@"; do
  label=${spec%%=*}; bin=${spec#*=}
  POSTHORN_SSE__HEARTBEAT=600s POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $bin serve > /tmp/exp/server.log 2>&1 & sp=$!
  for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
  /tmp/exp/posthorn-new loadtest idle --url http://127.0.0.1:$PORT -n 10000 --settle 45s --pid $sp --time-limit 120s > /tmp/exp/idle.txt 2>&1 & lp=$!
  sleep 20; t0=$(awk '{print $14+$15}' /proc/$sp/stat); sleep 20; t1=$(awk '{print $14+$15}' /proc/$sp/stat)
  echo "{\"label\":\"$label\",\"round\":$r,\"ms_per_s\":$(( (t1-t0)*10/20 ))}"
  wait $lp; kill -TERM $sp; wait $sp 2>/dev/null
done; done
