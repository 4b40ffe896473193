#!/usr/bin/env python3
"""The `cargo test` argument lists of one test tier (scripts/test.sh), one invocation per line.

Usage: cargo metadata --no-deps --format-version 1 | test-targets.py TIER PKG:TARGET...
  TIER check: every test target of the workspace except the PKG:TARGET given (the ones that need a cluster),
              plus every library's and binary's unit tests and the doc tests;
  TIER only:  exactly the PKG:TARGET given.
Every call selects with `--workspace` (so the features are the ones of `cargo test --workspace`, and nothing
is compiled a second time with others); a target name that several packages use gets a call of its own that
`--exclude`s the packages whose namesake is not wanted. A PKG:TARGET that does not exist is an error: the
list in scripts/test.sh must not go stale.
"""
import json
import sys
from collections import defaultdict


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("check", "only"):
        sys.exit(__doc__)
    tier, listed = sys.argv[1], sys.argv[2:]
    meta = json.load(sys.stdin)
    members = set(meta["workspace_members"])
    owners = defaultdict(set)  # test target name -> packages that have one by that name
    for p in meta["packages"]:
        if p["id"] not in members:
            continue
        for t in p["targets"]:
            if "test" in t["kind"]:
                owners[t["name"]].add(p["name"])
    wanted_pairs = set()
    for item in listed:
        pkg, _, name = item.partition(":")
        if pkg not in owners.get(name, ()):
            sys.exit(f"test-targets: no test target {name!r} in package {pkg!r} (scripts/test.sh lists it)")
        wanted_pairs.add((pkg, name))
    if tier == "check":
        wanted_pairs = {(p, n) for n, ps in owners.items() for p in ps} - wanted_pairs
    workspace_names, partial = [], defaultdict(list)  # partial: packages left out -> names
    for name in sorted(owners):
        pkgs = {p for p in owners[name] if (p, name) in wanted_pairs}
        if not pkgs:
            continue
        if pkgs == owners[name]:
            workspace_names.append(name)
        else:
            partial[tuple(sorted(owners[name] - pkgs))].append(name)
    lines = []
    tests = " ".join(f"--test {n}" for n in workspace_names)
    if tier == "check":
        lines.append(f"--workspace --lib --bins {tests}".strip())
    elif tests:
        lines.append(f"--workspace {tests}")
    for left_out, names in sorted(partial.items()):
        excludes = " ".join(f"--exclude {p}" for p in left_out)
        lines.append(f"--workspace {excludes} " + " ".join(f"--test {n}" for n in names))
    if tier == "check":
        lines.append("--workspace --doc")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
