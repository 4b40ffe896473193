#!/usr/bin/env python3
"""Assertions on `helm template` output (stdin) or a live Deployment (kubectl get -o json).

usage:
  helm template ... | check_render.py defaults|allon
  helm template ... | check_render.py netpol NS,NS,... [EXTRA_RULES]   (the serving NetworkPolicies)
  kubectl get deploy X -o json | check_render.py live-env defaults|allon
Prints one line per failed assertion and exits 1 on any failure.
"""
import json
import os
import re
import sys

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
APP = yaml.safe_load(open(os.path.join(ROOT, "charts/flexinfer/Chart.yaml")))["appVersion"]
W = "ghcr.io/flexinfer/flexinfer-worker:" + APP
R = "registry.example.com/flexinfer/quantizer:"

ENV = {
    "defaults": {
        "RUST_LOG": "info",
        "FLEXINFER_LEADER_ELECT": "true",
        "FLEXINFER_NAMESPACE": {"fieldRef": "metadata.namespace"},
        "POD_NAME": {"fieldRef": "metadata.name"},
        "FLEXINFER_WORKER_IMAGE": W,
        "FLEXINFER_WORKER_SERVICE_ACCOUNT": "flexinfer-worker",
        "FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS": "600",
        "FLEXINFER_QUANTIZER_GPTQ_IMAGE": W + "-cuda",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE": W + "-rocm-gfx1100",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX1100_IMAGE": W + "-rocm-gfx1100",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE": W + "-rocm-gfx906",
        "FLEXINFER_QUANTIZER_IMAGE_GPTQ": W + "-cuda",
        # The llama.cpp images FlexInfer builds; no vendor-blind FLEXINFER_RUNTIME_IMAGE_* by default (the
        # controller's table picks by GPU vendor and architecture).
        "FLEXINFER_LLAMACPP_IMAGE": "ghcr.io/flexinfer/flexinfer-llamacpp:" + APP,
        # Each Model's NetworkPolicy admits only the release's proxy pods (proxy and its policy on by default).
        "FLEXINFER_PROXY_NAMESPACE": "flexinfer-system",
        "FLEXINFER_PROXY_POD_LABELS": "app.kubernetes.io/name=flexinfer,app.kubernetes.io/instance=flexinfer,"
                                      "app.kubernetes.io/component=proxy",
    },
    "allon": {
        "RUST_LOG": "info",
        "FLEXINFER_LEADER_ELECT": "true",
        "FLEXINFER_NAMESPACE": {"fieldRef": "metadata.namespace"},
        "POD_NAME": {"fieldRef": "metadata.name"},
        "FLEXINFER_WORKER_IMAGE": W,
        "FLEXINFER_WORKER_SERVICE_ACCOUNT": "flexinfer-worker",
        "FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS": "600",
        "FLEXINFER_QUANTIZER_GPTQ_IMAGE": R + "gptq-cuda",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE": R + "gptq-rocm",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX1100_IMAGE": R + "gptq-rocm-gfx1100",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE": R + "gptq-rocm-gfx906",
        "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX1030_IMAGE": R + "gptq-rocm-gfx1030",
        "FLEXINFER_QUANTIZER_IMAGE_GGUF": R + "gguf",
        "FLEXINFER_QUANTIZER_IMAGE_AWQ": R + "awq",
        "FLEXINFER_QUANTIZER_IMAGE_GPTQ": R + "gptq",
        "FLEXINFER_QUANTIZER_IMAGE_EXL2": R + "exl2",
        "FLEXINFER_QUANTIZER_IMAGE_FP8": R + "fp8",
        "FLEXINFER_GPTQ_MAX_RTN_FALLBACK_PERCENT": "5",
        "FLEXINFER_GPTQ_RESUME_LAYERS": "false",
        "FLEXINFER_GPU_SUPPLEMENTAL_GROUPS": "44,110",
        "FLEXINFER_CREDENTIAL_REGISTRIES": "ghcr.io,registry.local:5000",
        "FLEXINFER_RUNTIME_IMAGE_VLLM": "registry.example.com/vllm/vllm-openai:v0.9.2",
        "FLEXINFER_LLAMACPP_IMAGE": "registry.example.com/flexinfer/llamacpp:7",
        "FLEXINFER_PROXY_NAMESPACE": "flexinfer-system",
        "FLEXINFER_PROXY_POD_LABELS": "app.kubernetes.io/name=flexinfer,app.kubernetes.io/instance=flexinfer,"
                                      "app.kubernetes.io/component=proxy",
        "FLEXINFER_RETRY_BASE_SECONDS": "30",
    },
}
# The proxy (on by default) adds a Deployment, a Service, a ServiceAccount, a ClusterRole(Binding) and, with its
# two replicas, a PodDisruptionBudget; the release installs the three CRDs (crds.install).
KINDS = {
    "defaults": {
        "ServiceAccount": 3, "ClusterRole": 2, "ClusterRoleBinding": 2, "Role": 1, "RoleBinding": 1,
        "Deployment": 2, "Service": 3, "ValidatingAdmissionPolicy": 1, "ValidatingAdmissionPolicyBinding": 1,
        "PodDisruptionBudget": 1, "CustomResourceDefinition": 3,
    },
}
PROXY_ENV = {
    "defaults": {
        "RUST_LOG": "info",
        "FLEXINFER_PROXY_LISTEN_ADDR": "0.0.0.0:8000",
        "FLEXINFER_PROXY_HEALTH_ADDR": "0.0.0.0:8081",
        "FLEXINFER_PROXY_KEEPALIVE_INTERVAL": "30s",
        # No FLEXINFER_PROXY_MAX_BODY_BYTES / BODY_MEMORY_BYTES: the proxy derives them from its memory limit.
    },
}
PROXY_ENV["allon"] = dict(PROXY_ENV["defaults"], FLEXINFER_PROXY_KEEPALIVE_INTERVAL="15s",
                          FLEXINFER_PROXY_API_KEYS_FILE="/etc/flexinfer-proxy/auth/keys",
                          FLEXINFER_PROXY_WATCH_NAMESPACE="models",
                          FLEXINFER_PROXY_MAX_BODY_BYTES="4194304",
                          FLEXINFER_PROXY_BODY_MEMORY_BYTES="67108864")
# Exactly what the proxy calls: watch Models, Services and EndpointSlices, patch models/status.
PROXY_RULES = [
    (["ai.flexinfer"], ["models"], ["get", "list", "watch"]),
    (["ai.flexinfer"], ["models/status"], ["get", "patch"]),
    ([""], ["services"], ["list", "watch"]),
    (["discovery.k8s.io"], ["endpointslices"], ["list", "watch"]),
]
# proxy.backendKeys.enabled adds get on Secrets (the Models' backend keys), nothing more.
PROXY_RULES_BACKEND_KEYS = PROXY_RULES + [([""], ["secrets"], ["get"])]
# All-on: proxy.watchNamespace=models, so one serving NetworkPolicy there.
KINDS["allon"] = dict(KINDS["defaults"], PrometheusRule=1, ServiceMonitor=2, GPUProfile=3, ConfigMap=1,
                      NetworkPolicy=1, Ingress=1, HTTPRoute=1)
# The labels the Model controller puts on a serving pod (crates/flexinfer-controller/src/model/render.rs,
# child_labels) for a vLLM Model "m".
SERVING_POD = {
    "app.kubernetes.io/managed-by": "flexinfer", "app.kubernetes.io/part-of": "flexinfer",
    "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "m",
    "app.kubernetes.io/component": "inference-server", "flexinfer.ai/model": "m",
}

# The shipped profiles' runtime.images in the all-on render (runtime.llamacpp = registry.example.com/flexinfer/llamacpp:7).
PROFILE_IMAGES = {
    "gfx1100": {"vllm": "docker.io/vllm/vllm-openai-rocm:v0.18.0", "ollama": "docker.io/ollama/ollama:0.12.6-rocm",
                "llamacpp": "registry.example.com/flexinfer/llamacpp:7-rocm"},
    "gfx906": {"ollama": "docker.io/ollama/ollama:0.12.6-rocm", "llamacpp": "registry.example.com/flexinfer/llamacpp:7-rocm"},
    "nvidia-sm89": {"vllm": "docker.io/vllm/vllm-openai:v0.18.0", "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda-b11206",
                    "ollama": "docker.io/ollama/ollama:0.12.6",
                    "exllamav2": "ghcr.io/theroyallab/tabbyapi@sha256:"
                                 "cbceb3032963ab7ada80c76649956b01f54e9e0b04a050fb3396c95950c52b03"},
}

errors = []


def built_for(img):
    """"cuda", "rocm" or None, by the rules of built_for in crates/flexinfer-controller/src/model/images.rs."""
    ref = img.split("@")[0]
    name, tag = (ref.rsplit(":", 1) + [""])[:2] if ":" in ref.rsplit("/", 1)[-1] else (ref, "")
    words = [w for w in re.split(r"[-_.]", tag) + re.split(r"[-_.]", name.rsplit("/", 1)[-1]) if w]
    rocm = any(w.startswith("rocm") for w in words)
    cuda = any(w.startswith("cuda") or re.fullmatch(r"cu[0-9]{2,3}", w) for w in words)
    if rocm or cuda:
        return None if rocm and cuda else ("rocm" if rocm else "cuda")
    if name.endswith(("/vllm-openai-rocm", "rocm/vllm")):
        return "rocm"
    if name.endswith(("vllm/vllm-openai", "theroyallab/tabbyapi")) or (name.endswith("ollama/ollama") and tag):
        return "cuda"
    return None


def check_vendor_images(name, vendor, images):
    """No image of the other vendor, and every image pinned (a tag other than latest, or a digest)."""
    for backend, img in images.items():
        b = built_for(img)
        check(not (vendor == "amd" and b == "cuda"), f"GPUProfile {name}: {backend} image {img} is a CUDA build on AMD")
        check(not (vendor == "nvidia" and b == "rocm"), f"GPUProfile {name}: {backend} image {img} is a ROCm build on NVIDIA")
        last = img.split("@")[0].rsplit("/", 1)[-1]
        # A version in the tag (v0.18.0, 0.12.6-rocm, server-cuda-b11206); `latest`, `rocm`, `server` float.
        pinned = "@sha256:" in img or (":" in last and re.search(r"[0-9]", last.rsplit(":", 1)[1]) is not None)
        check(pinned, f"GPUProfile {name}: {backend} image {img} is not pinned")


def check(cond, msg):
    if not cond:
        errors.append(msg)


def env_of(dep):
    c = dep["spec"]["template"]["spec"]["containers"][0]
    out = {}
    for e in c.get("env", []):
        check(e["name"] not in out, f"duplicate env {e['name']}")
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            out[e["name"]] = {"fieldRef": e["valueFrom"]["fieldRef"]["fieldPath"]}
        else:
            out[e["name"]] = e.get("valueFrom")
    return out


def component(d):
    return d["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def check_env(dep, mode, table=ENV):
    got = env_of(dep)
    want = table[mode]
    for k, v in want.items():
        check(got.get(k) == v, f"env {k}: want {v!r}, got {got.get(k)!r}")
    extra = sorted(set(got) - set(want))
    check(not extra, f"unexpected env {extra}")
    check(not any(isinstance(v, str) and not v for v in got.values()), "empty env value rendered")


def check_deployment(dep, mode):
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    check(dep["spec"]["replicas"] == (2 if mode == "allon" else 1), "replicas")
    check(c["image"] == "ghcr.io/flexinfer/flexinfer-controller:" + APP, f"controller image {c['image']}")
    check(not c.get("args") and not c.get("command"), "controller takes no args")
    psc = spec.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True, "pod runAsNonRoot")
    check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "pod seccomp RuntimeDefault")
    sc = c.get("securityContext", {})
    check(sc.get("runAsNonRoot") is True, "container runAsNonRoot")
    check(sc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem")
    check(sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation false")
    check(sc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities drop ALL")
    check(not sc.get("capabilities", {}).get("add"), "no added capabilities")
    check(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "container seccomp RuntimeDefault")
    check(not sc.get("privileged"), "not privileged")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(ports == {"metrics": 8080, "health": 8081}, f"ports {ports}")
    check(c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/healthz", "liveness /healthz")
    check(c.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/readyz", "readiness /readyz")
    check(c.get("livenessProbe", {}).get("httpGet", {}).get("port") == "health", "liveness on health port")
    check(c.get("resources", {}).get("requests") and c.get("resources", {}).get("limits"), "resources set")
    check_env(dep, mode)


def check_rbac(docs):
    for d in docs:
        if d["kind"] not in ("ClusterRole", "Role"):
            continue
        for r in d.get("rules", []):
            check("*" not in r.get("verbs", []) and "*" not in r.get("resources", []) and "*" not in r.get("apiGroups", []),
                  f"{d['kind']} {d['metadata']['name']} has a wildcard rule {r}")
            check(not any(x.startswith("secrets") for x in r.get("resources", [])),
                  f"{d['kind']} {d['metadata']['name']} grants Secrets")
            if d["kind"] == "ClusterRole":
                check("leases" not in r.get("resources", []), "leases must be a namespaced Role")


def subset(a, b):
    return all(b.get(k) == v for k, v in (a or {}).items())


def check_wiring(docs):
    """Selectors, ports and ServiceAccount references point at each other."""
    by = {}
    for d in docs:
        by.setdefault(d["kind"], []).append(d)
    dep = [d for d in by["Deployment"] if component(d) == "controller"][0]
    pod = dep["spec"]["template"]
    check(subset(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), "Deployment selector matches pod labels")
    sa = pod["spec"]["serviceAccountName"]
    check(any(d["metadata"]["name"] == sa for d in by.get("ServiceAccount", [])), f"pod ServiceAccount {sa} rendered")
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        for b in [d for d in by.get(kind, []) if component(d) == "controller"]:
            check([s["name"] for s in b["subjects"]] == [sa], f"{kind} {b['metadata']['name']} binds {sa}")
            role = b["roleRef"]["name"]
            check(any(r["metadata"]["name"] == role for r in by.get(b["roleRef"]["kind"], [])), f"{kind} roleRef {role} rendered")
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    for svc in [d for d in by.get("Service", []) if component(d) == "controller"]:
        check(subset(svc["spec"]["selector"], pod["metadata"]["labels"]), "metrics Service selects the controller pod")
        check(all(p["targetPort"] in ports for p in svc["spec"]["ports"]), "Service targetPort names a container port")
        for sm in [d for d in by.get("ServiceMonitor", []) if component(d) == "controller"]:
            check(subset(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]), "ServiceMonitor selects the metrics Service")
            check({e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]},
                  "ServiceMonitor endpoint port exists on the Service")
            check(all(e.get("path") == "/metrics" for e in sm["spec"]["endpoints"]), "ServiceMonitor path /metrics")
            check(all(e.get("honorLabels") is True for e in sm["spec"]["endpoints"]),
                  "ServiceMonitor keeps the series' own namespace label (honorLabels)")
    for b in by.get("ValidatingAdmissionPolicyBinding", []):
        check(any(p["metadata"]["name"] == b["spec"]["policyName"] for p in by.get("ValidatingAdmissionPolicy", [])),
              "binding references the policy")


def check_proxy(docs, mode):
    """The proxy: Deployment (HA), Service, its own ServiceAccount and least-privilege ClusterRole."""
    mine = [d for d in docs if component(d) == "proxy"]
    by = {}
    for d in mine:
        by.setdefault(d["kind"], []).append(d)
    want = ["ClusterRole", "ClusterRoleBinding", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
    if mode == "allon":
        want = sorted(want + ["HTTPRoute", "Ingress", "NetworkPolicy", "ServiceMonitor"])
    check(sorted(by) == want, f"proxy objects {sorted(by)}")
    if "Deployment" not in by:
        return
    dep = by["Deployment"][0]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    c = spec["containers"][0]
    check(dep["spec"]["replicas"] == 2, "proxy replicas 2 (HA)")
    check(dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "proxy rolls without losing capacity")
    check(c["image"] == "ghcr.io/flexinfer/flexinfer-proxy:" + APP, f"proxy image {c['image']}")
    check(subset(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), "proxy selector matches its pods")
    ctl = [d for d in docs if d["kind"] == "Deployment" and component(d) == "controller"][0]
    check(not subset(dep["spec"]["selector"]["matchLabels"], ctl["spec"]["template"]["metadata"]["labels"]),
          "proxy selector does not select controller pods")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(ports == {"http": 8000, "health": 8081}, f"proxy ports {ports}")
    check(c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}, "proxy readiness /readyz")
    check(c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}, "proxy liveness /healthz")
    sc = c.get("securityContext", {})
    check(sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False
          and sc.get("capabilities", {}).get("drop") == ["ALL"] and sc.get("runAsNonRoot") is True,
          "proxy container security context")
    check(spec.get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault", "proxy pod seccomp")
    check(spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"], "proxy replicas spread")
    check_env(dep, mode, PROXY_ENV)
    if mode == "allon":
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        check(mounts.get("auth", {}).get("mountPath") == "/etc/flexinfer-proxy/auth"
              and mounts["auth"].get("readOnly") is True, "API keys mounted read-only")
        check(vols.get("auth", {}).get("secret", {}).get("secretName") == "proxy-api-keys", "API keys from the Secret")
    else:
        check(not c.get("volumeMounts") and not spec.get("volumes"), "no auth volume without auth.existingSecret")
    sa = spec["serviceAccountName"]
    check(sa.endswith("-proxy") and any(d["metadata"]["name"] == sa for d in by.get("ServiceAccount", [])),
          f"proxy runs as its own ServiceAccount ({sa})")
    svcs = {d["metadata"]["name"]: d for d in by["Service"]}
    svc = svcs.get(sa, by["Service"][0])
    check(svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"], "proxy Service selects the proxy pods")
    check([(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(8000, "http")], "proxy Service port 8000 -> http")
    msvc = svcs.get(sa + "-metrics")
    check(msvc is not None and msvc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
          and [(p["name"], p["targetPort"]) for p in msvc["spec"]["ports"]] == [("metrics", "health")],
          "proxy metrics Service -> health port (/metrics)")
    for sm in by.get("ServiceMonitor", []):
        check(msvc is not None and subset(sm["spec"]["selector"]["matchLabels"], msvc["metadata"]["labels"])
              and not subset(sm["spec"]["selector"]["matchLabels"], ctl["metadata"]["labels"])
              and [(e["port"], e.get("path")) for e in sm["spec"]["endpoints"]] == [("metrics", "/metrics")],
              "proxy ServiceMonitor scrapes the proxy's /metrics")
        check(all(e.get("honorLabels") is True for e in sm["spec"]["endpoints"]),
              "proxy ServiceMonitor keeps the series' own labels (honorLabels)")
    role = by["ClusterRole"][0]
    rules = [(r["apiGroups"], r["resources"], r["verbs"]) for r in role["rules"]]
    check(rules == PROXY_RULES, f"proxy ClusterRole rules {rules}")
    b = by["ClusterRoleBinding"][0]
    check(b["roleRef"]["name"] == role["metadata"]["name"] and [s["name"] for s in b["subjects"]] == [sa],
          "proxy ClusterRoleBinding binds its ServiceAccount to its role")


def check_netpol(docs, namespaces, extra_rules=0):
    """One serving NetworkPolicy per namespace: serving pods, ingress only from the proxy pods on 8000."""
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"]
    got = sorted(d["metadata"]["namespace"] for d in pols)
    check(got == sorted(namespaces), f"NetworkPolicy namespaces: want {sorted(namespaces)}, got {got}")
    proxy = [d for d in docs if d["kind"] == "Deployment" and component(d) == "proxy"]
    ctl = [d for d in docs if d["kind"] == "Deployment" and component(d) == "controller"]
    for pol in pols:
        ns = pol["metadata"]["namespace"]
        spec = pol["spec"]
        sel = spec["podSelector"]["matchLabels"]
        check(subset(sel, SERVING_POD), f"{ns}: policy selects the serving pods ({sel})")
        for d in proxy + ctl:
            check(not subset(sel, d["spec"]["template"]["metadata"]["labels"]),
                  f"{ns}: policy does not select {component(d)} pods")
        check(spec["policyTypes"] == ["Ingress"], f"{ns}: policyTypes Ingress only")
        rules = spec.get("ingress", [])
        check(len(rules) == 1 + extra_rules, f"{ns}: {len(rules)} ingress rules, want {1 + extra_rules}")
        if not rules or not proxy:
            continue
        peers = rules[0]["from"]
        check(len(peers) == 1, f"{ns}: one peer (the proxy)")
        peer = peers[0]
        check(peer.get("namespaceSelector", {}).get("matchLabels") ==
              {"kubernetes.io/metadata.name": proxy[0]["metadata"]["namespace"]},
              f"{ns}: peer namespace is the proxy's ({peer.get('namespaceSelector')})")
        check(peer.get("podSelector", {}).get("matchLabels") == proxy[0]["spec"]["selector"]["matchLabels"],
              f"{ns}: peer pods are the proxy's")
        check(subset(peer["podSelector"]["matchLabels"], proxy[0]["spec"]["template"]["metadata"]["labels"]),
              f"{ns}: peer selector matches the proxy pods' labels")
        for d in ctl:
            check(not subset(peer["podSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]),
                  f"{ns}: peer selector does not admit controller pods")
        check(rules[0]["ports"] == [{"port": 8000, "protocol": "TCP"}], f"{ns}: port 8000/TCP only")


def check_static(docs, mode):
    counts = {}
    for d in docs:
        counts[d["kind"]] = counts.get(d["kind"], 0) + 1
    check(counts == KINDS[mode], f"kinds: want {KINDS[mode]}, got {counts}")
    deps = [d for d in docs if d["kind"] == "Deployment" and component(d) == "controller"]
    if deps:
        check_deployment(deps[0], mode)
    check_proxy(docs, mode)
    check_netpol(docs, ["models"] if mode == "allon" else [])
    for d in docs:
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "flexinfer-worker":
            check(d.get("automountServiceAccountToken") is False, "worker SA must not automount its token")
    check(any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "flexinfer-worker" for d in docs),
          "worker ServiceAccount flexinfer-worker")
    check_rbac(docs)
    check_wiring(docs)
    for d in docs:
        if d["kind"] == "GPUProfile":
            check(d["apiVersion"] == "ai.flexinfer/v1alpha2", "GPUProfile apiVersion")
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "GPUProfile")
    if mode == "allon":
        check(names == ["gfx1100", "gfx906", "nvidia-sm89"], f"GPUProfiles {names}")
        # Each profile names the controller's default image of every backend that has one on its architecture
        # (crates/flexinfer-controller/src/model/images.rs, TABLE): ROCm builds on AMD, CUDA builds on NVIDIA.
        for d in docs:
            if d["kind"] != "GPUProfile":
                continue
            name = d["metadata"]["name"]
            got = d["spec"].get("runtime", {}).get("images", {})
            want = PROFILE_IMAGES[name]
            check(got == want, f"GPUProfile {name}: runtime.images {got}, want {want}")
            check_vendor_images(name, d["spec"]["vendor"], got)
        b = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"][0]
        check(b["spec"]["validationActions"] == ["Deny"], "binding Deny")


def main():
    if sys.argv[1] == "live-env":
        dep = json.load(sys.stdin)
        # The proxy peer names the installed release and its namespace.
        meta = dep["metadata"]
        rel = meta.get("labels", {}).get("app.kubernetes.io/instance", "")
        want = dict(ENV[sys.argv[2]], FLEXINFER_PROXY_NAMESPACE=meta["namespace"],
                    FLEXINFER_PROXY_POD_LABELS="app.kubernetes.io/name=flexinfer,app.kubernetes.io/instance="
                    f"{rel},app.kubernetes.io/component=proxy")
        check_env(dep, sys.argv[2], {sys.argv[2]: want})
    elif sys.argv[1] == "backend-keys":
        # backend-keys on|off N: the proxy's N roles (ClusterRole, or a Role per watched namespace) hold exactly the
        # proxy's rules, plus get on Secrets when on.
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
        roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and component(d) == "proxy"]
        want = PROXY_RULES_BACKEND_KEYS if sys.argv[2] == "on" else PROXY_RULES
        check(len(roles) == int(sys.argv[3]), f"{len(roles)} proxy roles, want {sys.argv[3]}")
        for r in roles:
            rules = [(x["apiGroups"], x["resources"], x["verbs"]) for x in r["rules"]]
            check(rules == want, f"{r['kind']} {r['metadata'].get('namespace', '')}: rules {rules}")
    elif sys.argv[1] == "profile":
        # profile NAME VENDOR KEY=IMAGE... [spec.FIELD=JSON...]: the rendered GPUProfile NAME names exactly these
        # runtime images (and has these spec fields).
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
        p = [d for d in docs if d["kind"] == "GPUProfile" and d["metadata"]["name"] == sys.argv[2]]
        check(len(p) == 1, f"one GPUProfile {sys.argv[2]}")
        if p:
            got = p[0]["spec"].get("runtime", {}).get("images", {})
            args = dict(a.split("=", 1) for a in sys.argv[4:])
            want = {k: v for k, v in args.items() if not k.startswith("spec.")}
            check(got == want, f"GPUProfile {sys.argv[2]}: runtime.images {got}, want {want}")
            check_vendor_images(sys.argv[2], sys.argv[3], got)
            for k, v in args.items():
                if k.startswith("spec."):
                    have = p[0]["spec"].get(k[5:])
                    check(have == json.loads(v), f"GPUProfile {sys.argv[2]}: {k} {have!r}, want {v}")
    elif sys.argv[1] == "netpol":
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
        check_netpol(docs, [n for n in sys.argv[2].split(",") if n], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
        check_static(docs, sys.argv[1])
    for e in errors:
        print("FAIL:", e)
    sys.exit(1 if errors else 0)


main()
