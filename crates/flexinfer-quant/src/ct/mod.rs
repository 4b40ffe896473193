//! compressed-tensors output of the GPTQ solve: the `pack-quantized` layout (int4 / int8 weight-only,
//! grouped or per channel) that the `compressed-tensors` library and vLLM read. GPTQ is the algorithm,
//! compressed-tensors the container: the run is a GPTQ run (calibration, layer cache, resume, gate),
//! and the save converts each cached layer's packed tensors ([`pack::convert`]) and writes the
//! `quantization_config` of [`quantization_config`].

pub mod pack;

pub use pack::{check_settings, convert, dequantize, CtTensor, GptqTensors, BITS};

use serde_json::{json, Value};

/// compressed-tensors' `quantization_config`: one config group over every `Linear` (integer weights of
/// `bits` bits, `group` strategy with `group_size`, or `channel` for one group per row), no activation
/// quantization (`W4A16` / `W8A16`), the `ignore` list, the `pack-quantized` format. `actorder` is
/// `weight` when the sweep reordered columns inside their groups (the library's name for it: the layout
/// is unchanged), else null.
pub fn quantization_config(
    bits: u32,
    group_size: i32,
    sym: bool,
    reordered: bool,
    ignore: &[String],
) -> Value {
    let (strategy, group) = if group_size > 0 {
        ("group", json!(group_size))
    } else {
        ("channel", Value::Null)
    };
    json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": bits, "type": "int", "symmetric": sym,
                    "strategy": strategy, "group_size": group, "dynamic": false,
                    "block_structure": null,
                    "actorder": if reordered { json!("weight") } else { Value::Null },
                },
                "input_activations": null,
                "output_activations": null,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "quantizer": format!("flexinfer-quant:{}", env!("CARGO_PKG_VERSION")),
    })
}
