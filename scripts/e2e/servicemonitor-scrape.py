#!/usr/bin/env python3
"""The Prometheus scrape config that prometheus-operator generates for the chart's controller ServiceMonitor.

usage: helm template ... --set serviceMonitor.enabled=true | servicemonitor-scrape.py INTERVAL OUT.json TARGETS.json [--discover]

The real Prometheus of the e2e kill test scrapes the controller through it, so the labels it sees are the ones a
cluster with prometheus-operator sees: the operator's target labels (`namespace` and `service` of the scraped
Service, `pod`, `endpoint`, `job`) and the endpoint's `honorLabels` as `honor_labels` — which decides whether the
series' own `namespace` (the cache's) survives or becomes `exported_namespace`. Debian's Prometheus is built
without Kubernetes service discovery, so this script does the discovery the operator's config would do: with
`--discover` it lists, with kubectl, the EndpointSlices of the Services in the ServiceMonitor's namespaces that
carry its selector labels, and writes their ready addresses on the endpoint's port, with those target labels, to
TARGETS.json (file_sd; without `--discover` the file is an empty list). Only what the chart's ServiceMonitor uses
is translated; anything else is refused, so the test cannot pass on a config that silently differs from the
chart's. The scrape interval is the test's (the chart's 30 s would not fit in it). JSON is YAML: Prometheus reads
OUT.json as a scrape config.
"""
import json
import os
import subprocess
import sys

import yaml

HANDLED_SPEC = {"namespaceSelector", "selector", "endpoints"}
HANDLED_ENDPOINT = {"port", "path", "honorLabels", "interval", "scrapeTimeout"}


def kubectl_json(*args):
    out = subprocess.run(["kubectl", *args, "-o", "json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["items"]


def discover(spec, port):
    selector = ",".join(f"{k}={v}" for k, v in sorted(spec["selector"]["matchLabels"].items()))
    groups = []
    for ns in spec["namespaceSelector"]["matchNames"]:
        for svc in kubectl_json("get", "services", "-n", ns, "-l", selector):
            name = svc["metadata"]["name"]
            if not any(p.get("name") == port for p in svc["spec"].get("ports", [])):
                continue
            for sl in kubectl_json("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={name}"):
                num = next((p["port"] for p in sl.get("ports") or [] if p.get("name") == port), None)
                if num is None:
                    continue
                for ep in sl.get("endpoints") or []:
                    if (ep.get("conditions") or {}).get("ready") is False:
                        continue
                    pod = (ep.get("targetRef") or {}).get("name", "")
                    for addr in ep.get("addresses") or []:
                        groups.append({"targets": [f"{addr}:{num}"],
                                       "labels": {"namespace": ns, "service": name, "pod": pod,
                                                  "endpoint": port, "job": name}})
    return groups


def main():
    args = [a for a in sys.argv[1:] if a != "--discover"]
    if len(args) != 3:
        sys.exit(__doc__)
    interval, out, targets = args
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    monitors = [
        d for d in docs
        if d.get("kind") == "ServiceMonitor"
        and d["spec"].get("selector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "controller"
    ]
    if len(monitors) != 1:
        sys.exit(f"expected one controller ServiceMonitor in the rendered chart, found {len(monitors)}")
    m = monitors[0]
    spec = m["spec"]
    extra = set(spec) - HANDLED_SPEC
    if extra or set(spec["selector"]) - {"matchLabels"} or len(spec["endpoints"]) != 1:
        sys.exit(f"the ServiceMonitor uses fields this translation does not handle: {sorted(extra)} {spec}")
    ep = spec["endpoints"][0]
    if set(ep) - HANDLED_ENDPOINT:
        sys.exit(f"the ServiceMonitor endpoint uses fields this translation does not handle: {sorted(set(ep) - HANDLED_ENDPOINT)}")
    groups = discover(spec, ep["port"]) if "--discover" in sys.argv else []
    with open(targets, "w") as f:
        json.dump(groups, f, indent=1)
    ns, name = m["metadata"]["namespace"], m["metadata"]["name"]
    config = {
        "job_name": f"serviceMonitor/{ns}/{name}/0",
        "honor_labels": bool(ep.get("honorLabels", False)),
        "metrics_path": ep.get("path", "/metrics"),
        "scrape_interval": interval,
        "file_sd_configs": [{"files": [os.path.abspath(targets)], "refresh_interval": "5s"}],
    }
    with open(out, "w") as f:
        json.dump(config, f, indent=1)
    print(f"scrape config of ServiceMonitor {ns}/{name}: honor_labels={config['honor_labels']}, "
          f"{len(groups)} targets", file=sys.stderr)


main()
