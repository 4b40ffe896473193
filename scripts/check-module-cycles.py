#!/usr/bin/env python3
"""Fails when the child modules of a Rust module import each other in a circle.

usage: check-module-cycles.py [-v] SRC_ROOT MODULE [SRC_ROOT MODULE ...]
       check-module-cycles.py --self-test   (the parser finds known circles in a generated tree)
  SRC_ROOT  a crate's src directory;  MODULE  a module path in it (`modelcache`, `a::b`; `.` = the crate root)

A child module A depends on B when a file of A (or of A's submodules) names B through `crate::`, `super::`
or `self::` paths, in `use` items or inline, outside comments, strings and `#[cfg(test)] mod tests`. Each
circle is printed with the files behind every edge in it. -v also prints the whole graph.
"""
import os
import re
import sys


def module_path(path, src_root):
    rel = os.path.relpath(path, src_root)[:-3].split(os.sep)
    return rel[:-1] if rel[-1] in ("mod", "lib", "main") else rel


def strip_code(src):
    src = re.sub(r"'(?:\\.|[^'\\])'", "' '", src)  # char literals ('"', '\'')
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif (m := re.compile(r'b?r(#*)"').match(src, i)) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = src.find('"' + m.group(1), m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif src[i] == '"':
            i += 1
            while i < n and src[i] != '"':
                i += 2 if src[i] == "\\" else 1
            i += 1
            out.append('""')
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def drop_test_modules(src):
    """Removes `#[cfg(test)] mod NAME { ... }` bodies (brace-matched)."""
    out, pos = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", src):
        if m.start() < pos:
            continue
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
        out.append(src[pos:m.start()])
        pos = j
    out.append(src[pos:])
    return "".join(out)


def use_paths(tree, prefix=()):
    """`a::{b, c::{d, e}}` -> [(a, b), (a, c, d), (a, c, e)]."""
    parts, depth, cur = [], 0, ""
    for ch in tree + ",":
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    paths = []
    for part in filter(None, parts):
        m = re.fullmatch(r"([\w:]*?)::\{(.*)\}", part, re.S)
        if m:
            paths += use_paths(m.group(2), prefix + tuple(p for p in m.group(1).split("::") if p))
        else:
            paths.append(prefix + tuple(p.split(" as ")[0].strip() for p in part.split("::") if p))
    return paths


def graph(src_root, module):
    base = [] if module in (".", "") else module.split("::")
    directory = os.path.join(src_root, *base)
    children = set()
    for f in os.listdir(directory):
        full = os.path.join(directory, f)
        if f.endswith(".rs") and f not in ("mod.rs", "lib.rs", "main.rs"):
            children.add(f[:-3])
        elif os.path.isdir(full) and (os.path.exists(os.path.join(full, "mod.rs")) or os.path.exists(full + ".rs")):
            children.add(f)
    children.discard("tests")
    edges = {c: {} for c in children}
    for root, _, files in os.walk(directory):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            mod = module_path(path, src_root)
            if len(mod) <= len(base) or mod[: len(base)] != base or mod[len(base)] not in children:
                continue
            if "tests" in mod[len(base):]:
                continue
            me = mod[len(base)]
            with open(path, encoding="utf-8") as fh:
                src = drop_test_modules(strip_code(fh.read()))
            paths = []
            for m in re.finditer(r"\buse\s+([^;]+);", src):
                paths += use_paths(m.group(1))
            for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", src):
                paths.append(tuple(m.group(1).split("::")))
            for p in paths:
                if not p:
                    continue
                if p[0] == "crate":
                    target = list(p[1:])
                elif p[0] in ("super", "self"):
                    here, k = list(mod), 0
                    while k < len(p) and p[k] in ("super", "self"):
                        if p[k] == "super":
                            here = here[:-1]
                        k += 1
                    target = here + list(p[k:])
                else:
                    continue
                if len(target) > len(base) and target[: len(base)] == base:
                    other = target[len(base)]
                    if other in children and other != me:
                        edges[me].setdefault(other, set()).add(os.path.relpath(path, src_root))
    return edges


def circles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def self_test():
    """Known trees: each import form must give its edge, and comments, strings and test modules none."""
    import tempfile

    cases = {
        # file -> source; expected circles
        "use-tree": ({"a.rs": "use super::{b::{X, Y}, c};", "b.rs": "use crate::m::a::Z;", "c.rs": ""}, [["a", "b"]]),
        "inline path": ({"a.rs": "fn f() { super::b::g() }", "b.rs": "fn g() { crate::m::a::f() }"}, [["a", "b"]]),
        "submodule": ({"a.rs": "mod x;", "a/x.rs": "use super::super::b::T;", "b.rs": "use self::super::a::U;"}, [["a", "b"]]),
        "ignored": ({"a.rs": "// use super::b;\nconst S: &str = \"super::b::x\";\n#[cfg(test)]\nmod tests { use super::super::b; }",
                     "b.rs": "use super::a::Q;"}, []),
    }
    for name, (files, want) in cases.items():
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "m", "a"))
            for f, text in files.items():
                with open(os.path.join(root, "m", f), "w", encoding="utf-8") as fh:
                    fh.write(text)
            got = circles(graph(root, "m"))
        if got != want:
            print(f"self-test {name}: found {got}, expected {want}")
            return 1
    print(f"self-test: {len(cases)} trees parsed as expected")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    if not args or len(args) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    failed = False
    for src_root, module in zip(args[::2], args[1::2]):
        edges = graph(src_root, module)
        found = circles(edges)
        name = f"{src_root} {module}"
        for comp in found:
            failed = True
            print(f"{name}: import circle among {', '.join(comp)}:")
            for a in comp:
                for b in sorted(edges[a]):
                    if b in comp:
                        print(f"    {a} -> {b}  ({', '.join(sorted(edges[a][b]))})")
        if not found:
            print(f"{name}: no import circle among {len(edges)} modules")
        if verbose:
            for a in sorted(edges):
                print(f"    {a} -> {', '.join(sorted(edges[a])) or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
