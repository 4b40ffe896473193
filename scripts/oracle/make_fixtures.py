#!/usr/bin/env python3
"""Oracle fixtures for the engine's calibration forward, generated with Hugging Face transformers.

For each family: a tiny random-weight model is built with transformers (f32, eager attention), run on fixed
token ids, and written to tests/fixtures/oracle/<name>/ as
  config.json          the model's config (architectures set)
  model.safetensors    the weights in the hub checkpoint layout (per-expert tensors, e.g. Mixtral's
                       block_sparse_moe.experts.N.w1; Gemma 4 keeps its fused experts.gate_up_proj /
                       experts.down_proj), the layout the engine reads
  expected/expected.safetensors  hidden.<l> (the residual stream after decoder layer l, [tokens, hidden]) and
                       logits (kept out of the model directory's own *.safetensors)
  expected/expected.json  token ids, the router's top-k expert ids per token for every sparse layer, versions

The written weights are loaded back with transformers' own from_pretrained (which converts the hub layout to its
fused in-memory experts) and must give the same logits: that checks the layout conversion of this script.

Run with `make oracle` (needs torch, transformers, safetensors; not part of CI); `make_fixtures.py NAME...`
regenerates only the named families (each family's seed is fixed by its position in FAMILIES). The Rust side is
crates/flexinfer-quant/tests/oracle.rs. Deterministic: fixed seeds.

`make_fixtures.py --check-quantized [--json FILE] [--backend auto|torch] DIR[=FAMILY]...` (`make oracle-check`)
loads gptq checkpoints the engine wrote from these fixtures with transformers' GPTQ loader (needs optimum and
gptqmodel as well) and measures them against the fixture: see check_quantized and docs/user/gptq-engine.md
"Loaded by transformers".
"""

import json
import os
import sys
import tempfile

import torch
import transformers
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "oracle")

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe_no_norm_topk": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            use_sliding_window=False,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=64),
    ),
    # Gemma: (1 + w) norms, embeddings × sqrt(hidden), GELU-tanh, post-attention / pre- and post-feedforward
    # norms, query_pre_attn_scalar. A sliding window shorter than the token ids, so the local mask matters.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=128,
            sliding_window=6,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=128,
            sliding_window=6,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # Gemma 4 (text): plain `w` norms, q/k RMSNorm and a scale-free v RMSNorm, attention scale 1, a wider head
    # (global_head_dim) and fewer kv heads on the global layers, keys reused as values there (attention_k_eq_v),
    # proportional rope (partial_rotary_factor) on the global layers, a per-layer output scalar, final
    # soft-capping. Shaped like gemma-4-31B (dense) and gemma-4-26B-A4B (MoE: a dense MLP beside the routed
    # experts, each with its own norms; a router with its own RMSNorm, scale and per-expert weight scale).
    "gemma4_text": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            sliding_window=6,
            tie_word_embeddings=True,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "gemma4_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            sliding_window=6,
            tie_word_embeddings=True,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention"],
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=False,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=16,
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # The multimodal wrapper (Gemma4ForConditionalGeneration): text_config nested in config.json, the text stack
    # under model.language_model.*, a (tiny) vision tower the engine must copy untouched. Run on text tokens only.
    "gemma4_mm": (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        dict(
            text=dict(
                num_hidden_layers=2,
                intermediate_size=32,
                sliding_window=6,
                tie_word_embeddings=True,
                final_logit_softcapping=3.0,
                layer_types=["sliding_attention", "full_attention"],
                global_head_dim=32,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                hidden_size_per_layer_input=0,
                num_kv_shared_layers=0,
                rope_parameters={
                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
            vision=dict(
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=8,
                patch_size=4,
                position_embedding_size=16,
                pooling_kernel_size=2,
            ),
            # Special tokens outside TOKENS (a multimodal placeholder id would be replaced by the pad id).
            ids=dict(image_token_id=94, boi_token_id=93, eoi_token_id=92, video_token_id=91, boa_token_id=90,
                     eoa_token_index=89, audio_token_id=87),
        ),
    ),
    # Gated delta-net hybrids (Qwen3-Next, Qwen3.5): linear-attention layers (fused in_proj_qkvz / in_proj_ba on
    # Qwen3-Next, split in_proj_qkv / _z / _b / _a on Qwen3.5; causal depthwise conv, gated delta rule, gated
    # RMSNorm) beside full-attention layers (an output gate in q_proj, q/k norms, partial rope); (1 + w) norms.
    # More value heads than key heads, so the key heads are shared. At least 8 value heads on Qwen3.5, so that
    # in_proj_b / in_proj_a (one row per value head) pack at 4 bits when every linear is quantized.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            intermediate_size=64,
            head_dim=32,
            tie_word_embeddings=True,
            linear_num_key_heads=2,
            linear_num_value_heads=8,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        ),
    ),
    # The multimodal Qwen3.5-MoE wrapper: text_config nested, the text stack under model.language_model.*, a tiny
    # vision tower (model.visual.*) and MTP tensors (mtp.*, which transformers ignores) the engine copies untouched.
    "qwen3_5_moe_mm": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(
            text=dict(
                num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=3,
                linear_num_key_heads=2,
                linear_num_value_heads=8,
                linear_key_head_dim=16,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True},
            ),
            vision=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=64,
                num_position_embeddings=16,
            ),
            ids=dict(image_token_id=94, video_token_id=93, vision_start_token_id=92, vision_end_token_id=91),
            mtp={"mtp.fc.weight": [64, 128], "mtp.layers.0.mlp.experts.0.up_proj.weight": [16, 64],
                 "mtp.norm.weight": [64]},
        ),
    ),
}

TOKENS = [3, 17, 42, 5, 88, 61, 0, 23, 23, 77, 9, 50, 31, 14, 95, 2, 66, 40, 11, 8]


def zero_centred_norm(model, name):
    """A Qwen3-Next / Qwen3.5 RMSNorm weight, multiplied as 1 + w (not the gated norm, not the vision tower's)."""
    arch = type(model).__name__
    return (
        (arch.startswith("Qwen3Next") or arch.startswith("Qwen3_5"))
        and name.endswith("norm.weight")
        and "linear_attn.norm" not in name
        and "visual" not in name
    )


def init_weights(model, seed):
    """Realistically scaled random weights: N(0, 1/fan_in) matrices, norms near 1 (zero-centred norms: w near 0,
    so that 1 + w is near 1), a sharper router."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                centre = 0.0 if zero_centred_norm(model, name) else 1.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                router = name.endswith("mlp.gate.weight") or name.endswith("router.proj.weight")
                scale = 3.0 if router else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        # Gemma 4's per-layer output scalar is a (persistent) buffer: away from 1 so that it is exercised.
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def hub_state_dict(model, arch):
    """The in-memory state dict in the hub checkpoint layout (one tensor per expert projection)."""
    out = {}
    tied = model.config.tie_word_embeddings
    if arch.startswith("Gemma4") and tied:
        # The tied lm_head is not a tensor of the hub checkpoints.
        return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if arch.startswith("Gemma4"):
        # Gemma 4 checkpoints keep the fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj).
        return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
                if not (tied and k == "lm_head.weight")}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        v = v.detach().contiguous()
        if ".experts.gate_up_proj" in k:
            base = k[: k.index(".experts.gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                if arch == "MixtralForCausalLM":
                    b = base.replace(".mlp", ".block_sparse_moe")
                    out[f"{b}.experts.{e}.w1.weight"] = v[e, :inter].clone()
                    out[f"{b}.experts.{e}.w3.weight"] = v[e, inter:].clone()
                else:
                    out[f"{base}.experts.{e}.gate_proj.weight"] = v[e, :inter].clone()
                    out[f"{base}.experts.{e}.up_proj.weight"] = v[e, inter:].clone()
        elif ".experts.down_proj" in k:
            base = k[: k.index(".experts.down_proj")]
            for e in range(v.shape[0]):
                if arch == "MixtralForCausalLM":
                    b = base.replace(".mlp", ".block_sparse_moe")
                    out[f"{b}.experts.{e}.w2.weight"] = v[e].clone()
                else:
                    out[f"{base}.experts.{e}.down_proj.weight"] = v[e].clone()
        elif arch == "MixtralForCausalLM" and ".mlp.gate." in k:
            out[k.replace(".mlp.", ".block_sparse_moe.")] = v.clone()
        else:
            out[k] = v.clone()
    return out


def text_config(cfg_cls, extra):
    common = dict(COMMON)
    if "rope_parameters" in extra:
        common.pop("rope_theta")
    for k in extra:
        common.pop(k, None)
    return getattr(transformers, cfg_cls)(**common, **extra)


def decoder_layers(model):
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def run_one(name, cfg_cls, arch, extra, seed):
    if cfg_cls == "Gemma4Config":
        tc = text_config("Gemma4TextConfig", extra["text"])
        vc = transformers.Gemma4VisionConfig(**extra["vision"])
        cfg = transformers.Gemma4Config(text_config=tc.to_dict(), vision_config=vc.to_dict(), audio_config=None,
                                        **extra["ids"])
    elif cfg_cls == "Qwen3_5MoeConfig":
        tc = text_config("Qwen3_5MoeTextConfig", extra["text"])
        vc = transformers.Qwen3_5MoeVisionConfig(**extra["vision"])
        cfg = transformers.Qwen3_5MoeConfig(text_config=tc.to_dict(), vision_config=vc.to_dict(), **extra["ids"])
    else:
        cfg = text_config(cfg_cls, extra)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(torch.float32)
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "text_config"):
        model.config.text_config._attn_implementation = "eager"
    init_weights(model, seed)
    model.eval()

    hidden, topk = {}, {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):
        def grab(_m, _inp, out, i=i):
            hidden[i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
        hooks.append(layer.register_forward_hook(grab))
        gate = getattr(layer.mlp, "gate", None)
        if getattr(layer, "router", None) is not None:
            gate = layer.router  # Gemma 4: (probabilities, top-k weights, top-k ids)
        if gate is not None and (hasattr(gate, "top_k") or gate is getattr(layer, "router", None)):
            def grab_router(_m, _inp, out, i=i):
                topk[i] = out[2].detach().tolist()
            hooks.append(gate.register_forward_hook(grab_router))
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].detach().clone()
    for h in hooks:
        h.remove()

    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("_attn_implementation_autoset", None)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=1, sort_keys=True)
    weights = hub_state_dict(model, arch)
    # Extra tensors of the hub checkpoints that transformers does not load (Qwen3.5's MTP head): random, copied
    # untouched by the engine.
    g = torch.Generator().manual_seed(seed + 1)
    for k, shape in (extra.get("mtp") or {}).items():
        weights[k] = torch.randn(shape, generator=g)
    save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    expected = {f"hidden.{i}": t.contiguous() for i, t in hidden.items()}
    expected["logits"] = logits.contiguous()
    os.makedirs(os.path.join(d, "expected"), exist_ok=True)
    save_file(expected, os.path.join(d, "expected", "expected.safetensors"))
    with open(os.path.join(d, "expected", "expected.json"), "w") as f:
        json.dump(
            {
                "tokens": TOKENS,
                "router_topk": {str(k): v for k, v in sorted(topk.items())},
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "seed": seed,
            },
            f,
            indent=None,
        )

    # The hub layout written above must load into transformers and give the same logits.
    reloaded = getattr(transformers, arch).from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits[0]
    err = (again - logits).abs().max().item()
    if err > 1e-5:
        sys.exit(f"{name}: the written checkpoint reloads with logits differing by {err}")
    print(f"{name}: {len(hidden)} layers, sparse layers {sorted(topk)}, reload max |Δlogits| {err:.2e}")


def unpack_stream(words, bits, n):
    """Values 0..2^bits-1 from int32 words read as one little-endian bit stream along dim 0 (value k at bits
    k*bits .. (k+1)*bits, words in order): the packing of every GPTQ bit width, 3 bits included. Returns [n, ...]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64).view(1, 32, *([1] * (w.dim() - 1)))
    bitstream = ((w.unsqueeze(1) >> shifts) & 1).reshape(w.shape[0] * 32, *w.shape[1:])
    bitstream = bitstream[: n * bits].reshape(n, bits, *w.shape[1:])
    weights = (1 << torch.arange(bits, dtype=torch.int64)).view(1, bits, *([1] * (w.dim() - 1)))
    return (bitstream * weights).sum(1)


def gptq_dequant(t, stem, bits, v1):
    """The [out, in] f32 weight of one packed linear, by the GPTQ rules written out by hand: qweight [in*bits/32,
    out], qzeros [groups, out*bits/32], scales [groups, out], g_idx [in]; W[o, i] = scale[g, o] * (q[i, o] -
    z[g, o]) with g = g_idx[i] and z the stored zero + 1 in the v1 format (checkpoint_format "gptq")."""
    scales = t[f"{stem}.scales"].to(torch.float32)
    g_idx = t[f"{stem}.g_idx"].to(torch.int64)
    n_in, n_out = g_idx.shape[0], scales.shape[1]
    q = unpack_stream(t[f"{stem}.qweight"], bits, n_in)  # [in, out]
    z = unpack_stream(t[f"{stem}.qzeros"].T.contiguous(), bits, n_out).T  # [groups, out]
    if v1:
        z = z + 1
    return (scales[g_idx] * (q - z[g_idx]).to(torch.float32)).T.contiguous()


def read_safetensors_dir(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def logit_stats(got, want):
    got, want = got.to(torch.float64), want.to(torch.float64)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).to(torch.float64).mean().item()
    return cos, top1


def model_class(path):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return getattr(transformers, cfg["architectures"][0]), cfg


def check_quantized(path, family=None, defuse=False, backend="auto"):
    """Loads a gptq checkpoint written by the engine with transformers (GPTQ backend: optimum + gptqmodel, CPU)
    and measures it. `family` (default: the directory's name) names the oracle fixture it was quantized from.
    Returns a dict: whether it loaded (and the exact error if not), parameters transformers left uninitialised or
    ignored, the quantized modules and their kernel class; and, when it loaded:
      - fixture: cosine and top-1 agreement of its logits on the fixture's token ids with the fixture's f32 logits;
      - dequant: over the packed modules, the largest max |our hand-written GPTQ dequantization - the linear map the
        backend computes (its kernel applied to the identity)| relative to max |W| (the packing read by the
        consumer's rules); with the pure-torch kernel (TorchLinear) also its own dequantize_weight() against ours
        rounded to its dtype (max |difference|, 0 when the packing is read identically);
      - reference: the fixture's f32 model with every packed weight replaced by our dequantization, run by
        transformers: its logits against the backend's (same weights, different kernels) and against the fixture
        (the quantization error alone)."""
    family = family or os.path.basename(os.path.normpath(path))
    fixture = os.path.join(OUT, family)
    res = {"family": family, "path": path, "defused": defuse, "backend": backend}
    cls, cfg = model_class(path)
    if defuse:
        # What GPTQModel's own loader does before instantiating a model whose experts transformers fuses into
        # 3-D parameters (optimum's convert_model only replaces nn.Linear): patch the classes so that transformers
        # builds one nn.Linear per expert, which the GPTQ integration then replaces. Process-global: one family
        # per process.
        import defuser

        types = [cfg.get("model_type")] + [cfg.get(k, {}).get("model_type") for k in ("text_config",)]
        res["defuser_patched"] = {t: bool(defuser.replace_fused_blocks(t)) for t in types if t}
    qc = cfg.get("quantization_config", {})
    bits, v1 = qc.get("bits", 4), qc.get("checkpoint_format", "gptq") == "gptq"
    try:
        kw = {}
        if backend != "auto":
            # A loading attribute: merged into the checkpoint's quantization_config, nothing else is overridden.
            kw["quantization_config"] = transformers.GPTQConfig(bits=bits, backend=backend)
        m, info = cls.from_pretrained(path, dtype=torch.float32, device_map="cpu", attn_implementation="eager",
                                      output_loading_info=True, **kw)
    except Exception as e:  # noqa: BLE001 - the note records what happened
        import traceback

        res["loaded"] = False
        res["error"] = f"{type(e).__name__}: {str(e).strip()[:600]}"
        res["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
        return res
    m.eval()
    res["loaded"] = True
    res["class"] = type(m).__name__
    res["missing_keys"] = sorted(info.get("missing_keys", []))
    res["unexpected_keys"] = sorted(info.get("unexpected_keys", []))
    res["mismatched_keys"] = [str(k) for k in info.get("mismatched_keys", [])]
    qmods = {n: mod for n, mod in m.named_modules() if hasattr(mod, "qweight") and hasattr(mod, "dequantize_weight")}
    res["quant_modules"] = len(qmods)
    res["kernels"] = sorted({type(mod).__name__ for mod in qmods.values()})

    try:
        measure(res, m, cls, path, fixture, bits, v1)
    except Exception as e:  # noqa: BLE001 - the note records what happened
        import traceback

        res["measure_error"] = f"{type(e).__name__}: {str(e).strip()[:600]}"
        res["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    return res


def measure(res, m, cls, path, fixture, bits, v1):
    qmods = {n: mod for n, mod in m.named_modules() if hasattr(mod, "qweight") and hasattr(mod, "dequantize_weight")}
    tensors = read_safetensors_dir(path)
    stems = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    res["packed_in_checkpoint"] = len(stems)
    # Parameter names of the in-memory model may differ from the checkpoint's (e.g. a renamed prefix):
    # match a packed stem to a loaded quant module by its longest common suffix of dotted parts.
    def find_module(stem):
        if stem in qmods:
            return stem
        parts = stem.split(".")
        for k in range(len(parts) - 1, 1, -1):
            suffix = "." + ".".join(parts[-k:])
            hits = [n for n in qmods if n.endswith(suffix)]
            if len(hits) == 1:
                return hits[0]
        return None

    worst, unmatched, ours, exact, n_exact = 0.0, [], {}, 0.0, 0
    for stem in stems:
        w = gptq_dequant(tensors, stem, bits, v1)
        ours[stem] = w
        name = find_module(stem)
        if name is None:
            unmatched.append(stem)
            continue
        # The linear map the backend's kernel computes, probed with the identity (kernel-agnostic: some CPU
        # kernels repack the weights, so their dequantize_weight() no longer reads the checkpoint layout).
        mod = qmods[name]
        with torch.no_grad():
            eye = torch.eye(w.shape[1], dtype=torch.float32)
            zero = torch.zeros(1, w.shape[1], dtype=torch.float32)
            b = (mod(eye) - mod(zero)).to(torch.float32).T
        worst = max(worst, ((b - w).abs().max() / w.abs().max().clamp_min(1e-30)).item())
        if type(mod).__name__ == "TorchLinear":
            # The pure-torch kernel keeps the checkpoint layout: its own dequantization, element by element, in its
            # dtype (f16: the scales' dtype), against ours rounded to that dtype.
            with torch.no_grad():
                d = mod.dequantize_weight().T  # [in, out] -> [out, in]
            exact = max(exact, (d.float() - w.to(d.dtype).float()).abs().max().item())
            res["dequantize_weight_dtype"] = str(d.dtype)
            n_exact += 1
    res["dequant_max_rel_diff"] = worst
    if n_exact:
        res["dequantize_weight_max_abs_diff"], res["dequantize_weight_modules"] = exact, n_exact
    res["packed_not_loaded"] = unmatched

    with open(os.path.join(fixture, "expected", "expected.json")) as f:
        tokens = json.load(f)["tokens"]
    from safetensors.torch import load_file

    want = load_file(os.path.join(fixture, "expected", "expected.safetensors"))["logits"]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        got = m(input_ids=ids).logits[0].to(torch.float32)
    res["fixture_cosine"], res["fixture_top1"] = logit_stats(got, want)

    # The reference: the source model with our dequantized weights, run by transformers in f32.
    ref = cls.from_pretrained(fixture, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    params = dict(ref.named_parameters())
    replaced = 0
    with torch.no_grad():
        for stem, w in ours.items():
            p = params.get(f"{stem}.weight")
            if p is None:
                cands = [n for n in params if n.endswith("." + ".".join(stem.split(".")[-3:]) + ".weight")]
                p = params[cands[0]] if len(cands) == 1 else None
            if p is not None and p.shape == w.shape:
                p.copy_(w)
                replaced += 1
        ref_logits = ref(input_ids=ids).logits[0].to(torch.float32)
    res["reference_replaced"] = replaced
    res["backend_vs_reference_cosine"], res["backend_vs_reference_top1"] = logit_stats(got, ref_logits)
    res["backend_vs_reference_max_abs"] = (got - ref_logits).abs().max().item()
    res["reference_vs_fixture_cosine"], res["reference_vs_fixture_top1"] = logit_stats(ref_logits, want)


def summary_line(r):
    head = f"{r['family']} ({'defused' if r.get('defused') else 'plain'}, backend {r.get('backend')})"
    if not r.get("loaded"):
        return f"{head}: NOT LOADED: {r.get('error')}"
    if r.get("measure_error"):
        return (f"{head}: loaded as {r['class']}, {len(r.get('missing_keys', []))} missing keys, "
                f"{len(r.get('unexpected_keys', []))} unexpected keys; running it failed: {r['measure_error']}")
    f = lambda k: "-" if r.get(k) is None else f"{r[k]:.4f}"  # noqa: E731
    return (f"{head}: loaded as {r['class']} [{', '.join(r['kernels'])}], {r['quant_modules']} quant modules, "
            f"{r['packed_in_checkpoint']} packed, {len(r['packed_not_loaded'])} packed not loaded, {len(r['missing_keys'])} missing keys; "
            f"logits vs fixture cos {f('fixture_cosine')} top1 {f('fixture_top1')}; our dequant vs backend max rel "
            f"{r['dequant_max_rel_diff']:.2e}"
            + (f" (dequantize_weight vs ours in {r['dequantize_weight_dtype']}: max |diff| "
               f"{r['dequantize_weight_max_abs_diff']:.1e} over {r['dequantize_weight_modules']} modules)"
               if "dequantize_weight_modules" in r else "")
            + f"; backend vs our-dequant reference cos {f('backend_vs_reference_cosine')}"
            f" top1 {f('backend_vs_reference_top1')} ({r['reference_replaced']} weights replaced); reference vs fixture cos {f('reference_vs_fixture_cosine')}")


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--check-one":
        r = check_quantized(sys.argv[4], sys.argv[5], defuse=sys.argv[2] == "defused", backend=sys.argv[3])
        print("CHECK-RESULT " + json.dumps(r), flush=True)
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--check-quantized":
        # --check-quantized [--json FILE] [--backend B] PATH[=FAMILY]...  (FAMILY defaults to PATH's directory
        # name; B is GPTQModel's kernel choice, default auto). Each checkpoint is loaded in its own process, first
        # as transformers loads it; where the chosen kernel rejects a module's shape, again with the pure-torch
        # kernel (backend torch); where packed modules stay unloaded (fused MoE experts), again with GPTQModel's
        # defuser patches.
        import importlib.metadata
        import subprocess

        args, out, backend = sys.argv[2:], None, "auto"
        while args[:1] in (["--json"], ["--backend"]):
            if args[0] == "--json":
                out = args[1]
            else:
                backend = args[1]
            args = args[2:]
        versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "optimum", "gptqmodel",
                                                                "defuser", "safetensors")}
        results = {"versions": versions, "checks": []}
        for a in args:
            p, _, fam = a.partition("=")
            fam = fam or os.path.basename(os.path.normpath(p))
            mode, kernel = "plain", backend
            for _ in range(4):
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--check-one", mode, kernel, p, fam],
                                      capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK-RESULT ")]
                if lines:
                    r = json.loads(lines[-1][len("CHECK-RESULT "):])
                else:
                    r = {"family": fam, "path": p, "defused": mode == "defused", "backend": kernel, "loaded": False,
                         "error": f"check process exited {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
                results["checks"].append(r)
                print(summary_line(r), flush=True)
                if not r.get("loaded") and "must be divisible" in r.get("error", "") and kernel != "torch":
                    kernel = "torch"
                elif r.get("loaded") and (r.get("packed_not_loaded") or r.get("missing_keys")) and mode == "plain":
                    mode = "defused"
                else:
                    break
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
        return
    only = set(sys.argv[1:])  # optional family names: regenerate just those (seeds do not depend on it)
    unknown = only - set(FAMILIES)
    if unknown:
        sys.exit(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    for i, (name, (cfg_cls, arch, extra)) in enumerate(FAMILIES.items()):
        if not only or name in only:
            run_one(name, cfg_cls, arch, extra, seed=1000 + i)


if __name__ == "__main__":
    main()
