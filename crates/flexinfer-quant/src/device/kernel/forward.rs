//! The calibration forward on the device (docs/dev/gptq-device.md, "The calibration forward on the device"): the samples' activations
//! stay on the device for the whole run, each layer's stages run there in batches of samples, and each
//! batch's module-group input goes straight into the input group's Hessian session without leaving the
//! device ([`super::super::Session::accumulate_resident`]).
//!
//! Layout: the activations of all samples are one column-major `tokens × hidden` matrix (sample after
//! sample); a batch is a run of whole samples, so its rows are a contiguous range and its matrices are views
//! with the big matrix's leading dimension. Temporaries of a batch (`q`, `k`, `v`, the attention output, the
//! MLP's gate and up) are `batch tokens × width` with the batch's token count as leading dimension.
//!
//! Products: the layer's linears are `Y = X·Wᵀ` through the vendor's `sgemm` where it loads (else
//! `gptq_block_update` after a zero fill). Attention is computed per sample and key/value head in query
//! chunks of at most [`QUERY_CHUNK`] rows: the scores of the chunk's queries of every query head of the
//! group against the keys up to the chunk's last position (`sgemm`, strided-batched over the heads), the
//! causal softmax in place (`fwd_softmax`), and the chunk's output (`sgemm`). The score buffer is thus
//! bounded by `heads per group × QUERY_CHUNK × sample length` floats, never a `T × T` matrix per head.
//!
//! Numerics: f32 throughout, as the CPU forward; sums run in another order (the vendor's GEMMs), so the
//! activations agree with the CPU's to rounding, not to the bit (tests/device_forward.rs states the bound).

use super::launch::FWD_THREADS;
use super::{bytes_of, dims, lock, packed, Arg, DevPtr, GemmOp, Kernel, Launch, Shared, Vendor};
use crate::device::{DevResult, DeviceError, Resident, Session};
use crate::model::llama::{Rope, Stage};
use crate::model::{LayerWeights, Linear, ModelConfig};
use faer::Mat;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most queries whose scores are held at once per head (the chunk of [`ForwardOps`]'s attention).
pub const QUERY_CHUNK: usize = 512;

/// Why a layer's forward cannot run on the device (it then runs on the CPU), or `None`.
pub fn layer_unsupported(lw: &LayerWeights) -> Option<&'static str> {
    if lw.gdn.is_some() {
        Some("a gated delta-net (linear attention) layer")
    } else if lw.moe.is_some() {
        Some("a mixture-of-experts layer")
    } else if lw.attn.output_gate {
        Some("attention with an output gate")
    } else {
        None
    }
}

/// Seconds spent in the forward's work and in the Hessian accumulation it feeds (measured with a wait for
/// the device after each, so they add up to the wall time of the stages).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardTimes {
    pub forward: Duration,
    pub hessian: Duration,
    /// Host ↔ device copies of the activations (upload of the embeddings, downloads for host sessions).
    pub copies: Duration,
    /// Batches that ran out of device memory and were retried as smaller ones.
    pub smaller_batches: u32,
    /// Most tokens per batch now (smaller after such a retry).
    pub batch_tokens: usize,
}

/// The device forward as the quantize job drives it (object-safe; [`ForwardOps`] is the implementation).
pub trait ForwardPass {
    fn name(&self) -> String;
    /// Takes every sample's activations (`tokens × hidden` each) onto the device; the host copies are dropped.
    fn upload(&mut self, hidden: Vec<Mat<f32>>) -> DevResult<()>;
    /// The samples' activations back on the host; the device copy is freed.
    fn download(&mut self) -> DevResult<Vec<Mat<f32>>>;
    /// Whether the forward holds the activations (on the device, or spilled to host memory by it).
    fn resident(&self) -> bool;
    /// From the next [`ForwardPass::upload`] on, keep the activations in host memory and upload each batch
    /// for its stage (those that change them come back after it): for activations that do not fit the device.
    fn set_spill(&mut self, spill: bool);
    /// One stage of layer `lw` over every sample, batch by batch: each batch's input of the stage's modules
    /// goes to `session` (none: the stage's modules are all excluded) with weight `alpha`; [`Stage::GateUp`]
    /// also replaces the activations by the residual after attention (as the CPU's `accumulate_stage`).
    fn stage(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        rope: &Rope,
        stage: Stage,
        session: Option<&mut dyn Session>,
        alpha: f32,
    ) -> DevResult<()>;
    /// Moves the activations through the (quantized) layer: from the residual after attention when
    /// `from_x1`, else from the layer input (as the CPU's `advance`).
    fn advance(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        rope: &Rope,
        from_x1: bool,
    ) -> DevResult<()>;
    fn times(&self) -> ForwardTimes;
}

/// A batch's activations on the device: `(x, ldx, samples relative to the batch (first row, tokens), the
/// spilled batch's own buffer)`.
type BatchView = (DevPtr, usize, Vec<(usize, usize)>, Option<DevPtr>);

/// The activations: on the device, or (spilled) in host memory, uploaded batch by batch.
struct Hidden {
    /// Every sample's rows on the device (0 when spilled).
    x: DevPtr,
    /// Rows of `x` (every sample's tokens): its leading dimension.
    total: usize,
    /// Each sample's first row and token count.
    samples: Vec<(usize, usize)>,
    /// Spilled: each sample's activations on the host.
    host: Option<Vec<Mat<f32>>>,
}

/// A linear on the device: W (`out × in`, leading dimension `out`) and its bias.
struct DevLinear {
    w: DevPtr,
    b: Option<DevPtr>,
    out: usize,
    inp: usize,
}

/// The rope tables on the device: global, and local where the layer's differ.
struct DevRope {
    half: usize,
    cos: DevPtr,
    sin: DevPtr,
    local: Option<(usize, DevPtr, DevPtr)>,
}

/// [`ForwardPass`] through a [`Vendor`]: the context of the device's solve sessions (the same [`Shared`]).
pub struct ForwardOps<'d, V: Vendor> {
    pub(super) shared: &'d Mutex<Shared<V>>,
    pub(super) generation: u64,
    hidden: Option<Hidden>,
    rope: Option<DevRope>,
    hidden_size: usize,
    /// Most tokens of one batch (whole samples; a longer sample is a batch of its own).
    batch_tokens: usize,
    /// Every allocation of this forward in the current generation.
    live: Vec<DevPtr>,
    times: ForwardTimes,
    /// Whether each stage's work is waited for and timed (a 4-byte download after each step).
    timed: bool,
    /// Most queries per attention chunk ([`QUERY_CHUNK`]; tests set fewer to run the chunking on small inputs).
    chunk: usize,
    /// Whether the current batch has written the resident activations (then it cannot be run again).
    modified: bool,
    /// Keep the activations in host memory and upload each batch ([`ForwardPass::set_spill`]).
    spill: bool,
    /// A 4-byte buffer whose download waits for the queued work.
    sync: Option<DevPtr>,
}

impl<'d, V: Vendor> ForwardOps<'d, V> {
    pub(super) fn new(
        shared: &'d Mutex<Shared<V>>,
        generation: u64,
        hidden_size: usize,
        batch_tokens: usize,
    ) -> Self {
        ForwardOps {
            shared,
            generation,
            hidden: None,
            rope: None,
            hidden_size,
            batch_tokens: batch_tokens.max(1),
            live: Vec::new(),
            times: ForwardTimes::default(),
            timed: true,
            chunk: QUERY_CHUNK,
            modified: false,
            spill: false,
            sync: None,
        }
    }

    /// At most `chunk` queries per attention chunk (default [`QUERY_CHUNK`]).
    pub fn with_query_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    fn vendor(&mut self) -> DevResult<std::sync::MutexGuard<'d, Shared<V>>> {
        let g = lock(self.shared)?;
        if g.generation != self.generation {
            self.hidden = None;
            self.rope = None;
            self.sync = None;
            self.live.clear();
            return Err(DeviceError::new(
                g.vendor.name(),
                "forward",
                "the device was reset: the activations on it are lost",
            ));
        }
        Ok(g)
    }
    fn alloc(&mut self, bytes: usize) -> DevResult<DevPtr> {
        let p = self.vendor()?.vendor.alloc(bytes.max(4))?;
        self.live.push(p);
        Ok(p)
    }
    fn free(&mut self, p: DevPtr) {
        if let Ok(mut g) = lock(self.shared) {
            if g.generation == self.generation {
                g.vendor.free(p);
            }
        }
        self.live.retain(|&q| q != p);
    }
    fn upload_new(&mut self, src: &[u8]) -> DevResult<DevPtr> {
        let p = self.alloc(src.len())?;
        if let Err(e) = self.vendor()?.vendor.upload(p, src) {
            self.free(p);
            return Err(e);
        }
        Ok(p)
    }
    fn launch(&mut self, l: Launch, args: &[Arg]) -> DevResult<()> {
        self.vendor()?.vendor.launch(l, args)
    }
    /// Waits for the queued work (a download waits for it) and adds the time since `since` to `slot`.
    fn wait(
        &mut self,
        since: Instant,
        slot: fn(&mut ForwardTimes) -> &mut Duration,
    ) -> DevResult<()> {
        if self.timed {
            let p = match self.sync {
                Some(p) => p,
                None => {
                    let p = self.alloc(4)?;
                    self.sync = Some(p);
                    p
                }
            };
            let mut b = [0u8; 4];
            self.vendor()?.vendor.download(p, &mut b)?;
        }
        *slot(&mut self.times) += since.elapsed();
        Ok(())
    }

    /// `C = A·op(B)` through the vendor's BLAS, or `gptq_block_update` after a zero fill.
    fn gemm(&mut self, op: GemmOp) -> DevResult<()> {
        if op.m == 0 || op.n == 0 {
            return Ok(());
        }
        let mut g = self.vendor()?;
        if g.math().blas {
            return g.vendor.gemm(&op);
        }
        drop(g);
        let (f_rs, f_cs) = if op.b_trans {
            (op.ldb as i64, 1i64)
        } else {
            (1i64, op.ldb as i64)
        };
        for i in 0..op.batch {
            let p = op.single(i);
            if !op.accumulate {
                self.fill(p.c, p.ldc, p.m, p.n, 0.0, 0.0)?;
            }
            if op.k == 0 {
                continue;
            }
            self.launch(
                Launch::wide(Kernel::BlockUpdate, p.n, p.m),
                &[
                    Arg::Ptr(p.c),
                    dim(p.ldc)?,
                    Arg::Ptr(p.a),
                    dim(p.lda)?,
                    Arg::Ptr(p.b),
                    Arg::I64(f_rs),
                    Arg::I64(f_cs),
                    dim(p.m)?,
                    dim(p.k)?,
                    dim(p.n)?,
                ],
            )?;
        }
        Ok(())
    }
    /// `x = x·a + b` on a `rows × cols` view (a = 0: the constant b).
    fn fill(
        &mut self,
        x: DevPtr,
        ld: usize,
        rows: usize,
        cols: usize,
        a: f32,
        b: f32,
    ) -> DevResult<()> {
        self.launch(
            Launch::columns(Kernel::FwdAffine, rows, cols),
            &[
                Arg::Ptr(x),
                dim(ld)?,
                dim(rows)?,
                dim(cols)?,
                Arg::F32(a),
                Arg::F32(b),
            ],
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &mut self,
        x: DevPtr,
        ldx: usize,
        y: DevPtr,
        ldy: usize,
        rows: usize,
        w: DevPtr,
        d: usize,
        eps: f32,
    ) -> DevResult<()> {
        self.launch(
            Launch::rows(Kernel::FwdRmsNorm, rows, FWD_THREADS),
            &[
                Arg::Ptr(x),
                dim(ldx)?,
                Arg::Ptr(y),
                dim(ldy)?,
                Arg::Ptr(w),
                dim(rows)?,
                dim(d)?,
                Arg::F32(eps),
            ],
        )
    }
    fn add(
        &mut self,
        x: DevPtr,
        ldx: usize,
        y: DevPtr,
        ldy: usize,
        rows: usize,
        cols: usize,
    ) -> DevResult<()> {
        self.launch(
            Launch::columns(Kernel::FwdAdd, rows, cols),
            &[
                Arg::Ptr(x),
                dim(ldx)?,
                Arg::Ptr(y),
                dim(ldy)?,
                dim(rows)?,
                dim(cols)?,
            ],
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn head_norm(
        &mut self,
        x: DevPtr,
        ld: usize,
        rows: usize,
        heads: usize,
        d: usize,
        w: Option<DevPtr>,
        eps: f32,
    ) -> DevResult<()> {
        self.launch(
            Launch::tokens(Kernel::FwdHeadNorm, rows, heads),
            &[
                Arg::Ptr(x),
                dim(ld)?,
                dim(rows)?,
                dim(d)?,
                Arg::Ptr(w.unwrap_or(x)),
                Arg::I32(w.is_some() as i32),
                Arg::F32(eps),
            ],
        )
    }

    /// Uploads a linear (W column-major `out × in`, its bias).
    fn upload_linear(&mut self, l: &Linear) -> DevResult<DevLinear> {
        let w = self.upload_new(bytes_of(&packed(l.w.as_ref())))?;
        let b = match &l.b {
            Some(b) => match self.upload_new(bytes_of(b)) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.free(w);
                    return Err(e);
                }
            },
            None => None,
        };
        Ok(DevLinear {
            w,
            b,
            out: l.w.nrows(),
            inp: l.w.ncols(),
        })
    }
    fn free_linear(&mut self, l: DevLinear) {
        self.free(l.w);
        if let Some(b) = l.b {
            self.free(b);
        }
    }
    /// `y = x·Wᵀ (+ b)` for `rows` tokens (`x`: `rows × in`, `y`: `rows × out`).
    fn linear(
        &mut self,
        x: DevPtr,
        ldx: usize,
        rows: usize,
        l: &DevLinear,
        y: DevPtr,
        ldy: usize,
    ) -> DevResult<()> {
        self.gemm(GemmOp {
            m: rows,
            n: l.out,
            k: l.inp,
            a: x,
            lda: ldx,
            b: l.w,
            ldb: l.out,
            b_trans: true,
            c: y,
            ldc: ldy,
            accumulate: false,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        })?;
        if let Some(b) = l.b {
            self.launch(
                Launch::columns(Kernel::FwdAddBias, rows, l.out),
                &[Arg::Ptr(y), dim(ldy)?, Arg::Ptr(b), dim(rows)?, dim(l.out)?],
            )?;
        }
        Ok(())
    }

    fn rope_tables(&mut self, rope: &Rope) -> DevResult<()> {
        if self.rope.is_some() {
            return Ok(());
        }
        let cos = self.upload_new(bytes_of(&rope.cos))?;
        let sin = self.upload_new(bytes_of(&rope.sin))?;
        let local = match &rope.local {
            Some((c, s)) => Some((
                rope.local_half,
                self.upload_new(bytes_of(c))?,
                self.upload_new(bytes_of(s))?,
            )),
            None => None,
        };
        self.rope = Some(DevRope {
            half: rope.half,
            cos,
            sin,
            local,
        });
        Ok(())
    }

    fn spilled(&self) -> bool {
        self.hidden.as_ref().is_some_and(|h| h.host.is_some())
    }

    /// The batch's activations on the device: `(x, ldx, samples relative to the batch, window)`. Resident: a
    /// view into the big matrix. Spilled: a new buffer (`window`, freed by the caller) with the batch's
    /// samples uploaded in one copy.
    fn view(&mut self, batch: (usize, usize, usize, usize)) -> DevResult<BatchView> {
        let (s0, count, r0, rows) = batch;
        let hs = self.hidden_size;
        let h = self.hidden.as_ref().ok_or_else(lost)?;
        let samples: Vec<(usize, usize)> = h.samples[s0..s0 + count]
            .iter()
            .map(|&(first, len)| (first - r0, len))
            .collect();
        let Some(host) = &h.host else {
            return Ok((h.x + (r0 * 4) as DevPtr, h.total, samples, None));
        };
        let t = Instant::now();
        let mut packed = vec![0f32; rows * hs];
        for (m, &(first, len)) in host[s0..s0 + count].iter().zip(&samples) {
            for c in 0..hs {
                for (d, v) in packed[c * rows + first..c * rows + first + len]
                    .iter_mut()
                    .zip(m.col(c).iter())
                {
                    *d = *v;
                }
            }
        }
        let w = self.upload_new(bytes_of(&packed))?;
        self.times.copies += t.elapsed();
        Ok((w, rows, samples, Some(w)))
    }

    /// A spilled batch's activations back into host memory after a stage that changed them.
    fn write_back(&mut self, batch: (usize, usize, usize, usize), window: DevPtr) -> DevResult<()> {
        let (s0, count, _, rows) = batch;
        let hs = self.hidden_size;
        let t = Instant::now();
        let mut packed = vec![0f32; rows * hs];
        self.vendor()?
            .vendor
            .download(window, bytemuck::cast_slice_mut(&mut packed))?;
        let h = self.hidden.as_mut().ok_or_else(lost)?;
        let r0 = h.samples[s0].0;
        let samples: Vec<(usize, usize)> = h.samples[s0..s0 + count].to_vec();
        let host = h.host.as_mut().ok_or_else(lost)?;
        for (m, &(first, len)) in host[s0..s0 + count].iter_mut().zip(&samples) {
            let first = first - r0;
            for c in 0..hs {
                for (d, v) in m
                    .col_mut(c)
                    .iter_mut()
                    .zip(&packed[c * rows + first..c * rows + first + len])
                {
                    *d = *v;
                }
            }
        }
        self.times.copies += t.elapsed();
        Ok(())
    }

    /// The batch of whole samples from sample `s` on: (first sample, sample count, first row, rows); at least
    /// one sample, more while they fit [`ForwardOps::batch_tokens`].
    fn batch_from(&self, s: usize) -> Option<(usize, usize, usize, usize)> {
        let h = self.hidden.as_ref()?;
        let &(r0, mut rows) = h.samples.get(s)?;
        let mut j = s + 1;
        while j < h.samples.len() && rows + h.samples[j].1 <= self.batch_tokens {
            rows += h.samples[j].1;
            j += 1;
        }
        Some((s, j - s, r0, rows))
    }

    /// Runs `f` on every batch in order. A batch whose device memory runs out (an allocation fails) before it
    /// wrote the resident activations is run again as smaller batches (half its tokens, whole samples), and
    /// the smaller size is kept for the rest of the run; any other error, or one sample alone not fitting,
    /// is the caller's.
    fn each_batch(
        &mut self,
        mut f: impl FnMut(&mut Self, (usize, usize, usize, usize)) -> DevResult<()>,
    ) -> DevResult<()> {
        let mut s = 0;
        while let Some(b) = self.batch_from(s) {
            self.modified = false;
            match f(self, b) {
                Ok(()) => s += b.1,
                // A spilled batch writes only its device copy until it has finished.
                Err(e) if e.op == "alloc" && (!self.modified || self.spilled()) && b.1 > 1 => {
                    let smaller = (b.3 / 2).max(1);
                    tracing::warn!(
                        error = %e,
                        from = b.3,
                        to = smaller,
                        "calibration forward: a batch ran out of device memory; running smaller batches"
                    );
                    self.batch_tokens = smaller;
                    self.times.smaller_batches += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The token mixer (attention) of one batch: from the normalised input `hn` (`rows × hidden`, ld
    /// `rows`) to the o_proj input `att` (`rows × heads·head_dim`, ld `rows`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        hn: DevPtr,
        rows: usize,
        samples: &[(usize, usize)],
        att: DevPtr,
    ) -> DevResult<()> {
        let (nh, nkv, d) = (lw.attn.heads, lw.attn.kv_heads, lw.attn.head_dim);
        let q = self.alloc(rows * nh * d * 4)?;
        let k = self.alloc(rows * nkv * d * 4)?;
        let v = self.alloc(rows * nkv * d * 4)?;
        let r = self.attention_with(cfg, lw, w, hn, rows, samples, att, (q, k, v));
        for p in [q, k, v] {
            self.free(p);
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_with(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        hn: DevPtr,
        rows: usize,
        samples: &[(usize, usize)],
        att: DevPtr,
        (q, k, v): (DevPtr, DevPtr, DevPtr),
    ) -> DevResult<()> {
        let (nh, nkv, d) = (lw.attn.heads, lw.attn.kv_heads, lw.attn.head_dim);
        let eps = cfg.rms_norm_eps;
        self.linear(hn, rows, rows, &w[0], q, rows)?;
        self.linear(hn, rows, rows, &w[1], k, rows)?;
        if lw.attn.v_from_k {
            self.vendor()?.vendor.copy(v, k, rows * nkv * d * 4)?;
        } else {
            self.linear(hn, rows, rows, &w[2], v, rows)?;
        }
        if let Some(wq) = &lw.q_norm {
            let p = self.upload_new(bytes_of(wq))?;
            let r = self.head_norm(q, rows, rows, nh, d, Some(p), eps);
            self.free(p);
            r?;
        }
        if let Some(wk) = &lw.k_norm {
            let p = self.upload_new(bytes_of(wk))?;
            let r = self.head_norm(k, rows, rows, nkv, d, Some(p), eps);
            self.free(p);
            r?;
        }
        if lw.v_norm {
            self.head_norm(v, rows, rows, nkv, d, None, eps)?;
        }
        let (half, cos, sin) = {
            let t = self.rope.as_ref().ok_or_else(|| {
                DeviceError::new("gpu", "forward", "the rope tables are not on the device")
            })?;
            match (&t.local, lw.sliding) {
                (Some((h, c, s)), true) => (*h, *c, *s),
                _ => (t.half, t.cos, t.sin),
            }
        };
        let half = half.min(d / 2);
        let gemma = cfg.gemma.as_ref();
        let scale = gemma.map_or(1.0 / (d as f32).sqrt(), |g| g.attn_scale);
        let softcap = gemma.and_then(|g| g.attn_softcap).unwrap_or(0.0);
        let window = gemma
            .and_then(|g| g.sliding_window)
            .filter(|_| lw.sliding)
            .unwrap_or(0);
        let group = (nh / nkv.max(1)).max(1);
        let longest = samples.iter().map(|s| s.1).max().unwrap_or(0);
        let chunk = self.chunk.min(longest.max(1));
        let scores = self.alloc(group * chunk * longest.max(1) * 4)?;
        let r = (|| -> DevResult<()> {
            for &(r0, len) in samples {
                let off = |p: DevPtr, row: usize| p + (row * 4) as DevPtr;
                for (x, heads) in [(q, nh), (k, nkv)] {
                    self.launch(
                        Launch::tokens(Kernel::FwdRope, len, heads),
                        &[
                            Arg::Ptr(off(x, r0)),
                            dim(rows)?,
                            dim(len)?,
                            dim(d)?,
                            dim(half)?,
                            Arg::Ptr(cos),
                            Arg::Ptr(sin),
                        ],
                    )?;
                }
                for g in 0..nkv {
                    let col = |head: usize| head * d * rows;
                    let mut c0 = 0;
                    while c0 < len {
                        let cq = chunk.min(len - c0);
                        let keys = c0 + cq;
                        self.gemm(GemmOp {
                            m: cq,
                            n: keys,
                            k: d,
                            a: off(q, r0 + c0 + col(g * group)),
                            lda: rows,
                            b: off(k, r0 + col(g)),
                            ldb: rows,
                            b_trans: true,
                            c: scores,
                            ldc: cq,
                            accumulate: false,
                            batch: group,
                            stride_a: d * rows,
                            stride_b: 0,
                            stride_c: cq * keys,
                        })?;
                        self.launch(
                            Launch::tokens(Kernel::FwdSoftmax, cq, group),
                            &[
                                Arg::Ptr(scores),
                                dim(cq)?,
                                Arg::I64((cq * keys) as i64),
                                dim(cq)?,
                                dim(keys)?,
                                dim(c0)?,
                                Arg::F32(scale),
                                dim(window)?,
                                Arg::F32(softcap),
                            ],
                        )?;
                        self.gemm(GemmOp {
                            m: cq,
                            n: d,
                            k: keys,
                            a: scores,
                            lda: cq,
                            b: off(v, r0 + col(g)),
                            ldb: rows,
                            b_trans: false,
                            c: off(att, r0 + c0 + col(g * group)),
                            ldc: rows,
                            accumulate: false,
                            batch: group,
                            stride_a: cq * keys,
                            stride_b: 0,
                            stride_c: d * rows,
                        })?;
                        c0 += cq;
                    }
                }
            }
            Ok(())
        })();
        self.free(scores);
        r
    }

    /// `o = o_proj(att)` (RMS-normalised for Gemma) added to the batch's residual rows.
    #[allow(clippy::too_many_arguments)]
    fn attention_residual(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        wo: &DevLinear,
        att: DevPtr,
        rows: usize,
        x: DevPtr,
        ldx: usize,
    ) -> DevResult<()> {
        let hs = self.hidden_size;
        let o = self.alloc(rows * hs * 4)?;
        let r = (|| -> DevResult<()> {
            self.linear(att, rows, rows, wo, o, rows)?;
            if let Some(w) = &lw.attn_out_norm {
                let p = self.upload_new(bytes_of(w))?;
                let r = self.rms_norm(o, rows, o, rows, rows, p, hs, cfg.rms_norm_eps);
                self.free(p);
                r?;
            }
            self.modified = true;
            self.add(x, ldx, o, rows, rows, hs)
        })();
        self.free(o);
        r
    }

    /// The SwiGLU (GELU for Gemma) input of down_proj into `g` (`rows × intermediate`, ld `rows`) from the
    /// residual rows `x`.
    #[allow(clippy::too_many_arguments)]
    fn mlp_activation(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        gate: &DevLinear,
        up: &DevLinear,
        x: DevPtr,
        ldx: usize,
        rows: usize,
        g: DevPtr,
    ) -> DevResult<()> {
        let hs = self.hidden_size;
        let h2 = self.alloc(rows * hs * 4)?;
        let u = match self.alloc(rows * up.out * 4) {
            Ok(p) => p,
            Err(e) => {
                self.free(h2);
                return Err(e);
            }
        };
        let r = (|| -> DevResult<()> {
            let pn = self.upload_new(bytes_of(&lw.post_norm))?;
            let r = self.rms_norm(x, ldx, h2, rows, rows, pn, hs, cfg.rms_norm_eps);
            self.free(pn);
            r?;
            self.linear(h2, rows, rows, gate, g, rows)?;
            self.linear(h2, rows, rows, up, u, rows)?;
            let cols = gate.out.min(up.out);
            self.launch(
                Launch::columns(Kernel::FwdActMul, rows, cols),
                &[
                    Arg::Ptr(g),
                    dim(rows)?,
                    Arg::Ptr(u),
                    dim(rows)?,
                    dim(rows)?,
                    dim(cols)?,
                    Arg::I32(cfg.gemma.is_some() as i32),
                ],
            )
        })();
        self.free(h2);
        self.free(u);
        r
    }

    /// `x += down(act)` (RMS-normalised for Gemma), then Gemma 4's layer scalar.
    #[allow(clippy::too_many_arguments)]
    fn mlp_residual(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        down: &DevLinear,
        act: DevPtr,
        rows: usize,
        x: DevPtr,
        ldx: usize,
    ) -> DevResult<()> {
        let hs = self.hidden_size;
        let dn = self.alloc(rows * hs * 4)?;
        let r = (|| -> DevResult<()> {
            self.linear(act, rows, rows, down, dn, rows)?;
            if let Some(w) = &lw.mlp_out_norm {
                let p = self.upload_new(bytes_of(w))?;
                let r = self.rms_norm(dn, rows, dn, rows, rows, p, hs, cfg.rms_norm_eps);
                self.free(p);
                r?;
            }
            self.modified = true;
            self.add(x, ldx, dn, rows, rows, hs)?;
            if let Some(s) = lw.layer_scalar {
                self.fill(x, ldx, rows, hs, s, 0.0)?;
            }
            Ok(())
        })();
        self.free(dn);
        r
    }

    /// The batch's `rows × cols` activation (ld `rows`) into the session: on the device where the session
    /// takes it, else downloaded.
    fn feed(
        &mut self,
        session: &mut dyn Session,
        a: DevPtr,
        rows: usize,
        cols: usize,
        alpha: f32,
    ) -> DevResult<()> {
        let t = Instant::now();
        let resident = Resident {
            ptr: a,
            ld: rows,
            rows,
            cols,
            context: self.shared as *const _ as usize,
            generation: self.generation,
        };
        if session.accumulate_resident(&resident, alpha)? {
            return self.wait(t, |t| &mut t.hessian);
        }
        let mut host = vec![0f32; rows * cols];
        self.vendor()?
            .vendor
            .download(a, bytemuck::cast_slice_mut(&mut host))?;
        self.times.copies += t.elapsed();
        let t = Instant::now();
        let m = Mat::from_fn(rows, cols, |i, j| host[i + j * rows]);
        drop(host);
        session.accumulate(m.as_ref(), alpha)?;
        self.times.hessian += t.elapsed();
        Ok(())
    }

    /// Uploads the linears `idx` of the layer.
    fn weights(&mut self, lw: &LayerWeights, idx: &[usize]) -> DevResult<Vec<DevLinear>> {
        let mut out = Vec::with_capacity(idx.len());
        for &i in idx {
            match self.upload_linear(&lw.linears[i]) {
                Ok(l) => out.push(l),
                Err(e) => {
                    for l in out {
                        self.free_linear(l);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// One batch of a stage (see [`ForwardPass::stage`]); `w` holds the linears the stage reads.
    #[allow(clippy::too_many_arguments)]
    fn stage_batch(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        stage: Stage,
        session: Option<&mut dyn Session>,
        alpha: f32,
        batch: (usize, usize, usize, usize),
    ) -> DevResult<()> {
        let (x, ldx, samples, window) = self.view(batch)?;
        let r = self.stage_batch_on(
            cfg,
            lw,
            w,
            stage,
            session,
            alpha,
            batch.3,
            (x, ldx),
            &samples,
        );
        if let Some(win) = window {
            let r = r.and_then(|_| {
                if stage == Stage::GateUp {
                    self.write_back(batch, win)
                } else {
                    Ok(())
                }
            });
            self.free(win);
            return r;
        }
        r
    }

    /// [`ForwardOps::stage_batch`] on the batch's activations at `x` (leading dimension `ldx`).
    #[allow(clippy::too_many_arguments)]
    fn stage_batch_on(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        stage: Stage,
        session: Option<&mut dyn Session>,
        alpha: f32,
        rows: usize,
        (x, ldx): (DevPtr, usize),
        samples: &[(usize, usize)],
    ) -> DevResult<()> {
        let (hs, eps) = (self.hidden_size, cfg.rms_norm_eps);
        let samples = samples.to_vec();
        let t = Instant::now();
        match stage {
            Stage::GateUp => {
                self.gate_up_residual(cfg, lw, w, x, ldx, rows, &samples, session, alpha, t)
            }
            Stage::Qkv | Stage::O => {
                let Some(session) = session else {
                    return Ok(());
                };
                let hn = self.alloc(rows * hs * 4)?;
                let r = (|| -> DevResult<()> {
                    let p = self.upload_new(bytes_of(&lw.input_norm))?;
                    let r = self.rms_norm(x, ldx, hn, rows, rows, p, hs, eps);
                    self.free(p);
                    r?;
                    if stage == Stage::Qkv {
                        self.wait(t, |t| &mut t.forward)?;
                        return self.feed(session, hn, rows, hs, alpha);
                    }
                    let width = lw.attn.heads * lw.attn.head_dim;
                    let att = self.alloc(rows * width * 4)?;
                    let r = self
                        .attention(cfg, lw, w, hn, rows, &samples, att)
                        .and_then(|_| {
                            self.wait(t, |t| &mut t.forward)?;
                            self.feed(session, att, rows, width, alpha)
                        });
                    self.free(att);
                    r
                })();
                self.free(hn);
                r
            }
            Stage::Down => {
                let Some(session) = session else {
                    return Ok(());
                };
                let m = w[0].out.min(w[1].out);
                let g = self.alloc(rows * w[0].out * 4)?;
                let r = self
                    .mlp_activation(cfg, lw, &w[0], &w[1], x, ldx, rows, g)
                    .and_then(|_| {
                        self.wait(t, |t| &mut t.forward)?;
                        self.feed(session, g, rows, m, alpha)
                    });
                self.free(g);
                r
            }
        }
    }

    /// The GateUp stage of one batch: attention again, its output added to the residual rows in place, and
    /// the post-attention norm's output to the session.
    #[allow(clippy::too_many_arguments)]
    fn gate_up_residual(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        x: DevPtr,
        ldx: usize,
        rows: usize,
        samples: &[(usize, usize)],
        session: Option<&mut dyn Session>,
        alpha: f32,
        t: Instant,
    ) -> DevResult<()> {
        let (hs, eps) = (self.hidden_size, cfg.rms_norm_eps);
        let width = lw.attn.heads * lw.attn.head_dim;
        let hn = self.alloc(rows * hs * 4)?;
        let att = match self.alloc(rows * width * 4) {
            Ok(p) => p,
            Err(e) => {
                self.free(hn);
                return Err(e);
            }
        };
        // Every allocation of the batch comes before the residual is written (a batch that runs out of
        // memory can then run again as smaller ones).
        let post = match &session {
            Some(_) => match self.upload_new(bytes_of(&lw.post_norm)) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.free(hn);
                    self.free(att);
                    return Err(e);
                }
            },
            None => None,
        };
        let r = (|| -> DevResult<()> {
            let p = self.upload_new(bytes_of(&lw.input_norm))?;
            let r = self.rms_norm(x, ldx, hn, rows, rows, p, hs, eps);
            self.free(p);
            r?;
            self.attention(cfg, lw, w, hn, rows, samples, att)?;
            self.attention_residual(cfg, lw, &w[3], att, rows, x, ldx)?;
            let (Some(session), Some(p)) = (session, post) else {
                return self.wait(t, |t| &mut t.forward);
            };
            self.rms_norm(x, ldx, hn, rows, rows, p, hs, eps)?;
            self.wait(t, |t| &mut t.forward)?;
            self.feed(session, hn, rows, hs, alpha)
        })();
        if let Some(p) = post {
            self.free(p);
        }
        self.free(hn);
        self.free(att);
        r
    }

    /// One batch of [`ForwardPass::advance`].
    fn advance_batch(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        from_x1: bool,
        batch: (usize, usize, usize, usize),
    ) -> DevResult<()> {
        let rows = batch.3;
        let (x, ldx, samples, window) = self.view(batch)?;
        let r = self.advance_batch_on(cfg, lw, w, from_x1, rows, (x, ldx), &samples);
        if let Some(win) = window {
            let r = r.and_then(|_| self.write_back(batch, win));
            self.free(win);
            return r;
        }
        r
    }

    /// [`ForwardOps::advance_batch`] on the batch's activations at `x` (leading dimension `ldx`).
    #[allow(clippy::too_many_arguments)]
    fn advance_batch_on(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        w: &[DevLinear],
        from_x1: bool,
        rows: usize,
        (x, ldx): (DevPtr, usize),
        samples: &[(usize, usize)],
    ) -> DevResult<()> {
        let m = lw.mixer;
        if !from_x1 {
            self.gate_up_residual(
                cfg,
                lw,
                &w[..m],
                x,
                ldx,
                rows,
                samples,
                None,
                0.0,
                Instant::now(),
            )?;
        }
        let (gate, up, down) = (&w[m], &w[m + 1], &w[m + 2]);
        let g = self.alloc(rows * gate.out * 4)?;
        let r = self
            .mlp_activation(cfg, lw, gate, up, x, ldx, rows, g)
            .and_then(|_| self.mlp_residual(cfg, lw, down, g, rows, x, ldx));
        self.free(g);
        r
    }
}

/// A dimension of a forward kernel's launch as its `int` argument (an error past `i32`).
fn dim(v: usize) -> DevResult<Arg> {
    dims("forward", v).map(Arg::I32)
}

fn lost() -> DeviceError {
    DeviceError::new("gpu", "forward", "the activations are not on the device")
}

/// The linears a stage reads.
fn stage_linears(lw: &LayerWeights, stage: Stage) -> Vec<usize> {
    let m = lw.mixer;
    match stage {
        Stage::Qkv => Vec::new(),
        Stage::O => vec![0, 1, 2],
        Stage::GateUp => vec![0, 1, 2, 3],
        Stage::Down => vec![m, m + 1],
    }
}

impl<V: Vendor> ForwardPass for ForwardOps<'_, V> {
    fn name(&self) -> String {
        lock(self.shared)
            .map(|g| g.vendor.name())
            .unwrap_or_else(|_| "gpu".into())
    }

    fn upload(&mut self, hidden: Vec<Mat<f32>>) -> DevResult<()> {
        let t = Instant::now();
        if let Some(h) = self.hidden.take() {
            if h.host.is_none() {
                self.free(h.x);
            }
        }
        let hs = self.hidden_size;
        let total: usize = hidden.iter().map(Mat::nrows).sum();
        if self.spill {
            let mut samples = Vec::with_capacity(hidden.len());
            let mut r0 = 0;
            for m in &hidden {
                samples.push((r0, m.nrows()));
                r0 += m.nrows();
            }
            self.hidden = Some(Hidden {
                x: 0,
                total,
                samples,
                host: Some(hidden),
            });
            return Ok(());
        }
        let x = self.alloc(total.max(1) * hs * 4)?;
        let mut samples = Vec::with_capacity(hidden.len());
        let mut r0 = 0;
        let mut column = vec![0f32; total];
        // Column by column: each column of the big matrix gathers that feature of every sample.
        for c in 0..hs {
            let mut at = 0;
            for m in &hidden {
                for (d, s) in column[at..at + m.nrows()].iter_mut().zip(m.col(c).iter()) {
                    *d = *s;
                }
                at += m.nrows();
            }
            let dst = x + (c * total * 4) as DevPtr;
            if let Err(e) = self.vendor()?.vendor.upload(dst, bytes_of(&column)) {
                self.free(x);
                return Err(e);
            }
        }
        for m in &hidden {
            samples.push((r0, m.nrows()));
            r0 += m.nrows();
        }
        drop(hidden);
        self.hidden = Some(Hidden {
            x,
            total,
            samples,
            host: None,
        });
        self.times.copies += t.elapsed();
        Ok(())
    }

    fn download(&mut self) -> DevResult<Vec<Mat<f32>>> {
        let t = Instant::now();
        let mut h = self.hidden.take().ok_or_else(lost)?;
        if let Some(host) = h.host.take() {
            return Ok(host);
        }
        let hs = self.hidden_size;
        let mut all = vec![0f32; h.total * hs];
        let r = self
            .vendor()?
            .vendor
            .download(h.x, bytemuck::cast_slice_mut(&mut all));
        self.free(h.x);
        r?;
        let out = h
            .samples
            .iter()
            .map(|&(r0, len)| Mat::from_fn(len, hs, |i, c| all[r0 + i + c * h.total]))
            .collect();
        self.times.copies += t.elapsed();
        Ok(out)
    }

    fn resident(&self) -> bool {
        self.hidden.is_some()
    }

    fn set_spill(&mut self, spill: bool) {
        self.spill = spill;
    }

    fn stage(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        rope: &Rope,
        stage: Stage,
        mut session: Option<&mut dyn Session>,
        alpha: f32,
    ) -> DevResult<()> {
        if session.is_none() && stage != Stage::GateUp {
            return Ok(());
        }
        self.rope_tables(rope)?;
        let t = Instant::now();
        let w = self.weights(lw, &stage_linears(lw, stage))?;
        self.times.copies += t.elapsed();
        let r = self.each_batch(|me, b| {
            let s = session.as_mut().map(|s| &mut **s as &mut dyn Session);
            me.stage_batch(cfg, lw, &w, stage, s, alpha, b)
        });
        for l in w {
            self.free_linear(l);
        }
        r
    }

    fn advance(
        &mut self,
        cfg: &ModelConfig,
        lw: &LayerWeights,
        rope: &Rope,
        from_x1: bool,
    ) -> DevResult<()> {
        self.rope_tables(rope)?;
        let m = lw.mixer;
        let idx: Vec<usize> = (0..m + 3).collect();
        let t = Instant::now();
        let w = self.weights(lw, &idx)?;
        self.times.copies += t.elapsed();
        let t = Instant::now();
        let r = self.each_batch(|me, b| me.advance_batch(cfg, lw, &w, from_x1, b));
        for l in w {
            self.free_linear(l);
        }
        r?;
        self.wait(t, |t| &mut t.forward)
    }

    fn times(&self) -> ForwardTimes {
        ForwardTimes {
            batch_tokens: self.batch_tokens,
            ..self.times
        }
    }
}

impl<V: Vendor> Drop for ForwardOps<'_, V> {
    fn drop(&mut self) {
        if let Ok(mut g) = lock(self.shared) {
            if g.generation == self.generation {
                for p in self.live.drain(..) {
                    g.vendor.free(p);
                }
            }
        }
    }
}
