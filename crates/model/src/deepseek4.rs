//! DeepSeek V4 (`deepseek4`): hyper-connections, sliding-window / compressed-sparse /
//! heavily-compressed attention with sinks, q-LoRA, the grouped low-rank output projection,
//! and a mixture of experts with hash or learned routing and a shared expert.
//!
//! The forward is the one `tools/v4_fixtures/FORWARD.md` spells out (transformers 5.25's
//! `deepseek_v4`, read from llama.cpp's `deepseek4` GGUF layout):
//!
//! ```text
//! h[s, j] = token_embd[token_s]                      for each of the N streams j
//! per layer:  (post, C, c) = HC_attn(h);   a = Attention(rms(c, attn_norm))
//!             h[k] = post[k]·a + Σ_j C[j,k]·h[j]
//!             (post, C, c) = HC_ffn(h);    f = MoE(rms(c, ffn_norm), token)
//!             h[k] = post[k]·f + Σ_j C[j,k]·h[j]
//! logits = output · rms(Σ_j pre_j·h[j], output_norm),  pre = HyperHead(h)
//! ```
//!
//! Attention has one KV head (MQA; key = value) per layer: the raw rows of a sliding window
//! of `W` positions, plus on compressed layers the rows a compressor emits once per `m`
//! positions (softmax-gated pooling of projected tokens, RMS-normed and rotated at the
//! window's first position). CSA layers (`m = 4`) pool overlapping windows and attend only
//! the top-k rows a lightning indexer scores; HCA layers (any other `m`) attend every
//! complete row. A per-head sink logit joins each softmax.
//!
//! # Per-sequence state ([`Deepseek4State`])
//!
//! Everything a later position needs is kept as append-only logs indexed by absolute
//! position (raw KV rows; each compressor's projected tokens `[c | z + ape]`) or by row
//! (compressed rows, indexer keys). A compressed row is a pure function of the token log,
//! emitted when its window's last token arrives, so truncating the logs to a length *is*
//! restoring the state of that length: speculative rollback ([`Deepseek4State::truncate`])
//! is exact and copy-free. Each forward starting at position `p` makes `p` the sequence's
//! floor: entries no query at `p` or later reads (raw rows before the window, token logs of
//! windows already pooled) are dropped, and truncating below the floor is an error, never
//! wrong logits.
//!
//! # Numerics (G1)
//!
//! Matmuls go through the canonical quantized/float kernels split over N; row ops are the
//! backend's canonical ones (RMSNorm, SwiGLU, one `exp`). Everything specific to V4 is per
//! row in a fixed order (below), so a row's logits do not depend on the batch, the chunking
//! or the thread count:
//! - HC: `mix·scale + base` (plain multiply, add), `sigmoid(x) = 1/(1+exp(−x))`, softmax
//!   `e·(1/Σe)` with sums in index order, Sinkhorn sums in index order;
//!   `collapsed = fma(pre_j, h_j, ·)` over j in order; the update starts at `post_k·a` and
//!   adds `fma(C[j,k], h_j, ·)` over j in order.
//! - Compressor row: per channel, softmax over the slots in slot order, then
//!   `r = fma(a_j, c_j, r)` in slot order; RMSNorm; RoPE.
//! - Indexer: `score = fma(w_h, max(q_h·k, 0)·d^−½, ·)` over heads in order (canonical dots);
//!   top-k by score, ties to the lower row; the kept rows are attended in row order.
//! - Attention per (row, head): scores `dot(q, k_j)·scale` for the window rows in position
//!   order then the compressed rows in row order; `m = max(sink, scores)`; `l = Σ exp(s_j −
//!   m)` in that order, then `+ exp(sink − m)`; `o = fma(e_j, v_j, o)` in that order; `o ·=
//!   1/l`.
//! - RoPE on the trailing `n_rot` channels, pairs `(2i, 2i+1)`: the angle is one f32 product
//!   `p · inv_freq_i` (as torch and ggml compute it), its cos/sin evaluated in f64 and rounded
//!   to f32; `(x0·c − x1·s, x0·s + x1·c)` without fma; the output is rotated back with `−s`.
//! - MoE: `sqrt(softplus(l))` (`ln_1p(exp(l))`, `l` above 20 passes through), top-k ties to
//!   the lower expert; `out = Σ_j fma(g_j, y_j, ·)` over the row's experts in selection
//!   order, then `+ shared`.
//!
//! The state holds f32 values (no f16 rounding), and K/V are always read back from it.

mod attention;
mod config;
mod dspark;
mod hc;
mod load;
mod moe;
mod scratch;
mod state;

pub use config::{Deepseek4Config, V4Attention, Yarn};
pub use dspark::{Dspark, DsparkBlock, DsparkConfig, DsparkScratch, DsparkState};
pub use scratch::{Deepseek4Scratch, Deepseek4Trace};
pub use state::Deepseek4State;

use attention::*;
use hc::*;
use load::*;
use scratch::*;
use state::*;

use crate::ModelError;
use crate::config::vocab;
use crate::exec::{ActsCache, MAX_GROUP, MatJob, for_rows, matmuls};
use crate::model::{BatchRow, LoadOptions};
use crate::weights::{Loader, Matrix, TensorView};
use backend_cpu::{Kernels as RowOps, NormWeight, ThreadPool, canon};
use gguf::GgufFile;
use quant::dequantize_row;
use std::sync::Arc;

/// A loaded DeepSeek V4 model: configuration, packed weights, thread pool. Immutable once
/// loaded; [`Deepseek4::forward`] takes `&self` and the sequences' [`Deepseek4State`]s.
#[derive(Debug)]
pub struct Deepseek4 {
    gguf: Arc<GgufFile>,
    cfg: Deepseek4Config,
    embed: TensorView,
    layers: Vec<Layer>,
    head_hc: Hc,
    output_norm: Vec<f32>,
    output: Matrix,
    pool: ThreadPool,
    rope_main: Rope,
    rope_comp: Rope,
    n_ctx: usize,
    /// `max(N·D, hd, d_I)` ones: the weight of the unweighted RMSNorms.
    ones: Vec<f32>,
}

impl Deepseek4 {
    /// Replaces the thread pool (any size; results do not depend on it).
    pub fn with_thread_pool(mut self, pool: ThreadPool) -> Deepseek4 {
        self.pool = pool;
        self
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Deepseek4Config {
        &self.cfg
    }

    /// The context length: rows must have positions below it.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Threads a forward runs on.
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// The mapped model file.
    pub fn gguf(&self) -> &Arc<GgufFile> {
        &self.gguf
    }

    /// Bytes of the weights the forward reads (packed matrices, tables, the embedding rows).
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.embed.n_bytes() + self.output.n_bytes() + self.head_hc.mix.n_bytes();
        for l in &self.layers {
            let a = &l.attn;
            n += l.hc_attn.mix.n_bytes() + l.hc_ffn.mix.n_bytes();
            n += [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_b]
                .iter()
                .map(|m| m.n_bytes())
                .sum::<usize>();
            n += a.wo_a.iter().map(Matrix::n_bytes).sum::<usize>();
            for c in a.comp.iter().chain(a.indexer.as_ref().map(|i| &i.comp)) {
                n += c.wkv.n_bytes() + c.wgate.n_bytes();
            }
            if let Some(ix) = &a.indexer {
                n += ix.wq_b.n_bytes() + ix.proj.n_bytes();
            }
            n += l.moe.router.n_bytes();
            for f in l.moe.experts.iter().chain(l.moe.shared.as_ref()) {
                n += f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes();
            }
        }
        n
    }

    /// A new, empty sequence state.
    pub fn new_state(&self) -> Deepseek4State {
        Deepseek4State::new(&self.cfg)
    }

    /// A new, empty sequence state that also captures, at every computed position, the
    /// input rows of `layers` averaged over the HC streams (what a DSpark drafter reads;
    /// [`Deepseek4State::captured`]). The rows are concatenated in ascending layer order.
    /// Capturing changes no logit. Errors on an empty list, a repeated layer or one outside
    /// the model.
    pub fn new_capturing_state(&self, layers: &[usize]) -> Result<Deepseek4State, ModelError> {
        let mut sorted = layers.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.is_empty() || sorted.len() != layers.len() {
            return Err(ModelError::Config(format!(
                "capture layers {layers:?} must be distinct and at least one"
            )));
        }
        if let Some(&bad) = sorted.iter().find(|&&l| l >= self.cfg.n_layer) {
            return Err(ModelError::Config(format!(
                "capture layer {bad} is outside the model's {} layers",
                self.cfg.n_layer
            )));
        }
        let mut st = Deepseek4State::new(&self.cfg);
        st.capture = Some(Capture {
            log: Log::new(sorted.len() * self.cfg.n_embd),
            layers: sorted,
        });
        Ok(st)
    }

    /// Empty scratch buffers for [`Deepseek4::forward`].
    pub fn new_scratch(&self) -> Deepseek4Scratch {
        Deepseek4Scratch::default()
    }

    /// One batched forward over rows of one or several sequences.
    ///
    /// `rows[i].seq` indexes `states`. A sequence's rows are consecutive positions in row
    /// order starting at `p0` with `floor ≤ p0 ≤ len` ([`Deepseek4State::floor`],
    /// [`Deepseek4State::len`]): the state is first cut back to `p0` (exactly the state it
    /// had at that length), `p0` becomes its floor, then every row is appended and attended.
    /// `logits_out` gets `n_vocab` logits per row with `wants_logits`, in row order. A row's
    /// logits do not depend on the other rows, the chunking or the thread count (G1).
    ///
    /// Errors ([`ModelError::Batch`], [`ModelError::ContextOverflow`]) come before any state
    /// changes.
    pub fn forward(
        &self,
        s: &mut Deepseek4Scratch,
        states: &mut [&mut Deepseek4State],
        rows: &[BatchRow],
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits_out.clear();
        let spans = self.validate(states, rows)?;
        if rows.is_empty() {
            return Ok(());
        }
        for (st, span) in states.iter_mut().zip(&spans) {
            if let Some((first, _)) = *span {
                st.begin(first);
            }
        }
        let cx = Cx {
            pool: &self.pool,
            qk: quant::kernels(),
            ops: RowOps::selected(),
            cfg: &self.cfg,
        };
        let m = rows.len();
        let (d, n) = (self.cfg.n_embd, self.cfg.hc_streams);
        s.prepare(&self.cfg, m);
        let rd = self.cfg.n_rot;
        for (r, row) in rows.iter().enumerate() {
            self.rope_main
                .cos_sin(row.pos, &mut s.cs_main[r * rd..(r + 1) * rd]);
            self.rope_comp
                .cos_sin(row.pos, &mut s.cs_comp[r * rd..(r + 1) * rd]);
            let x = &mut s.x[..d];
            dequantize_row(
                self.embed.format,
                self.embed.row(&self.gguf, row.token as usize),
                x,
            )?;
            for j in 0..n {
                let base = (r * n + j) * d;
                s.h[base..base + d].copy_from_slice(&s.x[..d]);
            }
        }
        // Captured rows (DSpark): `m × cap_w`, only when a sequence in the batch captures.
        let cap_w = states
            .iter()
            .map(|st| st.capture_width())
            .max()
            .unwrap_or(0);
        grow(&mut s.cap, m * cap_w);
        let mut run = || -> Result<(), ModelError> {
            for (li, layer) in self.layers.iter().enumerate() {
                if cap_w > 0 {
                    capture_rows(&self.cfg, s, states, rows, li, cap_w);
                }
                self.attention(&cx, s, states, rows, li, layer)?;
                self.moe(&cx, s, rows, li, layer)?;
            }
            self.head(&cx, s, rows, logits_out)
        };
        let result = run();
        if result.is_ok() && cap_w > 0 {
            for (r, row) in rows.iter().enumerate() {
                if let Some(c) = &mut states[row.seq].capture {
                    c.log.push(&s.cap[r * cap_w..r * cap_w + c.log.width]);
                }
            }
        }
        for (st, span) in states.iter_mut().zip(&spans) {
            match (*span, &result) {
                (Some((_, last)), Ok(())) => st.len = last + 1,
                // A failed forward leaves every sequence at its first row's position.
                (Some((first, _)), Err(_)) => st.cut(first),
                (None, _) => {}
            }
        }
        result
    }

    /// Checks the batch; returns each sequence's (first, last) positions.
    fn validate(
        &self,
        states: &[&mut Deepseek4State],
        rows: &[BatchRow],
    ) -> Result<Vec<Option<(usize, usize)>>, ModelError> {
        let mut spans: Vec<Option<(usize, usize)>> = vec![None; states.len()];
        for (i, row) in rows.iter().enumerate() {
            let Some(span) = spans.get_mut(row.seq) else {
                return Err(ModelError::Batch(format!(
                    "row {i} names sequence {} but {} sequences were given",
                    row.seq,
                    states.len()
                )));
            };
            if row.token as usize >= self.cfg.n_vocab {
                return Err(ModelError::Batch(format!(
                    "row {i}: token id {} is outside the vocabulary (0..{})",
                    row.token, self.cfg.n_vocab
                )));
            }
            if row.pos >= self.n_ctx {
                return Err(ModelError::ContextOverflow {
                    row: i,
                    pos: row.pos,
                    n_ctx: self.n_ctx,
                });
            }
            *span = match *span {
                None => Some((row.pos, row.pos)),
                Some((first, last)) if row.pos == last + 1 => Some((first, row.pos)),
                Some((_, last)) => {
                    return Err(ModelError::Batch(format!(
                        "row {i}: sequence {} goes from position {last} to {}; rows of one \
                         sequence must be consecutive positions",
                        row.seq, row.pos
                    )));
                }
            };
        }
        for (j, (st, span)) in states.iter().zip(&spans).enumerate() {
            if st.layers.len() != self.cfg.n_layer {
                return Err(ModelError::Batch(format!(
                    "sequence {j}: the state was made for another model"
                )));
            }
            if let Some((first, _)) = *span {
                if first > st.len {
                    return Err(ModelError::Batch(format!(
                        "sequence {j}: first row is at position {first} but only positions \
                         0..{} are computed; positions cannot be skipped",
                        st.len
                    )));
                }
                if first < st.floor {
                    return Err(ModelError::Batch(format!(
                        "sequence {j}: cannot rewrite position {first}: the state before \
                         position {} was released",
                        st.floor
                    )));
                }
            }
        }
        Ok(spans)
    }
}

// ---------------------------------------------------------------------------------------
// The forward
// ---------------------------------------------------------------------------------------

struct Cx<'a> {
    pool: &'a ThreadPool,
    qk: &'a quant::Kernels,
    ops: RowOps,
    cfg: &'a Deepseek4Config,
}

/// `outs[j][..m·w_j.n] = x · W_jᵀ` for every job, all over the same input `x` (`m` rows).
fn matmul(
    cx: &Cx<'_>,
    acts: &mut ActsCache,
    tmp: &mut Vec<f32>,
    x: &[f32],
    m: usize,
    jobs: &mut [(&Matrix, &mut [f32])],
) -> Result<(), ModelError> {
    for group in jobs.chunks_mut(MAX_GROUP) {
        let Some(k) = group.first().map(|(w, _)| w.k) else {
            continue;
        };
        let ws: Vec<&Matrix> = group.iter().map(|(w, _)| *w).collect();
        let idx = acts.quantize_for(cx.qk, &ws, &x[..m * k])?;
        let mut mj: Vec<MatJob<'_>> = group
            .iter_mut()
            .enumerate()
            .map(|(j, (w, out))| MatJob {
                w,
                acts: acts.get(idx[j]),
                out: &mut out[..m * w.n],
            })
            .collect();
        matmuls(cx.pool, cx.qk, &mut mj, m, tmp)?;
    }
    Ok(())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + canon::exp(-x))
}

/// RMSNorm of the `m` rows of `x` (row length `w.len()`) into `out`.
fn rms_rows(
    cx: &Cx<'_>,
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
) -> Result<(), ModelError> {
    let n = w.len();
    let (ops, eps) = (cx.ops, cx.cfg.rms_eps);
    for_rows(cx.pool, &mut out[..m * n], n, |i, o| {
        ops.rms_norm(&x[i * n..(i + 1) * n], w, eps, NormWeight::Plain, o)
    })
}

/// RMSNorm of every `w.len()`-piece of the `m` rows (`row_len` each) of `x`, in place.
fn rms_pieces(
    cx: &Cx<'_>,
    x: &mut [f32],
    row_len: usize,
    w: &[f32],
    m: usize,
) -> Result<(), ModelError> {
    let (ops, eps) = (cx.ops, cx.cfg.rms_eps);
    for_rows(cx.pool, &mut x[..m * row_len], row_len, |_, row| {
        ops.rms_norm_in_place(row, w, eps, NormWeight::Plain)
    })
}

impl Deepseek4 {
    /// HyperHead collapse, final norm and the output matmul for the rows wanting logits.
    fn head(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        rows: &[BatchRow],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (n, d) = (cfg.hc_streams, cfg.n_embd);
        let nd = n * d;
        let want: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].wants_logits).collect();
        let nl = want.len();
        if nl == 0 {
            return Ok(());
        }
        grow(&mut s.head, nl * nd);
        for (i, &r) in want.iter().enumerate() {
            s.head[i * nd..(i + 1) * nd].copy_from_slice(&s.h[r * nd..(r + 1) * nd]);
        }
        rms_rows(cx, &s.head, &self.ones[..nd], &mut s.flat, nl)?;
        let hc = &self.head_hc;
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.flat,
            nl,
            &mut [(&hc.mix, &mut s.mix[..])],
        )?;
        hyper_head(cx, hc, &s.head, &s.mix, &mut s.x, nl)?;
        rms_rows(cx, &s.x, &self.output_norm, &mut s.xn, nl)?;
        logits.resize(nl * cfg.n_vocab, 0.0);
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.xn,
            nl,
            &mut [(&self.output, &mut logits[..])],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek V4 Flash's shape (43 layers, hd 512, window 128, layers 0–1 sliding, then
    /// CSA/4 on even and HCA/128 on odd layers, a 128-dim indexer): the state sizes the README
    /// quotes.
    fn flash() -> Deepseek4Config {
        let mut layers = vec![V4Attention::Sliding; 2];
        layers.extend((2..43).map(|i| {
            if i % 2 == 0 {
                V4Attention::Csa { ratio: 4 }
            } else {
                V4Attention::Hca { ratio: 128 }
            }
        }));
        Deepseek4Config {
            n_layer: 43,
            n_embd: 4096,
            n_vocab: 129_280,
            n_ctx_train: 1 << 20,
            n_head: 64,
            head_dim: 512,
            n_rot: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            rms_eps: 1e-6,
            window: 128,
            layers,
            rope_base: 10_000.0,
            compress_rope_base: 160_000.0,
            yarn: None,
            indexer_heads: 64,
            indexer_dim: 128,
            indexer_top_k: 512,
            n_expert: 256,
            n_expert_used: 6,
            n_expert_shared: 1,
            n_ff_exp: 2048,
            expert_weights_scale: 1.5,
            expert_weights_norm: true,
            hash_layers: 3,
            swiglu_limits: vec![10.0; 43],
            hc_streams: 4,
            hc_iters: 20,
            hc_eps: 1e-6,
        }
    }

    #[test]
    fn flash_state_and_scratch_sizes() {
        let c = flash();
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let at = |t: usize| mib(c.state_bytes(t, 512));
        // Window rows: 43 layers × 640 rows × 512 × 4 B; per CSA layer (21) rows/4 × (512 +
        // 128) floats, per HCA layer (20) rows/128 × 512, plus the open token logs.
        assert!((at(4096) - 274.1).abs() < 0.1, "{}", at(4096));
        assert!((at(65_536) - 1080.4).abs() < 0.1, "{}", at(65_536));
        let growth = mib(c.state_bytes(66_560, 512) - c.state_bytes(65_536, 512));
        assert!((growth - 13.44).abs() < 0.01, "{growth}");
        // The scratch of a 512-row prefill chunk.
        let scratch = mib(c.scratch_bytes(512));
        assert!(scratch > 300.0 && scratch < 700.0, "{scratch}");
        println!(
            "Flash state: {:.1} MiB at 4K, {:.1} MiB at 64K, +{growth:.2} MiB per 1K tokens; \
             scratch {scratch:.0} MiB",
            at(4096),
            at(65_536)
        );
    }
}
