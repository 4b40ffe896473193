#!/usr/bin/env python3
"""Check that every alert's runbook_url anchor (rules file argv[1]) names a heading of the runbook (argv[2]),
using GitHub's heading-slug rules."""
import re
import sys

import yaml


def slug(text):
    s = text.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


heads = set()
in_code = False
for line in open(sys.argv[2], encoding="utf-8"):
    if line.startswith("```"):
        in_code = not in_code
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m and not in_code:
        heads.add(slug(m.group(1)))
bad = []
for g in yaml.safe_load(open(sys.argv[1]))["groups"]:
    for r in g["rules"]:
        url = r.get("annotations", {}).get("runbook_url", "")
        anchor = url.split("#", 1)[1] if "#" in url else ""
        if anchor not in heads:
            bad.append(f"{r['alert']}: #{anchor}")
for b in bad:
    print("runbook anchor not found:", b)
if bad:
    print("headings:", sorted(heads))
sys.exit(1 if bad else 0)
