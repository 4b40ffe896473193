#!/usr/bin/env python3
"""A small TRAINED Llama for quantization quality measurements, written in the layout the engine
reads: config.json, model.safetensors (hub names, f32), tokenizer.json, plus the texts the measurements use.

Random weights make perplexity meaningless, so this trains a tiny Llama (4 layers, hidden 256, intermediate 768,
4 heads: every linear's input width is a multiple of 128, so group 128 applies everywhere) for a few minutes on
the CPU (one torch thread) on the Python standard library's sources, which every machine with Python has.

Text split (deterministic): the standard library's top-level *.py files sorted by name; every 10th file is
held out (evaluation), the rest is training text. Written next to the model:
  calib.jsonl   {"text": ...} training-text chunks for GPTQ calibration (never the held-out files)
  eval.txt      the held-out text, for perplexity

Usage: train_tiny_llama.py OUT_DIR [--steps N | --minutes M] [--seed S] (default 511 steps of 8 × 128 tokens
plus 30 at a low rate, deterministic with one torch thread: about 10 minutes on a busy 2-core machine). Weights are not committed:
`make oracle` writes them once to ~/.cache/flexinfer/lowbit-model (LOWBIT_MODEL). Needs torch, transformers,
tokenizers, safetensors.
"""

import argparse
import glob
import json
import math
import os
import random
import sysconfig
import time

import torch

torch.set_num_threads(1)

VOCAB = 4096
SEQ = 128


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if len(files) < 50:
        raise SystemExit(f"only {len(files)} standard-library sources under {root}")
    held = [f for i, f in enumerate(files) if i % 10 == 0]
    train = [f for i, f in enumerate(files) if i % 10 != 0]
    return train, held


def read(files):
    out = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            out.append(fh.read())
    return out


def train_tokenizer(texts, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=511)
    ap.add_argument("--minutes", type=float, help="train for this long instead of --steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_files, held_files = stdlib_files()
    train_texts, held_texts = read(train_files), read(held_files)
    tok = train_tokenizer(train_texts, os.path.join(args.out, "tokenizer.json"))
    ids = []
    for t in train_texts:
        ids.extend(tok.encode(t).ids)
    data = torch.tensor(ids, dtype=torch.long)
    print(f"train tokens {len(ids)}, held-out files {len(held_files)}", flush=True)

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    batch = 8
    deadline = time.time() + args.minutes * 60 if args.minutes else None
    step, warm = 0, 50
    start = time.time()
    while (time.time() < deadline) if deadline else (step < args.steps):
        idx = torch.randint(0, len(data) - SEQ - 1, (batch,))
        x = torch.stack([data[i : i + SEQ] for i in idx])
        lr_scale = min(1.0, (step + 1) / warm)
        for g in opt.param_groups:
            g["lr"] = 3e-3 * lr_scale
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
        step += 1
    # A short cool-down at a low learning rate settles the weights.
    for g in opt.param_groups:
        g["lr"] = 3e-4
    for _ in range(30):
        idx = torch.randint(0, len(data) - SEQ - 1, (batch,))
        x = torch.stack([data[i : i + SEQ] for i in idx])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    print(f"trained {step} steps in {time.time() - start:.0f}s, last loss {loss.item():.3f}", flush=True)

    model.eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(args.out, safe_serialization=True)
    # For GPTQModel's loader (AutoTokenizer); the engine reads tokenizer.json.
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(args.out, "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    ).save_pretrained(args.out)
    # The training-text calibration set: 256 chunks of about 2 × SEQ tokens from random training files.
    rng = random.Random(args.seed + 1)
    with open(os.path.join(args.out, "calib.jsonl"), "w") as fh:
        for _ in range(256):
            t = rng.choice(train_texts)
            lines = t.splitlines()
            if len(lines) < 40:
                continue
            a = rng.randrange(0, len(lines) - 30)
            fh.write(json.dumps({"text": "\n".join(lines[a : a + 30])}) + "\n")
    with open(os.path.join(args.out, "eval.txt"), "w") as fh:
        fh.write("\n".join(held_texts))
    with open(os.path.join(args.out, "train_info.json"), "w") as fh:
        json.dump(
            {
                "steps": step,
                "seconds": round(time.time() - start),
                "seed": args.seed,
                "train_files": len(train_files),
                "held_out_files": [os.path.basename(f) for f in held_files],
                "torch": torch.__version__,
                "final_train_loss": round(loss.item(), 4),
                "train_ppl_estimate": round(math.exp(loss.item()), 2),
            },
            fh,
            indent=1,
        )


if __name__ == "__main__":
    main()
