#!/usr/bin/env bash
# usage: run.sh BIN LABEL N
set -euo pipefail
ulimit -n "$(ulimit -Hn)"
bin=$1; label=$2; n=${3:-10000}; port=18180
POSTHORN_SERVER__LISTEN=127.0.0.1:$port "$bin" serve > /tmp/idle/$label.log 2>&1 &
pid=$!
for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
"$bin" loadtest idle --url http://127.0.0.1:$port -n "$n" --pid $pid --time-limit 120s | tail -3
kill -TERM $pid; wait $pid 2>/dev/null || true
