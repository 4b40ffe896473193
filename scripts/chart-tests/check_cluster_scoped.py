#!/usr/bin/env python3
"""Fail when a cluster-scoped object in the given rendered manifests carries metadata.namespace."""
import sys

import yaml

CLUSTER = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
           "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
bad = []
for f in sys.argv[1:]:
    for d in yaml.safe_load_all(open(f)):
        if d and d["kind"] in CLUSTER and d["metadata"].get("namespace"):
            bad.append("%s: %s/%s" % (f, d["kind"], d["metadata"]["name"]))
for b in bad:
    print("namespaced cluster-scoped object:", b)
sys.exit(1 if bad else 0)
