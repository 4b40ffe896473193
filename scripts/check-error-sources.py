#!/usr/bin/env python3
"""Fails when a `thiserror` error prints its own source in its message.

usage: check-error-sources.py [DIR ...]        (default: crates)
       check-error-sources.py --self-test      (the parser finds known repeats in generated text)

An error's source is a field marked `#[source]` or `#[from]`, or a field named `source`. A printer that
walks `source()` (`flexinfer_contract::error::chain`, anyhow's `{:#}`) prints the source after the
message, so a message that also prints it — `{source}`, `{0}`, `{source:?}`, or `.source` / `.0` among the
format arguments — shows the cause twice. Such a message names only its own context (`"reading {path}"`);
an error that is only its source is `#[error(transparent)]`. Prints the number of such errors, then one
`file:line: Name {field}` per error, and exits 1 when there is any.
"""
import os
import re
import sys


def string_end(src, i):
    """Index just past the string literal whose opening quote is at `i`."""
    j, n = i + 1, len(src)
    while j < n and src[j] != '"':
        j += 2 if src[j] == "\\" else 1
    return j + 1


def strip_comments(src):
    """`src` with `//` and `/* */` comments blanked (strings kept, line numbers kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c == '"':
            j = string_end(src, i)
            out.append(src[i:j])
            i = j
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'" and re.match(r"'(\\.|[^'\\])'", src[i:i + 4]):
            m = re.match(r"'(\\.|[^'\\])'", src[i:i + 4])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def balanced(src, i):
    """Index just past the bracket that closes the one at `i`, skipping string literals."""
    depth, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == '"':
            i = string_end(src, i) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def split_top(body):
    """`body` split at the commas outside brackets, angle brackets and strings."""
    parts, depth, cur, i, n = [], 0, [], 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            j = string_end(body, i)
            cur.append(body[i:j])
            i = j
            continue
        if c in "([{<":
            depth += 1
        elif c in ")]}>" and not (c == ">" and i > 0 and body[i - 1] == "-"):
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


ATTRS = re.compile(r"\s*(?:#\[(?:[^\[\]]|\[[^\]]*\])*\]\s*)*")
ITEM = re.compile(r"(?:pub(?:\([^)]*\))?\s+)?(?:struct\s+)?(\w+)\s*(?:<[^{(;]*>)?\s*(\{|\()")


def sources(body, brace):
    """The source fields of a struct or variant body: names for `{}`, positions for `()`."""
    out = []
    for k, part in enumerate(split_top(body)):
        attrs = re.findall(r"#\[(\w+)", part)
        rest = ATTRS.sub("", part, count=1) if part.startswith("#") else part
        rest = re.sub(r"^pub(\([^)]*\))?\s+", "", rest.strip())
        if brace == "{":
            m = re.match(r"(\w+)\s*:", rest)
            if m and (m.group(1) == "source" or "source" in attrs or "from" in attrs):
                out.append(m.group(1))
        elif "source" in attrs or "from" in attrs:
            out.append(str(k))
    return out


def repeats(src):
    """(line, item, field) for each error in `src` whose message prints its source."""
    src = strip_comments(src)
    hits = []
    for m in re.finditer(r"#\[error\(", src):
        end = balanced(src, m.end() - 1)
        args = split_top(src[m.end():end - 1])
        if not args or args[0] == "transparent" or not args[0].startswith('"'):
            continue
        fmt, rest = args[0], args[1:]
        after = ATTRS.match(src, end + 1 if src.startswith("]", end) else end).end()
        item = ITEM.match(src, after)
        if not item:
            continue
        close = balanced(src, item.end() - 1)
        for field in sources(src[item.end():close - 1], item.group(2)):
            named = re.search(r"\{" + re.escape(field) + r"(\}|:)", fmt)
            used = any(re.search(r"(^|[^\w.])\." + re.escape(field) + r"\b", a) for a in rest)
            if named or used:
                hits.append((src.count("\n", 0, m.start()) + 1, item.group(1), field))
    return hits


def scan(dirs):
    hits = []
    for d in dirs:
        for dp, dn, fn in os.walk(d):
            dn[:] = sorted(x for x in dn if x != "target" and not x.startswith("."))
            for f in sorted(fn):
                if f.endswith(".rs"):
                    p = os.path.join(dp, f)
                    with open(p, encoding="utf-8") as fh:
                        hits += [f"{p}:{line}: {name} {{{field}}}" for line, name, field in repeats(fh.read())]
    return hits


def self_test():
    """Known sources: each way of printing a source is found, the allowed forms are not."""
    cases = [
        ('#[error("reading {path}: {source}")]\nRead { path: String, source: io::Error },', ["Read source"]),
        ('#[error("x: {0}")]\nCfg(#[from] ConfigError),', ["Cfg 0"]),
        ('#[error(\n    "x {} y",\n    .cause.display()\n)]\nA {\n    #[source]\n    cause: E,\n},', ["A cause"]),
        ('#[error("{0:?} failed")]\nB(String, #[source] E),', []),
        ('#[error("{1:?}")]\nB(String, #[source] E),', ["B 1"]),
        ('#[error("reading {path}")]\npub struct R {\n    pub path: String,\n    #[source]\n    pub source: io::Error,\n}', []),
        ('#[error("reading {path}: {source}")]\npub struct R {\n    pub path: String,\n    pub source: io::Error,\n}', ["R source"]),
        ('#[error(transparent)]\nIo(#[from] io::Error),', []),
        ('/// doc\n#[error("a {x}")]\n#[allow(dead_code)]\nC { x: u8, #[from] y: E },', []),
        ('#[error("a")]\nD { #[source] e: E },\n#[error("{}", .e)]\nF { #[from] e: E },', ["F e"]),
        ('// #[error("{0}")] X(#[from] E),\n#[error("{n}")]\nG { n: u8 },', []),
    ]
    bad = 0
    for src, want in cases:
        got = [f"{name} {field}" for _, name, field in repeats(src)]
        if got != want:
            print(f"self-test: {src!r}: found {got}, expected {want}")
            bad += 1
    if bad:
        return 1
    print(f"self-test: {len(cases)} sources parsed as expected")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    hits = scan(argv[1:] or ["crates"])
    print(len(hits))
    for h in hits:
        print(h)
    if hits:
        print("these errors print their source in their message as well: a printer of the chain shows it twice; "
              "leave it out of the message (or use #[error(transparent)])", file=sys.stderr)
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
