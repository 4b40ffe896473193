#!/usr/bin/env python3
"""Reads GGUF files FlexInfer wrote with llama.cpp's own reader (the PyPI `gguf` package) and checks
them against a manifest the Rust test writes:

  {"files": [{"gguf": PATH,
              "metadata": {KEY: VALUE, ...},          # scalars, strings and arrays, compared exactly
              "tensors": [{"name", "type", "shape",   # shape in ggml order (ne[0] first)
                           "ours": PATH,              # our dequantization, raw little-endian f32
                           "source": PATH|null}]}]}   # f32 input, to compare gguf.quants.quantize bytes

For every tensor: the name, type and shape the reader sees; `gguf.quants.dequantize` of the stored
blocks equal to ours bit for bit; where `source` is given (types gguf-py can quantize: Q8_0, Q4_0,
BF16, F16), the stored bytes equal to `gguf.quants.quantize(source)`. Prints one line per file and
exits 1 on the first mismatch with what differs.
"""
import json
import sys

import numpy as np
import gguf
from gguf import quants


def fail(msg):
    print(f"MISMATCH: {msg}", file=sys.stderr)
    sys.exit(1)


def check_file(entry):
    path = entry["gguf"]
    r = gguf.GGUFReader(path)
    for key, want in entry["metadata"].items():
        f = r.fields.get(key)
        if f is None:
            fail(f"{path}: metadata key {key} missing")
        got = f.contents()
        if isinstance(want, float):
            ok = np.float32(got) == np.float32(want)
        else:
            ok = got == want
        if not ok:
            shown = got if not isinstance(got, list) else f"list of {len(got)}: {got[:8]}"
            fail(f"{path}: {key} = {shown!r}, expected {want!r}"[:2000])
    tensors = {t.name: t for t in r.tensors}
    names = [t.name for t in r.tensors]
    want_names = [t["name"] for t in entry["tensors"]]
    if names != want_names:
        fail(f"{path}: tensors {names} != {want_names}")
    n_values = 0
    n_quantized = 0
    for want in entry["tensors"]:
        t = tensors[want["name"]]
        if t.tensor_type.name != want["type"]:
            fail(f"{path}: {t.name} type {t.tensor_type.name}, expected {want['type']}")
        if [int(d) for d in t.shape] != want["shape"]:
            fail(f"{path}: {t.name} shape {list(t.shape)}, expected {want['shape']}")
        deq = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(-1)
        ours = np.fromfile(want["ours"], dtype="<f4")
        if deq.shape != ours.shape:
            fail(f"{path}: {t.name}: gguf-py gives {deq.shape[0]} values, ours {ours.shape[0]}")
        if not np.array_equal(deq.view(np.uint32), ours.view(np.uint32)):
            bad = np.nonzero(deq.view(np.uint32) != ours.view(np.uint32))[0]
            i = int(bad[0])
            fail(f"{path}: {t.name} ({t.tensor_type.name}): {len(bad)} values differ, first at {i}: "
                 f"gguf-py {deq[i]!r} vs ours {ours[i]!r}")
        if want.get("source"):
            src = np.fromfile(want["source"], dtype="<f4").reshape(int(np.prod(t.shape[1:])), int(t.shape[0]))
            theirs = quants.quantize(src, t.tensor_type)
            if theirs.tobytes() != np.asarray(t.data).tobytes():
                a = np.frombuffer(theirs.tobytes(), np.uint8)
                b = np.frombuffer(np.asarray(t.data).tobytes(), np.uint8)
                i = int(np.nonzero(a != b)[0][0])
                fail(f"{path}: {t.name} ({t.tensor_type.name}): gguf.quants.quantize differs from our bytes "
                     f"at byte {i} ({a[i]} vs {b[i]}), {(a != b).sum()} bytes in all")
            n_quantized += 1
        n_values += ours.shape[0]
    print(f"ok {path}: {len(names)} tensors, {n_values} values dequantized equal, "
          f"{n_quantized} quantized equal by gguf.quants.quantize, {len(entry['metadata'])} metadata keys "
          f"(GGUF v{r.fields['GGUF.version'].contents()})")


def main():
    with open(sys.argv[1]) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        check_file(entry)


if __name__ == "__main__":
    main()
