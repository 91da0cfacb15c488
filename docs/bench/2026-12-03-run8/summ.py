import json, sys, glob, statistics as st
# usage: summ.py DIR_GLOB  -> per round and per label/peer: rate or p99 and server CPU per unit
rows = {}
for path in sorted(glob.glob(sys.argv[1] + '/*/results.jsonl')):
    rnd = path.split('/')[-2]
    for line in open(path):
        r = json.loads(line); res = r['result']; c = res['cpu']; w = c['wall_seconds']
        if res['scenario'] == 'storm':
            n = res['accepted']; val = res['accepted_per_second']
            extra = ''
        else:
            n = res['deliveries']['received']; val = res['latency']['p99_ms']
            extra = 'p50 %.2f lossless %s' % (res['latency']['p50_ms'], res.get('lossless'))
        srv = c['server_percent'] / 100 * w / n * 1e6
        tool = c['tool_percent'] / 100 * w / n * 1e6
        rows.setdefault((r['label'], r['peer']), []).append((rnd, val, srv, tool, extra))
for (label, peer), vals in rows.items():
    for rnd, val, srv, tool, extra in vals:
        print(f'{label:16} {peer:9} round {rnd}: {val:10.2f}  server {srv:6.2f} us  tool {tool:6.2f} us  {extra}')
    print(f'{label:16} {peer:9} MEAN   : {st.mean(v[1] for v in vals):10.2f}  server {st.mean(v[2] for v in vals):6.2f} us  median {st.median(v[1] for v in vals):.2f}')
