#!/usr/bin/env python3
"""Helm post-renderer for the repository's local test cluster (scripts/testenv).

That cluster has a real kubelet node but no kube-proxy and runs the API server without the ServiceAccount
admission plugin, so a pod can neither reach the `kubernetes` Service nor gets a token volume by itself.
This adapts the rendered controller and proxy Deployments to it, leaving the chart as users get it:
- hostNetwork (the API server listens on the node's loopback), with KUBERNETES_SERVICE_HOST/PORT pointing there;
- the API-access volume the ServiceAccount admission plugin would add (token, kube-root-ca.crt, namespace);
- the controller's metrics/health bound to E2E_LISTEN_HOST:E2E_METRICS_PORT / E2E_HEALTH_PORT, the proxy's
  OpenAI port and health port to E2E_LISTEN_HOST:E2E_PROXY_PORT / E2E_PROXY_HEALTH_PORT (free ports on the node).
Reads the manifests on stdin, writes them to stdout. Settings come from the environment:
E2E_APISERVER_PORT, E2E_LISTEN_HOST, E2E_METRICS_PORT, E2E_HEALTH_PORT, E2E_PROXY_PORT, E2E_PROXY_HEALTH_PORT.
"""
import os
import sys

import yaml

env = os.environ
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
for d in docs:
    if d.get("kind") != "Deployment":
        continue
    name = d["metadata"]["name"]
    host = env["E2E_LISTEN_HOST"]
    if name.endswith("controller"):
        listen = {"FLEXINFER_METRICS_ADDR": f"{host}:{env['E2E_METRICS_PORT']}",
                  "FLEXINFER_HEALTH_ADDR": f"{host}:{env['E2E_HEALTH_PORT']}"}
        ports = {"metrics": env["E2E_METRICS_PORT"], "health": env["E2E_HEALTH_PORT"]}
    elif name.endswith("proxy") and env.get("E2E_PROXY_PORT"):
        listen = {"FLEXINFER_PROXY_LISTEN_ADDR": f"{host}:{env['E2E_PROXY_PORT']}",
                  "FLEXINFER_PROXY_HEALTH_ADDR": f"{host}:{env['E2E_PROXY_HEALTH_PORT']}"}
        ports = {"http": env["E2E_PROXY_PORT"], "health": env["E2E_PROXY_HEALTH_PORT"]}
    else:
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
    for c in pod["containers"]:
        c.setdefault("volumeMounts", []).append({
            "name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True})
        override = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": env["E2E_APISERVER_PORT"],
            **listen,
        }
        c["env"] = [e for e in c.get("env", []) if e["name"] not in override]
        c["env"] += [{"name": k, "value": v} for k, v in override.items()]
        for p in c.get("ports", []):
            if p["name"] in ports:
                p["containerPort"] = int(ports[p["name"]])
yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
