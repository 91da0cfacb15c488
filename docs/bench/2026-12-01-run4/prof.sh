#!/usr/bin/env bash
# perf the posthorn server for the whole run of LTARGS
set -u
cd /work/main; ulimit -n "$(ulimit -Hn)"
BIN=${BIN:-/work/target/release/posthorn}; OUT=/tmp/exp/out; PORT=18080
env ${EXTRA:-} POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > $OUT/server.log 2>&1 & SP=$!
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
perf record -e cpu-clock -F ${FREQ:-9999} ${CG:--g} -p $SP -o $OUT/perf.data > /dev/null 2>&1 & PP=$!
sleep 0.5
$BIN loadtest $LTARGS --url http://127.0.0.1:$PORT --pid $SP --time-limit 300s > $OUT/lt.txt 2>&1
kill -INT $PP; wait $PP
kill -TERM $SP; sleep 0.5; kill -KILL $SP 2>/dev/null; wait $SP 2>/dev/null
tail -n1 $OUT/lt.txt | head -c 300; echo
