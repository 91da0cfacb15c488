#!/usr/bin/env bash
set -euo pipefail
ulimit -n "$(ulimit -Hn)"
bin=$1; n=${2:-2000}; burst=${3:-100}; size=${4:-1000}; port=18190
POSTHORN_SERVER__LISTEN=127.0.0.1:$port "$bin" serve > /tmp/burst-hub.log 2>&1 &
pid=$!
for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
python3 "$(dirname "$0")"/burst.py $port $pid $n $burst $size || true
kill -TERM $pid; wait $pid 2>/dev/null || true
