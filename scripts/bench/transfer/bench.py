#!/usr/bin/env python3
"""Download/publish throughput, side by side in one run (not a test; never gates CI).

download: flexinfer-worker vs huggingface_hub.snapshot_download (plain and with hf_transfer),
          all against the same local hub server (flexinfer-hub, crates/flexinfer-hub);
publish:  flexinfer-worker vs the `oras` Python client, each against a fresh docker-registry;
reference: `cp -r` of the same tree on the same filesystem (the machine's copy rate).

Prints a table of medians (MiB/s) and ratios. Run through run.sh (it builds the worker, the hub and
the peer venv). Environment: WORKER (binary), HUB (the flexinfer-hub binary; default: beside WORKER),
BENCH_GIB (data size, default 1.5), BENCH_RUNS (3).
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = os.environ["WORKER"]
HUB = os.environ.get("HUB") or os.path.join(os.path.dirname(WORKER), "flexinfer-hub")
PY = sys.executable
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
GIB = float(os.environ.get("BENCH_GIB", "1.5"))
REPO = "bench/model"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def make_data(root):
    """One big shard (2/3 of the data), two smaller ones, and the usual small files."""
    total = int(GIB * (1 << 30))
    sizes = {"model-00001-of-00003.safetensors": total * 2 // 3,
             "model-00002-of-00003.safetensors": total // 6,
             "model-00003-of-00003.safetensors": total // 6}
    os.makedirs(root, exist_ok=True)
    block = os.urandom(16 << 20)
    for name, size in sizes.items():
        with open(os.path.join(root, name), "wb") as f:
            left, i = size, 0
            while left > 0:
                n = min(left, len(block))
                f.write(i.to_bytes(8, "little") + block[8:n])
                left -= n
                i += 1
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        json.dump({"model": {"type": "BPE", "vocab": {str(i): i for i in range(20000)}}}, f)
    return sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root))


def timed(cmd, env=None, cwd=None):
    """Wall time until the tool is done *and* its data is on disk (flexinfer fsyncs each file
    before marking it complete; the peers do not, so a trailing `sync` is counted for all)."""
    sync()
    t = time.monotonic()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    sync()
    dt = time.monotonic() - t
    if r.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dt


def sync():
    subprocess.run(["sync"])


def tree_hashes(root, skip=(".source-integrity.json", ".download_complete", ".cache")):
    import hashlib
    out = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        for n in names:
            if n in skip:
                continue
            p = os.path.join(d, n)
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for b in iter(lambda: f.read(1 << 22), b""):
                    h.update(b)
            out[os.path.relpath(p, root)] = h.hexdigest()
    return out


class Registry:
    def __init__(self, work):
        self.dir = tempfile.mkdtemp(dir=work, prefix="registry-")
        self.port = free_port()
        cfg = os.path.join(self.dir, "config.yml")
        with open(cfg, "w") as f:
            f.write(f"version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
                    f"storage:\n  filesystem:\n    rootdirectory: {self.dir}/storage\n"
                    f"http:\n  addr: 127.0.0.1:{self.port}\n")
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", cfg], stdout=self.log, stderr=self.log)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("docker-registry did not start")

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    work = tempfile.mkdtemp(prefix="flexinfer-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work):
    src = os.path.join(work, "src")
    total = make_data(src)
    mib = total / (1 << 20)
    print(f"data: {mib:.0f} MiB in {len(os.listdir(src))} files; runs per tool: {RUNS}; cpus: {os.cpu_count()}")
    port = free_port()
    hub = subprocess.Popen([HUB, src, REPO, str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert hub.stdout.readline().startswith(b"ready")
        bench_download(work, src, mib, port)
    finally:
        hub.kill()
        hub.wait()
    bench_publish(work, src, mib)


def attempt(name, fn, dest):
    """Run one measurement; a failing peer is reported, not fatal."""
    try:
        return fn(dest)
    except SystemExit as e:
        print(f"  ! {name} failed: {str(e)[-300:]}")
        return None


def bench_download(work, src, mib, port):
    endpoint = f"http://127.0.0.1:{port}"
    base_env = dict(os.environ, HF_HOME=os.path.join(work, "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                    HF_HUB_DISABLE_PROGRESS_BARS="1", HF_ENDPOINT=endpoint)
    want = tree_hashes(src)

    def dl_flexinfer(dest):
        env = dict(base_env, SOURCE=REPO, MODEL_DIR=dest, FLEXINFER_TERMINATION_LOG=os.path.join(work, "term"))
        return timed([WORKER, "download"], env=env)

    def dl_hf(dest, transfer):
        env = dict(base_env, HF_HUB_ENABLE_HF_TRANSFER="1" if transfer else "0")
        code = ("import sys; from huggingface_hub import snapshot_download; "
                "snapshot_download(sys.argv[1], local_dir=sys.argv[2], max_workers=8)")
        return timed([PY, "-c", code, REPO, dest], env=env)

    def cp(dest):
        return timed(["cp", "-r", src, dest])

    def curl(dest):
        # The loopback limit: every file fetched in parallel by curl, no verification.
        os.makedirs(dest)
        urls = " ".join(f"{endpoint}/{REPO}/resolve/main/{n}" for n in sorted(os.listdir(src)))
        script = f"cd {dest} && printf '%s\\n' {urls} | xargs -P 4 -n 1 curl -sfSO"
        return timed(["bash", "-c", script])

    tools = {
        "flexinfer-worker download": dl_flexinfer,
        "huggingface_hub snapshot_download": lambda d: dl_hf(d, False),
        "huggingface_hub + hf_transfer": lambda d: dl_hf(d, True),
        "curl, 4 in parallel (loopback limit)": curl,
        "cp -r (same filesystem)": cp,
    }
    times = {k: [] for k in tools}
    for i in range(RUNS):
        for name, fn in tools.items():
            dest = os.path.join(work, f"dl-{i}")
            t = attempt(name, fn, dest)
            if t is not None:
                times[name].append(t)
                if i == 0 and name not in ("cp -r (same filesystem)", "curl, 4 in parallel (loopback limit)"):
                    got = tree_hashes(dest)
                    assert got == want, f"{name}: downloaded tree differs"
            shutil.rmtree(dest, ignore_errors=True)
    global CP_TIMES
    CP_TIMES = times["cp -r (same filesystem)"]
    report("download", mib, times, "flexinfer-worker download",
           ["huggingface_hub snapshot_download", "huggingface_hub + hf_transfer"], "curl, 4 in parallel (loopback limit)")



def bench_publish(work, src, mib):
    want = tree_hashes(src)

    def pub_flexinfer(reg):
        env = dict(os.environ, MODEL_DIR=src, OCI_REF=f"127.0.0.1:{reg.port}/bench/model:v1", OCI_INSECURE="true",
                   FLEXINFER_TERMINATION_LOG=os.path.join(work, "term"))
        return timed([WORKER, "publish"], env=env)

    def pub_oras(reg):
        files = sorted(os.listdir(src))
        code = ("import sys, oras.client; c = oras.client.OrasClient(hostname=sys.argv[1], insecure=True); "
                "c.push(target=sys.argv[1] + '/bench/model:v1', files=sys.argv[2:])")
        return timed([PY, "-c", code, f"127.0.0.1:{reg.port}", *files], cwd=src)

    ptools = {"flexinfer-worker publish": pub_flexinfer, "oras (Python) push": pub_oras}
    ptimes = {k: [] for k in ptools}
    ptimes["cp -r (same filesystem)"] = CP_TIMES
    for i in range(RUNS):
        for name, fn in ptools.items():
            reg = Registry(work)
            try:
                t = attempt(name, fn, reg)
                if t is None:
                    continue
                ptimes[name].append(t)
                if i == 0 and name == "flexinfer-worker publish":
                    # Compatibility: `oras pull` of our artifact reproduces the tree.
                    out = os.path.join(work, "oras-pull")
                    os.makedirs(out)
                    code = ("import sys, oras.client; c = oras.client.OrasClient(hostname=sys.argv[1], insecure=True); "
                            "c.pull(target=sys.argv[1] + '/bench/model:v1', outdir=sys.argv[2])")
                    timed([PY, "-c", code, f"127.0.0.1:{reg.port}", out])
                    assert tree_hashes(out) == want, "oras pull of the flexinfer artifact differs"
                    print("check: oras pull of the flexinfer-published artifact reproduces the tree byte for byte")
                    shutil.rmtree(out)
            finally:
                reg.close()
    report("publish", mib, ptimes, "flexinfer-worker publish", ["oras (Python) push"], "cp -r (same filesystem)")


def report(what, mib, times, ours, peers, ref):
    print(f"\n{what}: median of {RUNS} (MiB/s; all runs in seconds)")
    med = {k: statistics.median(v) for k, v in times.items() if v}
    for k, v in times.items():
        if not v:
            print(f"  {k:40s}   (no successful run)")
            continue
        print(f"  {k:40s} {mib / med[k]:8.0f} MiB/s   runs: {', '.join(f'{x:.2f}' for x in v)}")
    for p in peers:
        if p not in med or ours not in med:
            continue
        print(f"  ratio {ours} / {p}: {med[p] / med[ours]:.2f}x")
    if ref in med and ours in med:
        print(f"  ratio {ours} / {ref}: {med[ref] / med[ours]:.2f}")
    if "cp -r (same filesystem)" in med and ours in med and ref != "cp -r (same filesystem)":
        print(f"  ratio {ours} / cp -r: {med['cp -r (same filesystem)'] / med[ours]:.2f}")


if __name__ == "__main__":
    main()
