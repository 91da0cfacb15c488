#!/usr/bin/env bash
# usage: prof.sh storm|broadcast OUTPREFIX  -> perf record (flat) of the release hub during one run
set -u
ulimit -n "$(ulimit -Hn)"
what=$1; out=$2; PORT=18380; BIN=${BIN:-/work/main/target/release/posthorn}
POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > /tmp/exp/server.log 2>&1 & sp=$!
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
if [ $what = storm ]; then
  perf record -F 2999 -p $sp -o $out.data 2>/dev/null & pp=$!
  $BIN loadtest storm --url http://127.0.0.1:$PORT -n 10000 --pid $sp --time-limit 120s > $out.lt.txt 2>&1
else
  $BIN loadtest fanout --mode broadcast --rate 1 --connections 10000 --duration 30s --url http://127.0.0.1:$PORT --pid $sp --time-limit 120s > $out.lt.txt 2>&1 &
  lp=$!; sleep 12
  perf record -F 2999 -p $sp -o $out.data 2>/dev/null & pp=$!
  sleep 15; kill -INT $pp; wait $lp
fi
kill -INT $pp 2>/dev/null; wait $pp 2>/dev/null
kill -TERM $sp; wait $sp 2>/dev/null
perf report -i $out.data --no-children --sort dso,symbol --percent-limit 0.4 --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -70 > $out.top.txt
tail -1 $out.lt.txt | cut -c1-300
