//! Per-family model policies: what a family needs from a quantization run, in one table. A
//! Python GPTQ pipeline typically patches its quantizer at run time per family (a `QUANTIZE_MODEL_POLICIES`
//! variable: Gemma 4 expert Hessians offloaded to disk, more calibration samples for MoE, key
//! remapping of multimodal checkpoints); here the engine handles those cases itself, and this table
//! says, for the model at hand, which rule applied and what the user should know. Each applied
//! rule is one `model_policy` event (`policy`, `message`, `advice`) at the start of the run.
// The figures come from the model's config and the user's settings.
#![deny(clippy::arithmetic_side_effects)]

use crate::exclusion::Exclusion;
use crate::model::calib::CalibSettings;
use crate::model::ModelConfig;

/// What the run knows when it picks the policies.
pub struct Facts<'a> {
    pub cfg: &'a ModelConfig,
    pub calib: &'a CalibSettings,
    pub exclusion: &'a Exclusion,
}

/// One applied rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The rule's name (stable: alerts and docs refer to it).
    pub policy: &'static str,
    /// What the engine does for this family.
    pub message: String,
    /// What the user may want to change, when anything (`None`: nothing to do).
    pub advice: Option<String>,
}

type Rule = fn(&Facts) -> Option<Applied>;

/// The table, in the order the events are emitted.
const POLICIES: [(&str, Rule); 4] = [
    ("multimodal-text-stack", multimodal),
    ("moe-expert-calibration", moe_calibration),
    ("moe-expert-hessians", moe_hessians),
    ("hybrid-linear-attention", hybrid),
];

/// The policies that apply to this model and run.
pub fn applied(facts: &Facts) -> Vec<Applied> {
    POLICIES
        .iter()
        .filter_map(|(_, rule)| rule(facts))
        .collect()
}

/// The names of every policy (for docs and tests).
pub fn names() -> Vec<&'static str> {
    POLICIES.iter().map(|(n, _)| *n).collect()
}

fn multimodal(f: &Facts) -> Option<Applied> {
    (f.cfg.text_prefix != "model.").then(|| Applied {
        policy: "multimodal-text-stack",
        message: format!(
            "multimodal checkpoint: the text stack under {:?} is quantized; vision/audio towers, \
             projectors and MTP heads are copied unchanged",
            f.cfg.text_prefix
        ),
        advice: None,
    })
}

/// Tokens that reach the average routed expert of a sparse layer.
fn tokens_per_expert(f: &Facts, experts: usize, top_k: usize) -> usize {
    f.calib
        .max_samples
        .saturating_mul(f.calib.max_seq_len)
        .saturating_mul(top_k)
        .checked_div(experts)
        .unwrap_or(0)
}

/// An expert's gate/up Hessian is `hidden × hidden`: with fewer routed tokens than that it is rank
/// deficient and GPTQ leans on the damping. A 128-expert top-8 model needs `maxSamples` around 512
/// for this reason; this rule says how many samples the average expert needs.
fn moe_calibration(f: &Facts) -> Option<Applied> {
    let moe = f.cfg.moe.as_ref()?;
    let (experts, top_k) = (moe.num_experts, moe.spec.top_k);
    let per_expert = tokens_per_expert(f, experts, top_k);
    let needed = f.cfg.hidden_size;
    let samples_needed = needed
        .saturating_mul(experts)
        .div_ceil(top_k.saturating_mul(f.calib.max_seq_len).max(1));
    let message = format!(
        "mixture of experts ({experts} experts, top-{top_k}): per-expert Hessians from the tokens routed \
         to each expert; about {per_expert} calibration tokens reach the average expert \
         ({} samples × {} tokens × {top_k} / {experts})",
        f.calib.max_samples, f.calib.max_seq_len
    );
    let advice = (per_expert < needed).then(|| {
        format!(
            "the average expert's {needed}-wide Hessian gets fewer tokens than its width: raise \
             calibration.maxSamples to at least {samples_needed} (or maxSeqLen) for full-rank expert Hessians"
        )
    });
    Some(Applied {
        policy: "moe-expert-calibration",
        message,
        advice,
    })
}

/// A PyTorch pipeline offloads Gemma 4's expert Hessians to disk because all of them together exceed a
/// card's memory. The engine quantizes the experts of a sparse layer one after another
/// ([`super::experts`]), so one expert's Hessians are alive at a time whatever the expert count;
/// this rule states both figures.
fn moe_hessians(f: &Facts) -> Option<Applied> {
    let moe = f.cfg.moe.as_ref()?;
    let h = f.cfg.hidden_size;
    let i = moe.expert_intermediate;
    // gate/up share one h×h Hessian per expert, down has one i×i; f32 entries.
    let per_expert = h
        .saturating_mul(h)
        .saturating_add(i.saturating_mul(i))
        .saturating_mul(4);
    let sparse = moe.sparse.iter().filter(|s| **s).count();
    let all = per_expert
        .saturating_mul(moe.num_experts)
        .saturating_mul(sparse);
    let mib = |b: usize| b.div_ceil(1 << 20);
    Some(Applied {
        policy: "moe-expert-hessians",
        message: format!(
            "experts are quantized one after another: {} MiB of expert Hessians alive at a time, instead of \
             {} MiB for all {} experts of the {sparse} sparse layers together (no disk offload needed)",
            mib(per_expert),
            mib(all),
            moe.num_experts
        ),
        advice: None,
    })
}

/// On gated delta-net hybrids, quantizing the linear-attention layers' small decay and
/// write-strength projections costs much more quality than on attention layers (measured on the
/// engine's generated hybrids: logits cosine 0.90–0.96 with every linear at 4 bits, 0.96–0.98 with
/// `auto` or `gdn`).
fn hybrid(f: &Facts) -> Option<Applied> {
    if !f.cfg.hybrid {
        return None;
    }
    let advice = matches!(f.exclusion, Exclusion::None).then(|| {
        "dynamicExclusion: none quantizes the linear-attention layers too; `auto` or `gdn` keeps them in \
         full precision, which costs little size and keeps quality"
            .to_string()
    });
    Some(Applied {
        policy: "hybrid-linear-attention",
        message: "gated delta-net hybrid: linear-attention layers run the delta-rule forward; \
                  dynamicExclusion decides which of their modules are quantized"
            .into(),
        advice,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(extra: serde_json::Value) -> ModelConfig {
        let mut raw = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        });
        if let (Some(o), Some(e)) = (raw.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        ModelConfig::from_json(raw).unwrap_or_else(|e| panic!("{e}"))
    }

    fn run(cfg: &ModelConfig, samples: usize, seq: usize, ex: Exclusion) -> Vec<Applied> {
        let calib = CalibSettings {
            max_samples: samples,
            max_seq_len: seq,
        };
        applied(&Facts {
            cfg,
            calib: &calib,
            exclusion: &ex,
        })
    }

    #[test]
    fn dense_llama_needs_no_policy() {
        assert!(run(&cfg(json!({})), 256, 2048, Exclusion::Auto).is_empty());
    }

    #[test]
    fn moe_advice_names_the_samples_for_full_rank_expert_hessians() {
        let moe = cfg(json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 64, "num_experts_per_tok": 2,
        }));
        // 64 samples × 16 tokens × 2 / 64 = 32 tokens per expert < 64 (hidden): advice, with
        // ceil(64 × 64 / (2 × 16)) = 128 samples.
        let a = run(&moe, 64, 16, Exclusion::Auto);
        let names: Vec<_> = a.iter().map(|x| x.policy).collect();
        assert_eq!(names, ["moe-expert-calibration", "moe-expert-hessians"]);
        let advice = a[0].advice.clone().unwrap_or_default();
        assert!(advice.contains("at least 128"), "{advice}");
        assert!(
            a[0].message.contains("about 32 calibration tokens"),
            "{}",
            a[0].message
        );
        // Enough tokens: the rule still reports, without advice.
        let a = run(&moe, 128, 16, Exclusion::Auto);
        assert_eq!(a[0].advice, None);
    }

    /// The Qwen3.5 MoE multimodal hybrid fixture gets every rule; `none` draws the hybrid advice.
    #[test]
    fn multimodal_moe_hybrid_gets_every_policy() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/oracle/qwen3_5_moe_mm");
        let c = ModelConfig::load(&dir).unwrap_or_else(|e| panic!("{e}"));
        let a = run(&c, 256, 2048, Exclusion::None);
        let names: Vec<_> = a.iter().map(|x| x.policy).collect();
        assert_eq!(names, names_all());
        let hybrid = a.iter().find(|x| x.policy == "hybrid-linear-attention");
        assert!(hybrid.and_then(|h| h.advice.as_ref()).is_some());
        let a = run(&c, 256, 2048, Exclusion::Auto);
        let hybrid = a.iter().find(|x| x.policy == "hybrid-linear-attention");
        assert_eq!(hybrid.map(|h| h.advice.clone()), Some(None));
    }

    fn names_all() -> Vec<&'static str> {
        names()
    }

    #[test]
    fn every_policy_has_a_unique_name() {
        let mut n = names();
        n.sort();
        n.dedup();
        assert_eq!(n.len(), POLICIES.len());
    }
}
