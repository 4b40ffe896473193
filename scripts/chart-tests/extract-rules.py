#!/usr/bin/env python3
"""Extract PrometheusRule groups from `helm template` output (stdin) into a Prometheus rule file.

usage: helm template ... | extract-rules.py OUT_FULL.yaml [OUT_NO_ANNOTATIONS.yaml]
The second file drops annotations so `promtool test rules` can compare alert labels only
(annotation templates are still checked by `promtool check rules` on the first file).
"""
import copy
import sys

import yaml

docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
rules = [d for d in docs if d.get("kind") == "PrometheusRule"]
if len(rules) != 1:
    sys.exit(f"expected exactly one PrometheusRule in the rendered chart, found {len(rules)}")
groups = rules[0]["spec"]["groups"]
with open(sys.argv[1], "w") as f:
    yaml.safe_dump({"groups": groups}, f, sort_keys=False)
if len(sys.argv) > 2:
    bare = copy.deepcopy(groups)
    for g in bare:
        for r in g["rules"]:
            r.pop("annotations", None)
    with open(sys.argv[2], "w") as f:
        yaml.safe_dump({"groups": bare}, f, sort_keys=False)
n = sum(len(g["rules"]) for g in groups)
print(f"extracted {len(groups)} groups, {n} rules: " + ", ".join(r.get("alert", r.get("record", "?")) for g in groups for r in g["rules"]))
