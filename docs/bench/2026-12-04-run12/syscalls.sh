#!/usr/bin/env bash
# usage: syscalls.sh label bin  (label floor: the floor server) — syscall counts over 10 s of a 10,000-stream broadcast
set -u; ulimit -n "$(ulimit -Hn)"
label=$1; bin=$2; PORT=18090
if [ "$label" = floor ]; then $bin --bench --listen 127.0.0.1:$PORT --threads 2 >/dev/null 2>&1 & sp=$!; peer=nchan
else POSTHORN_SERVER__LISTEN=127.0.0.1:$PORT $bin serve >/dev/null 2>&1 & sp=$!; peer=posthorn; fi
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
${TOOL:-/tmp/exp/posthorn-base} loadtest fanout --peer $peer --mode broadcast --connections 10000 --rate 1 --duration 30s --url http://127.0.0.1:$PORT --pid $sp --time-limit 120s > /tmp/exp/sc-$label.lt 2>&1 & lp=$!
sleep 12; timeout -s INT 10 strace -c -f -p $sp -o /tmp/exp/sc-$label.txt; wait $lp; kill $sp; wait $sp 2>/dev/null
head -20 /tmp/exp/sc-$label.txt
