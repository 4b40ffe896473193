#!/usr/bin/env python3
"""The card's own measured rates, for docs/benchmarks.md's ratios (issue #18): FP32 GEMM (TF32 off: the
engine's kernels compute in plain f32) and FP32 Cholesky (torch.linalg.cholesky, cuSOLVER underneath) at the
sizes of scripts/gpu-check.sh. Runs where PyTorch with CUDA is (the device machine); not a test.

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
    for r in out["records"]:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
