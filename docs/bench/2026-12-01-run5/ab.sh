#!/usr/bin/env bash
# usage: ab.sh ROUNDS "labelA|EXTRA_A|BIN_A" "labelB|EXTRA_B|BIN_B" ...   (LTARGS env)
R=$1; shift
for r in $(seq $R); do
  for spec in "$@"; do
    IFS="|" read -r label extra bin peer <<< "$spec"
    EXTRA="$extra" BIN="${bin:-/work/target/release/posthorn}" PEER=${peer:-posthorn} ./run.sh > /dev/null 2>&1
    python3 - "$label" <<'PY'
import json,sys
r=json.loads(open('/tmp/exp/out/last.txt').readline())
c=r.get('cpu',{})
lat=r.get('latency',{})
srv=c.get('server_percent',0)/100*c.get('wall_seconds',0)
out={'label':sys.argv[1]}
if 'accepted_per_second' in r: out.update(rate=round(r['accepted_per_second']), srv_us_per_conn=round(srv/r.get('accepted',1)*1e6,1), tool_pct=round(c.get('tool_percent',0)))
if 'connects_per_second' in r:
    cc=r.get('cpu_connecting',{})
    out.update(rate=round(r['connects_per_second']), bytes=round(r.get('bytes_per_connection') or 0), srv_us_per_conn=round(cc.get('server_percent',0)/100*cc.get('wall_seconds',0)/r['connections']*1e6,1), tool_pct=round(cc.get('tool_percent',0)))
if 'deliveries' in r and r['deliveries'].get('received'):
    n=r['deliveries']['received']; w=c.get('wall_seconds',0)
    out.update(srv_us_per_ev=round(srv/n*1e6,2), tool_us_per_ev=round(c.get('tool_percent',0)/100*w/n*1e6,2))
if lat: out.update(p50=lat.get('p50_ms'), p99=lat.get('p99_ms'), lossless=r.get('lossless'), srv_pct=round(c.get('server_percent',0),1), tool_pct=round(c.get('tool_percent',0),1))
print(json.dumps(out)); sys.stdout.flush()
PY
  done
done
