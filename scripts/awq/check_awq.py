"""Reads an AWQ artifact of ours (AutoAWQ's GEMM layout) with its real consumers
(crates/flexinfer-quant/tests/awq_artifact.rs):

1. GPTQModel's AWQ reader (`gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm`, what its
   torch AWQ kernel runs): every quantized linear's `qweight` + `qzeros` + `scales` must dequantize to
   EXPECTED exactly (tolerance 0). EXPECTED (f32, `[out, in]`) is computed by the test with its own
   unpacking of the AWQ order, not by our reader.
2. transformers: AutoModelForCausalLM loads the artifact through its AWQ quantizer (AwqConfig from
   `quantization_config`; the linears become GPTQModel's AWQ modules, F16 on the CPU); its logits must
   match a dense model (the source in f32 with EXPECTED linears and the artifact's folded norms and biases):
   cosine >= 0.999, printed. Also printed: the cosine of the AWQ logits and of plain round-to-nearest
   (the same 4-bit groups, min/max, no scales, no clipping; computed here) against the source model.

Usage: check_awq.py ARTIFACT SOURCE EXPECTED.safetensors
Prints one JSON line with what it checked; exits non-zero on the first mismatch.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from consumer_check import artifact_tensors, cosine, fail, quantized_modules  # noqa: E402


def rtn(w, group):
    """4-bit asymmetric min/max round-to-nearest in groups of `group` inputs (the baseline AWQ improves on)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo = g.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = g.amax(dim=-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-5)
    z = (-lo / s).round().clamp(0, 15)
    q = ((g / s).round() + z).clamp(0, 15)
    return ((q - z) * s).reshape(rows, cols)


def main():
    artifact, source, expected_path = sys.argv[1:4]
    import gptqmodel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    cfg = json.load(open(f"{artifact}/config.json"))
    qc = cfg["quantization_config"]
    if (qc.get("quant_method"), qc.get("version"), qc.get("bits"), qc.get("zero_point")) != ("awq", "gemm", 4, True):
        fail(f"quantization_config {qc}")
    group = qc["group_size"]
    tensors = artifact_tensors(artifact)
    expected = load_file(expected_path)
    modules = quantized_modules(tensors, expected, ".qweight")
    for m in modules:
        if f"{m}.weight" in tensors:
            fail(f"{m}: the dense weight is in the artifact too")
        qw, qz, sc = tensors[f"{m}.qweight"], tensors[f"{m}.qzeros"], tensors[f"{m}.scales"]
        if qw.dtype != torch.int32 or qz.dtype != torch.int32 or sc.dtype != torch.float16:
            fail(f"{m}: qweight {qw.dtype}, qzeros {qz.dtype}, scales {sc.dtype}")
        w = dequantize_gemm(qw, qz, sc, 4, group).T
        want = expected[f"{m}.weight"]
        if w.shape != want.shape or not torch.equal(w.float(), want):
            diff = (w.float() - want).abs().max().item() if w.shape == want.shape else w.shape
            fail(f"{m}: GPTQModel's AWQ dequantization differs from ours (max |diff| {diff})")

    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7, 3, 44, 12, 90]])
    model = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float16)
    kinds = {type(model.get_submodule(m)).__name__ for m in modules}
    if not all("Awq" in k or "AWQ" in k for k in kinds):
        fail(f"the quantized linears loaded as {kinds}, not AWQ modules")
    with torch.no_grad():
        logits = model(ids).logits.float()
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        full = ref(ids).logits.float()
        sd = ref.state_dict()
        plain = {m: rtn(sd[f"{m}.weight"].clone(), group) for m in modules}
        for name, t in tensors.items():
            if name in sd and name != "lm_head.weight" and not name.startswith("model.embed_tokens"):
                sd[name].copy_(t.float())
        for m in modules:
            sd[f"{m}.weight"].copy_(expected[f"{m}.weight"])
        dense = ref(ids).logits.float()
        ref2 = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        sd2 = ref2.state_dict()
        for m in modules:
            sd2[f"{m}.weight"].copy_(plain[m])
        rtn_logits = ref2(ids).logits.float()

    cos = cosine(logits, dense)
    if cos < 0.999:
        fail(f"logits of the loaded model vs the dense model with our weights: cosine {cos}")
    print(json.dumps({
        "gptqmodel": gptqmodel.__version__, "modules": len(modules), "groupSize": group,
        "loadedAs": sorted(kinds), "logitsCosineVsDequantized": cos,
        "logitsCosineVsSource": cosine(logits, full), "denseCosineVsSource": cosine(dense, full),
        "rtnCosineVsSource": cosine(rtn_logits, full),
    }))


if __name__ == "__main__":
    main()
