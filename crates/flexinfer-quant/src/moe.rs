//! Sparse-MoE MLPs: the router (softmax over the expert logits in f32, top-k, optional renormalisation of the
//! k weights, as transformers' Mixtral / Qwen2-MoE / Qwen3-MoE blocks do) and the weighted sum of the chosen
//! SwiGLU experts, plus the optional always-on shared expert behind a sigmoid gate (Qwen2-MoE).

use crate::llama::linear;
use crate::model::Linear;
use faer::{Mat, MatRef};

/// Tensor layout of a sparse-MoE MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeStyle {
    /// `mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`, optional `mlp.shared_expert(_gate)`.
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.N.{w1,w3,w2}`.
    Mixtral,
}

impl MoeStyle {
    /// Block-relative module prefix of the MoE MLP.
    pub fn base(self) -> &'static str {
        match self {
            MoeStyle::Qwen => "mlp.",
            MoeStyle::Mixtral => "block_sparse_moe.",
        }
    }

    /// Names of an expert's gate, up and down projections.
    pub fn expert_names(self) -> [&'static str; 3] {
        match self {
            MoeStyle::Qwen => ["gate_proj", "up_proj", "down_proj"],
            MoeStyle::Mixtral => ["w1", "w3", "w2"],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub style: MoeStyle,
    pub top_k: usize,
    /// Renormalize the top-k routing weights to sum to 1.
    pub renormalize: bool,
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
    let mut g = linear(x, gate);
    let u = linear(x, up);
    for c in 0..g.ncols().min(u.ncols()) {
        let uc = u.col_as_slice(c);
        for (gv, &uv) in g.col_as_slice_mut(c).iter_mut().zip(uc) {
            *gv = *gv / (1.0 + (-*gv).exp()) * uv;
        }
    }
    g
}

impl Mlp {
    pub fn forward(&self, x: MatRef<'_, f32>) -> Mat<f32> {
        let act = swiglu(&self.gate, &self.up, x);
        linear(act.as_ref(), &self.down)
    }
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub shared_gate: Option<Linear>,
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
            let y = self.experts[j].forward(sub.as_ref());
            for (i, &(tok, w)) in toks.iter().enumerate() {
                for c in 0..d {
                    out[(tok, c)] += w * y[(i, c)];
                }
            }
        }
        if let Some(shared) = &self.shared {
            let y = shared.forward(h);
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
        };
        let h = Mat::from_fn(4, 3, |r, c| ((r * 3 + c) as f32 * 0.71).cos());
        for renormalize in [false, true] {
            let spec = MoeSpec {
                style: MoeStyle::Qwen,
                top_k: 2,
                renormalize,
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
        };
        let r = route(logits.as_ref(), &spec);
        assert_eq!(r.top[0].iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2]);
        assert!((r.top[0][0].1 - 0.5).abs() < 1e-6);
        let per = r.per_expert(4);
        assert_eq!(per[1], vec![(0, r.top[0][0].1)]);
        assert!(per[0].is_empty() && per[3].is_empty());
    }
}
