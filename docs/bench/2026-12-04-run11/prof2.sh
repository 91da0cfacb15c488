#!/usr/bin/env bash
set -u
ulimit -n "$(ulimit -Hn)"
out=$1; PORT=18380; BIN=${BIN:-/tmp/exp/posthorn-base}
POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > /tmp/exp/server.log 2>&1 & sp=$!
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
$BIN loadtest fanout --mode broadcast --rate 1 --connections 10000 --duration 30s --url http://127.0.0.1:$PORT --pid $sp --time-limit 120s > $out.lt.txt 2>&1 &
lp=$!; sleep 12
perf record -F 2999 -p $sp -o $out.data 2>/dev/null & pp=$!
sleep 15; kill -INT $pp; wait $lp
wait $pp 2>/dev/null
kill -TERM $sp; wait $sp 2>/dev/null
perf report -i $out.data --no-children --sort comm --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head > $out.comm.txt
perf report -i $out.data --no-children --sort comm,dso,symbol --percent-limit 0.3 --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -90 > $out.top.txt
tail -1 $out.lt.txt | cut -c1-400
