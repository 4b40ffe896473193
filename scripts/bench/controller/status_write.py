#!/usr/bin/env python3
# Benchmark (not a test): what one ModelCache status write costs the API server, server-side apply of the
# whole status (what the controller sends) against a JSON merge patch of only the changed fields, both
# conditional on the resourceVersion; alternated twice. Needs an API server from scripts/testenv/up.sh and
# the CRDs:
#   export TESTENV_BIN=$HOME/.cache/testenv/v1.34.4/bin PATH=$TESTENV_BIN:$PATH
#   eval "$(bash scripts/testenv/up.sh api)"; kubectl apply --server-side -k deploy/crds/
#   python3 scripts/bench/controller/status_write.py 200 5; bash scripts/testenv/down.sh "$TESTENV_DIR"
# Prints per write: the API server's and etcd's CPU milliseconds (from /proc), wall time and body size.
import http.client, json, os, ssl, sys, time
W = os.environ["TESTENV_DIR"]; P = W + "/pki"
port = int(open(os.environ["KUBECONFIG"]).read().split("https://127.0.0.1:")[1].split()[0])
ctx = ssl.create_default_context(cafile=P + "/ca.crt"); ctx.load_cert_chain(P + "/admin.crt", P + "/admin.key")
conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx)
def req(method, path, body=None, ctype="application/json"):
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers={"Content-Type": ctype})
    r = conn.getresponse(); data = r.read()
    if r.status >= 300: raise SystemExit(f"{method} {path}: {r.status} {data[:300]}")
    return json.loads(data)
def cpu(name):
    """CPU seconds (user + system) of this test environment's process `name` (its flags name the directory)."""
    for pid in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
            if cmd[0].endswith("/" + name) and W in " ".join(cmd):
                f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            pass
    return float("nan")
NS, N, ROUNDS = "ssa", int(sys.argv[1]), int(sys.argv[2])
base = "/apis/ai.flexinfer/v1alpha1/namespaces/ssa/modelcaches"
req("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
def cond(t, s, r, m): return {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": "2026-12-08T01:00:00Z", "observedGeneration": 1}
def status(i, k):
    ph = {"startedAt": "2026-12-08T01:00:00Z", "image": "example.com/worker:rocm", "specHash": "a505f08f18f54623",
          "runHash": "c6b3696abdebe0dc", "generation": "a505f08f-20261208010000", "progress": k % 100,
          "lastProgressAt": f"2026-12-08T01:{k % 60:02d}:00Z", "progressDetail": f"{k}s of 86400s deadline",
          "progressSource": "elapsed-estimate"}
    return {"phase": "Quantizing", "currentPhase": "quantization", "observedGeneration": 1, "retryCount": 0,
            "claimName": f"c{i}-cache", "progress": 40,
            "download": dict(ph, completedAt="2026-12-08T01:00:04Z", outputDir=f"c{i}/source.a7044fc3-20261208010000", progress=100, revision="main"),
            "quantization": ph, "publish": {},
            "conditions": [cond("Ready", "False", "InProgress", "quantization running"), cond("Progressing", "True", "JobRunning", f"Job c{i}-quantize running"),
                           cond("Downloaded", "True", "DownloadComplete", "downloaded"), cond("Quantized", "False", "InProgress", f"Job c{i}-quantize running"),
                           cond("Published", "False", "Waiting", "waiting for quantization"), cond("Degraded", "False", "InProgress", "")]}
rvs = []
for i in range(N):
    o = req("POST", base, {"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache", "metadata": {"name": f"c{i}"},
                           "spec": {"source": f"org/model-{i}", "quantization": {"format": "GPTQ"}}})
    o = req("PATCH", f"{base}/c{i}/status?fieldManager=flexinfer-controller&force=true",
            {"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache", "status": status(i, 0)}, "application/apply-patch+yaml")
    rvs.append(o["metadata"]["resourceVersion"])
def diff(a, b):
    out = {}
    for k, v in b.items():
        if k not in a: out[k] = v
        elif isinstance(v, dict) and isinstance(a[k], dict):
            d = diff(a[k], v)
            if d: out[k] = d
        elif a[k] != v: out[k] = v
    for k in a:
        if k not in b: out[k] = None
    return out
k = 1
results = {}
for method in ["apply", "merge", "apply", "merge"]:
    a0, e0, t0, nbytes = cpu("kube-apiserver"), cpu("etcd"), time.time(), 0
    for r in range(ROUNDS):
        for i in range(N):
            old, new = status(i, k - 1), status(i, k)
            if method == "apply":
                body = {"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache", "metadata": {"resourceVersion": rvs[i]}, "status": new}
                o = req("PATCH", f"{base}/c{i}/status?fieldManager=flexinfer-controller&force=true", body, "application/apply-patch+yaml")
            else:
                body = {"metadata": {"resourceVersion": rvs[i]}, "status": diff(old, new)}
                o = req("PATCH", f"{base}/c{i}/status?fieldManager=flexinfer-controller", body, "application/merge-patch+json")
            nbytes += len(json.dumps(body))
            rvs[i] = o["metadata"]["resourceVersion"]
        k += 1
    n = ROUNDS * N
    a, e, t = cpu("kube-apiserver") - a0, cpu("etcd") - e0, time.time() - t0
    print(f"{method:6s}: {n} writes, API server CPU {a*1000/n:.2f} ms/write, etcd {e*1000/n:.2f} ms/write, wall {t*1000/n:.2f} ms/write, body {nbytes/n:.0f} B")
# The merge patches must leave exactly the status an apply would have written.
o = req("GET", f"{base}/c0")
assert o["status"] == json.loads(json.dumps(status(0, k - 1))), (o["status"], status(0, k - 1))
print("final status equals the intended one")
print("managedFields managers:", sorted({(m["manager"], m["operation"]) for m in o["metadata"].get("managedFields", [])}))
