#!/usr/bin/env python3
"""Held-out perplexity of the trained tiny Llama (scripts/oracle/train_tiny_llama.py), unquantized, with the
weights of a `gptq` checkpoint (ours or GPTQModel's), or round-to-nearest (docs/benchmarks.md, "GPTQ at 4, 3 and 2 bits on a trained model").

  lowbit_eval.py MODEL_DIR                      the f32 model
  lowbit_eval.py MODEL_DIR --gptq CKPT_DIR      every packed linear of CKPT_DIR dequantized from qweight /
                                                qzeros / scales / g_idx by the format's rules, written out here
  lowbit_eval.py MODEL_DIR --awq CKPT_DIR       an AWQ (GEMM) checkpoint: every linear dequantized from qweight /
                                                qzeros / scales in AutoAWQ's packing order, and every other
                                                tensor of CKPT_DIR (the norms the scales were folded into)
  lowbit_eval.py MODEL_DIR --rtn BITS [--group 128]   symmetric min/max round-to-nearest per group (the
                                                engine's conventions: zero (maxq+1)/2, half to even, f16 scales)

Perplexity: MODEL_DIR/eval.txt (held-out standard-library files) tokenized with MODEL_DIR/tokenizer.json, cut
into windows of 128 tokens (the training context), the first --tokens tokens (default 32768), mean token NLL.
Also `kl`: the mean per-token KL divergence KL(f32 ‖ quantized) of the next-token distributions on the same
tokens (0 for the f32 model) — more sensitive than perplexity where the quantization error is small. Prints one
JSON line. CPU, one torch thread.
"""

import argparse
import json
import math
import os
import time

import numpy as np
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)

SEQ = 128


def unpack(words, bits, count):
    """Values packed along axis 0 of int32 `words` as one little-endian bit stream (value i at bit bits*i):
    the gptq layout for 2/4/8 bits and, with fields crossing words, for 3 bits."""
    w = words.view(np.uint32).astype(np.uint64)
    out = np.empty((count,) + w.shape[1:], dtype=np.int64)
    mask = (1 << bits) - 1
    for i in range(count):
        off = bits * i
        k, s = divmod(off, 32)
        v = w[k] >> np.uint64(s)
        if s + bits > 32:
            v = v | (w[k + 1] << np.uint64(32 - s))
        out[i] = (v & np.uint64(mask)).astype(np.int64)
    return out


def dequantize_checkpoint(ckpt):
    with open(os.path.join(ckpt, "quantize_config.json")) as fh:
        qc = json.load(fh)
    bits = qc["bits"]
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    tensors = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            # Only the packed tensors (int32, f16 scales); the rest may be bf16, which numpy lacks.
            for k, v in load_file(os.path.join(ckpt, f)).items():
                if k.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"):
                    tensors[k] = v.float().numpy() if v.is_floating_point() else v.numpy()
    weights = {}
    for name in [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]:
        qweight, qzeros = tensors[name + ".qweight"], tensors[name + ".qzeros"]
        scales = tensors[name + ".scales"]
        g_idx = tensors[name + ".g_idx"].astype(np.int64)
        cols, rows = g_idx.shape[0], scales.shape[1]
        q = unpack(qweight, bits, cols)  # [in, out]
        z = unpack(np.ascontiguousarray(qzeros.T), bits, rows).T  # [groups, out]
        if v1:
            z = z + 1
        w = scales[g_idx] * (q - z[g_idx])  # [in, out]
        weights[name + ".weight"] = torch.from_numpy(np.ascontiguousarray(w.T.astype(np.float32)))
    return weights, qc


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def dequantize_awq(ckpt):
    """An AWQ GEMM checkpoint: `(q - z) * s` per group of inputs, the eight outputs of a word in AWQ's order;
    also every floating-point tensor that is not packed (the folded norms)."""
    with open(os.path.join(ckpt, "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    group = qc["group_size"]
    tensors = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(ckpt, f)))

    def nibbles(words):  # [n, m] int32 -> [n, 8m] int64, AWQ order undone
        w = words.numpy().view(np.uint32).astype(np.int64)
        seq = np.stack([(w >> (4 * i)) & 0xF for i in range(8)], axis=-1)  # [n, m, 8] nibble i
        return seq[:, :, AWQ_REVERSE_ORDER].reshape(w.shape[0], -1)

    weights = {}
    for name in [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]:
        q = nibbles(tensors[name + ".qweight"])  # [in, out]
        z = nibbles(tensors[name + ".qzeros"])  # [groups, out]
        s = tensors[name + ".scales"].float().numpy()  # [groups, out]
        g = np.arange(q.shape[0]) // group
        w = (q - z[g]) * s[g]
        weights[name + ".weight"] = torch.from_numpy(np.ascontiguousarray(w.T.astype(np.float32)))
    for k, v in tensors.items():
        if v.is_floating_point() and not k.endswith(".scales"):
            weights.setdefault(k, v.float())
    return weights, qc


def rtn(w, bits, group):
    """Symmetric min/max RTN per row and group (w: [out, in])."""
    maxq = 2**bits - 1
    out_f, in_f = w.shape
    g = in_f if group <= 0 else group
    x = w.reshape(out_f, in_f // g, g)
    xmax = torch.maximum(x.amax(-1).clamp(min=0), (-x.amin(-1)).clamp(min=0))
    scale = torch.where(xmax == 0, torch.full_like(xmax, 2.0 / maxq), 2 * xmax / maxq)
    scale = scale.half().float().unsqueeze(-1)
    zero = (maxq + 1) / 2
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return (scale * (q - zero)).reshape(out_f, in_f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gptq")
    ap.add_argument("--awq")
    ap.add_argument("--rtn", type=int)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    with open(os.path.join(args.model, "eval.txt"), encoding="utf-8") as fh:
        ids = tok.encode(fh.read()).ids
    windows = min(len(ids), args.tokens) // SEQ
    x = torch.tensor(ids[: windows * SEQ]).reshape(windows, SEQ)
    batches = [x[b : b + 16] for b in range(0, windows, 16)]
    with torch.no_grad():
        reference = [torch.log_softmax(model(input_ids=xb).logits[:, :-1], -1) for xb in batches]
    info = {"label": args.label or ("fp32" if not (args.gptq or args.rtn or args.awq) else "")}
    if args.gptq or args.awq:
        weights, qc = dequantize_checkpoint(args.gptq) if args.gptq else dequantize_awq(args.awq)
        sd = model.state_dict()
        missing = [k for k in weights if k not in sd]
        if missing:
            raise SystemExit(f"checkpoint modules not in the model: {missing[:3]}")
        with torch.no_grad():
            for k, v in weights.items():
                sd[k].copy_(v)
        packed = sum(k.endswith(".weight") and "layers." in k and "norm" not in k for k in weights)
        info.update(checkpoint=args.gptq or args.awq, modules=packed, bits=qc["bits"], group=qc["group_size"])
    elif args.rtn:
        n = 0
        with torch.no_grad():
            for name, mod in model.model.layers.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.copy_(rtn(mod.weight, args.rtn, args.group))
                    n += 1
        info.update(rtn_bits=args.rtn, group=args.group, modules=n)

    t0 = time.time()
    nll, kl, count = 0.0, 0.0, 0
    with torch.no_grad():
        for xb, ref in zip(batches, reference):
            logp = torch.log_softmax(model(input_ids=xb).logits[:, :-1], -1)
            target = xb[:, 1:]
            nll -= logp.gather(-1, target.unsqueeze(-1)).sum().item()
            kl += (ref.exp() * (ref - logp)).sum().item()
            count += target.numel()
    info.update(
        ppl=round(math.exp(nll / count), 4),
        kl=round(kl / count, 6),
        tokens=count,
        eval_seconds=round(time.time() - t0, 1),
    )
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
