#!/usr/bin/env python3
"""Print the URI of the host's apt source that serves SUITE (deb822 *.sources first, then one-line *.list).

usage: apt-mirror.py SUITE      e.g. bookworm, bookworm-security, trixie
The base image is built from the same archive the host's apt uses, so no mirror is named in this repository.
When no source serves SUITE itself (a trixie image built on a bookworm host), the URI of a source of the same
kind (security or not) serving another suite is printed instead, with a note on stderr: Debian mirrors carry
every suite.
"""
import glob
import re
import sys

suite = sys.argv[1]
# (uri, suites) of every enabled deb source, in the order below
found = []
for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    with open(f) as fh:
        blocks = fh.read().split("\n\n")
    for block in blocks:
        fields = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line:
                continue
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" in fields.get("types", "").split() and "uris" in fields:
            found.append((fields["uris"].split()[0], fields.get("suites", "").split()))
for f in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        with open(f) as fh:
            lines = fh.read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m:
            found.append((m.group(2), [m.group(3)]))
for uri, suites in found:
    if suite in suites:
        print(uri)
        sys.exit(0)
# Another suite of the same kind from a Debian archive (…/debian, …/debian-security).
security = suite.endswith("-security")
for uri, suites in found:
    if not re.search(r"/debian(-security)?/?$", uri):
        continue
    if any(s.endswith("-security") == security for s in suites):
        print(f"apt-mirror: no apt source serves {suite}; using {uri} (serves {' '.join(suites)})", file=sys.stderr)
        print(uri)
        sys.exit(0)
sys.exit(f"apt-mirror: no enabled apt source serves {suite}; set BASE_MIRROR / BASE_SECURITY_MIRROR")
