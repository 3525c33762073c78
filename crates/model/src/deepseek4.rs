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

mod dspark;

pub use dspark::{Dspark, DsparkBlock, DsparkConfig, DsparkScratch, DsparkState};

use crate::ModelError;
use crate::config::vocab;
use crate::exec::{ActsCache, MAX_GROUP, MatJob, for_rows, matmuls};
use crate::model::{BatchRow, LoadOptions};
use crate::weights::{Loader, Matrix, TensorView};
use backend_cpu::{Kernels as RowOps, NormWeight, ThreadPool, canon};
use gguf::GgufFile;
use quant::dequantize_row;
use std::sync::Arc;

/// Upper bounds on metadata values, far above any real model, so absurd files fail with a
/// typed error instead of huge allocations.
const MAX_HC_STREAMS: usize = 64;
const MAX_SINKHORN_ITERS: usize = 10_000;
const MAX_RATIO: usize = 1 << 16;

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// How one layer attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4Attention {
    /// The raw rows of the sliding window only (`compress_ratios[i] = 0`).
    Sliding,
    /// Compressed sparse attention (`compress_ratios[i] = 4`): one row per `ratio` positions
    /// pooled over overlapping windows; the lightning indexer keeps the top-k rows per query.
    Csa {
        /// Positions per compressed row.
        ratio: usize,
    },
    /// Heavily compressed attention (any other ratio): one row per `ratio` positions pooled
    /// over disjoint windows; every complete row is attended.
    Hca {
        /// Positions per compressed row.
        ratio: usize,
    },
}

impl V4Attention {
    /// Positions per compressed row (`None` for sliding-only layers).
    pub fn ratio(self) -> Option<usize> {
        match self {
            V4Attention::Sliding => None,
            V4Attention::Csa { ratio } | V4Attention::Hca { ratio } => Some(ratio),
        }
    }
}

/// YaRN frequency scaling of the compressed layers' RoPE (`rope.scaling.*` with type yarn).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`.
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub original_context: usize,
    /// `rope.scaling.yarn_beta_fast` (default 32).
    pub beta_fast: f32,
    /// `rope.scaling.yarn_beta_slow` (default 1).
    pub beta_slow: f32,
}

/// The hyperparameters of a DeepSeek V4 model, from the `deepseek4.*` metadata keys of
/// llama.cpp's conversion.
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek4Config {
    /// `block_count`.
    pub n_layer: usize,
    /// `embedding_length` (D).
    pub n_embd: usize,
    /// Logit width (rows of `output.weight`).
    pub n_vocab: usize,
    /// `context_length`.
    pub n_ctx_train: usize,
    /// `attention.head_count` (H).
    pub n_head: usize,
    /// `attention.key_length`: the one KV head's width (hd).
    pub head_dim: usize,
    /// `rope.dimension_count`: rotated trailing channels per head.
    pub n_rot: usize,
    /// `attention.q_lora_rank`.
    pub q_lora_rank: usize,
    /// `attention.output_group_count` (G).
    pub o_groups: usize,
    /// `attention.output_lora_rank` (R).
    pub o_lora_rank: usize,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `attention.sliding_window` (W): a query at `t` sees raw rows `t−W < p ≤ t`.
    pub window: usize,
    /// Per layer, from `attention.compress_ratios`.
    pub layers: Vec<V4Attention>,
    /// `rope.freq_base`: sliding-only layers.
    pub rope_base: f32,
    /// `attention.compress_rope_freq_base`: compressed layers (attention, compressor,
    /// indexer).
    pub compress_rope_base: f32,
    /// YaRN on the compressed layers' RoPE.
    pub yarn: Option<Yarn>,
    /// `attention.indexer.head_count`.
    pub indexer_heads: usize,
    /// `attention.indexer.key_length`.
    pub indexer_dim: usize,
    /// `attention.indexer.top_k`.
    pub indexer_top_k: usize,
    /// `expert_count`.
    pub n_expert: usize,
    /// `expert_used_count`.
    pub n_expert_used: usize,
    /// `expert_shared_count`.
    pub n_expert_shared: usize,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: usize,
    /// `expert_weights_scale` (routed scaling factor).
    pub expert_weights_scale: f32,
    /// `expert_weights_norm`: divide the chosen gates by their sum (default true).
    pub expert_weights_norm: bool,
    /// `hash_layer_count`: the first layers route by token id.
    pub hash_layers: usize,
    /// Per layer, `swiglu_clamp_exp` (infinite where absent); the shared expert uses the same
    /// limit (transformers does; llama.cpp writes no `swiglu_clamp_shexp`).
    pub swiglu_limits: Vec<f32>,
    /// `hyper_connection.count` (N streams).
    pub hc_streams: usize,
    /// `hyper_connection.sinkhorn_iterations`.
    pub hc_iters: usize,
    /// `hyper_connection.epsilon`.
    pub hc_eps: f32,
}

impl Deepseek4Config {
    /// Reads the configuration of `gguf` (`general.architecture` must be `deepseek4`).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Deepseek4Config, ModelError> {
        let arch = gguf.architecture()?;
        if arch != "deepseek4" {
            return Err(ModelError::Config(format!(
                "expected a deepseek4 file, got {arch:?}"
            )));
        }
        let key = |k: &str| format!("deepseek4.{k}");
        let req = |k: &str| -> Result<usize, ModelError> {
            Ok(usize::try_from(gguf.get_u32(&key(k))?).unwrap_or(usize::MAX))
        };
        let opt = |k: &str, default: usize| -> Result<usize, ModelError> {
            match gguf.get(&key(k)) {
                None => Ok(default),
                Some(_) => req(k),
            }
        };
        let optf = |k: &str, default: f32| -> Result<f32, ModelError> {
            match gguf.get(&key(k)) {
                None => Ok(default),
                Some(_) => Ok(gguf.get_f32(&key(k))?),
            }
        };
        let bad = |msg: String| Err(ModelError::Config(msg));
        let n_layer = req("block_count")?;
        let n_embd = req("embedding_length")?;
        let n_ctx_train = req("context_length")?;
        let n_head = req("attention.head_count")?;
        let head_dim = req("attention.key_length")?;
        let n_rot = req("rope.dimension_count")?;
        let q_lora_rank = req("attention.q_lora_rank")?;
        let o_groups = req("attention.output_group_count")?;
        let o_lora_rank = req("attention.output_lora_rank")?;
        let window = req("attention.sliding_window")?;
        let n_expert = req("expert_count")?;
        let n_expert_used = req("expert_used_count")?;
        let n_ff_exp = req("expert_feed_forward_length")?;
        let hc_streams = req("hyper_connection.count")?;
        for (name, v) in [
            ("block_count", n_layer),
            ("embedding_length", n_embd),
            ("context_length", n_ctx_train),
            ("attention.head_count", n_head),
            ("attention.key_length", head_dim),
            ("attention.q_lora_rank", q_lora_rank),
            ("attention.output_group_count", o_groups),
            ("attention.output_lora_rank", o_lora_rank),
            ("attention.sliding_window", window),
            ("expert_count", n_expert),
            ("expert_used_count", n_expert_used),
            ("expert_feed_forward_length", n_ff_exp),
            ("hyper_connection.count", hc_streams),
        ] {
            if v == 0 || v == usize::MAX {
                return bad(format!("deepseek4.{name} = {v} must be > 0"));
            }
        }
        if opt("attention.head_count_kv", 1)? != 1 {
            return bad("deepseek4.attention.head_count_kv must be 1 (one shared KV head)".into());
        }
        if opt("attention.value_length", head_dim)? != head_dim {
            return bad("deepseek4.attention.value_length must equal key_length".into());
        }
        if n_rot == 0 || n_rot % 2 != 0 || n_rot > head_dim {
            return bad(format!(
                "deepseek4.rope.dimension_count {n_rot} must be even, > 0 and at most the head \
                 size {head_dim}"
            ));
        }
        if (n_head * head_dim) % o_groups != 0 || n_head % o_groups != 0 {
            return bad(format!(
                "deepseek4.attention.output_group_count {o_groups} must divide the {n_head} heads"
            ));
        }
        if n_expert_used > n_expert {
            return bad(format!(
                "deepseek4.expert_used_count {n_expert_used} exceeds expert_count {n_expert}"
            ));
        }
        if hc_streams > MAX_HC_STREAMS {
            return bad(format!(
                "deepseek4.hyper_connection.count {hc_streams} is above {MAX_HC_STREAMS}"
            ));
        }
        let hc_iters = opt("hyper_connection.sinkhorn_iterations", 20)?;
        if hc_iters == 0 || hc_iters > MAX_SINKHORN_ITERS {
            return bad(format!(
                "deepseek4.hyper_connection.sinkhorn_iterations {hc_iters} must be in \
                 1..={MAX_SINKHORN_ITERS}"
            ));
        }
        let hc_eps = optf("hyper_connection.epsilon", 1e-6)?;
        let rms_eps = gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = optf("rope.freq_base", 10_000.0)?;
        let compress_rope_base = optf("attention.compress_rope_freq_base", rope_base)?;
        let expert_weights_scale = optf("expert_weights_scale", 1.0)?;
        for (name, v) in [
            ("hyper_connection.epsilon", hc_eps),
            ("attention.layer_norm_rms_epsilon", rms_eps),
            ("expert_weights_scale", expert_weights_scale),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("deepseek4.{name} = {v} must be finite and >= 0"));
            }
        }
        for (name, v) in [
            ("rope.freq_base", rope_base),
            ("attention.compress_rope_freq_base", compress_rope_base),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("deepseek4.{name} = {v} must be finite and > 0"));
            }
        }
        let expert_weights_norm = match gguf.get(&key("expert_weights_norm")) {
            None => true,
            Some(_) => gguf.get_bool(&key("expert_weights_norm"))?,
        };
        let n_expert_shared = opt("expert_shared_count", 0)?;
        if n_expert_shared > n_expert.max(16) {
            return bad(format!(
                "deepseek4.expert_shared_count {n_expert_shared} is implausible"
            ));
        }
        let hash_layers = opt("hash_layer_count", 0)?;
        if hash_layers > n_layer {
            return bad(format!(
                "deepseek4.hash_layer_count {hash_layers} exceeds block_count {n_layer}"
            ));
        }
        let ratios = gguf
            .get_array(&key("attention.compress_ratios"))?
            .to_i64s()
            .ok_or_else(|| {
                ModelError::Config("deepseek4.attention.compress_ratios must be integers".into())
            })?;
        if ratios.len() != n_layer {
            return bad(format!(
                "deepseek4.attention.compress_ratios has {} entries for {n_layer} layers",
                ratios.len()
            ));
        }
        let mut layers = Vec::with_capacity(n_layer);
        for (i, &r) in ratios.iter().enumerate() {
            layers.push(match r {
                0 => V4Attention::Sliding,
                4 => V4Attention::Csa { ratio: 4 },
                r if (2..=MAX_RATIO as i64).contains(&r) => V4Attention::Hca { ratio: r as usize },
                r => {
                    return bad(format!(
                        "deepseek4.attention.compress_ratios[{i}] = {r}: a ratio must be 0 or in \
                         2..={MAX_RATIO}"
                    ));
                }
            });
        }
        let any_csa = layers.iter().any(|l| matches!(l, V4Attention::Csa { .. }));
        let (indexer_heads, indexer_dim, indexer_top_k) = if any_csa {
            let h = req("attention.indexer.head_count")?;
            let d = req("attention.indexer.key_length")?;
            let k = req("attention.indexer.top_k")?;
            if h == 0 || d == 0 || k == 0 || h == usize::MAX || d == usize::MAX {
                return bad("deepseek4.attention.indexer.* must be > 0".into());
            }
            if n_rot > d {
                return bad(format!(
                    "deepseek4.attention.indexer.key_length {d} is below rope.dimension_count \
                     {n_rot}"
                ));
            }
            (h, d, k)
        } else {
            (0, 0, 0)
        };
        let swiglu_limits = match gguf.get(&key("swiglu_clamp_exp")) {
            None => vec![f32::INFINITY; n_layer],
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| {
                    ModelError::Config("deepseek4.swiglu_clamp_exp must be an array".into())
                })?;
                let vals: Vec<f32> = match (arr.as_f32s(), arr.as_f64s()) {
                    (Some(f), _) => f.to_vec(),
                    (None, Some(f)) => f.iter().map(|&x| x as f32).collect(),
                    _ => return bad("deepseek4.swiglu_clamp_exp must be floats".into()),
                };
                if vals.len() != n_layer {
                    return bad(format!(
                        "deepseek4.swiglu_clamp_exp has {} entries for {n_layer} layers",
                        vals.len()
                    ));
                }
                // 0 (or below) means "no clamp" in llama.cpp's convention.
                vals.into_iter()
                    .map(|l| {
                        if l.is_nan() || l <= 0.0 {
                            f32::INFINITY
                        } else {
                            l
                        }
                    })
                    .collect()
            }
        };
        let yarn = match gguf.get(&key("rope.scaling.type")) {
            None => None,
            Some(_) => match gguf.get_str(&key("rope.scaling.type"))? {
                "none" => None,
                "yarn" => {
                    let factor = gguf.get_f32(&key("rope.scaling.factor"))?;
                    let original_context = req("rope.scaling.original_context_length")?;
                    let beta_fast = optf("rope.scaling.yarn_beta_fast", 32.0)?;
                    let beta_slow = optf("rope.scaling.yarn_beta_slow", 1.0)?;
                    if !(factor.is_finite() && factor > 0.0)
                        || original_context == 0
                        || !(beta_fast.is_finite() && beta_fast > 0.0)
                        || !(beta_slow.is_finite() && beta_slow > 0.0)
                    {
                        return bad(
                            "deepseek4.rope.scaling.*: YaRN needs a finite factor > 0, an \
                             original context > 0 and betas > 0"
                                .into(),
                        );
                    }
                    Some(Yarn {
                        factor,
                        original_context,
                        beta_fast,
                        beta_slow,
                    })
                }
                other => {
                    return Err(ModelError::Config(format!(
                        "deepseek4.rope.scaling.type {other:?} is not supported (none, yarn)"
                    )));
                }
            },
        };
        let (n_vocab, tied) = vocab(gguf)?;
        if tied {
            return Err(ModelError::MissingTensor {
                name: "output.weight".into(),
            });
        }
        Ok(Deepseek4Config {
            n_layer,
            n_embd,
            n_vocab,
            n_ctx_train,
            n_head,
            head_dim,
            n_rot,
            q_lora_rank,
            o_groups,
            o_lora_rank,
            rms_eps,
            window,
            layers,
            rope_base,
            compress_rope_base,
            yarn,
            indexer_heads,
            indexer_dim,
            indexer_top_k,
            n_expert,
            n_expert_used,
            n_expert_shared,
            n_ff_exp,
            expert_weights_scale,
            expert_weights_norm,
            hash_layers,
            swiglu_limits,
            hc_streams,
            hc_iters,
            hc_eps,
        })
    }

    /// Width of the mixing output of one HC block: `(2 + N)·N`.
    fn hc_mix(&self) -> usize {
        (2 + self.hc_streams) * self.hc_streams
    }

    /// Bytes of one sequence's state at `tokens` positions (f32 logs; an upper bound that
    /// assumes the state was pruned at most `batch` rows ago).
    pub fn state_bytes(&self, tokens: usize, batch: usize) -> u64 {
        let hd = self.head_dim as u64;
        let di = self.indexer_dim as u64;
        let live = (self.window + batch).min(tokens) as u64;
        let mut floats = 0u64;
        for l in &self.layers {
            floats += live * hd;
            if let Some(m) = l.ratio() {
                let m = m as u64;
                let rows = tokens as u64 / m;
                let open = (2 * m + batch as u64).min(tokens as u64);
                let overlap = if matches!(l, V4Attention::Csa { .. }) {
                    2
                } else {
                    1
                };
                floats += rows * hd + open * 2 * overlap * hd;
                if matches!(l, V4Attention::Csa { .. }) {
                    floats += rows * di + open * 2 * overlap * di;
                }
            }
        }
        floats * 4
    }
}

impl Deepseek4Config {
    /// Bytes of the forward's scratch for a batch of `rows` rows (f32 buffers; the
    /// activations of quantized matmuls add about a fifth of the widest input).
    pub fn scratch_bytes(&self, rows: usize) -> u64 {
        let (d, n) = (self.n_embd as u64, self.hc_streams as u64);
        let qd = (self.n_head * self.head_dim) as u64;
        let hd = self.head_dim as u64;
        let di = self.indexer_dim as u64;
        let ni = self.indexer_heads as u64;
        let fs = (self.n_ff_exp * self.n_expert_shared.max(1)) as u64;
        let per_row = 3 * n * d
            + 3 * d
            + self.q_lora_rank as u64
            + 2 * qd
            + 5 * hd
            + 4 * di
            + ni * di
            + ni
            + 2 * (self.o_groups * self.o_lora_rank) as u64
            + self.n_expert as u64
            + 2 * fs
            + self.n_expert_used as u64 * d
            + 2 * self.n_ff_exp as u64
            + d;
        let floats = rows as u64 * per_row + 2 * self.n_vocab as u64;
        floats * 4 + rows as u64 * (n * d).max(qd) * 6 / 5
    }
}

// ---------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------

/// Inverse frequencies of one RoPE kind (f32, as torch holds them).
#[derive(Clone, Debug)]
struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `base^(−2i/dims)`, with YaRN's ramp between the interpolated (`/factor`) and the
    /// original frequencies when given (transformers `_compute_yarn_parameters`,
    /// truncate = true; the attention factor is 1).
    fn new(base: f64, dims: usize, yarn: Option<Yarn>) -> Rope {
        let half = dims / 2;
        let base_inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f64 / dims as f64))
            .collect();
        let inv: Vec<f64> = match yarn {
            None => base_inv,
            Some(y) => {
                let d = dims as f64;
                let l0 = y.original_context as f64;
                let corr =
                    |r: f64| d * (l0 / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let low = corr(f64::from(y.beta_fast)).floor().max(0.0);
                let mut high = corr(f64::from(y.beta_slow)).ceil().min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                let f = f64::from(y.factor);
                base_inv
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extra = 1.0 - ramp;
                        (b / f) * (1.0 - extra) + b * extra
                    })
                    .collect()
            }
        };
        Rope {
            inv_freq: inv.into_iter().map(|v| v as f32).collect(),
        }
    }

    /// cos (first half) and sin (second half) of position `pos`, `dims` values.
    fn cos_sin(&self, pos: usize, out: &mut [f32]) {
        let half = self.inv_freq.len();
        let (c, s) = out.split_at_mut(half);
        for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(&self.inv_freq) {
            let angle = f64::from(pos as f32 * f);
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }
}

/// Rotates the trailing `cs.len()` channels of every `head_dim` piece of `x` (pairs
/// `(2i, 2i+1)`); `inverse` rotates by the negated angle.
fn rope_tail(x: &mut [f32], head_dim: usize, cs: &[f32], inverse: bool) {
    let dims = cs.len();
    let half = dims / 2;
    let (cos, sin) = cs.split_at(half);
    for head in x.chunks_exact_mut(head_dim) {
        let tail = &mut head[head_dim - dims..];
        for i in 0..half {
            let s = if inverse { -sin[i] } else { sin[i] };
            let (y0, y1) = canon::rotate(tail[2 * i], tail[2 * i + 1], cos[i], s);
            tail[2 * i] = y0;
            tail[2 * i + 1] = y1;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------

/// The mixing weights of one hyper-connection block (or of the final HyperHead).
#[derive(Debug)]
struct Hc {
    /// `*_fn`: `[N·D] → mix`.
    mix: Matrix,
    /// `*_base`.
    base: Vec<f32>,
    /// `*_scale`.
    scale: Vec<f32>,
}

/// A compressor: per-token projections pooled once per `ratio` positions.
#[derive(Debug)]
struct Compressor {
    /// `*_compressor_kv`: `D → cw`.
    wkv: Matrix,
    /// `*_compressor_gate`: `D → cw`.
    wgate: Matrix,
    /// `*_compressor_ape`: `ratio × cw`, row-major.
    ape: Vec<f32>,
    /// `*_compressor_norm`: `width`.
    norm: Vec<f32>,
    ratio: usize,
    /// Output row width.
    width: usize,
    /// Overlapping windows (CSA): `cw = 2·width`, series A feeds the next row.
    overlap: bool,
}

impl Compressor {
    /// Values per projected token (`c` or `z`).
    fn cw(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }
}

/// The lightning indexer of a CSA layer.
#[derive(Debug)]
struct Indexer {
    comp: Compressor,
    /// `indexer.attn_q_b`: `q_lora_rank → n_I·d_I`.
    wq_b: Matrix,
    /// `indexer.proj`: `D → n_I`.
    proj: Matrix,
}

#[derive(Debug)]
struct Attn {
    kind: V4Attention,
    norm: Vec<f32>,
    wq_a: Matrix,
    q_a_norm: Vec<f32>,
    wq_b: Matrix,
    wkv: Matrix,
    kv_norm: Vec<f32>,
    sinks: Vec<f32>,
    /// `attn_output_a` cut into the G groups (`H·hd/G → R` each).
    wo_a: Vec<Matrix>,
    wo_b: Matrix,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
}

#[derive(Debug)]
enum Routing {
    /// `ffn_gate_tid2eid`: `k` experts per token id (row-major `[vocab][k]`).
    Hash(Vec<u32>),
    /// `exp_probs_b.bias`: added to the scores for the selection only.
    Learned(Vec<f32>),
}

#[derive(Debug)]
struct Ffn {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

#[derive(Debug)]
struct Moe {
    norm: Vec<f32>,
    router: Matrix,
    routing: Routing,
    experts: Vec<Ffn>,
    shared: Option<Ffn>,
    limit: f32,
}

#[derive(Debug)]
struct Layer {
    hc_attn: Hc,
    attn: Attn,
    hc_ffn: Hc,
    moe: Moe,
}

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

fn load_hc(
    l: &Loader<'_>,
    prefix: &str,
    nd: usize,
    n_mix: usize,
    n_scale: usize,
) -> Result<Hc, ModelError> {
    Ok(Hc {
        mix: l.matrix(&format!("{prefix}_fn.weight"), nd, n_mix)?,
        base: l.vector(&format!("{prefix}_base.weight"), n_mix)?,
        scale: l.vector(&format!("{prefix}_scale.weight"), n_scale)?,
    })
}

/// A small 2-D tensor (`dims = [k, n]`) decoded to f32, row-major.
fn load_table(l: &Loader<'_>, name: &str, k: usize, n: usize) -> Result<Vec<f32>, ModelError> {
    let parts = l.matrix_parts(name, &[k as u64, n as u64], 1, n)?;
    let mut out = vec![0.0f32; k * n];
    for (row, m) in out.chunks_exact_mut(k).zip(&parts) {
        m.packed.dequantize_row(0, row)?;
    }
    Ok(out)
}

fn load_compressor(
    l: &Loader<'_>,
    prefix: &str,
    d: usize,
    width: usize,
    ratio: usize,
    overlap: bool,
) -> Result<Compressor, ModelError> {
    let cw = if overlap { 2 * width } else { width };
    Ok(Compressor {
        wkv: l.matrix(&format!("{prefix}_kv.weight"), d, cw)?,
        wgate: l.matrix(&format!("{prefix}_gate.weight"), d, cw)?,
        ape: load_table(l, &format!("{prefix}_ape.weight"), cw, ratio)?,
        norm: l.vector(&format!("{prefix}_norm.weight"), width)?,
        ratio,
        width,
        overlap,
    })
}

fn load_ffn(l: &Loader<'_>, p: &str, kind: &str, d: usize, f: usize) -> Result<Ffn, ModelError> {
    Ok(Ffn {
        gate: l.matrix(&format!("{p}ffn_gate_{kind}.weight"), d, f)?,
        up: l.matrix(&format!("{p}ffn_up_{kind}.weight"), d, f)?,
        down: l.matrix(&format!("{p}ffn_down_{kind}.weight"), f, d)?,
    })
}

impl Deepseek4 {
    /// Loads the DeepSeek V4 model in `gguf`: reads the [`Deepseek4Config`], checks every
    /// tensor's shape and type and packs the matmul weights. `opts.kv_type` is ignored (the
    /// state is f32).
    pub fn load(gguf: Arc<GgufFile>, opts: &LoadOptions) -> Result<Deepseek4, ModelError> {
        let cfg = Deepseek4Config::from_gguf(&gguf)?;
        let n_ctx = opts.n_ctx.unwrap_or(cfg.n_ctx_train);
        if n_ctx == 0 || n_ctx > cfg.n_ctx_train {
            return Err(ModelError::Config(format!(
                "context length {n_ctx} must be in 1..={} (the model's trained context)",
                cfg.n_ctx_train
            )));
        }
        let l = Loader::new(&gguf);
        let (d, v, hd, n) = (cfg.n_embd, cfg.n_vocab, cfg.head_dim, cfg.hc_streams);
        let nd = n * d;
        let qd = cfg.n_head * hd;
        let gw = qd / cfg.o_groups;
        let gr = cfg.o_groups * cfg.o_lora_rank;
        let embed = l.view("token_embd.weight", d, v)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, &kind) in cfg.layers.iter().enumerate() {
            let p = format!("blk.{i}.");
            let t = |s: &str| format!("{p}{s}");
            let (comp, indexer) = match kind {
                V4Attention::Sliding => (None, None),
                V4Attention::Hca { ratio } => (
                    Some(load_compressor(
                        &l,
                        &t("attn_compressor"),
                        d,
                        hd,
                        ratio,
                        false,
                    )?),
                    None,
                ),
                V4Attention::Csa { ratio } => {
                    let (ni, di) = (cfg.indexer_heads, cfg.indexer_dim);
                    let indexer = Indexer {
                        comp: load_compressor(&l, &t("indexer_compressor"), d, di, ratio, true)?,
                        wq_b: l.matrix(&t("indexer.attn_q_b.weight"), cfg.q_lora_rank, ni * di)?,
                        proj: l.matrix(&t("indexer.proj.weight"), d, ni)?,
                    };
                    (
                        Some(load_compressor(
                            &l,
                            &t("attn_compressor"),
                            d,
                            hd,
                            ratio,
                            true,
                        )?),
                        Some(indexer),
                    )
                }
            };
            let attn = Attn {
                kind,
                norm: l.vector(&t("attn_norm.weight"), d)?,
                wq_a: l.matrix(&t("attn_q_a.weight"), d, cfg.q_lora_rank)?,
                q_a_norm: l.vector(&t("attn_q_a_norm.weight"), cfg.q_lora_rank)?,
                wq_b: l.matrix(&t("attn_q_b.weight"), cfg.q_lora_rank, qd)?,
                wkv: l.matrix(&t("attn_kv.weight"), d, hd)?,
                kv_norm: l.vector(&t("attn_kv_a_norm.weight"), hd)?,
                sinks: l.vector(&t("attn_sinks.weight"), cfg.n_head)?,
                wo_a: l.matrix_parts(
                    &t("attn_output_a.weight"),
                    &[gw as u64, gr as u64],
                    cfg.o_lora_rank,
                    cfg.o_groups,
                )?,
                wo_b: l.matrix(&t("attn_output_b.weight"), gr, d)?,
                comp,
                indexer,
            };
            let (e, f) = (cfg.n_expert, cfg.n_ff_exp);
            let routing = if i < cfg.hash_layers {
                let k = cfg.n_expert_used;
                let table = l.i32s(&t("ffn_gate_tid2eid.weight"), &[k as u64, v as u64])?;
                let mut ids = Vec::with_capacity(table.len());
                for (j, &x) in table.iter().enumerate() {
                    match u32::try_from(x) {
                        Ok(x) if (x as usize) < e => ids.push(x),
                        _ => {
                            return Err(ModelError::Config(format!(
                                "{}: entry {j} = {x} is not an expert id (0..{e})",
                                t("ffn_gate_tid2eid.weight")
                            )));
                        }
                    }
                }
                Routing::Hash(ids)
            } else {
                Routing::Learned(l.vector(&t("exp_probs_b.bias"), e)?)
            };
            let gate = l.matrix_parts(
                &t("ffn_gate_exps.weight"),
                &[d as u64, f as u64, e as u64],
                f,
                e,
            )?;
            let up = l.matrix_parts(
                &t("ffn_up_exps.weight"),
                &[d as u64, f as u64, e as u64],
                f,
                e,
            )?;
            let down = l.matrix_parts(
                &t("ffn_down_exps.weight"),
                &[f as u64, d as u64, e as u64],
                d,
                e,
            )?;
            let experts = gate
                .into_iter()
                .zip(up)
                .zip(down)
                .map(|((gate, up), down)| Ffn { gate, up, down })
                .collect();
            let shared = if cfg.n_expert_shared > 0 {
                Some(load_ffn(&l, &p, "shexp", d, f * cfg.n_expert_shared)?)
            } else {
                None
            };
            let moe = Moe {
                norm: l.vector(&t("ffn_norm.weight"), d)?,
                router: l.matrix(&t("ffn_gate_inp.weight"), d, e)?,
                routing,
                experts,
                shared,
                limit: cfg.swiglu_limits[i],
            };
            layers.push(Layer {
                hc_attn: load_hc(&l, &t("hc_attn"), nd, cfg.hc_mix(), 3)?,
                attn,
                hc_ffn: load_hc(&l, &t("hc_ffn"), nd, cfg.hc_mix(), 3)?,
                moe,
            });
        }
        let head_hc = load_hc(&l, "output_hc", nd, n, 1)?;
        let output_norm = l.vector("output_norm.weight", d)?;
        let output = l.matrix("output.weight", d, v)?;
        let rope_main = Rope::new(f64::from(cfg.rope_base), cfg.n_rot, None);
        let rope_comp = Rope::new(f64::from(cfg.compress_rope_base), cfg.n_rot, cfg.yarn);
        let ones = vec![1.0f32; nd.max(hd).max(cfg.indexer_dim)];
        Ok(Deepseek4 {
            gguf,
            cfg,
            embed,
            layers,
            head_hc,
            output_norm,
            output,
            pool: ThreadPool::for_machine(opts.threads),
            rope_main,
            rope_comp,
            n_ctx,
            ones,
        })
    }

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
// Per-sequence state
// ---------------------------------------------------------------------------------------

/// Rows of `width` values for positions (or row indices) `base..len`.
#[derive(Clone, Debug)]
struct Log {
    width: usize,
    base: usize,
    data: Vec<f32>,
}

impl Log {
    fn new(width: usize) -> Log {
        Log {
            width,
            base: 0,
            data: Vec::new(),
        }
    }

    fn push(&mut self, row: &[f32]) {
        self.data.extend_from_slice(&row[..self.width]);
    }

    /// Row `i` (`base ≤ i < len`; empty otherwise, which the forward never asks for).
    fn row(&self, i: usize) -> &[f32] {
        let w = self.width;
        match i.checked_sub(self.base) {
            Some(r) => self.data.get(r * w..(r + 1) * w).unwrap_or(&[]),
            None => &[],
        }
    }

    fn truncate(&mut self, len: usize) {
        let keep = len.saturating_sub(self.base);
        self.data.truncate(keep * self.width);
    }

    /// Drops the rows before `i`.
    fn forget_before(&mut self, i: usize) {
        let drop = i
            .saturating_sub(self.base)
            .min(self.data.len() / self.width.max(1));
        if drop > 0 {
            self.data.drain(..drop * self.width);
            self.base += drop;
        }
    }

    fn bytes(&self) -> usize {
        self.data.capacity() * 4
    }
}

/// A compressor's state: projected tokens `[c | z + ape]` by position, emitted rows.
#[derive(Clone, Debug)]
struct CompState {
    ratio: usize,
    tokens: Log,
    rows: Log,
}

#[derive(Clone, Debug)]
struct LayerState {
    /// Raw KV rows (normed, rotated) by position.
    kv: Log,
    comp: Option<CompState>,
    index: Option<CompState>,
}

/// One sequence's state for [`Deepseek4::forward`]: per layer the raw KV rows of the window,
/// the compressors' pending tokens and emitted rows, and the indexer's keys (see the module
/// docs). Truncating it to a length restores exactly the state of that length.
#[derive(Clone, Debug)]
pub struct Deepseek4State {
    layers: Vec<LayerState>,
    len: usize,
    floor: usize,
    window: usize,
    /// Captured target rows (DSpark), when the state was made capturing.
    capture: Option<Capture>,
}

/// The rows a DSpark drafter reads: per position, the input of each captured layer averaged
/// over the HC streams, concatenated in layer order (`layers.len() × D` values).
#[derive(Clone, Debug)]
struct Capture {
    /// Captured layers, ascending.
    layers: Vec<usize>,
    log: Log,
}

impl Deepseek4State {
    fn new(cfg: &Deepseek4Config) -> Deepseek4State {
        let comp = |ratio: usize, width: usize, overlap: bool| {
            let cw = if overlap { 2 * width } else { width };
            CompState {
                ratio,
                tokens: Log::new(2 * cw),
                rows: Log::new(width),
            }
        };
        let layers = cfg
            .layers
            .iter()
            .map(|&kind| LayerState {
                kv: Log::new(cfg.head_dim),
                comp: match kind {
                    V4Attention::Sliding => None,
                    V4Attention::Csa { ratio } => Some(comp(ratio, cfg.head_dim, true)),
                    V4Attention::Hca { ratio } => Some(comp(ratio, cfg.head_dim, false)),
                },
                index: match kind {
                    V4Attention::Csa { ratio } => Some(comp(ratio, cfg.indexer_dim, true)),
                    _ => None,
                },
            })
            .collect();
        Deepseek4State {
            layers,
            len: 0,
            floor: 0,
            window: cfg.window,
            capture: None,
        }
    }

    /// Width of a captured row (0 when the state does not capture).
    pub fn capture_width(&self) -> usize {
        self.capture.as_ref().map_or(0, |c| c.log.width)
    }

    /// The layers whose input rows this state captures (empty when it does not).
    pub fn capture_layers(&self) -> &[usize] {
        self.capture.as_ref().map_or(&[], |c| &c.layers)
    }

    /// The captured rows of positions `from..to`, contiguous (`(to − from) ×`
    /// [`Deepseek4State::capture_width`] values); `None` when the state does not capture or
    /// a row is not held (beyond the computed length, or released: rows before the sliding
    /// window of the last forward's first position are dropped as the raw KV rows are).
    pub fn captured(&self, from: usize, to: usize) -> Option<&[f32]> {
        let c = self.capture.as_ref()?;
        let w = c.log.width;
        if from > to || to > self.len || from < c.log.base {
            return None;
        }
        let (a, b) = ((from - c.log.base) * w, (to - c.log.base) * w);
        c.log.data.get(a..b)
    }

    /// Positions computed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is computed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The lowest length the state can be truncated to (the first position of the last
    /// forward): everything before it that no later query reads was released.
    pub fn floor(&self) -> usize {
        self.floor
    }

    /// Cuts the state back to `len` positions — exactly the state it had at that length
    /// (speculative rollback). `len` above the current length changes nothing; below
    /// [`Deepseek4State::floor`] is an error and changes nothing.
    pub fn truncate(&mut self, len: usize) -> Result<(), ModelError> {
        if len < self.floor {
            return Err(ModelError::Batch(format!(
                "cannot truncate to {len} positions: the state before position {} was released",
                self.floor
            )));
        }
        if len < self.len {
            self.cut(len);
        }
        Ok(())
    }

    /// Cuts every log to `len` positions (also logs a failed forward left longer than
    /// `self.len`).
    fn cut(&mut self, len: usize) {
        if let Some(c) = &mut self.capture {
            c.log.truncate(len);
        }
        for l in &mut self.layers {
            l.kv.truncate(len);
            for c in l.comp.iter_mut().chain(l.index.iter_mut()) {
                c.tokens.truncate(len);
                c.rows.truncate(len / c.ratio);
            }
        }
        self.len = self.len.min(len);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.capture.as_ref().map_or(0, |c| c.log.bytes())
            + self
                .layers
                .iter()
                .map(|l| {
                    l.kv.bytes()
                        + l.comp
                            .iter()
                            .chain(l.index.iter())
                            .map(|c| c.tokens.bytes() + c.rows.bytes())
                            .sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Starts a forward at `first` (validated: `floor ≤ first ≤ len`): cut back, raise the
    /// floor, release what no query at `first` or later reads.
    fn begin(&mut self, first: usize) {
        let _ = self.truncate(first);
        self.floor = first;
        if let Some(c) = &mut self.capture {
            // A drafter reads the rows of the window before its anchor (at `first` or later).
            c.log.forget_before((first + 1).saturating_sub(self.window));
        }
        for l in &mut self.layers {
            l.kv.forget_before((first + 1).saturating_sub(self.window));
            for c in l.comp.iter_mut().chain(l.index.iter_mut()) {
                // Re-emitting row `first/m` needs window `first/m − 1` (CSA's A half).
                c.tokens
                    .forget_before((first / c.ratio).saturating_sub(1) * c.ratio);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scratch
// ---------------------------------------------------------------------------------------

/// Buffers reused across [`Deepseek4::forward`] calls (grown on demand, never shrunk).
#[derive(Debug, Default)]
pub struct Deepseek4Scratch {
    /// Streams `m × N × D`, and the next streams.
    h: Vec<f32>,
    h2: Vec<f32>,
    /// Normed flattened streams `m × N·D`.
    flat: Vec<f32>,
    /// HC mix `m × (2+N)·N`.
    mix: Vec<f32>,
    /// Per row: pre (N), post (N), C (N²).
    hcw: Vec<f32>,
    /// Collapsed stream, normed input, block output: `m × D`.
    x: Vec<f32>,
    xn: Vec<f32>,
    a: Vec<f32>,
    qr: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    cc: Vec<f32>,
    cz: Vec<f32>,
    ic: Vec<f32>,
    iz: Vec<f32>,
    qi: Vec<f32>,
    wts: Vec<f32>,
    att: Vec<f32>,
    grp: Vec<f32>,
    zg: Vec<f32>,
    zo: Vec<f32>,
    rl: Vec<f32>,
    sg: Vec<f32>,
    su: Vec<f32>,
    ys: Vec<f32>,
    xe: Vec<f32>,
    ge: Vec<f32>,
    ue: Vec<f32>,
    ye: Vec<f32>,
    head: Vec<f32>,
    cs_main: Vec<f32>,
    cs_comp: Vec<f32>,
    /// Captured rows (DSpark) of this forward, `m × width`.
    cap: Vec<f32>,
    /// Per row of a CSA layer: the compressed rows kept by the indexer.
    sel: Vec<Vec<u32>>,
    /// Per row: (expert, gate) of its `k` routed experts.
    route: Vec<(u32, f32)>,
    tmp: Vec<f32>,
    acts: ActsCache,
    trace: Option<Deepseek4Trace>,
}

/// The top-k decisions of the forwards run with tracing on
/// ([`Deepseek4Scratch::set_trace`]), for comparison with a reference.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Deepseek4Trace {
    /// `(layer, sequence, position, kept rows ascending)` for every CSA query that sees
    /// more compressed rows than the indexer keeps.
    pub indexer: Vec<(usize, usize, usize, Vec<u32>)>,
    /// `(layer, sequence, position, experts ascending)` for every row of every
    /// learned-routing layer.
    pub router: Vec<(usize, usize, usize, Vec<u32>)>,
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

impl Deepseek4Scratch {
    /// Starts (or stops) recording the top-k decisions of later forwards.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on.then(Deepseek4Trace::default);
    }

    /// The decisions recorded since tracing started or was last taken (empty when off).
    pub fn take_trace(&mut self) -> Deepseek4Trace {
        match &mut self.trace {
            Some(t) => std::mem::take(t),
            None => Deepseek4Trace::default(),
        }
    }

    fn prepare(&mut self, c: &Deepseek4Config, m: usize) {
        let (d, n) = (c.n_embd, c.hc_streams);
        let qd = c.n_head * c.head_dim;
        let hd = c.head_dim;
        let di2 = 2 * c.indexer_dim;
        for (v, len) in [
            (&mut self.h, m * n * d),
            (&mut self.h2, m * n * d),
            (&mut self.flat, m * n * d),
            (&mut self.mix, m * c.hc_mix()),
            (&mut self.hcw, m * (2 * n + n * n)),
            (&mut self.x, m * d),
            (&mut self.xn, m * d),
            (&mut self.a, m * d),
            (&mut self.qr, m * c.q_lora_rank),
            (&mut self.q, m * qd),
            (&mut self.kv, m * hd),
            (&mut self.cc, m * 2 * hd),
            (&mut self.cz, m * 2 * hd),
            (&mut self.ic, m * di2),
            (&mut self.iz, m * di2),
            (&mut self.qi, m * c.indexer_heads * c.indexer_dim),
            (&mut self.wts, m * c.indexer_heads),
            (&mut self.att, m * qd),
            (&mut self.grp, m * qd / c.o_groups),
            (&mut self.zg, m * c.o_lora_rank),
            (&mut self.zo, m * c.o_groups * c.o_lora_rank),
            (&mut self.rl, m * c.n_expert),
            (&mut self.sg, m * c.n_ff_exp * c.n_expert_shared.max(1)),
            (&mut self.su, m * c.n_ff_exp * c.n_expert_shared.max(1)),
            (&mut self.ys, m * c.n_expert_used * d),
            (&mut self.cs_main, m * c.n_rot),
            (&mut self.cs_comp, m * c.n_rot),
        ] {
            grow(v, len);
        }
        if self.sel.len() < m {
            self.sel.resize(m, Vec::new());
        }
        self.route.clear();
        self.route.resize(m * c.n_expert_used, (0, 0.0));
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.h, &self.h2, &self.flat, &self.mix, &self.hcw, &self.x, &self.xn, &self.a,
            &self.qr, &self.q, &self.kv, &self.cc, &self.cz, &self.ic, &self.iz, &self.qi,
            &self.wts, &self.att, &self.grp, &self.zg, &self.zo, &self.rl, &self.sg, &self.su,
            &self.ys, &self.xe, &self.ge, &self.ue, &self.ye, &self.head, &self.tmp, &self.cap,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>();
        f * 4 + self.acts.bytes()
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

/// Pre (N), post (N) and the Sinkhorn-normalised C (N×N) of one row from its mix.
fn hc_weights(cfg: &Deepseek4Config, hc: &Hc, mix: &[f32], out: &mut [f32]) {
    let n = cfg.hc_streams;
    let eps = cfg.hc_eps;
    let (pre, rest) = out.split_at_mut(n);
    let (post, c) = rest.split_at_mut(n);
    for j in 0..n {
        pre[j] = sigmoid(mix[j] * hc.scale[0] + hc.base[j]) + eps;
        post[j] = 2.0 * sigmoid(mix[n + j] * hc.scale[1] + hc.base[n + j]);
    }
    for j in 0..n {
        let row = &mut c[j * n..(j + 1) * n];
        for (k, v) in row.iter_mut().enumerate() {
            let i = 2 * n + j * n + k;
            *v = mix[i] * hc.scale[2] + hc.base[i];
        }
        let mx = row
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let mut s = 0.0f32;
        for v in row.iter_mut() {
            *v = canon::exp(*v - mx);
            s += *v;
        }
        let inv = 1.0 / s;
        for v in row.iter_mut() {
            *v = *v * inv + eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let mut s = 0.0f32;
            for j in 0..n {
                s += c[j * n + k];
            }
            let den = s + eps;
            for j in 0..n {
                c[j * n + k] /= den;
            }
        }
    };
    cols(c);
    for _ in 1..cfg.hc_iters {
        for j in 0..n {
            let row = &mut c[j * n..(j + 1) * n];
            let mut s = 0.0f32;
            for &v in row.iter() {
                s += v;
            }
            let den = s + eps;
            for v in row.iter_mut() {
                *v /= den;
            }
        }
        cols(c);
    }
}

/// The HC collapse of one row (ARCHITECTURE.md: `collapsed = fma(pre_j, h_j, ·)` over j in
/// order): `out[i] = Σ_j pre[j]·h[j·d + i]` for the `pre.len()` streams of `h` (`d` each).
fn hc_collapse(pre: &[f32], h: &[f32], d: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (j, &p) in pre.iter().enumerate() {
            acc = p.mul_add(h[j * d + i], acc);
        }
        *o = acc;
    }
}

/// The HyperHead of `m` rows: from each row's mix (`N` values) the weights
/// `pre_j = sigmoid(mix_j·scale_0 + base_j) + eps`, then the HC collapse of the row's
/// streams in `h` into `out` (`D` values a row).
fn hyper_head(
    cx: &Cx<'_>,
    hc: &Hc,
    h: &[f32],
    mix: &[f32],
    out: &mut [f32],
    m: usize,
) -> Result<(), ModelError> {
    let (n, d, eps) = (cx.cfg.hc_streams, cx.cfg.n_embd, cx.cfg.hc_eps);
    let nd = n * d;
    for_rows(cx.pool, &mut out[..m * d], d, |i, o| {
        let mx = &mix[i * n..(i + 1) * n];
        let pre: Vec<f32> = (0..n)
            .map(|j| sigmoid(mx[j] * hc.scale[0] + hc.base[j]) + eps)
            .collect();
        hc_collapse(&pre, &h[i * nd..(i + 1) * nd], d, o);
        Ok::<(), ModelError>(())
    })
}

/// Attention of one query head `q` with a sink (ARCHITECTURE.md, attention per (row,
/// head)): scores `dot(q, key(j))·scale` for `j` in `0..total` in order;
/// `mx = max(sink, scores)`; `l = Σ exp(s_j − mx)` in that order, then `+ exp(sink − mx)`;
/// `o = fma(e_j, key(j), o)` in that order (the key is the value); `o ·= 1/l`.
fn sink_attention<'k>(
    ops: RowOps,
    q: &[f32],
    scale: f32,
    sink: f32,
    total: usize,
    key: impl Fn(usize) -> &'k [f32],
    out: &mut [f32],
) {
    let mut sc = Vec::with_capacity(total);
    let mut mx = sink;
    for j in 0..total {
        let v = ops.dot(q, key(j)).unwrap_or(f32::NAN) * scale;
        if v > mx {
            mx = v;
        }
        sc.push(v);
    }
    let mut l = 0.0f32;
    out.fill(0.0);
    for (j, &v) in sc.iter().enumerate() {
        let e = canon::exp(v - mx);
        l += e;
        for (o, &x) in out.iter_mut().zip(key(j)) {
            *o = e.mul_add(x, *o);
        }
    }
    l += canon::exp(sink - mx);
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

impl Deepseek4 {
    /// HC before a block: the weights of every row into `s.hcw` and the collapsed stream
    /// into `s.x`.
    fn hc_pre(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        hc: &Hc,
        m: usize,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (n, d) = (cfg.hc_streams, cfg.n_embd);
        let nd = n * d;
        let ones = &self.ones[..nd];
        rms_rows(cx, &s.h, ones, &mut s.flat, m)?;
        let nm = cfg.hc_mix();
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.flat,
            m,
            &mut [(&hc.mix, &mut s.mix[..])],
        )?;
        let hw = 2 * n + n * n;
        let mix = &s.mix;
        for_rows(cx.pool, &mut s.hcw[..m * hw], hw, |r, out| {
            hc_weights(cfg, hc, &mix[r * nm..(r + 1) * nm], out);
            Ok::<(), ModelError>(())
        })?;
        let (h, hcw) = (&s.h, &s.hcw);
        for_rows(cx.pool, &mut s.x[..m * d], d, |r, out| {
            hc_collapse(&hcw[r * hw..r * hw + n], &h[r * nd..(r + 1) * nd], d, out);
            Ok::<(), ModelError>(())
        })
    }

    /// HC after a block: `h[k] = post[k]·a + Σ_j C[j,k]·h[j]` with the block output in `s.a`.
    fn hc_post(&self, cx: &Cx<'_>, s: &mut Deepseek4Scratch, m: usize) -> Result<(), ModelError> {
        let (n, d) = (cx.cfg.hc_streams, cx.cfg.n_embd);
        let nd = n * d;
        let hw = 2 * n + n * n;
        let (h, hcw, a) = (&s.h, &s.hcw, &s.a);
        for_rows(cx.pool, &mut s.h2[..m * nd], nd, |r, out| {
            let post = &hcw[r * hw + n..r * hw + 2 * n];
            let c = &hcw[r * hw + 2 * n..(r + 1) * hw];
            let hr = &h[r * nd..(r + 1) * nd];
            let ar = &a[r * d..(r + 1) * d];
            for k in 0..n {
                for i in 0..d {
                    let mut acc = post[k] * ar[i];
                    for j in 0..n {
                        acc = c[j * n + k].mul_add(hr[j * d + i], acc);
                    }
                    out[k * d + i] = acc;
                }
            }
            Ok::<(), ModelError>(())
        })?;
        std::mem::swap(&mut s.h, &mut s.h2);
        Ok(())
    }

    fn attention(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        states: &mut [&mut Deepseek4State],
        rows: &[BatchRow],
        li: usize,
        layer: &Layer,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let m = rows.len();
        let a = &layer.attn;
        let (hd, rd) = (cfg.head_dim, cfg.n_rot);
        let qd = cfg.n_head * hd;
        self.hc_pre(cx, s, &layer.hc_attn, m)?;
        rms_rows(cx, &s.x, &a.norm, &mut s.xn, m)?;
        {
            let mut jobs: Vec<(&Matrix, &mut [f32])> =
                vec![(&a.wq_a, &mut s.qr[..]), (&a.wkv, &mut s.kv[..])];
            if let Some(c) = &a.comp {
                jobs.push((&c.wkv, &mut s.cc[..]));
                jobs.push((&c.wgate, &mut s.cz[..]));
            }
            if let Some(ix) = &a.indexer {
                jobs.push((&ix.comp.wkv, &mut s.ic[..]));
                jobs.push((&ix.comp.wgate, &mut s.iz[..]));
                jobs.push((&ix.proj, &mut s.wts[..]));
            }
            matmul(cx, &mut s.acts, &mut s.tmp, &s.xn, m, &mut jobs)?;
        }
        rms_pieces(cx, &mut s.qr, cfg.q_lora_rank, &a.q_a_norm, m)?;
        {
            let mut jobs: Vec<(&Matrix, &mut [f32])> = vec![(&a.wq_b, &mut s.q[..])];
            if let Some(ix) = &a.indexer {
                jobs.push((&ix.wq_b, &mut s.qi[..]));
            }
            matmul(cx, &mut s.acts, &mut s.tmp, &s.qr, m, &mut jobs)?;
        }
        let cs = if a.kind == V4Attention::Sliding {
            &s.cs_main
        } else {
            &s.cs_comp
        };
        // Queries: unweighted RMSNorm per head, then RoPE; the KV row: weighted RMSNorm, RoPE.
        let (ops, eps) = (cx.ops, cfg.rms_eps);
        let ones_hd = &self.ones[..hd];
        // (`rms_norm_in_place` with a head-sized weight normalises each head separately.)
        for_rows(cx.pool, &mut s.q[..m * qd], qd, |_, row| {
            ops.rms_norm_in_place(row, ones_hd, eps, NormWeight::Plain)
        })?;
        for_rows(cx.pool, &mut s.q[..m * qd], qd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        rms_pieces(cx, &mut s.kv, hd, &a.kv_norm, m)?;
        for_rows(cx.pool, &mut s.kv[..m * hd], hd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        if a.indexer.is_some() {
            let (ni, di) = (cfg.indexer_heads, cfg.indexer_dim);
            for_rows(cx.pool, &mut s.qi[..m * ni * di], ni * di, |r, row| {
                rope_tail(row, di, &cs[r * rd..(r + 1) * rd], false);
                Ok::<(), ModelError>(())
            })?;
            let sc = (ni as f32).powf(-0.5);
            for v in &mut s.wts[..m * ni] {
                *v *= sc;
            }
        }
        // Append every row to its sequence's state (rows of a sequence are in position
        // order), emitting compressed rows as windows complete.
        let mut row_buf = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let ls = &mut states[row.seq].layers[li];
            ls.kv.push(&s.kv[r * hd..(r + 1) * hd]);
            if let (Some(w), Some(st)) = (&a.comp, ls.comp.as_mut()) {
                push_token(
                    cx,
                    w,
                    st,
                    &self.rope_comp,
                    row.pos,
                    &s.cc,
                    &s.cz,
                    r,
                    &mut row_buf,
                )?;
            }
            if let (Some(ix), Some(st)) = (&a.indexer, ls.index.as_mut()) {
                push_token(
                    cx,
                    &ix.comp,
                    st,
                    &self.rope_comp,
                    row.pos,
                    &s.ic,
                    &s.iz,
                    r,
                    &mut row_buf,
                )?;
            }
        }
        let states: &[&mut Deepseek4State] = states;
        // The indexer's choice per row (CSA).
        if let V4Attention::Csa { ratio } = a.kind {
            let (ni, di, k) = (cfg.indexer_heads, cfg.indexer_dim, cfg.indexer_top_k);
            let (qi, wts) = (&s.qi, &s.wts);
            let scale = (di as f32).powf(-0.5);
            let ops = cx.ops;
            let sel = &mut s.sel[..m];
            cx.pool.for_chunks_mut(sel, 1, |r, out| {
                let row = &rows[r];
                let keys = match &states[row.seq].layers[li].index {
                    Some(c) => &c.rows,
                    None => return,
                };
                let vis = (row.pos + 1) / ratio;
                let chosen = &mut out[0];
                chosen.clear();
                if vis <= k {
                    chosen.extend(0..vis as u32);
                    return;
                }
                let q = &qi[r * ni * di..(r + 1) * ni * di];
                let w = &wts[r * ni..(r + 1) * ni];
                let mut scored: Vec<(f32, u32)> = (0..vis)
                    .map(|t| {
                        let key = keys.row(t);
                        let mut acc = 0.0f32;
                        for h in 0..ni {
                            let dot = ops.dot(&q[h * di..(h + 1) * di], key).unwrap_or(f32::NAN);
                            acc = w[h].mul_add(dot.max(0.0) * scale, acc);
                        }
                        (acc, t as u32)
                    })
                    .collect();
                scored.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                chosen.extend(scored[..k].iter().map(|&(_, t)| t));
                chosen.sort_unstable();
            });
            if let Some(tr) = &mut s.trace {
                for (r, row) in rows.iter().enumerate() {
                    if (row.pos + 1) / ratio > k {
                        tr.indexer.push((li, row.seq, row.pos, s.sel[r].clone()));
                    }
                }
            }
        }
        // Attention per (row, head).
        {
            let (q, sel) = (&s.q, &s.sel);
            let nh = cfg.n_head;
            let scale = (hd as f32).powf(-0.5);
            let window = cfg.window;
            let ops = cx.ops;
            let kind = a.kind;
            let sinks = &a.sinks;
            cx.pool.for_chunks_mut(&mut s.att[..m * qd], hd, |rh, out| {
                let (r, h) = (rh / nh, rh % nh);
                let row = &rows[r];
                let ls = &states[row.seq].layers[li];
                let t = row.pos;
                let qh = &q[r * qd + h * hd..r * qd + (h + 1) * hd];
                let lo = (t + 1).saturating_sub(window);
                let comp_rows: &[u32] = match kind {
                    V4Attention::Csa { .. } => &sel[r],
                    _ => &[],
                };
                let n_hca = match kind {
                    V4Attention::Hca { ratio } => (t + 1) / ratio,
                    _ => 0,
                };
                let comp = ls.comp.as_ref().map(|c| &c.rows);
                let key = |j: usize| -> &[f32] {
                    let nw = t + 1 - lo;
                    if j < nw {
                        ls.kv.row(lo + j)
                    } else {
                        let c = j - nw;
                        let idx = if comp_rows.is_empty() {
                            c
                        } else {
                            comp_rows[c] as usize
                        };
                        comp.map_or(&[][..], |l| l.row(idx))
                    }
                };
                let total = (t + 1 - lo) + comp_rows.len() + n_hca;
                sink_attention(ops, qh, scale, sinks[h], total, key, out);
            });
        }
        self.attn_project(cx, s, a, m)
    }

    /// The attention block's tail: the output in `s.att` rotated back by each query's
    /// position, the grouped low-rank projection into `s.a`, then the HC update.
    fn attn_project(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        a: &Attn,
        m: usize,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (hd, rd) = (cfg.head_dim, cfg.n_rot);
        let qd = cfg.n_head * hd;
        let cs = if a.kind == V4Attention::Sliding {
            &s.cs_main
        } else {
            &s.cs_comp
        };
        // Rotate the output back by the query's position, then the grouped projection.
        for_rows(cx.pool, &mut s.att[..m * qd], qd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], true);
            Ok::<(), ModelError>(())
        })?;
        let (g, rk) = (cfg.o_groups, cfg.o_lora_rank);
        let gw = qd / g;
        for (gi, wa) in a.wo_a.iter().enumerate() {
            for r in 0..m {
                s.grp[r * gw..(r + 1) * gw]
                    .copy_from_slice(&s.att[r * qd + gi * gw..r * qd + (gi + 1) * gw]);
            }
            matmul(
                cx,
                &mut s.acts,
                &mut s.tmp,
                &s.grp,
                m,
                &mut [(wa, &mut s.zg[..])],
            )?;
            for r in 0..m {
                s.zo[r * g * rk + gi * rk..r * g * rk + (gi + 1) * rk]
                    .copy_from_slice(&s.zg[r * rk..(r + 1) * rk]);
            }
        }
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.zo,
            m,
            &mut [(&a.wo_b, &mut s.a[..])],
        )?;
        self.hc_post(cx, s, m)
    }

    fn moe(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        rows: &[BatchRow],
        li: usize,
        layer: &Layer,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let m = rows.len();
        let moe = &layer.moe;
        let (d, e, k) = (cfg.n_embd, cfg.n_expert, cfg.n_expert_used);
        self.hc_pre(cx, s, &layer.hc_ffn, m)?;
        rms_rows(cx, &s.x, &moe.norm, &mut s.xn, m)?;
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.xn,
            m,
            &mut [(&moe.router, &mut s.rl[..])],
        )?;
        // Routing: sqrt(softplus) scores, the row's k experts and their gates.
        for (r, row) in rows.iter().enumerate() {
            let l = &s.rl[r * e..(r + 1) * e];
            let sc: Vec<f32> = l
                .iter()
                .map(|&x| {
                    let sp = if x > 20.0 { x } else { canon::exp(x).ln_1p() };
                    sp.sqrt()
                })
                .collect();
            let route = &mut s.route[r * k..(r + 1) * k];
            match &moe.routing {
                Routing::Hash(table) => {
                    let t = row.token as usize;
                    for (slot, &x) in route.iter_mut().zip(&table[t * k..(t + 1) * k]) {
                        slot.0 = x;
                    }
                }
                Routing::Learned(bias) => {
                    let mut order: Vec<(f32, u32)> = sc
                        .iter()
                        .zip(bias)
                        .enumerate()
                        .map(|(i, (&v, &b))| (v + b, i as u32))
                        .collect();
                    order.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                    for (slot, &(_, i)) in route.iter_mut().zip(&order) {
                        slot.0 = i;
                    }
                    if let Some(tr) = &mut s.trace {
                        let mut chosen: Vec<u32> = route.iter().map(|x| x.0).collect();
                        chosen.sort_unstable();
                        tr.router.push((li, row.seq, row.pos, chosen));
                    }
                }
            }
            for slot in route.iter_mut() {
                slot.1 = sc[slot.0 as usize];
            }
            if cfg.expert_weights_norm {
                let mut sum = 0.0f32;
                for slot in route.iter() {
                    sum += slot.1;
                }
                let den = sum + 1e-20;
                for slot in route.iter_mut() {
                    slot.1 /= den;
                }
            }
            for slot in route.iter_mut() {
                slot.1 *= cfg.expert_weights_scale;
            }
        }
        // The shared expert over every row (its output goes to `s.a`).
        let limit = moe.limit;
        match &moe.shared {
            Some(f) => {
                run_ffn(
                    cx,
                    &mut s.acts,
                    &mut s.tmp,
                    f,
                    &s.xn,
                    m,
                    limit,
                    &mut s.sg,
                    &mut s.su,
                    &mut s.a,
                )?;
            }
            None => s.a[..m * d].fill(0.0),
        }
        // Routed experts: the rows of each expert together.
        let ff = cfg.n_ff_exp;
        for (ei, f) in moe.experts.iter().enumerate() {
            let picks: Vec<(usize, usize)> = (0..m)
                .flat_map(|r| (0..k).map(move |j| (r, j)))
                .filter(|&(r, j)| s.route[r * k + j].0 as usize == ei)
                .collect();
            if picks.is_empty() {
                continue;
            }
            let ne = picks.len();
            grow(&mut s.xe, ne * d);
            grow(&mut s.ge, ne * ff);
            grow(&mut s.ue, ne * ff);
            grow(&mut s.ye, ne * d);
            for (i, &(r, _)) in picks.iter().enumerate() {
                s.xe[i * d..(i + 1) * d].copy_from_slice(&s.xn[r * d..(r + 1) * d]);
            }
            run_ffn(
                cx,
                &mut s.acts,
                &mut s.tmp,
                f,
                &s.xe,
                ne,
                limit,
                &mut s.ge,
                &mut s.ue,
                &mut s.ye,
            )?;
            for (i, &(r, j)) in picks.iter().enumerate() {
                s.ys[(r * k + j) * d..(r * k + j + 1) * d]
                    .copy_from_slice(&s.ye[i * d..(i + 1) * d]);
            }
        }
        let (ys, route) = (&s.ys, &s.route);
        for_rows(cx.pool, &mut s.a[..m * d], d, |r, out| {
            for (i, o) in out.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for j in 0..k {
                    acc = route[r * k + j].1.mul_add(ys[(r * k + j) * d + i], acc);
                }
                *o += acc;
            }
            Ok::<(), ModelError>(())
        })?;
        // `*o += acc` above is `shared + routed`: the routed sum first, then one add.
        self.hc_post(cx, s, m)
    }

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

/// Stores, for every row whose sequence captures layer `li`, the layer's input averaged over
/// the HC streams (`Σ_j h_j` in stream order, then `/ N`) into its piece of `s.cap` (row
/// stride `cap_w`, pieces in ascending layer order).
fn capture_rows(
    cfg: &Deepseek4Config,
    s: &mut Deepseek4Scratch,
    states: &[&mut Deepseek4State],
    rows: &[BatchRow],
    li: usize,
    cap_w: usize,
) {
    let (n, d) = (cfg.hc_streams, cfg.n_embd);
    let nd = n * d;
    let n_f = n as f32;
    for (r, row) in rows.iter().enumerate() {
        let Some(c) = states.get(row.seq).and_then(|st| st.capture.as_ref()) else {
            continue;
        };
        let Some(t) = c.layers.iter().position(|&l| l == li) else {
            continue;
        };
        let h = &s.h[r * nd..(r + 1) * nd];
        let out = &mut s.cap[r * cap_w + t * d..r * cap_w + (t + 1) * d];
        for (i, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for j in 0..n {
                acc += h[j * d + i];
            }
            *o = acc / n_f;
        }
    }
}

/// One gated expert over `m` rows of `x`: `down(silu(min(gate, L)) · clamp(up, −L, L))`.
#[allow(clippy::too_many_arguments)]
fn run_ffn(
    cx: &Cx<'_>,
    acts: &mut ActsCache,
    tmp: &mut Vec<f32>,
    f: &Ffn,
    x: &[f32],
    m: usize,
    limit: f32,
    g: &mut Vec<f32>,
    u: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let fw = f.gate.n;
    grow(g, m * fw);
    grow(u, m * fw);
    matmul(
        cx,
        acts,
        tmp,
        x,
        m,
        &mut [(&f.gate, &mut g[..]), (&f.up, &mut u[..])],
    )?;
    if limit.is_finite() {
        for v in &mut g[..m * fw] {
            *v = v.min(limit);
        }
        for v in &mut u[..m * fw] {
            *v = v.clamp(-limit, limit);
        }
    }
    let ops = cx.ops;
    let up: &[f32] = u;
    for_rows(cx.pool, &mut g[..m * fw], fw, |i, gr| {
        ops.swiglu_in_place(gr, &up[i * fw..(i + 1) * fw])
    })?;
    matmul(cx, acts, tmp, g, m, &mut [(&f.down, out)])
}

/// Appends row `r`'s projected token (`c`, and `z` plus the window offset's `ape`) to a
/// compressor's state and emits the window's row when the token completes it.
#[allow(clippy::too_many_arguments)]
fn push_token(
    cx: &Cx<'_>,
    w: &Compressor,
    st: &mut CompState,
    rope: &Rope,
    pos: usize,
    c: &[f32],
    z: &[f32],
    r: usize,
    buf: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let cw = w.cw();
    let m = w.ratio;
    let off = pos % m;
    buf.clear();
    buf.extend_from_slice(&c[r * cw..(r + 1) * cw]);
    buf.extend(
        z[r * cw..(r + 1) * cw]
            .iter()
            .zip(&w.ape[off * cw..(off + 1) * cw])
            .map(|(&zv, &a)| zv + a),
    );
    st.tokens.push(buf);
    if off + 1 == m {
        let win = pos / m;
        let mut out = vec![0.0f32; w.width];
        emit_row(cx, w, st, rope, win, &mut out)?;
        st.rows.push(&out);
    }
    Ok(())
}

/// Compressed row `win` from the token log: per channel a softmax over the window's slots
/// (CSA: series A of window `win − 1`, then series B of window `win`), the gated sum, then
/// RMSNorm and RoPE at position `win·m`.
fn emit_row(
    cx: &Cx<'_>,
    w: &Compressor,
    st: &CompState,
    rope: &Rope,
    win: usize,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let (m, width, cw) = (w.ratio, w.width, w.cw());
    // (window, offset into a token row of `c`) of each slot; `z` sits `cw` further.
    let mut slots: Vec<(usize, usize)> = Vec::with_capacity(2 * m);
    if w.overlap {
        if win > 0 {
            slots.extend((0..m).map(|j| ((win - 1) * m + j, 0)));
        }
        slots.extend((0..m).map(|j| (win * m + j, width)));
    } else {
        slots.extend((0..m).map(|j| (win * m + j, 0)));
    }
    let mut rows: Vec<&[f32]> = Vec::with_capacity(slots.len());
    for &(t, _) in &slots {
        let row = st.tokens.row(t);
        if row.len() != 2 * cw {
            return Err(ModelError::Batch(format!(
                "compressor state lost token {t} needed by row {win}"
            )));
        }
        rows.push(row);
    }
    let mut es = vec![0.0f32; slots.len()];
    for (ch, o) in out.iter_mut().enumerate() {
        let z = |i: usize| rows[i][cw + slots[i].1 + ch];
        let mx = (0..slots.len()).fold(f32::NEG_INFINITY, |a, i| if z(i) > a { z(i) } else { a });
        let mut sum = 0.0f32;
        for (i, e) in es.iter_mut().enumerate() {
            *e = canon::exp(z(i) - mx);
            sum += *e;
        }
        let inv = 1.0 / sum;
        let mut acc = 0.0f32;
        for (i, &e) in es.iter().enumerate() {
            acc = (e * inv).mul_add(rows[i][slots[i].1 + ch], acc);
        }
        *o = acc;
    }
    cx.ops
        .rms_norm_in_place(out, &w.norm, cx.cfg.rms_eps, NormWeight::Plain)?;
    let mut cs = vec![0.0f32; cx.cfg.n_rot];
    rope.cos_sin(win * m, &mut cs);
    rope_tail(out, width, &cs, false);
    Ok(())
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
