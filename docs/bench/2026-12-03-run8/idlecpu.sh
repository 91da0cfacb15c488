#!/usr/bin/env bash
# hub CPU (ticks of 10 ms per second) while 10,000 streams sit idle
set -u; ulimit -n "$(ulimit -Hn)"
BIN=${BIN:-/work/main/target/release/posthorn}; PORT=18480
env "$@" POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > /tmp/exp/server.log 2>&1 & sp=$!
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
$BIN loadtest idle --url http://127.0.0.1:$PORT -n 10000 --settle 30s --pid $sp --time-limit 120s > /tmp/exp/idle.txt 2>&1 & lp=$!
prev=0; line=""
for s in $(seq 1 40); do sleep 1; t=$(awk '{print $14+$15}' /proc/$sp/stat); line="$line $((t-prev))"; prev=$t; done
echo "ticks/s:$line"
wait $lp; kill -TERM $sp; wait $sp 2>/dev/null
