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
import sys

import torch
from safetensors import safe_open
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
    modules = sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale"))
    if not modules:
        fail("no quantized linears in the artifact")
    if sorted(n[: -len(".weight")] for n in expected) != modules:
        fail("the quantized linears differ from the expected list")
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

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])

    def load_and_run(dequantize):
        model = AutoModelForCausalLM.from_pretrained(
            artifact, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=dequantize)
        )
        with torch.no_grad():
            logits = model(ids).logits.float()
        params = dict(model.named_parameters())
        for m in modules:
            got = params.get(f"{m}.weight")
            if got is None:
                fail(f"dequantize={dequantize}: {m}.weight is not a parameter of the model transformers loaded")
            if not torch.equal(got.detach().float(), expected[f"{m}.weight"]):
                fail(f"dequantize={dequantize}: {m}: transformers' weight differs from our dequantization")
        return logits

    dequantized = load_and_run(True)
    w8a8 = load_and_run(False)
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        full = ref(ids).logits.float()
        sd = ref.state_dict()
        for m in modules:
            sd[f"{m}.weight"].copy_(expected[f"{m}.weight"])
        dense = ref(ids).logits.float()

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()

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
