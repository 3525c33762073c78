//! The hyperparameters ([`Deepseek4Config`]) read from the GGUF metadata, and the state and
//! scratch sizes the memory estimate uses.

use super::*;

/// Upper bounds on metadata values, far above any real model, so absurd files fail with a
/// typed error instead of huge allocations.
pub(super) const MAX_HC_STREAMS: usize = 64;
pub(super) const MAX_SINKHORN_ITERS: usize = 10_000;
pub(super) const MAX_RATIO: usize = 1 << 16;

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
    pub(super) fn hc_mix(&self) -> usize {
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
