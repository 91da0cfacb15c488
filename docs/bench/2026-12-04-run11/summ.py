import json,collections,sys
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[r['label']].append(r)
fl=d.get('floor')
for k,v in d.items():
    n=len(v); m=lambda f: sum(r[f] for r in v)/n
    print(k, n, 'lossless', all(r['lossless'] for r in v), 'srv %.2f user %.2f sys %.2f p50 %.1f p99 %.1f'%(m('srv_us_per_delivery'),m('user_us'),m('sys_us'),m('p50_ms'),m('p99_ms')),
      ('ratio/floor per round '+' '.join('%.2f'%(a['srv_us_per_delivery']/b['srv_us_per_delivery']) for a,b in zip(v,fl)) + ' mean-ratio %.3f'%(m('srv_us_per_delivery')/(sum(r['srv_us_per_delivery'] for r in fl)/len(fl)))) if fl else '')
