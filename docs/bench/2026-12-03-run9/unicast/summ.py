import json,sys,collections
d=collections.defaultdict(list)
for i in sys.argv[1:]:
  for l in open(f'{i}/results.jsonl'):
    r=json.loads(l); x=r['result']; c=x['cpu']; n=x['deliveries']['received']
    d[(r['label'],r['peer'])].append((x['lossless'],x['latency']['p50_ms'],x['latency']['p99_ms'], c['server_percent']/100*c['wall_seconds']/n*1e6))
for k,v in d.items():
  print(k[0],k[1],'lossless' if all(a[0] for a in v) else 'LOSS','p50',[round(a[1],2) for a in v],'p99',[round(a[2],2) for a in v],'mean p99',round(sum(a[2] for a in v)/len(v),2),'cpu/event',round(sum(a[3] for a in v)/len(v),1))
