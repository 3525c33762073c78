//! The building blocks shared by the architectures: RMSNorm, causal (optionally
//! sliding-window) self-attention over the paged KV cache with optional QK-norm and
//! post-norm, the gated feed-forward block (SwiGLU or GELU-tanh GeGLU, optional post-norm),
//! and the scratch buffers they work in.
//!
//! Each block reads the residual stream `x` (one row per batch row) from the scratch and
//! adds its output back into it. Every step is per row or a matmul split over N, so a
//! row's values never depend on the other rows of the batch or on the thread count.

use crate::ModelError;
use crate::config::Config;
use crate::exec::{ActsCache, MatJob, for_rows, matmuls};
use crate::weights::Matrix;
use backend_cpu::{
    AttnParams, AttnRow, KvCache, NormWeight, RopeStyle, RopeTable, ThreadPool, attention,
};
use gguf::GgufFile;

/// What every block needs besides its weights: the pool, the kernel sets, the file the
/// weights live in, and per-model constants.
pub(crate) struct Ctx<'a> {
    /// Thread pool (matmuls split N over it; row ops split rows).
    pub pool: &'a ThreadPool,
    /// Quantized matmul kernels.
    pub qk: &'a quant::Kernels,
    /// Row-op kernels.
    pub ops: backend_cpu::Kernels,
    /// The mapped model file.
    pub gguf: &'a GgufFile,
    /// Hyperparameters.
    pub cfg: &'a Config,
    /// RoPE cos/sin table of the global-attention layers.
    pub rope: &'a RopeTable,
    /// RoPE cos/sin table of the sliding-window layers (the same table where the
    /// architecture has one base).
    pub rope_swa: &'a RopeTable,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
}

/// Buffers reused across forward calls (grown on demand, never shrunk), so a decode step
/// allocates nothing once warm. One per concurrent caller of [`crate::Model::forward`].
#[derive(Debug, Default)]
pub struct ForwardScratch {
    /// Residual stream, `m × n_embd`.
    pub(crate) x: Vec<f32>,
    /// Normed input of the current block, `m × n_embd`.
    pub(crate) xn: Vec<f32>,
    /// Queries, `m × q_dim`.
    pub(crate) q: Vec<f32>,
    /// Keys, `m × kv_dim`.
    pub(crate) k: Vec<f32>,
    /// Values, `m × kv_dim`.
    pub(crate) v: Vec<f32>,
    /// Attention output, `m × q_dim`.
    pub(crate) attn: Vec<f32>,
    /// Block output before the residual add, `m × n_embd`.
    pub(crate) proj: Vec<f32>,
    /// FFN gate (then SwiGLU result), `m × n_ff`.
    pub(crate) gate: Vec<f32>,
    /// FFN up, `m × n_ff`.
    pub(crate) up: Vec<f32>,
    /// Tile-major matmul staging.
    pub(crate) tmp: Vec<f32>,
    /// Final-normed rows that want logits.
    pub(crate) head: Vec<f32>,
    /// Absolute position of each row.
    pub(crate) positions: Vec<usize>,
    /// Rows that want logits.
    pub(crate) logit_rows: Vec<usize>,
    /// Token id of each row.
    pub(crate) tokens: Vec<u32>,
    /// Per sequence of the batch: (first position, last position) of its rows.
    pub(crate) spans: Vec<Option<(usize, usize)>>,
    /// Quantized activations.
    pub(crate) acts: ActsCache,
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

impl ForwardScratch {
    /// Empty buffers; they grow to the largest batch seen.
    pub fn new() -> ForwardScratch {
        ForwardScratch::default()
    }

    /// Makes room for `m` rows of a model with `cfg`.
    pub(crate) fn prepare(&mut self, cfg: &Config, m: usize) {
        grow(&mut self.x, m * cfg.n_embd);
        grow(&mut self.xn, m * cfg.n_embd);
        grow(&mut self.proj, m * cfg.n_embd);
        grow(&mut self.q, m * cfg.q_dim());
        grow(&mut self.attn, m * cfg.q_dim());
        grow(&mut self.k, m * cfg.kv_dim());
        grow(&mut self.v, m * cfg.kv_dim());
        grow(&mut self.gate, m * cfg.n_ff);
        grow(&mut self.up, m * cfg.n_ff);
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.x, &self.xn, &self.q, &self.k, &self.v, &self.attn, &self.proj, &self.gate,
            &self.up, &self.tmp, &self.head,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>();
        f * 4 + self.acts.bytes()
    }
}

/// RMSNorm of the first `m` rows of `x` into `out` (row length `w.len()`).
pub(crate) fn rms_norm_rows(
    cx: &Ctx<'_>,
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
) -> Result<(), ModelError> {
    let n = w.len();
    let ops = cx.ops;
    let eps = cx.cfg.rms_eps;
    for_rows(cx.pool, out, n, |i, o| {
        ops.rms_norm(&x[i * n..(i + 1) * n], w, eps, NormWeight::Plain, o)
    })
}

/// RMSNorm of each `n`-value piece of `x` in place (`n = w.len()`: QK-norm, per head).
fn rms_norm_heads(
    cx: &Ctx<'_>,
    x: &mut [f32],
    row_len: usize,
    w: &[f32],
) -> Result<(), ModelError> {
    let ops = cx.ops;
    let eps = cx.cfg.rms_eps;
    for_rows(cx.pool, x, row_len, |_, row| {
        ops.rms_norm_in_place(row, w, eps, NormWeight::Plain)
    })
}

/// Self-attention of one layer: RMSNorm → Q/K/V (+ biases) → QK-norm (per head, gemma3) →
/// RoPE (the layer's table: sliding-window layers use [`Ctx::rope_swa`]) → K/V into the
/// cache → attention over the cache (windowed where the layer slides) → output projection
/// → post-norm (gemma3) → residual add.
#[derive(Debug)]
pub(crate) struct Attention {
    /// `blk.N.attn_norm.weight`.
    pub norm: Vec<f32>,
    /// `blk.N.attn_q.weight`.
    pub wq: Matrix,
    /// `blk.N.attn_k.weight`.
    pub wk: Matrix,
    /// `blk.N.attn_v.weight`.
    pub wv: Matrix,
    /// `blk.N.attn_output.weight`.
    pub wo: Matrix,
    /// `blk.N.attn_q.bias` (qwen2).
    pub bq: Option<Vec<f32>>,
    /// `blk.N.attn_k.bias` (qwen2).
    pub bk: Option<Vec<f32>>,
    /// `blk.N.attn_v.bias` (qwen2).
    pub bv: Option<Vec<f32>>,
    /// `blk.N.attn_q_norm.weight`, `head_dim` values applied to every query head (gemma3).
    pub q_norm: Option<Vec<f32>>,
    /// `blk.N.attn_k_norm.weight`, applied to every key head (gemma3).
    pub k_norm: Option<Vec<f32>>,
    /// `blk.N.post_attention_norm.weight`: RMSNorm of the block output before the residual add
    /// (gemma3).
    pub post_norm: Option<Vec<f32>>,
}

impl Attention {
    /// Runs the block for the batch `rows` (their K/V blocks already reserved) at `layer`.
    pub fn forward(
        &self,
        cx: &Ctx<'_>,
        s: &mut ForwardScratch,
        kv: &mut KvCache,
        layer: usize,
        rows: &[AttnRow<'_>],
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let m = rows.len();
        let (e, qd, kvd, hd) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        rms_norm_rows(cx, &s.x[..m * e], &self.norm, &mut s.xn[..m * e])?;
        let idx = s
            .acts
            .quantize_for(cx.qk, &[&self.wq, &self.wk, &self.wv], &s.xn[..m * e])?;
        let (q, k, v) = (&mut s.q[..m * qd], &mut s.k[..m * kvd], &mut s.v[..m * kvd]);
        matmuls(
            cx.pool,
            cx.qk,
            &mut [
                MatJob {
                    w: &self.wq,
                    acts: s.acts.get(idx[0]),
                    out: q,
                },
                MatJob {
                    w: &self.wk,
                    acts: s.acts.get(idx[1]),
                    out: k,
                },
                MatJob {
                    w: &self.wv,
                    acts: s.acts.get(idx[2]),
                    out: v,
                },
            ],
            m,
            &mut s.tmp,
        )?;
        if let Some(w) = &self.q_norm {
            rms_norm_heads(cx, q, qd, w)?;
        }
        if let Some(w) = &self.k_norm {
            rms_norm_heads(cx, k, kvd, w)?;
        }
        let ops = cx.ops;
        let positions = &s.positions[..m];
        let sliding = cfg.layer_windows.get(layer).copied().flatten().is_some();
        let rope = if sliding { cx.rope_swa } else { cx.rope };
        let style = cx.rope_style;
        for (buf, width, bias, rotate) in [
            (&mut *q, qd, &self.bq, true),
            (&mut *k, kvd, &self.bk, true),
            (&mut *v, kvd, &self.bv, false),
        ] {
            if bias.is_none() && !rotate {
                continue;
            }
            for_rows(cx.pool, buf, width, |i, row| {
                if let Some(b) = bias {
                    ops.add_in_place(row, b)?;
                }
                if rotate {
                    ops.rope(row, hd, &positions[i..i + 1], rope, style)?;
                }
                Ok::<(), backend_cpu::Error>(())
            })?;
        }
        kv.write_rows(layer, rows, k, v)?;
        let out = &mut s.attn[..m * qd];
        attention(
            cx.pool,
            kv,
            layer,
            rows,
            q,
            out,
            AttnParams {
                n_head: cfg.n_head,
                scale: cfg.attn_scale,
            },
        )?;
        let idx = s.acts.quantize_for(cx.qk, &[&self.wo], out)?;
        matmuls(
            cx.pool,
            cx.qk,
            &mut [MatJob {
                w: &self.wo,
                acts: s.acts.get(idx[0]),
                out: &mut s.proj[..m * e],
            }],
            m,
            &mut s.tmp,
        )?;
        if let Some(w) = &self.post_norm {
            rms_norm_heads(cx, &mut s.proj[..m * e], e, w)?;
        }
        ops.add_in_place(&mut s.x[..m * e], &s.proj[..m * e])?;
        Ok(())
    }
}

/// The gate activation of the feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GateAct {
    /// `silu(gate) · up` (llama, qwen2).
    Silu,
    /// `gelu_tanh(gate) · up` (gemma3).
    GeluTanh,
}

/// The gated feed-forward block: RMSNorm → gate/up (one activation quantization) →
/// `act(gate) · up` → down → post-norm (gemma3) → residual add.
#[derive(Debug)]
pub(crate) struct Mlp {
    /// `blk.N.ffn_norm.weight`.
    pub norm: Vec<f32>,
    /// `blk.N.ffn_gate.weight`.
    pub gate: Matrix,
    /// `blk.N.ffn_up.weight`.
    pub up: Matrix,
    /// `blk.N.ffn_down.weight`.
    pub down: Matrix,
    /// The gate activation.
    pub act: GateAct,
    /// `blk.N.post_ffw_norm.weight`: RMSNorm of the block output before the residual add
    /// (gemma3).
    pub post_norm: Option<Vec<f32>>,
}

impl Mlp {
    /// Runs the block for `m` rows.
    pub fn forward(
        &self,
        cx: &Ctx<'_>,
        s: &mut ForwardScratch,
        m: usize,
    ) -> Result<(), ModelError> {
        let (e, f) = (cx.cfg.n_embd, cx.cfg.n_ff);
        rms_norm_rows(cx, &s.x[..m * e], &self.norm, &mut s.xn[..m * e])?;
        let idx = s
            .acts
            .quantize_for(cx.qk, &[&self.gate, &self.up], &s.xn[..m * e])?;
        let (gate, up) = (&mut s.gate[..m * f], &mut s.up[..m * f]);
        matmuls(
            cx.pool,
            cx.qk,
            &mut [
                MatJob {
                    w: &self.gate,
                    acts: s.acts.get(idx[0]),
                    out: gate,
                },
                MatJob {
                    w: &self.up,
                    acts: s.acts.get(idx[1]),
                    out: up,
                },
            ],
            m,
            &mut s.tmp,
        )?;
        let ops = cx.ops;
        let up: &[f32] = up;
        let act = self.act;
        for_rows(cx.pool, gate, f, |i, g| match act {
            GateAct::Silu => ops.swiglu_in_place(g, &up[i * f..(i + 1) * f]),
            GateAct::GeluTanh => ops.geglu_in_place(g, &up[i * f..(i + 1) * f]),
        })?;
        let idx = s.acts.quantize_for(cx.qk, &[&self.down], gate)?;
        matmuls(
            cx.pool,
            cx.qk,
            &mut [MatJob {
                w: &self.down,
                acts: s.acts.get(idx[0]),
                out: &mut s.proj[..m * e],
            }],
            m,
            &mut s.tmp,
        )?;
        if let Some(w) = &self.post_norm {
            rms_norm_heads(cx, &mut s.proj[..m * e], e, w)?;
        }
        ops.add_in_place(&mut s.x[..m * e], &s.proj[..m * e])?;
        Ok(())
    }
}

/// The output head for the rows listed in `s.logit_rows` (in that order): final RMSNorm of
/// their residual rows, then the output matmul into `logits` (`n_vocab` per row; cleared
/// first, empty when no row wants logits).
pub(crate) fn logits_head(
    cx: &Ctx<'_>,
    s: &mut ForwardScratch,
    output_norm: &[f32],
    output: &Matrix,
    logits: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let e = cx.cfg.n_embd;
    let nl = s.logit_rows.len();
    logits.clear();
    if nl == 0 {
        return Ok(());
    }
    if s.head.len() < nl * e {
        s.head.resize(nl * e, 0.0);
    }
    for (i, &r) in s.logit_rows.iter().enumerate() {
        s.xn[i * e..(i + 1) * e].copy_from_slice(&s.x[r * e..(r + 1) * e]);
    }
    rms_norm_rows(cx, &s.xn[..nl * e], output_norm, &mut s.head[..nl * e])?;
    let idx = s.acts.quantize_for(cx.qk, &[output], &s.head[..nl * e])?;
    logits.resize(nl * output.n, 0.0);
    matmuls(
        cx.pool,
        cx.qk,
        &mut [MatJob {
            w: output,
            acts: s.acts.get(idx[0]),
            out: logits,
        }],
        nl,
        &mut s.tmp,
    )
}
