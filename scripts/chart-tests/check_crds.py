#!/usr/bin/env python3
"""The chart's templated CRDs (templates/crds.yaml, on stdin) against the generated files they come from.

usage: helm template … --show-only templates/crds.yaml | check_crds.py FILES_DIR keep|nokeep
Each rendered CRD must equal its file in FILES_DIR except for metadata.labels (the chart's labels) and, with
`keep`, exactly the annotation helm.sh/resource-policy: keep (with `nokeep`, no annotations). Every file must be
rendered once. Prints what differs and exits 1.
"""
import glob
import os
import sys

import yaml


def main():
    files_dir, mode = sys.argv[1], sys.argv[2]
    want = {}
    for path in sorted(glob.glob(os.path.join(files_dir, "*.yaml"))):
        doc = yaml.safe_load(open(path))
        want[doc["metadata"]["name"]] = doc
    got = [d for d in yaml.safe_load_all(sys.stdin) if d]
    errors = []
    names = [d.get("metadata", {}).get("name") for d in got]
    if sorted(names) != sorted(want):
        errors.append(f"rendered CRDs {sorted(names)} != files {sorted(want)}")
    for d in got:
        name = d["metadata"]["name"]
        if name not in want:
            continue
        meta = d["metadata"]
        labels = meta.pop("labels", None) or {}
        if labels.get("app.kubernetes.io/managed-by") != "Helm" or "app.kubernetes.io/instance" not in labels:
            errors.append(f"{name}: labels {labels} lack the chart's labels")
        annotations = meta.pop("annotations", None)
        expect = {"helm.sh/resource-policy": "keep"} if mode == "keep" else None
        if annotations != expect:
            errors.append(f"{name}: annotations {annotations}, want {expect}")
        if d != want[name]:
            errors.append(f"{name}: the rendered CRD differs from its file beyond labels and annotations")
    for e in errors:
        print(e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
