"""Reads a compressed-tensors `pack-quantized` artifact of ours (the GPTQ solve in compressed-tensors'
container) with its real consumers (crates/flexinfer-quant/tests/ct_artifact.rs):

1. compressed-tensors: validates `quantization_config` (QuantizationConfig) and, for every quantized
   linear, decompresses `weight_packed` + `weight_scale` + `weight_shape` (+ `weight_zero_point` when
   asymmetric) with the compressor its `format` names; the result must equal EXPECTED (f32) exactly
   (tolerance 0). EXPECTED is computed by the test from the GPTQ container of the same run (codes,
   zeros and scales of the solve, the scales in the model's dtype), not from these tensors.
2. transformers: AutoModelForCausalLM loads the artifact through CompressedTensorsHfQuantizer
   (dequantize=True: weights decompressed at load); every quantized linear's weight equals EXPECTED
   and the logits equal a dense model holding the EXPECTED weights
   (cosine >= 0.99999, printed).

Usage: check_pack_quantized.py ARTIFACT SOURCE EXPECTED.safetensors
Prints one JSON line with what it checked; exits non-zero on the first mismatch.
"""
import json
import sys

import torch
from safetensors.torch import load_file


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def artifact_tensors(path):
    index = json.load(open(f"{path}/model.safetensors.index.json"))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(f"{path}/{shard}"))
    return out


def main():
    artifact, source, expected_path = sys.argv[1:4]
    from compressed_tensors import QuantizationConfig, __version__ as ct_version
    from compressed_tensors.compressors import BaseCompressor

    cfg = json.load(open(f"{artifact}/config.json"))
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    if qc.format != "pack-quantized":
        fail(f"format {qc.format}")
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    scheme = next(iter(qc.config_groups.values()))
    bits = scheme.weights.num_bits
    tensors = artifact_tensors(artifact)
    expected = load_file(expected_path)
    modules = sorted(n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed"))
    if not modules:
        fail("no quantized linears in the artifact")
    if sorted(n[: -len(".weight")] for n in expected) != modules:
        fail("the quantized linears differ from the expected list")
    names = set(compressor.compression_param_names(scheme))
    for m in modules:
        state = {k: tensors[f"{m}.{k}"] for k in names if f"{m}.{k}" in tensors}
        if set(state) != names:
            fail(f"{m}: tensors {sorted(state)}, the compressor expects {sorted(names)}")
        if f"{m}.weight" in tensors:
            fail(f"{m}: the dense weight is in the artifact too")
        packed, shape = state["weight_packed"], state["weight_shape"]
        if packed.dtype != torch.int32 or shape.dtype != torch.int64:
            fail(f"{m}: weight_packed {packed.dtype}, weight_shape {shape.dtype}")
        out = compressor.decompress(state, scheme)["weight"]
        want = expected[f"{m}.weight"]
        if out.dtype != state["weight_scale"].dtype or not torch.equal(out.float(), want):
            diff = (out.float() - want).abs().max().item()
            fail(f"{m}: compressed-tensors' decompression differs from ours (max |diff| {diff}, {out.dtype})")

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])
    model = AutoModelForCausalLM.from_pretrained(
        artifact, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    with torch.no_grad():
        logits = model(ids).logits.float()
    params = dict(model.named_parameters())
    for m in modules:
        got = params.get(f"{m}.weight")
        if got is None:
            fail(f"{m}.weight is not a parameter of the model transformers loaded")
        if not torch.equal(got.detach().float(), expected[f"{m}.weight"]):
            diff = (got.detach().float() - expected[f"{m}.weight"]).abs().max().item()
            fail(f"{m}: transformers' weight differs from our dequantization (max |diff| {diff})")
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        full = ref(ids).logits.float()
        sd = ref.state_dict()
        for m in modules:
            sd[f"{m}.weight"].copy_(expected[f"{m}.weight"])
        dense = ref(ids).logits.float()

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()

    cos = cosine(logits, dense)
    cos_src = cosine(logits, full)
    if cos < 0.99999:
        fail(f"logits of the loaded model vs the dense model with our weights: cosine {cos}")
    print(json.dumps({
        "compressedTensors": ct_version, "format": qc.format, "bits": bits,
        "symmetric": scheme.weights.symmetric, "strategy": scheme.weights.strategy,
        "groupSize": scheme.weights.group_size, "actorder": scheme.weights.actorder,
        "modules": len(modules), "ignore": qc.ignore, "logitsCosineVsDequantized": cos,
        "logitsCosineVsSource": cos_src,
    }))


if __name__ == "__main__":
    main()
