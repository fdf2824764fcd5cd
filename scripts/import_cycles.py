#!/usr/bin/env python3
"""Fails when a crate's source, or a Python package, has an import cycle between its files.

Usage: scripts/import_cycles.py DIR... (each a crate's `src/`, or a directory holding
`__init__.py`: a Python package; CI checks every crate and the Python SDK).

A Python package's graph (`python_edges`): every import of a module of the package is an edge
to that module's file, wherever it stands: at module level, inside a function (a deferred
import is still a dependency), and under `if TYPE_CHECKING:` too (a type-only import still ties
the two files together; a cycle through one is broken by moving the type, not by hiding the
import). The forms: `from .x import y`, `from . import x`, `from .. import x` (relative to the
file's package), `import sandq.x`, `from sandq.x import y`, `from sandq import x` (absolute,
through the package's own name: the directory's). `from . import x` is an edge to `x.py` (or
`x/__init__.py`) when it is a module, else to the package's `__init__.py` (a name defined
there); `from .x.y import z` goes to the deepest module that exists. `__init__.py` is a node
like any other: its imports (re-exports included) are edges from it.

The Rust graph:

The graph: every `crate::a::b::...` path in a file (also inside `use crate::{...}` groups) and
every `super::x` is an edge to the deepest file of that module path that exists. The crate root
(`lib.rs`, or `main.rs` in a crate without a library) is a node like the others:
- a path to an item the root defines (`crate::Gateway`) is an edge to the root, and one to an
  item the root re-exports (`pub use state::Gateway;` then `crate::Gateway`) an edge to the file
  that defines it;
- the root's own paths to its modules (`jobs::router()`, `use jobs::Thing;`) are edges from it,
  but its `mod x;` and `pub use x::...` lines are containment, not imports (a map names what it
  holds).
Comments and `#[cfg(test)] mod tests` are left out. docs/STYLE.md ("Layout") says why: a stage
never depends on the pipeline that calls it, and a crate's root is its map, not a room.
"""
import os
import re
import sys


def strip(src):
    """Source without its test module and comments."""
    src = re.split(r'#\[cfg\(test\)\]\s*mod tests', src)[0]
    return '\n'.join(re.sub(r'//.*', '', line) for line in src.split('\n'))


def expand(prefix, body):
    """The paths of a `{...}` use group (nested groups too), each as a list of segments."""
    out = []
    depth = 0
    cur = ''
    for ch in body + ',':
        if ch == '{':
            depth += 1
        if ch == '}':
            depth -= 1
        if ch == ',' and depth == 0:
            cur = cur.strip()
            if cur:
                m = re.match(r'([\w:]*?)::\{(.*)\}$', cur, re.S)
                if m:
                    out += expand(prefix + [x for x in m.group(1).split('::') if x], m.group(2))
                else:
                    out.append(prefix + [x for x in cur.split(' as ')[0].split('::') if x])
            cur = ''
        else:
            cur += ch
    return out


def read_files(root, suffix):
    """Every file under `root` whose name ends with `suffix`, by its path relative to `root`."""
    files = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(suffix):
                p = os.path.relpath(os.path.join(d, f), root)
                with open(os.path.join(root, p)) as fh:
                    files[p] = fh.read()
    return files


def python_edges(root):
    """The Python package at `root`: its files (paths relative to `root`) and the import edges
    between them (the module's docstring has the rules)."""
    import ast

    package = os.path.basename(os.path.normpath(os.path.abspath(root)))
    files = read_files(root, '.py')

    def modpath(p):
        parts = p[:-3].split('/')
        return parts[:-1] if parts[-1] == '__init__' else parts

    bymod = {tuple(modpath(p)): p for p in files}

    def resolve(path):
        """The file of the deepest existing module of `path` (segments under the package)."""
        for i in range(len(path), -1, -1):
            if tuple(path[:i]) in bymod:
                return bymod[tuple(path[:i])]
        return None

    edges = {}
    for p, src in files.items():
        me = modpath(p)
        # The package a relative import starts from: the file's own for `__init__.py`.
        here = me if p.endswith('__init__.py') else me[:-1]
        targets = []
        for node in ast.walk(ast.parse(src, p)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split('.')
                    if parts[0] == package:
                        targets.append(resolve(parts[1:]))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                elif node.module and node.module.split('.')[0] == package:
                    base = []
                else:
                    continue
                mod = base + (node.module.split('.') if node.module else [])
                if not node.level:
                    mod = mod[1:]
                for alias in node.names:
                    # `from . import x`: the module x when there is one, else a name of `mod`.
                    sub = mod + [alias.name]
                    targets.append(bymod[tuple(sub)] if tuple(sub) in bymod else resolve(mod))
        for t in targets:
            if t and t != p:
                edges.setdefault(p, set()).add(t)
    return files, edges


def check(root):
    if os.path.exists(os.path.join(root, '__init__.py')):
        files, edges = python_edges(root)
        return report(root, files, edges)
    files = read_files(root, '.rs')
    crate_root = 'lib.rs' if 'lib.rs' in files else 'main.rs'
    # A binary beside a library is a crate of its own (it names the library by its crate name).
    files = {p: s for p, s in files.items() if not p.startswith('bin/') and (p == crate_root or p != 'main.rs')}

    def modpath(p):
        if p == crate_root:
            return []
        parts = p[:-3].split('/')
        if parts[-1] == 'mod':
            parts = parts[:-1]
        return parts

    bymod = {tuple(modpath(p)): p for p in files}
    root_src = strip(files.get(crate_root, ''))
    # The root's re-exports: a name the crate's files reach as `crate::Name`.
    reexports = {}
    for m in re.finditer(r'\bpub(?:\([\w:]+\))?\s+use\s+([\w:]+?)(?:::\{(.*?)\})?\s*;', root_src, re.S):
        head = [x for x in m.group(1).split('::') if x]
        if m.group(2) is not None:
            for path in expand(head, m.group(2)):
                reexports[path[-1]] = path
        else:
            reexports[head[-1]] = head

    def resolve(path):
        for i in range(len(path), 0, -1):
            if tuple(path[:i]) in bymod:
                return bymod[tuple(path[:i])]
        if path and path[0] in reexports and reexports[path[0]][0] in {k[0] for k in bymod if k}:
            return resolve(reexports[path[0]] + path[1:])
        return crate_root if path else None

    edges = {}
    for p, raw in files.items():
        src = strip(raw)
        me = modpath(p)
        paths = []
        if p == crate_root:
            # Containment lines go; what is left names the modules the root's own code uses.
            body = re.sub(r'\b(?:pub(?:\([\w:]+\))?\s+)?mod\s+\w+\s*;', '', src)
            body = re.sub(r'\bpub(?:\([\w:]+\))?\s+use\s+[^;]*;', '', body)
            children = {k[0] for k in bymod if len(k) == 1}
            for m in re.finditer(r'\buse\s+(\w+)::\{(.*?)\};', body, re.S):
                if m.group(1) in children:
                    paths += [[m.group(1)] + x for x in expand([], m.group(2))]
            for m in re.finditer(r'(?<![\w:])(\w+)((?:::\w+)+)', body):
                if m.group(1) in children:
                    paths.append([m.group(1)] + [x for x in m.group(2).split('::') if x])
        for m in re.finditer(r'\buse\s+(crate|super)::\{(.*?)\};', src, re.S):
            base = [] if m.group(1) == 'crate' else me[:-1]
            paths += [base + x for x in expand([], m.group(2))]
        for m in re.finditer(r'\b(crate|super)((?:::\w+)+)', src):
            base = [] if m.group(1) == 'crate' else me[:-1]
            paths.append(base + [x for x in m.group(2).split('::') if x])
        for path in paths:
            t = resolve(path)
            if t and t != p:
                edges.setdefault(p, set()).add(t)
    return report(root, files, edges)


def report(root, files, edges):
    """Prints every cycle a depth-first walk of `edges` closes; their count."""
    color = {}
    stack = []
    cycles = []

    def dfs(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if color.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not color.get(v):
                dfs(v)
        stack.pop()
        color[u] = 2

    for f in sorted(files):
        if not color.get(f):
            dfs(f)
    for c in cycles:
        print(f"{root}: import cycle: {' -> '.join(c)}")
    return len(cycles)


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    roots = sys.argv[1:] or ["worker/src"]
    found = sum(check(r) for r in roots)
    print(f"import cycles: {found} in {len(roots)} crate(s) or package(s)")
    sys.exit(1 if found else 0)
