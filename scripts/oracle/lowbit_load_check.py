#!/usr/bin/env python3
"""Loads a gptq checkpoint of the trained tiny Llama with transformers (GPTQModel's kernels; needs optimum and
gptqmodel) and compares its logits on 100 fixed token ids with the f32 model whose quantized linears are our own
dequantization of the same checkpoint (lowbit_eval.dequantize_checkpoint, rounded to f16): whether a loader
reads the layout as we mean it (the group-aware order keeps the plain layout).

  lowbit_load_check.py CKPT_DIR MODEL_DIR      prints one JSON line (kernel class, cosine, top-1 agreement)
"""
import sys, torch, json
torch.set_num_threads(1)
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from lowbit_eval import dequantize_checkpoint
from transformers import AutoModelForCausalLM, LlamaForCausalLM
ck = sys.argv[1]; base = sys.argv[2]
q = AutoModelForCausalLM.from_pretrained(ck, device_map="cpu", torch_dtype=torch.float16)
ref = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
w, _ = dequantize_checkpoint(ck)
sd = ref.state_dict()
with torch.no_grad():
    for k, v in w.items(): sd[k].copy_(v.half().float())
x = torch.arange(0, 4000, 37)[:100].reshape(1, -1)
with torch.no_grad():
    a = q(input_ids=x).logits.float(); b = ref(input_ids=x).logits
print(json.dumps({"checkpoint": ck, "loaded_class": type(q.model.layers[0].self_attn.q_proj).__name__,
  "cosine": torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item(),
  "top1": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}))
