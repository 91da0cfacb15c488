#!/usr/bin/env bash
# usage: sysc.sh posthorn|floor BIN [N] [RATE]  -> perf trace summary of the server for 10 s of a broadcast
set -u
ulimit -n "$(ulimit -Hn)"
kind=$1; bin=$2; N=${3:-2000}; RATE=${4:-2}; PORT=18280
TOOL=${TOOL:-/work/main/target/debug/posthorn}
if [ $kind = posthorn ]; then
  POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $bin serve > /tmp/exp/server.log 2>&1 & sp=$!; peer=posthorn
else
  $bin --bench --listen 127.0.0.1:$PORT --threads 2 > /tmp/exp/server.log 2>&1 & sp=$!; peer=nchan
fi
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
$TOOL loadtest fanout --peer $peer --mode broadcast --connections $N --rate $RATE --duration 25s --settle 2s \
   --url http://127.0.0.1:$PORT --pid $sp --time-limit 120s > /tmp/exp/lt.txt 2>&1 &
lp=$!
sleep 10
timeout -s INT 10 perf trace -s -p $sp -o /tmp/exp/trace.txt 2>/dev/null
wait $lp
kill -TERM $sp; wait $sp 2>/dev/null
echo "window: 10 s x $RATE/s x $N = $((10*RATE*N)) deliveries"
grep -E "^\s+[a-z_0-9]+ +[0-9]+" /tmp/exp/trace.txt | awk '{c[$1]+=$2} END {for (k in c) print c[k], k}' | sort -rn | head -15
tail -1 /tmp/exp/lt.txt | cut -c1-400
