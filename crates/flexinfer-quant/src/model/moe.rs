//! Sparse-MoE MLPs: the router (softmax over the expert logits in f32, top-k, optional renormalisation of the
//! k weights, as transformers' Mixtral / Qwen2-MoE / Qwen3-MoE blocks do) and the weighted sum of the chosen
//! SwiGLU experts, plus the optional always-on shared expert behind a sigmoid gate (Qwen2-MoE).
//!
//! Gemma 4 routes differently: its router RMS-normalises the residual itself (no weight), multiplies it by a
//! learned vector over `sqrt(hidden)`, takes softmax / top-k / renormalisation, then multiplies each chosen
//! weight by a learned per-expert scale. Its experts are GELU-tanh gated and read their own normalisation of the
//! residual; a dense MLP runs beside them on every token (kept here as the ungated shared unit), and both
//! outputs are normalised before they are summed.

use crate::model::nn::{linear, rms_norm};
use crate::model::Linear;
use faer::{Mat, MatRef};

/// Tensor layout of a sparse-MoE MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeStyle {
    /// `mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`, optional `mlp.shared_expert(_gate)`.
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.N.{w1,w3,w2}`.
    Mixtral,
    /// `router.{proj,scale,per_expert_scale}`, `experts.N.{gate,up,down}_proj` (or the fused
    /// `experts.gate_up_proj` / `experts.down_proj` of the hub checkpoints), the dense MLP `mlp.*`.
    Gemma4,
}

/// The gating activation of an MLP: `act(gate(x)) · up(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => crate::model::nn::gelu_tanh(x),
        }
    }
}

impl MoeStyle {
    /// Block-relative module prefix of the MoE MLP.
    pub fn base(self) -> &'static str {
        match self {
            MoeStyle::Qwen => "mlp.",
            MoeStyle::Mixtral => "block_sparse_moe.",
            MoeStyle::Gemma4 => "",
        }
    }

    /// Names of an expert's gate, up and down projections.
    pub fn expert_names(self) -> [&'static str; 3] {
        match self {
            MoeStyle::Qwen | MoeStyle::Gemma4 => ["gate_proj", "up_proj", "down_proj"],
            MoeStyle::Mixtral => ["w1", "w3", "w2"],
        }
    }

    /// Block-relative prefix of the always-on (shared) unit's projections.
    pub fn shared_prefix(self) -> &'static str {
        match self {
            MoeStyle::Gemma4 => "mlp.",
            _ => "mlp.shared_expert.",
        }
    }

    /// Block-relative name of the router linear.
    pub fn router_name(self) -> &'static str {
        match self {
            MoeStyle::Qwen => "mlp.gate",
            MoeStyle::Mixtral => "block_sparse_moe.gate",
            MoeStyle::Gemma4 => "router.proj",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub style: MoeStyle,
    pub top_k: usize,
    /// Renormalize the top-k routing weights to sum to 1.
    pub renormalize: bool,
    /// The experts' (and shared unit's) gating activation.
    pub act: Activation,
}

/// A SwiGLU MLP.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// `silu(gate(x)) · up(x)`: the input of `down`.
pub fn swiglu(gate: &Linear, up: &Linear, x: MatRef<'_, f32>) -> Mat<f32> {
    gated(gate, up, x, Activation::Silu)
}

/// `act(gate(x)) · up(x)`: the input of `down`.
pub fn gated(gate: &Linear, up: &Linear, x: MatRef<'_, f32>, act: Activation) -> Mat<f32> {
    let mut g = linear(x, gate);
    let u = linear(x, up);
    for c in 0..g.ncols().min(u.ncols()) {
        let uc = u.col_as_slice(c);
        for (gv, &uv) in g.col_as_slice_mut(c).iter_mut().zip(uc) {
            *gv = act.apply(*gv) * uv;
        }
    }
    g
}

impl Mlp {
    pub fn forward(&self, x: MatRef<'_, f32>) -> Mat<f32> {
        self.forward_act(x, Activation::Silu)
    }

    pub fn forward_act(&self, x: MatRef<'_, f32>, act: Activation) -> Mat<f32> {
        let a = gated(&self.gate, &self.up, x, act);
        linear(a.as_ref(), &self.down)
    }
}

/// Gemma 4's router and norms around its experts (norm weights as multiplied).
#[derive(Clone, Debug)]
pub struct Gemma4Moe {
    /// `router.scale / sqrt(hidden)`: multiplies the RMS-normalised residual before `router.proj`.
    pub router_scale: Vec<f32>,
    /// `router.per_expert_scale`: multiplies each chosen expert's renormalised weight.
    pub per_expert_scale: Vec<f32>,
    /// `post_feedforward_layernorm_1`: the dense MLP's output norm (its input norm is the layer's `post_norm`).
    pub shared_out_norm: Vec<f32>,
    /// `pre_feedforward_layernorm_2` / `post_feedforward_layernorm_2`: the experts' input and output norms.
    pub experts_in_norm: Vec<f32>,
    pub experts_out_norm: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub shared_gate: Option<Linear>,
    pub gemma4: Option<Gemma4Moe>,
}

/// The router's choice for each token: `top[t]` = the k (expert, weight) pairs, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top: Vec<Vec<(usize, f32)>>,
}

impl Routing {
    /// Tokens (and their weights) routed to each of `n_experts` experts, in token order.
    pub fn per_expert(&self, n_experts: usize) -> Vec<Vec<(usize, f32)>> {
        let mut out = vec![Vec::new(); n_experts];
        for (t, top) in self.top.iter().enumerate() {
            for &(e, w) in top {
                if let Some(v) = out.get_mut(e) {
                    v.push((t, w));
                }
            }
        }
        out
    }
}

/// Routes each row of `logits` (`[tokens, experts]`): softmax, the k largest probabilities (ties: lower expert
/// index first), divided by their sum when `renormalize`.
pub fn route(logits: MatRef<'_, f32>, spec: &MoeSpec) -> Routing {
    let e = logits.ncols();
    let k = spec.top_k.min(e);
    let mut top = Vec::with_capacity(logits.nrows());
    let mut p = vec![0f32; e];
    let mut idx: Vec<usize> = (0..e).collect();
    for t in 0..logits.nrows() {
        let m = (0..e)
            .map(|j| logits[(t, j)])
            .fold(f32::NEG_INFINITY, f32::max);
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = (logits[(t, j)] - m).exp();
        }
        let z: f32 = p.iter().sum();
        for pj in p.iter_mut() {
            *pj /= z;
        }
        idx.iter_mut().enumerate().for_each(|(i, v)| *v = i);
        idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let sum: f32 = idx[..k].iter().map(|&j| p[j]).sum();
        top.push(
            idx[..k]
                .iter()
                .map(|&j| {
                    let w = if spec.renormalize && sum > 0.0 {
                        p[j] / sum
                    } else {
                        p[j]
                    };
                    (j, w)
                })
                .collect(),
        );
    }
    Routing { top }
}

/// Rows `rows` of `x`.
pub fn gather_rows(x: MatRef<'_, f32>, rows: &[(usize, f32)]) -> Mat<f32> {
    Mat::from_fn(rows.len(), x.ncols(), |i, c| x[(rows[i].0, c)])
}

impl MoeWeights {
    pub fn route(&self, h: MatRef<'_, f32>, spec: &MoeSpec) -> Routing {
        route(linear(h, &self.router).as_ref(), spec)
    }

    /// The routing of the residual stream after attention `x1`: from its `post_norm` normalisation (Qwen,
    /// Mixtral), or through Gemma 4's own router normalisation and per-expert scale.
    pub fn route_residual(
        &self,
        x1: MatRef<'_, f32>,
        post_norm: &[f32],
        eps: f32,
        spec: &MoeSpec,
    ) -> Routing {
        match &self.gemma4 {
            None => self.route(rms_norm(x1, post_norm, eps).as_ref(), spec),
            Some(g) => {
                let h = rms_norm(x1, &g.router_scale, eps);
                let mut r = self.route(h.as_ref(), spec);
                for top in r.top.iter_mut() {
                    for (e, w) in top.iter_mut() {
                        *w *= g.per_expert_scale.get(*e).copied().unwrap_or(1.0);
                    }
                }
                r
            }
        }
    }

    /// The norm weights of the routed experts' input and of the shared unit's input, given the layer's
    /// `post_norm` (the same for both but on Gemma 4).
    pub fn input_norms(&self, post_norm: &[f32]) -> (Vec<f32>, Vec<f32>) {
        match &self.gemma4 {
            None => (post_norm.to_vec(), post_norm.to_vec()),
            Some(g) => (g.experts_in_norm.clone(), post_norm.to_vec()),
        }
    }

    /// The MoE MLP's contribution for the residual after attention `x1` (before the layer's MLP output norm).
    pub fn forward_residual(
        &self,
        x1: MatRef<'_, f32>,
        post_norm: &[f32],
        eps: f32,
        spec: &MoeSpec,
    ) -> Mat<f32> {
        let Some(g) = &self.gemma4 else {
            return self.forward(rms_norm(x1, post_norm, eps).as_ref(), spec);
        };
        let (t, d) = (x1.nrows(), x1.ncols());
        let assigned = self
            .route_residual(x1, post_norm, eps, spec)
            .per_expert(self.experts.len());
        let h = rms_norm(x1, &g.experts_in_norm, eps);
        let mut routed = Mat::<f32>::zeros(t, d);
        for (j, toks) in assigned.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let sub = gather_rows(h.as_ref(), toks);
            let y = self.experts[j].forward_act(sub.as_ref(), spec.act);
            for (i, &(tok, w)) in toks.iter().enumerate() {
                for c in 0..d {
                    routed[(tok, c)] += w * y[(i, c)];
                }
            }
        }
        let mut out = rms_norm(routed.as_ref(), &g.experts_out_norm, eps);
        if let Some(shared) = &self.shared {
            let hs = rms_norm(x1, post_norm, eps);
            let y = shared.forward_act(hs.as_ref(), spec.act);
            let y = rms_norm(y.as_ref(), &g.shared_out_norm, eps);
            out += &y;
        }
        out
    }

    /// The MoE MLP's output for the normalised residual `h` (`[tokens, hidden]`).
    pub fn forward(&self, h: MatRef<'_, f32>, spec: &MoeSpec) -> Mat<f32> {
        let (t, d) = (h.nrows(), h.ncols());
        let assigned = self.route(h, spec).per_expert(self.experts.len());
        let mut out = Mat::<f32>::zeros(t, d);
        for (j, toks) in assigned.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let sub = gather_rows(h, toks);
            let y = self.experts[j].forward_act(sub.as_ref(), spec.act);
            for (i, &(tok, w)) in toks.iter().enumerate() {
                for c in 0..d {
                    out[(tok, c)] += w * y[(i, c)];
                }
            }
        }
        if let Some(shared) = &self.shared {
            let y = shared.forward_act(h, spec.act);
            let g = self.shared_gate.as_ref().map(|g| linear(h, g));
            for tok in 0..t {
                let s = g
                    .as_ref()
                    .map_or(1.0, |g| 1.0 / (1.0 + (-g[(tok, 0)]).exp()));
                for c in 0..d {
                    out[(tok, c)] += s * y[(tok, c)];
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lin(rows: usize, cols: usize, seed: f32) -> Linear {
        Linear {
            w: Mat::from_fn(rows, cols, |r, c| {
                ((r * cols + c) as f32 * 0.37 + seed).sin() * 0.5
            }),
            b: None,
        }
    }

    fn mlp(seed: f32) -> Mlp {
        Mlp {
            gate: lin(5, 3, seed),
            up: lin(5, 3, seed + 1.0),
            down: lin(3, 5, seed + 2.0),
        }
    }

    fn dense(m: &Mlp, x: &[f32]) -> Vec<f32> {
        let xm = Mat::from_fn(1, x.len(), |_, c| x[c]);
        let y = m.forward(xm.as_ref());
        (0..y.ncols()).map(|c| y[(0, c)]).collect()
    }

    #[test]
    fn moe_matches_a_token_by_token_reference() {
        let moe = MoeWeights {
            router: lin(3, 3, 0.3),
            experts: vec![mlp(1.0), mlp(2.0), mlp(3.0)],
            shared: Some(mlp(4.0)),
            shared_gate: Some(lin(1, 3, 0.9)),
            gemma4: None,
        };
        let h = Mat::from_fn(4, 3, |r, c| ((r * 3 + c) as f32 * 0.71).cos());
        for renormalize in [false, true] {
            let spec = MoeSpec {
                style: MoeStyle::Qwen,
                top_k: 2,
                renormalize,
                act: Activation::Silu,
            };
            let out = moe.forward(h.as_ref(), &spec);
            for t in 0..4 {
                let x: Vec<f32> = (0..3).map(|c| h[(t, c)]).collect();
                let logits: Vec<f32> = (0..3)
                    .map(|e| (0..3).map(|c| moe.router.w[(e, c)] * x[c]).sum())
                    .collect();
                let z: f32 = logits.iter().map(|l| l.exp()).sum();
                let p: Vec<f32> = logits.iter().map(|l| l.exp() / z).collect();
                let mut idx = [0usize, 1, 2];
                idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let norm = if renormalize {
                    p[idx[0]] + p[idx[1]]
                } else {
                    1.0
                };
                let mut want = [0f32; 3];
                for &e in &idx[..2] {
                    let y = dense(&moe.experts[e], &x);
                    want.iter_mut()
                        .zip(&y)
                        .for_each(|(w, v)| *w += p[e] / norm * v);
                }
                let g: f32 = (0..3)
                    .map(|c| moe.shared_gate.as_ref().unwrap().w[(0, c)] * x[c])
                    .sum();
                let s = 1.0 / (1.0 + (-g).exp());
                let y = dense(moe.shared.as_ref().unwrap(), &x);
                want.iter_mut().zip(&y).for_each(|(w, v)| *w += s * v);
                for c in 0..3 {
                    assert!(
                        (out[(t, c)] - want[c]).abs() < 1e-5,
                        "token {t}: {} vs {}",
                        out[(t, c)],
                        want[c]
                    );
                }
            }
        }
    }

    #[test]
    fn routing_ties_pick_the_lower_expert_and_renormalise() {
        let logits = Mat::from_fn(1, 4, |_, c| [1.0f32, 2.0, 2.0, 0.0][c]);
        let spec = MoeSpec {
            style: MoeStyle::Mixtral,
            top_k: 2,
            renormalize: true,
            act: Activation::Silu,
        };
        let r = route(logits.as_ref(), &spec);
        assert_eq!(r.top[0].iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2]);
        assert!((r.top[0][0].1 - 0.5).abs() < 1e-6);
        let per = r.per_expert(4);
        assert_eq!(per[1], vec![(0, r.top[0][0].1)]);
        assert!(per[0].is_empty() && per[3].is_empty());
    }
}
