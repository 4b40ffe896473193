#!/usr/bin/env python3
"""GPTQModel (the peer) on the trained tiny Llama with its own defaults at BITS, group 128, symmetric, on the
CPU, with the calibration the engine gets: the first SAMPLES texts of MODEL_DIR/calib.jsonl tokenized with
MODEL_DIR/tokenizer.json (no special tokens), cut to SEQ tokens (docs/benchmarks.md, "GPTQ at 4, 3 and 2 bits on a trained model").

  gptqmodel_quantize.py MODEL_DIR OUT_DIR BITS [--samples 128] [--seq 256] [--awq]

--awq: GPTQModel's AWQ (AWQConfig: its scale and clipping search, the GEMM layout, zero points) instead of GPTQ.

Needs gptqmodel (BUILD_CUDA_EXT=0 pip install --no-build-isolation gptqmodel) in the oracle venv; prints one
JSON line with the seconds it took. GPTQMODEL_CPU_WORKERS=2 on a 2-core machine.
"""

import argparse
import json
import os
import time

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch  # noqa: E402

torch.set_num_threads(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("bits", type=int)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--awq", action="store_true")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not os.path.exists(os.path.join(args.model, "tokenizer_config.json")):
        PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(args.model, "tokenizer.json"), bos_token="<s>", eos_token="</s>"
        ).save_pretrained(args.model)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    calib = []
    with open(os.path.join(args.model, "calib.jsonl")) as fh:
        for line in fh:
            ids = tok.encode(json.loads(line)["text"]).ids[: args.seq]
            if len(ids) >= 2:
                calib.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
            if len(calib) == args.samples:
                break

    from gptqmodel import AWQConfig, GPTQModel, QuantizeConfig

    if args.awq:
        qcfg = AWQConfig(bits=args.bits, group_size=128, sym=False)
    else:
        qcfg = QuantizeConfig(bits=args.bits, group_size=128, sym=True, desc_act=False)
    t0 = time.time()
    model = GPTQModel.load(args.model, qcfg, device="cpu")
    model.quantize(calib, batch_size=1)
    seconds = time.time() - t0
    model.save(args.out)
    qc_path = os.path.join(args.out, "quantize_config.json")
    if not os.path.exists(qc_path):
        qc_path = os.path.join(args.out, "config.json")
    with open(qc_path) as fh:
        qc = json.load(fh)
        qc = qc.get("quantization_config", qc)
    print(json.dumps({"gptqmodel_seconds": round(seconds, 1), "bits": args.bits, "meta": qc.get("meta")}))


if __name__ == "__main__":
    main()
