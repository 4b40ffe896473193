//! What llama.cpp 0.7.0 (the pinned Debian sid build, ggml 0.27.0) knows: the ggml tensor types
//! with their block lengths and sizes (`ggml_type_traits`), the file types (`enum llama_ftype`) and
//! the architectures it loads (`LLM_ARCH_NAMES`, read from the root's `libllama.so`).

/// A ggml tensor type llama.cpp can load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GgmlType {
    pub(crate) id: u32,
    pub(crate) name: &'static str,
    /// Values per block: a row's length must be a multiple of it.
    pub(crate) block_len: u64,
    /// Bytes per block.
    pub(crate) block_bytes: u64,
}

const fn t(id: u32, name: &'static str, block_len: u64, block_bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        block_len,
        block_bytes,
    }
}

/// `ggml_type_traits` of every type ggml 0.27 still has.
const TYPES: &[GgmlType] = &[
    t(0, "F32", 1, 4),
    t(1, "F16", 1, 2),
    t(2, "Q4_0", 32, 18),
    t(3, "Q4_1", 32, 20),
    t(6, "Q5_0", 32, 22),
    t(7, "Q5_1", 32, 24),
    t(8, "Q8_0", 32, 34),
    t(9, "Q8_1", 32, 36),
    t(10, "Q2_K", 256, 84),
    t(11, "Q3_K", 256, 110),
    t(12, "Q4_K", 256, 144),
    t(13, "Q5_K", 256, 176),
    t(14, "Q6_K", 256, 210),
    t(15, "Q8_K", 256, 292),
    t(16, "IQ2_XXS", 256, 66),
    t(17, "IQ2_XS", 256, 74),
    t(18, "IQ3_XXS", 256, 98),
    t(19, "IQ1_S", 256, 50),
    t(20, "IQ4_NL", 32, 18),
    t(21, "IQ3_S", 256, 110),
    t(22, "IQ2_S", 256, 82),
    t(23, "IQ4_XS", 256, 136),
    t(24, "I8", 1, 1),
    t(25, "I16", 1, 2),
    t(26, "I32", 1, 4),
    t(27, "I64", 1, 8),
    t(28, "F64", 1, 8),
    t(29, "IQ1_M", 256, 56),
    t(30, "BF16", 1, 2),
    t(34, "TQ1_0", 256, 54),
    t(35, "TQ2_0", 256, 66),
    t(39, "MXFP4", 32, 17),
];

/// Type ids ggml once had and removed: a file with them does not load.
const REMOVED: &[(u32, &str)] = &[
    (4, "Q4_2"),
    (5, "Q4_3"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
];

pub(crate) fn ggml_type(id: u32) -> Result<GgmlType, String> {
    if let Some(t) = TYPES.iter().find(|t| t.id == id) {
        return Ok(*t);
    }
    match REMOVED.iter().find(|(r, _)| *r == id) {
        Some((_, name)) => Err(format!(
            "ggml type {id} ({name}) was removed from ggml; llama.cpp cannot load it"
        )),
        None => Err(format!("unknown ggml type id {id}")),
    }
}

/// Whether tensors of this type are quantized (not a plain float or integer type).
pub(crate) fn is_quantized(t: GgmlType) -> bool {
    t.block_len > 1
}

/// `general.file_type` (`enum llama_ftype`) → the preset's name.
pub(crate) fn file_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

/// `general.architecture` values llama.cpp 0.7.0 loads (`LLM_ARCH_NAMES`; `clip`, the projector
/// of multimodal models, is not a language model and is left out).
pub(crate) const ARCHITECTURES: &[&str] = &[
    "llama",
    "llama4",
    "deci",
    "falcon",
    "grok",
    "gpt2",
    "gptj",
    "gptneox",
    "mpt",
    "baichuan",
    "starcoder",
    "refact",
    "bert",
    "modern-bert",
    "nomic-bert",
    "nomic-bert-moe",
    "neo-bert",
    "jina-bert-v2",
    "jina-bert-v3",
    "eurobert",
    "bloom",
    "stablelm",
    "qwen",
    "qwen2",
    "qwen2moe",
    "qwen2vl",
    "qwen3",
    "qwen3moe",
    "qwen3next",
    "qwen3vl",
    "qwen3vlmoe",
    "qwen35",
    "qwen35moe",
    "phi2",
    "phi3",
    "phimoe",
    "plamo",
    "plamo2",
    "plamo3",
    "codeshell",
    "orion",
    "internlm2",
    "minicpm",
    "minicpm3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3n",
    "gemma4",
    "gemma-embedding",
    "starcoder2",
    "mamba",
    "mamba2",
    "jamba",
    "falcon-h1",
    "xverse",
    "command-r",
    "cohere2",
    "cohere2moe",
    "dbrx",
    "olmo",
    "olmo2",
    "olmoe",
    "openelm",
    "arctic",
    "deepseek",
    "deepseek2",
    "chatglm",
    "glm4",
    "glm4moe",
    "bitnet",
    "t5",
    "t5encoder",
    "jais",
    "jais2",
    "nemotron",
    "nemotron_h",
    "nemotron_h_moe",
    "exaone",
    "exaone4",
    "exaone-moe",
    "rwkv6",
    "rwkv6qwen2",
    "rwkv7",
    "arwkv7",
    "granite",
    "granitemoe",
    "granitehybrid",
    "chameleon",
    "plm",
    "bailingmoe",
    "bailingmoe2",
    "dots1",
    "arcee",
    "ernie4_5",
    "ernie4_5-moe",
    "hunyuan-moe",
    "hunyuan-dense",
    "smollm3",
    "gpt-oss",
    "lfm2",
    "lfm2moe",
    "dream",
    "smallthinker",
    "llada",
    "llada-moe",
    "seed_oss",
    "grovemoe",
    "apertus",
    "minimax-m2",
    "cogvlm",
    "rnd1",
    "pangu-embedded",
    "mistral3",
    "mimo2",
    "kimi-linear",
    // the rest of the pinned build's table
    "clef",
    "vllm-decision2",
    "qwen4exp",
    "gemma4-assistant",
    "gemma-embedding2",
    "maple",
    "muse-glimmer",
    "deepseek2-ocr",
    "deepseek32",
    "deepseek4",
    "glm-dsa",
    "granite_swa",
    "graniteswitch",
    "wavtokenizer-dec",
    "bailingmoe3",
    "dots3note",
    "afmoe",
    "laguna",
    "hunyuan_vl",
    "hy_v3",
    "hy_v4",
    "minimax-01",
    "hrm_text",
    "minimax-m3",
    "eagle3",
    "dflash",
    "mistral4",
    "paddleocr",
    "step35",
    "spark2_5",
    "llama-embed",
    "maincoder",
    "maion-coder",
    "kimi-k3",
    "glm5-next",
    "talkie",
    "mellum",
    "nanbeige",
    "qwen3tts",
    "pockettts",
    "k2-horizon",
];

/// Architectures without attention heads (recurrent): no `attention.head_count` is needed.
pub(crate) const RECURRENT: &[&str] =
    &["mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"];

/// `tokenizer.ggml.model` values llama.cpp's vocabulary loader accepts.
pub(crate) const TOKENIZER_MODELS: &[&str] = &[
    "no", "none", "llama", "bert", "gpt2", "t5", "rwkv", "plamo2",
];

/// `<arch>.rope.scaling.type` values llama.cpp knows.
pub(crate) const ROPE_SCALING_TYPES: &[&str] = &["none", "linear", "yarn", "longrope"];

/// ggml's limit on a tensor name (`GGML_MAX_NAME`, including the terminating NUL).
pub(crate) const MAX_NAME: usize = 64;
/// ggml's limit on a tensor's dimensions (`GGML_MAX_DIMS`).
pub(crate) const MAX_DIMS: u32 = 4;
/// `GGUF_DEFAULT_ALIGNMENT`.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
