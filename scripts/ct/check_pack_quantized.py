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
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from consumer_check import (  # noqa: E402
    artifact_tensors, compressed_tensors_logits, cosine, fail, quantized_modules, reference_logits,
)


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
    modules = quantized_modules(tensors, expected, ".weight_packed")
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

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])
    logits = compressed_tensors_logits(artifact, ids, modules, expected, dequantize=True, show_diff=True)
    full, dense = reference_logits(source, ids, modules, expected)

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
