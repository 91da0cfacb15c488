# usage: cgdiff.py DIR_A DIR_B EVENTS  -- per-function instructions per event (20 s run minus 10 s run)
import re,sys
def load(path):
    d={}
    lines=open(path).read().split('\n')
    start=next(i for i,l in enumerate(lines) if l.rstrip().endswith('file:function'))+2
    end=next(i for i in range(start,len(lines)) if not lines[i].strip())
    for line in lines[start:end]:
        m=re.match(r'\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*?)(?: \[[^\]]*\])?$',line)
        if m and 'PROGRAM TOTALS' not in line:
            name=m.group(2)
            name=re.sub(r'^.*?:(?=[<a-zA-Z_])','',name,1) if ':' in name else name
            d[name]=d.get(name,0)+int(m.group(1).replace(',',''))
    return d
def per_event(dir,events):
    a=load(dir+'/broadcast-10s.annotated.txt'); b=load(dir+'/broadcast-20s.annotated.txt')
    return {k:(b.get(k,0)-a.get(k,0))/events for k in set(a)|set(b)}
A=per_event(sys.argv[1],float(sys.argv[3])); B=per_event(sys.argv[2],float(sys.argv[3]))
rows=sorted(set(A)|set(B),key=lambda k:-abs(B.get(k,0)-A.get(k,0)))
print(f"{'A':>8} {'B':>8} {'B-A':>8}  function (instructions per event)")
for k in rows[:int(sys.argv[4]) if len(sys.argv)>4 else 30]:
    print(f"{A.get(k,0):8.1f} {B.get(k,0):8.1f} {B.get(k,0)-A.get(k,0):8.1f}  {k[:150]}")
print(f"{sum(A.values()):8.1f} {sum(B.values()):8.1f}  (sum of listed functions in the annotate output)")
