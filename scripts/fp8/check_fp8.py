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
3. Static activation scales (the config group's input_activations `dynamic: false`, FP8_ACTIVATIONS=static):
   every quantized linear has an `input_scale` F32 [1], finite and > 0; the model transformers loads with
   dequantize=False holds exactly ours as its `input_scale` parameters (and fake-quantizes each linear's
   input with them in the W8A8 forward above); and torch's own forward over the calibration token ids
   (CALIB_IDS.json, a list of id lists), through the dense model holding our dequantized weights, gives
   max|input| / 448 per linear equal to ours within 1e-4 relative (f32 summation order).

Usage: check_fp8.py ARTIFACT SOURCE EXPECTED.safetensors [CALIB_IDS.json]
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
    calib_path = sys.argv[4] if len(sys.argv) > 4 else None
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

    scheme = next(iter(qc.config_groups.values()))
    static = scheme.input_activations is not None and not scheme.input_activations.dynamic
    ours_input = {}
    if static:
        ia = scheme.input_activations
        if (ia.strategy, ia.type, ia.num_bits, ia.symmetric) != ("tensor", "float", 8, True):
            fail(f"static input_activations are not 8-bit float per-tensor symmetric: {ia}")
        if calib_path is None:
            fail("a static artifact needs CALIB_IDS.json")
        for m in modules:
            s = tensors.get(f"{m}.input_scale")
            if s is None:
                fail(f"{m}.input_scale is missing")
            if s.dtype != torch.float32 or list(s.shape) != [1] or not (torch.isfinite(s).all() and (s > 0).all()):
                fail(f"{m}.input_scale is {s.dtype} {list(s.shape)} {s.tolist()}, expected a finite positive F32 [1]")
            ours_input[m] = s
    elif any(n.endswith(".input_scale") for n in tensors):
        fail("a dynamic artifact holds input_scale tensors")

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])

    def load_and_run(dequantize):
        return compressed_tensors_logits(artifact, ids, modules, expected, dequantize, f"dequantize={dequantize}: ")

    dequantized = load_and_run(True)
    w8a8, loaded_input = compressed_tensors_logits(
        artifact, ids, modules, expected, False, "dequantize=False: ", input_scales=True
    )
    full, dense = reference_logits(source, ids, modules, expected)
    worst_rel = None
    if static:
        for m in modules:
            got = loaded_input.get(m)
            if got is None or not torch.equal(got.detach().float().reshape(-1), ours_input[m].reshape(-1)):
                fail(f"{m}: transformers' input_scale {None if got is None else got.tolist()} is not ours {ours_input[m].tolist()}")
        torch_scales = calibration_input_scales(source, modules, expected, json.load(open(calib_path)))
        worst_rel = 0.0
        for m in modules:
            ours = ours_input[m].item()
            rel = abs(torch_scales[m] - ours) / ours
            worst_rel = max(worst_rel, rel)
            if rel > 1e-4:
                fail(f"{m}: input_scale {ours} vs torch's forward max|x|/448 {torch_scales[m]} (relative {rel})")

    cos = cosine(dequantized, dense)
    cos_w8a8 = cosine(w8a8, dense)
    cos_src = cosine(dequantized, full)
    if cos < 0.99999:
        fail(f"logits of the dequantized FP8 model vs the dense model with our weights: cosine {cos}")
    if cos_w8a8 < 0.99:
        fail(f"logits with FP8 activations vs the dense model with our weights: cosine {cos_w8a8}")
    report = {
        "compressedTensors": ct_version, "format": qc.format, "modules": len(modules),
        "ignore": qc.ignore, "logitsCosineVsDequantized": cos, "logitsCosineW8A8VsDequantized": cos_w8a8,
        "logitsCosineVsSource": cos_src, "logitsCosineW8A8VsSource": cosine(w8a8, full),
    }
    if static:
        report.update({"activations": "static", "inputScales": len(ours_input), "inputScaleMaxRelDiff": worst_rel})
    print(json.dumps(report))


def calibration_input_scales(source, modules, expected, samples):
    """max|input| / 448 of each module of `modules` over every token of `samples` (one forward per sample) in
    the dense source model holding EXPECTED's (our dequantized) weights: the static scales as torch
    computes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    sd = model.state_dict()
    with torch.no_grad():
        for m in modules:
            sd[f"{m}.weight"].copy_(expected[f"{m}.weight"])
    amax = {m: 0.0 for m in modules}
    named = dict(model.named_modules())

    def hook(name):
        def record(_mod, args):
            amax[name] = max(amax[name], args[0].detach().abs().max().item())
        return record

    handles = [named[m].register_forward_pre_hook(hook(m)) for m in modules]
    # The engine's embedding clamps an id beyond the table to its last row (the test tokenizer's ids can
    # exceed the tiny model's vocabulary); the same here.
    last = model.get_input_embeddings().num_embeddings - 1
    with torch.no_grad():
        for ids in samples:
            model(torch.tensor([[min(t, last) for t in ids]]))
    for h in handles:
        h.remove()
    return {m: amax[m] / 448.0 for m in modules}


if __name__ == "__main__":
    main()
