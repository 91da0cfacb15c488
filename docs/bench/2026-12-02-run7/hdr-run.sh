#!/usr/bin/env bash
ulimit -n "$(ulimit -Hn)"
bin=$1; n=$2; pad=$3; port=18191
POSTHORN_SERVER__LISTEN=127.0.0.1:$port "$bin" serve > /tmp/hdr-hub.log 2>&1 &
pid=$!
for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
python3 "$(dirname "$0")"/hdr.py $port $pid $n $pad
kill -TERM $pid; wait $pid 2>/dev/null
