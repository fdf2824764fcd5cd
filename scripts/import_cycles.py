#!/usr/bin/env python3
"""Fails when a crate's source has an import cycle between its files.

Usage: scripts/import_cycles.py DIR... (each a crate's `src/`; CI checks every crate).

The graph: every `crate::a::b::...` path in a file (also inside `use crate::{...}` groups) and
every `super::x` is an edge to the deepest file of that module path that exists; comments and
`#[cfg(test)] mod tests` are left out, and a module root's `mod x; pub use x::...` lines are
containment, not imports. docs/STYLE.md ("Layout") says why: a stage never depends on the
pipeline that calls it.
"""
import re,os,sys

def check(root):
    files={}
    for d,_,fs in os.walk(root):
        for f in fs:
            if f.endswith('.rs'):
                p=os.path.relpath(os.path.join(d,f),root)
                files[p]=open(os.path.join(root,p)).read()
    def modpath(p):
        parts=p[:-3].split('/')
        if parts[-1]=='mod': parts=parts[:-1]
        if parts==['lib']: return []
        return parts
    bymod={tuple(modpath(p)):p for p in files if not p.startswith('bin/') and p!='main.rs'}
    def resolve(path):
        best=None
        for i in range(len(path),0,-1):
            if tuple(path[:i]) in bymod: return bymod[tuple(path[:i])]
        return None
    def expand(prefix, body):
        # body: contents of a {...} group, possibly nested
        out=[]; depth=0; cur=''
        for ch in body+',':
            if ch=='{': depth+=1
            if ch=='}': depth-=1
            if ch==',' and depth==0:
                cur=cur.strip()
                if cur:
                    m=re.match(r'([\w:]*?)::\{(.*)\}$',cur,re.S)
                    if m: out+=expand(prefix+[x for x in m.group(1).split('::') if x], m.group(2))
                    else: out.append(prefix+[x for x in cur.split(' as ')[0].split('::') if x])
                cur=''
            else: cur+=ch
        return out
    edges={}
    for p,src in files.items():
        if p.startswith('bin/') or p in('main.rs','lib.rs'): continue
        src=re.split(r'#\[cfg\(test\)\]\s*mod tests',src)[0]
        src='\n'.join(re.sub(r'//.*','',l) for l in src.split('\n'))
        me=modpath(p)
        paths=[]
        for m in re.finditer(r'\buse\s+(crate|super)::\{(.*?)\};',src,re.S):
            base=[] if m.group(1)=='crate' else me[:-1]
            paths+= [base+x for x in expand([],m.group(2))]
        for m in re.finditer(r'\b(crate|super)((?:::\w+)+)',src):
            base=[] if m.group(1)=='crate' else me[:-1]
            paths.append(base+[x for x in m.group(2).split('::') if x])
        for path in paths:
            t=resolve(path)
            if t and t!=p: edges.setdefault(p,set()).add(t)
    color={}; stack=[]; cycles=[]
    def dfs(u):
        color[u]=1; stack.append(u)
        for v in sorted(edges.get(u,())):
            if color.get(v)==1: cycles.append(stack[stack.index(v):]+[v])
            elif not color.get(v): dfs(v)
        stack.pop(); color[u]=2
    for f in sorted(files):
        if not color.get(f): dfs(f)
    for c in cycles:
        print(f"{root}: import cycle: {' -> '.join(c)}")
    return len(cycles)


if __name__ == "__main__":
    roots = sys.argv[1:] or ["worker/src"]
    found = sum(check(r) for r in roots)
    print(f"import cycles: {found} in {len(roots)} crate(s)")
    sys.exit(1 if found else 0)
