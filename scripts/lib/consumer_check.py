"""What the Python consumer checks share (scripts/fp8/check_fp8.py, scripts/ct/check_pack_quantized.py,
scripts/awq/check_awq.py): the failure exit, reading the artifact's shards, the list of quantized linears
checked against EXPECTED, the logits of a compressed-tensors artifact as transformers loads it, the logits of
the dense reference model and the cosine of two logits.

A check imports it with its own directory's ../lib on sys.path (the checks run as
`python scripts/<x>/check_<y>.py ARTIFACT SOURCE EXPECTED.safetensors`, from any working directory).
"""
import json
import sys

import torch
from safetensors.torch import load_file


def fail(msg):
    """The first mismatch: FAIL and the message on stderr, exit 1."""
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def artifact_tensors(path):
    """Every tensor of the shards that the artifact's model.safetensors.index.json names."""
    index = json.load(open(f"{path}/model.safetensors.index.json"))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(f"{path}/{shard}"))
    return out


def quantized_modules(tensors, expected, suffix):
    """The modules with a `<module><suffix>` tensor (sorted); fails when there is none or when they are
    not exactly the modules of EXPECTED's `<module>.weight` tensors."""
    modules = sorted(n[: -len(suffix)] for n in tensors if n.endswith(suffix))
    if not modules:
        fail("no quantized linears in the artifact")
    if sorted(n[: -len(".weight")] for n in expected) != modules:
        fail("the quantized linears differ from the expected list")
    return modules


def compressed_tensors_logits(artifact, ids, modules, expected, dequantize, prefix="", show_diff=False,
                              input_scales=False):
    """The logits of the artifact as transformers loads it through CompressedTensorsHfQuantizer (dense f32,
    CompressedTensorsConfig(dequantize=...)); fails unless every quantized linear's weight is a parameter
    equal to EXPECTED's. `prefix` starts the failure messages; `show_diff` adds the max |diff| to them. With
    `input_scales`, returns (logits, {module: its loaded `input_scale` parameter or buffer})."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        artifact, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=dequantize)
    )
    with torch.no_grad():
        logits = model(ids).logits.float()
    params = dict(model.named_parameters())
    for m in modules:
        got = params.get(f"{m}.weight")
        if got is None:
            fail(f"{prefix}{m}.weight is not a parameter of the model transformers loaded")
        if not torch.equal(got.detach().float(), expected[f"{m}.weight"]):
            diff = ""
            if show_diff:
                diff = f" (max |diff| {(got.detach().float() - expected[f'{m}.weight']).abs().max().item()})"
            fail(f"{prefix}{m}: transformers' weight differs from our dequantization{diff}")
    if input_scales:
        state = model.state_dict()
        return logits, {m: state[f"{m}.input_scale"] for m in modules if f"{m}.input_scale" in state}
    return logits


def reference_logits(source, ids, modules, expected):
    """The source model's logits in f32, and those of the source with EXPECTED's weights in its quantized
    linears (the dense model holding our dequantized weights)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        full = ref(ids).logits.float()
        sd = ref.state_dict()
        for m in modules:
            sd[f"{m}.weight"].copy_(expected[f"{m}.weight"])
        dense = ref(ids).logits.float()
    return full, dense


def cosine(a, b):
    """The cosine similarity of two logits tensors, flattened."""
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
