#!/usr/bin/env python3
"""Print the URI of the host's apt source that serves SUITE (deb822 *.sources first, then one-line *.list).

usage: apt-mirror.py SUITE      e.g. bookworm, bookworm-security
The base image is built from the same archive the host's apt uses, so no mirror is named in this repository.
"""
import glob
import re
import sys

suite = sys.argv[1]
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
        if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
            print(fields["uris"].split()[0])
            sys.exit(0)
for f in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        with open(f) as fh:
            lines = fh.read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m and m.group(3) == suite:
            print(m.group(2))
            sys.exit(0)
sys.exit(f"apt-mirror: no enabled apt source serves {suite}; set BASE_MIRROR / BASE_SECURITY_MIRROR")
