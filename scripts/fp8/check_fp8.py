"""Reads an FP8 artifact of ours with its real consumers (the FP8 consumer test,
crates/flexinfer-quant/tests/fp8_artifact.rs):

1. compressed-tensors: validates `quantization_config` (QuantizationConfig), and for every
   quantized linear decompresses `weight` + `weight_scale` with the compressor its `format` names;
   the result must equal our dequantization (EXPECTED, f32) exactly, and torch's own E4M3 cast of
   the source weight divided by our scale must give our codes (round to nearest even, saturation).
2. transformers: AutoModelForCausalLM loads the artifact through CompressedTensorsHfQuantizer twice.
   With dequantize=True (weights dequantized at load) every quantized linear's weight equals our
   dequantization and the logits equal a dense model holding our dequantized weights (cosine
   ≥ 0.99999). With dequantize=False (compressed-tensors' own route: FP8 weights decompressed on the
   first forward, inputs of the quantized linears fake-quantized to FP8 per token as the scheme's
   dynamic input_activations say — what vLLM's W8A8 kernels compute) the weights equal ours after the
   forward and the logits stay close to the dense ones (cosine ≥ 0.99, printed).

Usage: check_fp8.py ARTIFACT SOURCE EXPECTED.safetensors
Prints one JSON line with what it checked; exits non-zero on the first mismatch.
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from consumer_check import (  # noqa: E402
    artifact_tensors, compressed_tensors_logits, cosine, fail, quantized_modules, reference_logits,
)


def source_tensors(path):
    import glob

    out = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


def main():
    artifact, source, expected_path = sys.argv[1:4]
    from compressed_tensors import QuantizationConfig, __version__ as ct_version
    from compressed_tensors.compressors import BaseCompressor

    cfg = json.load(open(f"{artifact}/config.json"))
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors = artifact_tensors(artifact)
    src = source_tensors(source)
    expected = load_file(expected_path)
    modules = quantized_modules(tensors, expected, ".weight_scale")
    for m in modules:
        scheme = next(iter(qc.config_groups.values()))
        w, s = tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"]
        if w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
            fail(f"{m}: weight {w.dtype}, weight_scale {s.dtype}")
        out = compressor.decompress({"weight": w, "weight_scale": s}, scheme)["weight"]
        want = expected[f"{m}.weight"]
        if out.dtype != torch.float32 or not torch.equal(out, want):
            diff = (out.float() - want).abs().max().item()
            fail(f"{m}: compressed-tensors' decompression differs from ours (max |diff| {diff})")
        ours = w.view(torch.uint8)
        torch_codes = (src[f"{m}.weight"].float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        if not torch.equal(torch_codes.view(torch.uint8), ours):
            bad = (torch_codes.view(torch.uint8) != ours).sum().item()
            fail(f"{m}: {bad} codes differ from torch's float8_e4m3fn cast")

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])

    def load_and_run(dequantize):
        return compressed_tensors_logits(artifact, ids, modules, expected, dequantize, f"dequantize={dequantize}: ")

    dequantized = load_and_run(True)
    w8a8 = load_and_run(False)
    full, dense = reference_logits(source, ids, modules, expected)

    cos = cosine(dequantized, dense)
    cos_w8a8 = cosine(w8a8, dense)
    cos_src = cosine(dequantized, full)
    if cos < 0.99999:
        fail(f"logits of the dequantized FP8 model vs the dense model with our weights: cosine {cos}")
    if cos_w8a8 < 0.99:
        fail(f"logits with FP8 activations vs the dense model with our weights: cosine {cos_w8a8}")
    print(json.dumps({
        "compressedTensors": ct_version, "format": qc.format, "modules": len(modules),
        "ignore": qc.ignore, "logitsCosineVsDequantized": cos, "logitsCosineW8A8VsDequantized": cos_w8a8,
        "logitsCosineVsSource": cos_src,
    }))


if __name__ == "__main__":
    main()
