#!/usr/bin/env python3
"""Helm post-renderer for the repository's local test cluster (scripts/testenv).

That cluster has a real kubelet node but no kube-proxy and runs the API server without the ServiceAccount
admission plugin, so a pod can neither reach the `kubernetes` Service nor gets a token volume by itself.
This adapts the rendered controller and proxy Deployments to it, leaving the chart as users get it:
- the controller: hostNetwork (the API server listens on the node's loopback), with KUBERNETES_SERVICE_HOST/PORT
  pointing there, its metrics/health bound to E2E_LISTEN_HOST:E2E_METRICS_PORT / E2E_HEALTH_PORT (free ports);
- the proxy keeps the pod network (its replicas have their own IPs and the chart's ports) and reaches the API
  server through the host's TCP relay E2E_APISERVER_RELAY, by a kubeconfig (ConfigMap `flexinfer-e2e-kubeconfig`,
  added to the output) that checks the server's certificate for its `kubernetes` name;
- both get the API-access volume the ServiceAccount admission plugin would add (token, kube-root-ca.crt, namespace).
Reads the manifests on stdin, writes them to stdout. Settings come from the environment:
E2E_APISERVER_PORT, E2E_LISTEN_HOST, E2E_METRICS_PORT, E2E_HEALTH_PORT, E2E_APISERVER_RELAY, E2E_RELEASE_NAMESPACE.
"""
import os
import sys

import yaml

env = os.environ
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
relay_proxies = False
for d in docs:
    if d.get("kind") != "Deployment":
        continue
    name = d["metadata"]["name"]
    host = env["E2E_LISTEN_HOST"]
    if name.endswith("controller"):
        listen = {"FLEXINFER_METRICS_ADDR": f"{host}:{env['E2E_METRICS_PORT']}",
                  "FLEXINFER_HEALTH_ADDR": f"{host}:{env['E2E_HEALTH_PORT']}"}
        ports = {"metrics": env["E2E_METRICS_PORT"], "health": env["E2E_HEALTH_PORT"]}
    elif name.endswith("proxy") and env.get("E2E_APISERVER_RELAY"):
        listen, ports = None, {}
    else:
        continue
    pod = d["spec"]["template"]["spec"]
    if listen is not None:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    else:
        pod.setdefault("volumes", []).append(
            {"name": "e2e-kubeconfig", "configMap": {"name": "flexinfer-e2e-kubeconfig"}})
        relay_proxies = True
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
        if listen is not None:
            override = {
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": env["E2E_APISERVER_PORT"],
                **listen,
            }
        else:
            c["volumeMounts"].append({"name": "e2e-kubeconfig", "mountPath": "/etc/flexinfer-e2e", "readOnly": True})
            override = {"KUBECONFIG": "/etc/flexinfer-e2e/kubeconfig"}
        c["env"] = [e for e in c.get("env", []) if e["name"] not in override]
        c["env"] += [{"name": k, "value": v} for k, v in override.items()]
        for p in c.get("ports", []):
            if p["name"] in ports:
                p["containerPort"] = int(ports[p["name"]])
if relay_proxies:
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "in-pod",
        "clusters": [{"name": "testenv", "cluster": {
            "server": f"https://{env['E2E_APISERVER_RELAY']}",
            "certificate-authority": f"{sa}/ca.crt",
            "tls-server-name": "kubernetes"}}],
        "users": [{"name": "sa", "user": {"tokenFile": f"{sa}/token"}}],
        "contexts": [{"name": "in-pod", "context": {"cluster": "testenv", "user": "sa"}}],
    }
    docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "flexinfer-e2e-kubeconfig", "namespace": env["E2E_RELEASE_NAMESPACE"]},
                 "data": {"kubeconfig": yaml.safe_dump(kubeconfig, sort_keys=False)}})
yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
