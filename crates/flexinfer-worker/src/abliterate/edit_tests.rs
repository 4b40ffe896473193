//! Unit tests of the edit plan, the orthogonalization helpers and the dtype conversions.

use super::*;
use crate::abliterate::ortho::{
    orthogonalize_read, orthogonalize_write, orthogonalize_writer, writer_direction,
};

#[test]
fn target_layers_parse() {
    assert_eq!(TargetLayers::parse("auto").unwrap(), TargetLayers::Auto);
    assert_eq!(
        TargetLayers::parse("2-4").unwrap(),
        TargetLayers::List(vec![2, 3, 4])
    );
    assert_eq!(
        TargetLayers::parse("5,1,1").unwrap(),
        TargetLayers::List(vec![1, 5])
    );
    assert!(TargetLayers::parse("4-2").is_err());
    assert!(TargetLayers::parse("x").is_err());
}

#[test]
fn matrices_parse() {
    assert_eq!(
        Matrix::parse_list("o_proj, down_proj,o_proj").unwrap(),
        vec![Matrix::OProj, Matrix::DownProj]
    );
    assert!(Matrix::parse_list("gate_proj").is_err());
    assert!(Matrix::parse_list(" , ").is_err());
}

#[test]
fn name_classification() {
    assert!(is_expert("mlp.experts.3.down_proj.weight"));
    assert!(is_expert("model.layers.0.mlp.experts.down_proj"));
    assert!(!is_expert("mlp.shared_expert.down_proj.weight"));
    assert!(!is_expert("mlp.shared_experts.down_proj.weight"));
    assert!(is_tower(
        "model.vision_tower.encoder.layers.0.mlp.fc2.weight"
    ));
    assert!(is_tower("visual.blocks.0.attn.proj.weight"));
    assert_eq!(
        decoder_layer("model.layers.12.self_attn.o_proj.weight"),
        Some((12, "self_attn.o_proj.weight".into()))
    );
    assert_eq!(
        decoder_layer("model.vision_tower.layers.1.o_proj.weight"),
        None
    );
}

#[test]
fn orthogonalization_removes_only_the_direction() {
    let r = {
        let v = [0.6f32, 0.0, 0.8];
        v.to_vec()
    };
    // [3, 2] writing matrix.
    let mut w = vec![1.0f32, 2.0, -3.0, 0.5, 4.0, 1.5];
    let orig = w.clone();
    orthogonalize_write(&mut w, 2, &r);
    for c in 0..2 {
        let d: f32 = (0..3).map(|i| r[i] * w[i * 2 + c]).sum();
        assert!(d.abs() < 1e-6);
        // A direction orthogonal to r sees the same output.
        let v = [0.8f32, 0.0, -0.6];
        let a: f32 = (0..3).map(|i| v[i] * w[i * 2 + c]).sum();
        let b: f32 = (0..3).map(|i| v[i] * orig[i * 2 + c]).sum();
        assert!((a - b).abs() < 1e-5);
    }
    let mut h = vec![1.0f32, 2.0, 3.0, -1.0, 0.0, 2.0];
    orthogonalize_read(&mut h, &r);
    for row in h.chunks(3) {
        let d: f32 = row.iter().zip(&r).map(|(a, b)| a * b).sum();
        assert!(d.abs() < 1e-6);
    }
}

#[test]
fn writer_without_output_norm_is_the_plain_projection_bit_for_bit() {
    let r = {
        let mut v: Vec<f32> = (0..7).map(|i| (i as f32 * 1.3).sin()).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter_mut().for_each(|x| *x /= n);
        v
    };
    let w: Vec<f32> = (0..7 * 5).map(|i| (i as f32 * 0.37).cos()).collect();
    let (mut a, mut b) = (w.clone(), w);
    orthogonalize_write(&mut a, 5, &r);
    orthogonalize_writer(&mut b, 5, &r, None);
    assert_eq!(
        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(writer_direction(&r, None).unwrap(), r);
}

#[test]
fn normalised_writer_adds_nothing_along_r_only_with_the_scaled_direction() {
    // Residual contribution of writer output x under an output norm g: g ⊙ x / rms(x).
    let contribution = |w: &[f32], a: &[f32], g: &[f32]| -> Vec<f64> {
        let x: Vec<f64> = (0..3)
            .map(|i| (0..2).map(|j| w[i * 2 + j] as f64 * a[j] as f64).sum())
            .collect();
        let rms = (x.iter().map(|v| v * v).sum::<f64>() / 3.0).sqrt();
        x.iter()
            .zip(g)
            .map(|(v, &gv)| gv as f64 * v / rms)
            .collect()
    };
    let r = [0.6f32, 0.0, 0.8];
    let g = [0.5f32, 1.0, 2.0];
    let w0 = vec![1.0f32, 2.0, -3.0, 0.5, 4.0, 1.5];
    let a = [0.7f32, -1.1];
    let along = |c: &[f64]| c.iter().zip(&r).map(|(x, &y)| x * y as f64).sum::<f64>();
    let mut aware = w0.clone();
    orthogonalize_writer(&mut aware, 2, &r, Some(&g));
    assert!(along(&contribution(&aware, &a, &g)).abs() < 1e-6);
    let mut naive = w0;
    orthogonalize_writer(&mut naive, 2, &r, None);
    assert!(along(&contribution(&naive, &a, &g)).abs() > 0.1);
    let v = writer_direction(&r, Some(&g)).unwrap();
    let n: f32 = v.iter().map(|x| x * x).sum();
    assert!((n - 1.0).abs() < 1e-6);
    // A writer that cannot reach r (g ⊙ r = 0) is left as it is.
    assert!(writer_direction(&r, Some(&[0.0, 1.0, 0.0])).is_none());
    let mut w = vec![1.0f32; 6];
    orthogonalize_writer(&mut w, 2, &r, Some(&[0.0, 1.0, 0.0]));
    assert_eq!(w, vec![1.0f32; 6]);
}

#[test]
fn output_norms_follow_each_gemma_convention() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
    let settings = |n: usize| super::super::Settings {
        target: TargetLayers::List((0..n).collect()),
        matrices: vec![Matrix::OProj, Matrix::DownProj],
        skip_gdn: true,
        skip_vision: true,
        lm_head: false,
        norm_threshold: 100.0,
        max_ppl_increase_percent: 5.0,
    };
    for (fam, prefix, one_plus, moe) in [
        ("gemma2", "model.", true, false),
        ("gemma3_text", "model.", true, false),
        ("gemma4_text", "model.", false, false),
        ("gemma4_moe", "model.", false, true),
        ("gemma4_mm", "model.language_model.", false, false),
        ("qwen3", "model.", false, false),
    ] {
        let dir = root.join(fam);
        let store = TensorStore::open_dir(&dir).unwrap();
        let raw = super::super::output::read_config(&dir).unwrap();
        let layout = Layout::from_model(&store, &raw).unwrap();
        let cfg = flexinfer_quant::model::ModelConfig::from_json(raw).unwrap();
        let s = settings(cfg.num_layers);
        let mut p = plan(&layout, &s, &(0..cfg.num_layers).collect::<Vec<_>>()).unwrap();
        attach_output_norms(&mut p, &store, &cfg).unwrap();
        assert_eq!(p.edits.len(), 2 * cfg.num_layers, "{fam}");
        for e in &p.edits {
            let Some(n) = &e.out_norm else {
                assert_eq!(fam, "qwen3", "{}", e.tensor);
                continue;
            };
            assert!(e.tensor.starts_with(prefix), "{}", e.tensor);
            let l = e.layer.unwrap();
            let lp = format!("{prefix}layers.{l}.");
            let read = |name: &str| store.f32(&format!("{lp}{name}.weight")).unwrap();
            let want: Vec<f32> = if e.tensor.ends_with("o_proj.weight") {
                read("post_attention_layernorm")
            } else if moe {
                let (a, b) = (
                    read("post_feedforward_layernorm_1"),
                    read("post_feedforward_layernorm"),
                );
                a.iter().zip(&b).map(|(x, y)| x * y).collect()
            } else {
                read("post_feedforward_layernorm")
            };
            let want: Vec<f32> = if one_plus {
                want.iter().map(|v| v + 1.0).collect()
            } else {
                want
            };
            assert_eq!(n.scale, want, "{fam} {}", e.tensor);
            assert_eq!(
                n.norms.len(),
                if moe && e.tensor.contains("mlp") {
                    2
                } else {
                    1
                }
            );
        }
        if moe {
            assert!(
                p.guarded_experts > 0,
                "the fused experts are counted as guarded"
            );
        }
    }
}

#[test]
fn half_precision_conversions_round_to_nearest_even() {
    for &x in &[
        0.0f32, 1.0, -2.5, 0.1, 65504.0, 1e-5, -3.0e-7, 1234.5678, 6.1e-5,
    ] {
        let h = f32_to_f16(x);
        let back = f16_to_f32(h);
        assert!((back - x).abs() <= x.abs() * 1e-3 + 6e-8, "{x} -> {back}");
        let b = f32::from_bits((f32_to_bf16(x) as u32) << 16);
        assert!((b - x).abs() <= x.abs() * 8e-3, "{x} -> {b}");
    }
    assert_eq!(f32_to_f16(1.0), 0x3c00);
    assert_eq!(f32_to_f16(1e6), 0x7c00);
    // 1 + 2^-11 is halfway between 1 and the next f16: ties to even (1.0).
    assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    for bits in [0x0001u16, 0x03ff, 0x0400, 0x3c01, 0x7bff, 0xc000] {
        assert_eq!(f32_to_f16(f16_to_f32(bits)), bits);
    }
}
