# usage: cgmiss.py DIR_A DIR_B EVENTS [ROWS] -- per-function last-level data read misses (DLmr)
# per event, 20 s run minus 10 s run, of two cache-simulated broadcast runs (A and B)
import re,sys,os
BYFN=os.environ.get('BYFN')=='1'
def load(path):
    lines=open(path).read().split('\n')
    start=next(i for i,l in enumerate(lines) if l.rstrip().endswith('file:function'))+2
    d={}
    for line in lines[start:]:
        if not line.strip(): break
        line=re.sub(r'\(\s*[\d.]+%\)','',line)
        parts=line.split()
        vals=parts[:9]; name=' '.join(parts[9:])
        name=re.sub(r' \[[^\]]*\]$','',name)
        if BYFN: name=name.split(':',1)[1] if ':' in name and not name.startswith('<') else name.split('.rs:',1)[-1].split('.S:',1)[-1].split('.h:',1)[-1]
        name=name.replace('/tmp/head/','')
        dlmr=0 if vals[7]=='.' else int(vals[7].replace(',',''))
        d[name]=d.get(name,0)+dlmr
    return d
def per_event(dir,events):
    a=load(dir+'/broadcast-10s.annotated.txt'); b=load(dir+'/broadcast-20s.annotated.txt')
    return {k:(b.get(k,0)-a.get(k,0))/events for k in set(a)|set(b)}
A=per_event(sys.argv[1],float(sys.argv[3])); B=per_event(sys.argv[2],float(sys.argv[3]))
rows=sorted(set(A)|set(B),key=lambda k:-max(A.get(k,0),B.get(k,0)))
print(f"{'A':>6} {'B':>6}  function:source line's file (last-level data read misses per event)")
for k in rows[:int(sys.argv[4]) if len(sys.argv)>4 else 40]:
    short=re.sub(r'/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/','',k)
    short=re.sub(r'/rustc/[0-9a-f]+/','',short)
    print(f"{A.get(k,0):6.2f} {B.get(k,0):6.2f}  {short[:170]}")
print(f"{sum(A.values()):6.2f} {sum(B.values()):6.2f}  all functions")
