#!/usr/bin/env python3
"""Finds import circles between the modules of each library crate in the workspace.

    module_cycles.py [ROOT]     exit 1, printing each circle, if any crate has one

A module here is a source file (`a/mod.rs` is module `a`). Module A depends on module B when
A's code (its `#[cfg(test)]` block left out) names a path into B: `use crate::b::X`,
`super::b::f()`, `crate::b::X` inline. A parent naming its own descendants is not counted (it
declares and re-exports them); a child naming its parent is: `config` naming `tasks::image`,
whose code names `tasks`, which names `config`, is a circle, for none of the three can be
read without the others. Paths through
re-exports resolve to the module the path names, which is the dependency a reader sees.
"""

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip(text):
    """The code without comments, string literals or the trailing test module."""
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod \w+\s*\{", text, re.M)
    if m:
        text = text[: m.start()]
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def expand(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (aliases and globs dropped)."""
    tree = tree.strip()
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix = tree[:start]
                inner = tree[start + 1 : i]
                parts, d, cur = [], 0, ""
                for c in inner:
                    if c == "," and d == 0:
                        parts.append(cur)
                        cur = ""
                        continue
                    d += c == "{"
                    d -= c == "}"
                    cur += c
                parts.append(cur)
                out = []
                for p in parts:
                    p = p.strip()
                    if not p:
                        continue
                    if p == "self":
                        out.append(prefix.rstrip(":"))
                    else:
                        out.extend(prefix + q for q in expand(p))
                return out
    tree = re.sub(r"\s+as\s+\w+$", "", tree)
    return [tree.rstrip(":*").rstrip(":")]


def paths(code):
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", code):
        found.extend(expand(m.group(1)))
    code_wo_use = re.sub(r"\buse\s+[^;]+;", " ", code)
    for m in re.finditer(rf"\b((?:crate|super|self)(?:::(?:super|{IDENT}))+)", code_wo_use):
        found.append(m.group(1))
    return [re.sub(r"\s+", "", p) for p in found]


def modules(src):
    """Module path (tuple) -> file, for the crate rooted at src/lib.rs."""
    out = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src)
        parts = list(rel.with_suffix("").parts)
        if parts[0] in ("bin", "main") or rel.as_posix() == "main.rs":
            continue
        if parts[-1] in ("mod", "lib"):
            parts = parts[:-1]
        out[tuple(parts)] = f
    return out


def resolve(path, here, mods):
    parts = path.split("::")
    if parts[0] == "crate":
        base, rest = [], parts[1:]
    elif parts[0] in ("super", "self"):
        base = list(here)
        rest = parts
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                if not base:
                    return None
                base = base[:-1]
            rest = rest[1:]
    else:
        return None
    full = base + rest
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n])
    return None


def declares(a, b):
    """Whether b is a descendant of a: a parent declares and re-exports its children."""
    return b[: len(a)] == a


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check_crate(src):
    mods = modules(src)
    graph = {}
    for here, f in mods.items():
        for p in paths(strip(f.read_text())):
            target = resolve(p, here, mods)
            if target is not None and target != here and not declares(here, target):
                graph.setdefault(here, set()).add(target)
    return mods, graph, cycles(graph)


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    bad = 0
    for lib in sorted(root.glob("*/src/lib.rs")):
        src = lib.parent
        mods, graph, found = check_crate(src)
        for comp in found:
            bad += 1
            names = ", ".join("::".join(m) or "(root)" for m in comp)
            print(f"{src.parent.name}: import circle among {names}")
            for m in comp:
                deps = sorted("::".join(t) for t in graph.get(m, ()) if t in comp)
                print(f"    {'::'.join(m)} -> {', '.join(deps)}")
    if bad:
        sys.exit(1)
    print(f"module_cycles: no import circle in {len(list(root.glob('*/src/lib.rs')))} crates")


if __name__ == "__main__":
    main()
