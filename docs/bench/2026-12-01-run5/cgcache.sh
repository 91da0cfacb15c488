#!/usr/bin/env bash
# callgrind with a cache simulation: 10,000 streams, broadcasts at 0.5/s for 20 s
set -u
ulimit -n 20000
BIN=${BIN:-/tmp/exp/posthorn-new}; OUT=/tmp/exp/cgc; PORT=18095; TAG=${TAG:-new}
rm -f $OUT/$TAG.cg.*
POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes \
  --D1=32768,8,64 --LL=${LL:-8388608},16,64 --callgrind-out-file=$OUT/$TAG.cg.%p $BIN serve > $OUT/$TAG.server.log 2>&1 & SP=$!
for i in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
$BIN loadtest fanout --mode broadcast --connections 10000 --rate 0.5 --duration ${DUR:-20s} --settle 60s \
  --url http://127.0.0.1:$PORT --time-limit 600s > $OUT/$TAG.lt.txt 2>&1 & LT=$!
until grep -qs "open in" $OUT/$TAG.lt.txt; do sleep 0.2; done
callgrind_control -i on $SP > /dev/null 2>&1
wait $LT
callgrind_control -i off $SP > /dev/null 2>&1
kill -TERM $SP; wait $SP
grep -v '^{' $OUT/$TAG.lt.txt | tail -3 | cut -c1-300
