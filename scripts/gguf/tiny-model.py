#!/usr/bin/env python3
"""Write a tiny random Llama checkpoint that `flexinfer-worker quantize` with FORMAT=GGUF accepts, for smoke
checks of a serving image (scripts/images/verify.sh --llamacpp): config.json, model.safetensors (F32, seeded),
a byte-level BPE tokenizer (GPT-2's byte alphabet, llama.cpp's `gpt-2` pre-tokenizer), a chat template, and a
calibration file. Random weights: the server answers, the words mean nothing. Standard library only.

usage: tiny-model.py DIR        writes DIR/model/ and DIR/calibration.jsonl
Sizes: hidden 256 (one K-quant super-block per row), 2 layers, 4 heads (2 KV heads), vocab 261; ~5 MB.
"""
import json
import os
import random
import struct
import sys

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def byte_chars():
    """GPT-2's printable stand-ins for the 256 byte values (bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    model = os.path.join(out, "model")
    os.makedirs(model, exist_ok=True)
    vocab = {c: i for i, c in enumerate(byte_chars())}
    merges = [("Ġ", "t"), ("t", "h"), ("th", "e"), ("Ġ", "a")]
    for k, (a, b) in enumerate(merges):
        vocab[a + b] = 256 + k
    eot = "<|endoftext|>"
    vocab[eot] = 260
    n_vocab = len(vocab)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": 260, "content": eot, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": [f"{a} {b}" for a, b in merges]},
    }
    with open(os.path.join(model, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": eot, "eos_token": eot, "model_max_length": 2048,
                   "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}"}, f)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": n_vocab,
        "bos_token_id": 260, "eos_token_id": 260,
    }
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f, indent=1)

    head = HIDDEN // HEADS
    shapes = [("model.embed_tokens.weight", (n_vocab, HIDDEN), 0.02)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,), None),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0.05),
            (p + "self_attn.k_proj.weight", (KV_HEADS * head, HIDDEN), 0.05),
            (p + "self_attn.v_proj.weight", (KV_HEADS * head, HIDDEN), 0.05),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), 0.05),
            (p + "post_attention_layernorm.weight", (HIDDEN,), None),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN), 0.05),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN), 0.05),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER), 0.05),
        ]
    shapes += [("model.norm.weight", (HIDDEN,), None), ("lm_head.weight", (n_vocab, HIDDEN), 0.05)]
    rng = random.Random(7)
    header, blobs, offset = {}, [], 0
    for name, shape, std in shapes:
        n = 1
        for d in shape:
            n *= d
        vals = [1.0] * n if std is None else [rng.gauss(0.0, std) for _ in range(n)]
        blob = struct.pack(f"<{n}f", *vals)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(model, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)

    words = "the cat sat on a mat and the dog ran to the park while a bird sang".split()
    with open(os.path.join(out, "calibration.jsonl"), "w") as f:
        for i in range(32):
            r = random.Random(i)
            f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(48))}) + "\n")


if __name__ == "__main__":
    main()
