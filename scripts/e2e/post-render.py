#!/usr/bin/env python3
"""Helm post-renderer for the repository's local test cluster (scripts/testenv).

That cluster has a real kubelet node but no kube-proxy and runs the API server without the ServiceAccount
admission plugin, so a pod can neither reach the `kubernetes` Service nor gets a token volume by itself.
This adapts the rendered controller Deployment to it, leaving the chart as users get it:
- hostNetwork (the API server listens on the node's loopback), with KUBERNETES_SERVICE_HOST/PORT pointing there;
- the API-access volume the ServiceAccount admission plugin would add (token, kube-root-ca.crt, namespace);
- metrics/health bound to E2E_LISTEN_HOST:E2E_METRICS_PORT / E2E_HEALTH_PORT (free ports on the node).
Reads the manifests on stdin, writes them to stdout. Settings come from the environment:
E2E_APISERVER_PORT, E2E_LISTEN_HOST, E2E_METRICS_PORT, E2E_HEALTH_PORT.
"""
import os
import sys

import yaml

env = os.environ
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
for d in docs:
    if d.get("kind") != "Deployment" or not d["metadata"]["name"].endswith("controller"):
        continue
    pod = d["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    pod.setdefault("volumes", []).append({
        "name": "kube-api-access",
        "projected": {"defaultMode": 0o444, "sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
        ]},
    })
    host, mp, hp = env["E2E_LISTEN_HOST"], env["E2E_METRICS_PORT"], env["E2E_HEALTH_PORT"]
    for c in pod["containers"]:
        c.setdefault("volumeMounts", []).append({
            "name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True})
        override = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": env["E2E_APISERVER_PORT"],
            "FLEXINFER_METRICS_ADDR": f"{host}:{mp}",
            "FLEXINFER_HEALTH_ADDR": f"{host}:{hp}",
        }
        c["env"] = [e for e in c.get("env", []) if e["name"] not in override]
        c["env"] += [{"name": k, "value": v} for k, v in override.items()]
        for p in c.get("ports", []):
            p["containerPort"] = int(mp if p["name"] == "metrics" else hp)
yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
