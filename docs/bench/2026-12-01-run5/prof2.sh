#!/usr/bin/env bash
# perf the server (PEER=posthorn|floor) for the whole run of LTARGS; OUTP names the perf file
set -u
cd /work/main; ulimit -n "$(ulimit -Hn)"
BIN=${BIN:-/work/target/release/posthorn}; OUT=/tmp/exp/out; PORT=18080
if [ "${PEER:-posthorn}" = floor ]; then
  $(ls -t /work/target/release/deps/sse_floor-* | grep -v '\.d$' | head -1) --listen 127.0.0.1:$PORT > $OUT/server.log 2>&1 & SP=$!; LP=nchan
else
  env ${EXTRA:-} POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $BIN serve > $OUT/server.log 2>&1 & SP=$!; LP=posthorn
fi
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
perf record -e cpu-clock -F ${FREQ:-2999} ${CG:--g} -p $SP -o $OUT/${OUTP:-perf}.data > /dev/null 2>&1 & PP=$!
sleep 0.5
$BIN loadtest $LTARGS --url http://127.0.0.1:$PORT --peer $LP --pid $SP --time-limit 300s > $OUT/lt.txt 2>&1
kill -INT $PP; wait $PP
kill -TERM $SP; sleep 0.5; kill -KILL $SP 2>/dev/null; wait $SP 2>/dev/null
grep -v '^{' $OUT/lt.txt | tail -2 | cut -c 1-400
