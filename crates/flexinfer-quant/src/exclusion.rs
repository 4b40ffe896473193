//! `dynamicExclusion`: which decoder linears stay in full precision (docs/user/quantization.md).
//!
//! - `auto` (the CRD default): on a hybrid architecture (gated delta-net linear attention beside full attention,
//!   Qwen3-Next / Qwen3.5) the attention modules of both kinds, shared experts, routers, vision towers and MTP
//!   heads stay in full precision and the FFN / routed-expert linears are quantized; on a dense or plain MoE
//!   architecture every decoder linear is quantized.
//! - `gdn`: only the linear-attention (`linear_attn.*`) modules stay in full precision.
//! - `none`: every decoder linear is quantized.
//! - anything else: a comma list of module-name substrings kept in full precision (the explicit form).
//!
//! In every mode routers (`mlp.gate`, `block_sparse_moe.gate`), vision/audio towers and MTP heads are never
//! quantized: the serving engines load those layers unquantized whatever the checkpoint says.

use crate::error::{Result, SpecError};

/// What a linear is, from its checkpoint name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// `self_attn.{q,k,v,o}_proj`.
    FullAttention,
    /// Gated delta-net `linear_attn.*`.
    LinearAttention,
    /// A dense SwiGLU MLP (`mlp.{gate,up,down}_proj`).
    DenseMlp,
    /// A routed expert (`mlp.experts.N.*`, `block_sparse_moe.experts.N.*`).
    Expert,
    /// The always-on shared expert of a MoE layer and its gate.
    SharedExpert,
    /// The MoE router (and a shared expert's scalar gate).
    Router,
    /// Vision / audio towers and their projectors.
    Tower,
    /// Multi-token-prediction heads.
    Mtp,
    Other,
}

pub fn classify(name: &str) -> ModuleKind {
    let has = |s: &str| name.contains(s);
    if name.starts_with("mtp.") || has(".mtp.") || has("mtp_") {
        ModuleKind::Mtp
    } else if has("vision")
        || has("visual")
        || has("audio")
        || has("multi_modal_projector")
        || has("embed_vision")
        || has("embed_audio")
    {
        ModuleKind::Tower
    } else if has("linear_attn.") {
        ModuleKind::LinearAttention
    } else if name.ends_with("shared_expert_gate") {
        // The shared expert's scalar sigmoid gate (one output row): a router.
        ModuleKind::Router
    } else if has("shared_expert") {
        ModuleKind::SharedExpert
    } else if name.ends_with("mlp.gate")
        || name.ends_with("block_sparse_moe.gate")
        || name.ends_with(".router")
        || has(".router.")
    {
        ModuleKind::Router
    } else if has(".experts.") {
        ModuleKind::Expert
    } else if has("self_attn.") {
        ModuleKind::FullAttention
    } else if has("mlp.") || has("block_sparse_moe.") {
        ModuleKind::DenseMlp
    } else {
        ModuleKind::Other
    }
}

/// A parsed `DYNAMIC_EXCLUSION`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exclusion {
    Auto,
    Gdn,
    None,
    /// Module-name substrings kept in full precision.
    List(Vec<String>),
}

impl Exclusion {
    /// Unset or empty reads as `none` (the engine's own default; the operator always passes the CRD value).
    pub fn parse(s: Option<&str>) -> Result<Self> {
        let s = s.map(str::trim).unwrap_or("");
        Ok(match s {
            "" | "none" => Exclusion::None,
            "auto" => Exclusion::Auto,
            "gdn" => Exclusion::Gdn,
            list => {
                let items: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                if let Some(bad) = items
                    .iter()
                    .find(|i| matches!(i.as_str(), "auto" | "gdn" | "none"))
                {
                    return Err(SpecError::ExclusionMode {
                        item: bad.clone(),
                        list: list.to_string(),
                    }
                    .into());
                }
                Exclusion::List(items)
            }
        })
    }

    pub fn as_str(&self) -> String {
        match self {
            Exclusion::Auto => "auto".into(),
            Exclusion::Gdn => "gdn".into(),
            Exclusion::None => "none".into(),
            Exclusion::List(l) => l.join(","),
        }
    }

    /// Whether linear `name` stays in full precision. `hybrid`: the model mixes linear and full attention.
    pub fn excludes(&self, name: &str, hybrid: bool) -> bool {
        let kind = classify(name);
        if matches!(
            kind,
            ModuleKind::Router | ModuleKind::Tower | ModuleKind::Mtp
        ) {
            return true;
        }
        match self {
            Exclusion::None => false,
            Exclusion::Gdn => kind == ModuleKind::LinearAttention,
            Exclusion::Auto => {
                hybrid
                    && matches!(
                        kind,
                        ModuleKind::FullAttention
                            | ModuleKind::LinearAttention
                            | ModuleKind::SharedExpert
                    )
            }
            Exclusion::List(items) => items.iter().any(|s| name.contains(s.as_str())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One layer of each layout, as named in the hub checkpoints.
    const HYBRID_LAYER: &[&str] = &[
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.0.linear_attn.in_proj_ba",
        "model.layers.0.linear_attn.out_proj",
        "model.layers.3.self_attn.q_proj",
        "model.layers.3.self_attn.o_proj",
        "model.layers.3.mlp.gate",
        "model.layers.3.mlp.experts.7.gate_proj",
        "model.layers.3.mlp.experts.7.down_proj",
        "model.layers.3.mlp.shared_expert.up_proj",
        "model.layers.3.mlp.shared_expert_gate",
        "mtp.layers.0.mlp.experts.0.up_proj",
        "model.visual.blocks.0.attn.qkv",
    ];

    fn kept(mode: &Exclusion, hybrid: bool) -> Vec<&'static str> {
        HYBRID_LAYER
            .iter()
            .copied()
            .filter(|n| !mode.excludes(n, hybrid))
            .collect()
    }

    #[test]
    fn classification_table() {
        let want = [
            ModuleKind::LinearAttention,
            ModuleKind::LinearAttention,
            ModuleKind::LinearAttention,
            ModuleKind::FullAttention,
            ModuleKind::FullAttention,
            ModuleKind::Router,
            ModuleKind::Expert,
            ModuleKind::Expert,
            ModuleKind::SharedExpert,
            ModuleKind::Router,
            ModuleKind::Mtp,
            ModuleKind::Tower,
        ];
        for (n, k) in HYBRID_LAYER.iter().zip(want) {
            assert_eq!(classify(n), k, "{n}");
        }
        assert_eq!(
            classify("model.layers.1.block_sparse_moe.gate"),
            ModuleKind::Router
        );
        assert_eq!(
            classify("model.layers.1.block_sparse_moe.experts.3.w2"),
            ModuleKind::Expert
        );
        assert_eq!(
            classify("model.language_model.layers.1.mlp.down_proj"),
            ModuleKind::DenseMlp
        );
        // Gemma 4 (MoE, multimodal layout): router, per-expert modules, the dense MLP beside the experts,
        // vision tower and its projector.
        for (n, k) in [
            (
                "model.language_model.layers.0.router.proj",
                ModuleKind::Router,
            ),
            (
                "model.language_model.layers.0.experts.5.gate_proj",
                ModuleKind::Expert,
            ),
            ("model.layers.0.experts.5.down_proj", ModuleKind::Expert),
            (
                "model.language_model.layers.0.mlp.up_proj",
                ModuleKind::DenseMlp,
            ),
            (
                "model.language_model.layers.0.self_attn.k_proj",
                ModuleKind::FullAttention,
            ),
            (
                "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear",
                ModuleKind::Tower,
            ),
            ("model.embed_vision.embedding_projection", ModuleKind::Tower),
        ] {
            assert_eq!(classify(n), k, "{n}");
        }
    }

    #[test]
    fn quantized_sets_per_mode_on_a_hybrid() {
        assert_eq!(
            kept(&Exclusion::Auto, true),
            [
                "model.layers.3.mlp.experts.7.gate_proj",
                "model.layers.3.mlp.experts.7.down_proj",
            ]
        );
        assert_eq!(
            kept(&Exclusion::Gdn, true),
            [
                "model.layers.3.self_attn.q_proj",
                "model.layers.3.self_attn.o_proj",
                "model.layers.3.mlp.experts.7.gate_proj",
                "model.layers.3.mlp.experts.7.down_proj",
                "model.layers.3.mlp.shared_expert.up_proj",
            ]
        );
        // `none`: every decoder linear except the router (and the never-quantized MTP / vision modules).
        assert_eq!(
            kept(&Exclusion::None, true),
            [
                "model.layers.0.linear_attn.in_proj_qkvz",
                "model.layers.0.linear_attn.in_proj_ba",
                "model.layers.0.linear_attn.out_proj",
                "model.layers.3.self_attn.q_proj",
                "model.layers.3.self_attn.o_proj",
                "model.layers.3.mlp.experts.7.gate_proj",
                "model.layers.3.mlp.experts.7.down_proj",
                "model.layers.3.mlp.shared_expert.up_proj",
            ]
        );
    }

    #[test]
    fn auto_on_a_dense_or_plain_moe_model_quantizes_every_decoder_linear() {
        for n in [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.0.block_sparse_moe.experts.1.w1",
            "model.layers.0.mlp.shared_expert.up_proj",
        ] {
            assert!(!Exclusion::Auto.excludes(n, false), "{n}");
        }
        assert!(Exclusion::Auto.excludes("model.layers.0.block_sparse_moe.gate", false));
    }

    #[test]
    fn parse_modes_and_lists() {
        assert_eq!(Exclusion::parse(None).unwrap(), Exclusion::None);
        assert_eq!(Exclusion::parse(Some(" ")).unwrap(), Exclusion::None);
        assert_eq!(Exclusion::parse(Some("auto")).unwrap(), Exclusion::Auto);
        assert_eq!(Exclusion::parse(Some(" gdn ")).unwrap(), Exclusion::Gdn);
        assert_eq!(Exclusion::parse(Some("none")).unwrap(), Exclusion::None);
        let l = Exclusion::parse(Some("o_proj, layers.1.mlp ,")).unwrap();
        assert_eq!(
            l,
            Exclusion::List(vec!["o_proj".into(), "layers.1.mlp".into()])
        );
        assert!(l.excludes("model.layers.4.self_attn.o_proj", false));
        assert!(l.excludes("model.layers.1.mlp.up_proj", false));
        assert!(!l.excludes("model.layers.11.mlp.up_proj", true));
        let e = Exclusion::parse(Some("o_proj,auto"))
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("DYNAMIC_EXCLUSION") && e.contains("auto"), "{e}");
    }
}
