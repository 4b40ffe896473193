#!/usr/bin/env python3
"""The card's own measured rates, for docs/benchmarks.md's ratios: FP32 GEMM (TF32 off: the
engine's kernels compute in plain f32) and FP32 Cholesky (torch.linalg.cholesky, cuSOLVER underneath) at the
sizes of scripts/gpu-check.sh, and the machine's host ↔ device copy rates (the engine's Hessian upload and
checkpoint download are read against these). Runs where PyTorch with CUDA is (the device machine); not a test.

    python3 scripts/bench/gpu_peak.py [--json FILE]

Each rate is the median of 5 timed runs after 2 warm-ups, timed with CUDA events.
"""
import argparse
import json
import statistics

import torch


def timed(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall(fn, reps=5, warm=1):
    """Median wall-clock seconds of a host-side or synchronous copy."""
    import time
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def transfers(records, mib=512):
    """Copy rates of `mib` MiB: page-locked and pageable (already touched) host memory to and from the
    device, a host copy between touched buffers, and a fresh host allocation written once (its page
    faults: what a download into a new matrix pays on top of the copy)."""
    n = mib * (1 << 20) // 4
    d = torch.empty(n, device="cuda")
    d.fill_(1.0)
    pinned = torch.empty(n, pin_memory=True)
    pinned.fill_(1.0)
    pageable = torch.empty(n)
    pageable.fill_(1.0)
    other = torch.empty(n)
    other.fill_(2.0)
    gb = mib * (1 << 20) / 1e9

    def rec(op, s):
        records.append({"op": op, "mib": mib, "seconds": s, "gb_per_s": gb / s})

    rec("h2d pinned", wall(lambda: d.copy_(pinned, non_blocking=False)))
    rec("d2h pinned", wall(lambda: pinned.copy_(d, non_blocking=False)))
    rec("h2d pageable", wall(lambda: d.copy_(pageable)))
    rec("d2h pageable", wall(lambda: pageable.copy_(d)))
    rec("host copy", wall(lambda: other.copy_(pageable)))
    rec("host fresh write", wall(lambda: torch.empty(n).fill_(3.0)))
    rec("d2h into fresh pageable", wall(lambda: torch.empty(n).copy_(d)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "records": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for n in (4096, 8192):
        a = torch.randn(n, n, device=dev, generator=g)
        b = torch.randn(n, n, device=dev, generator=g)
        s = timed(lambda: a @ b)
        out["records"].append({"op": "sgemm", "n": n, "seconds": s, "gflops": 2 * n**3 / s / 1e9})
    # XᵀX of calibration-shaped activations (2048 tokens), the Hessian's shape.
    for n in (4096, 11008):
        x = torch.randn(2048, n, device=dev, generator=g)
        s = timed(lambda: x.T @ x)
        out["records"].append({"op": "xtx", "n": n, "tokens": 2048, "seconds": s,
                               "gflops": 2 * 2048 * n * n / s / 1e9})
    for n in (4096, 11008, 21504):
        x = torch.randn(n, 256, device=dev, generator=g)
        h = x @ x.T / 256 + torch.eye(n, device=dev)
        s = timed(lambda: torch.linalg.cholesky(h))
        out["records"].append({"op": "cholesky", "n": n, "seconds": s, "gflops": n**3 / 3 / s / 1e9})
        del x, h
    transfers(out["records"])
    for r in out["records"]:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
