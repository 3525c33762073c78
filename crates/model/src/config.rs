//! Hyperparameters read from GGUF metadata (`{arch}.*` keys, as llama.cpp writes them) and
//! the tensor table (vocabulary width).

use crate::ModelError;
use backend_cpu::RopeStyle;
use gguf::GgufFile;

/// Architectures this crate implements (`general.architecture` values).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "gemma3"];

/// A model architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama (SmolLM2, …): RMSNorm, SwiGLU, normal-style RoPE, no biases.
    Llama,
    /// Qwen2 (Qwen2.5-Coder, …): llama with Q/K/V biases and NeoX-style RoPE.
    Qwen2,
    /// Gemma 3: sliding-window layers interleaved with global ones (two RoPE bases),
    /// QK-norm, norms after attention and MLP, scaled embeddings, GELU-tanh GeGLU.
    Gemma3,
}

impl Arch {
    /// The architecture named by `general.architecture`, or
    /// [`ModelError::UnsupportedArchitecture`].
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(ModelError::UnsupportedArchitecture {
                arch: other.to_string(),
                supported: SUPPORTED_ARCHITECTURES,
            }),
        }
    }

    /// The GGUF name (metadata key prefix).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// Which elements RoPE pairs up (llama.cpp's `llama_model_rope_type`: llama is
    /// `LLAMA_ROPE_TYPE_NORM`, qwen2 and gemma3 `LLAMA_ROPE_TYPE_NEOX`).
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama => RopeStyle::Normal,
            Arch::Qwen2 | Arch::Gemma3 => RopeStyle::Neox,
        }
    }

    /// Whether the Q/K/V projections must carry biases.
    pub fn requires_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// None (`rope.scaling.type` absent or `none`, or a factor of 1).
    None,
    /// Linear position interpolation: positions are divided by `factor`.
    Linear {
        /// The scaling factor (`rope.scaling.factor` or the older `rope.scale_linear`).
        factor: f32,
    },
}

impl RopeScaling {
    /// The factor positions are divided by (1 for none).
    pub fn factor(self) -> f32 {
        match self {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => factor,
        }
    }
}

/// The hyperparameters of a model, read from its GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Architecture.
    pub arch: Arch,
    /// Transformer blocks (`block_count`).
    pub n_layer: usize,
    /// Hidden size (`embedding_length`).
    pub n_embd: usize,
    /// Feed-forward inner size (`feed_forward_length`).
    pub n_ff: usize,
    /// Query heads (`attention.head_count`).
    pub n_head: usize,
    /// Key/value heads (`attention.head_count_kv`, default `n_head`).
    pub n_head_kv: usize,
    /// Values per head (`attention.key_length`, default `n_embd / n_head`).
    pub head_dim: usize,
    /// Rotated elements per head (`rope.dimension_count`, default `head_dim`).
    pub n_rot: usize,
    /// RMSNorm epsilon (`attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// RoPE frequency base (`rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Context length the model was trained for (`context_length`).
    pub n_ctx_train: usize,
    /// Logit width: rows of the output matrix (which may exceed the real token count:
    /// padding entries).
    pub n_vocab: usize,
    /// Whether the output head reuses `token_embd.weight` (no `output.weight` in the file).
    pub tied_embeddings: bool,
    /// Per layer: `None` for global attention, `Some(W)` for a sliding window of `W` keys
    /// (a query at `p` sees keys `max(0, p-W+1)..=p`). All `None` for llama and qwen2.
    pub layer_windows: Vec<Option<usize>>,
    /// RoPE frequency base of the sliding-window layers (gemma3: `rope.freq_base_swa`,
    /// default 10000, unscaled); equals `rope_base` where no layer slides.
    pub rope_base_swa: f32,
    /// Attention score scale (`1/sqrt(head_dim)`; gemma3 takes llama.cpp's
    /// `f_attention_scale`, the `query_pre_attn_scalar` of the checkpoint).
    pub attn_scale: f32,
    /// Final logit soft-capping `c` (`logits = c·tanh(logits/c)`), when the file sets
    /// `final_logit_softcapping` (gemma3; absent in the released GGUFs).
    pub final_logit_softcap: Option<f32>,
}

impl Config {
    /// Reads the configuration of `gguf`.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Config, ModelError> {
        let arch = Arch::from_name(gguf.architecture()?)?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let req = |k: &str| -> Result<usize, ModelError> {
            Ok(usize::try_from(gguf.get_u32(&key(k))?).unwrap_or(usize::MAX))
        };
        let opt = |k: &str| -> Result<Option<usize>, ModelError> {
            match gguf.get(&key(k)) {
                None => Ok(None),
                Some(_) => req(k).map(Some),
            }
        };
        let n_layer = req("block_count")?;
        let n_embd = req("embedding_length")?;
        let n_ff = req("feed_forward_length")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = opt("attention.head_count_kv")?.unwrap_or(n_head);
        let n_ctx_train = req("context_length")?;
        let rms_eps = gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = match gguf.get(&key("rope.freq_base")) {
            None => 10_000.0,
            Some(_) => gguf.get_f32(&key("rope.freq_base"))?,
        };
        let positive = |what: &str, v: usize| {
            if v == 0 {
                Err(ModelError::Config(format!("{a}.{what} must be > 0")))
            } else {
                Ok(v)
            }
        };
        positive("block_count", n_layer)?;
        positive("embedding_length", n_embd)?;
        positive("feed_forward_length", n_ff)?;
        positive("attention.head_count", n_head)?;
        positive("attention.head_count_kv", n_head_kv)?;
        positive("context_length", n_ctx_train)?;
        if n_head % n_head_kv != 0 {
            return Err(ModelError::Config(format!(
                "attention.head_count {n_head} is not a multiple of attention.head_count_kv \
                 {n_head_kv}"
            )));
        }
        let head_dim = match opt("attention.key_length")? {
            Some(d) => d,
            None => {
                if n_embd % n_head != 0 {
                    return Err(ModelError::Config(format!(
                        "embedding_length {n_embd} is not a multiple of head_count {n_head}"
                    )));
                }
                n_embd / n_head
            }
        };
        positive("attention.key_length", head_dim)?;
        if let Some(dv) = opt("attention.value_length")?
            && dv != head_dim
        {
            return Err(ModelError::Config(format!(
                "attention.value_length {dv} differs from attention.key_length {head_dim} \
                 (unsupported)"
            )));
        }
        let n_rot = opt("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot % 2 != 0 || n_rot > head_dim {
            return Err(ModelError::Config(format!(
                "rope.dimension_count {n_rot} must be even, > 0 and at most the head size \
                 {head_dim}"
            )));
        }
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(ModelError::Config(format!(
                "attention.layer_norm_rms_epsilon {rms_eps} must be finite and >= 0"
            )));
        }
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(ModelError::Config(format!(
                "rope.freq_base {rope_base} must be finite and > 0"
            )));
        }
        let rope_scaling = rope_scaling(gguf, a)?;
        let (n_vocab, tied_embeddings) = vocab(gguf)?;
        let mut layer_windows = vec![None; n_layer];
        let mut rope_base_swa = rope_base;
        // llama.cpp `f_attention_scale`: 1/sqrt(head_dim), f32 sqrt then f32 division.
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        let mut final_logit_softcap = None;
        if arch == Arch::Gemma3 {
            layer_windows = gemma3_windows(gguf, a, n_layer)?;
            rope_base_swa = match gguf.get(&key("rope.freq_base_swa")) {
                None => 10_000.0,
                Some(_) => gguf.get_f32(&key("rope.freq_base_swa"))?,
            };
            if !(rope_base_swa.is_finite() && rope_base_swa > 0.0) {
                return Err(ModelError::Config(format!(
                    "rope.freq_base_swa {rope_base_swa} must be finite and > 0"
                )));
            }
            // gemma_pytorch: the 27B model (62 layers) scales by 1/sqrt(n_embd / n_head).
            if n_layer == 62 {
                attn_scale = 1.0 / ((n_embd / n_head) as f32).sqrt();
            }
            let cap_key = key("final_logit_softcapping");
            if gguf.get(&cap_key).is_some() {
                let c = gguf.get_f32(&cap_key)?;
                if !c.is_finite() || c < 0.0 {
                    return Err(ModelError::Config(format!(
                        "final_logit_softcapping {c} must be finite and >= 0"
                    )));
                }
                final_logit_softcap = (c > 0.0).then_some(c);
            }
        }
        Ok(Config {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rms_eps,
            rope_base,
            rope_scaling,
            n_ctx_train,
            n_vocab,
            tied_embeddings,
            layer_windows,
            rope_base_swa,
            attn_scale,
            final_logit_softcap,
        })
    }

    /// Query width of one row: `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Key (and value) width of one row: `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// The largest sliding window of any layer (`None` when every layer is global).
    pub fn max_window(&self) -> Option<usize> {
        self.layer_windows.iter().flatten().copied().max()
    }
}

/// The per-layer windows of gemma3, as llama.cpp sets them: `attention.sliding_window`
/// `W` (absent or 0: every layer global), and `attention.sliding_window_pattern` either a
/// per-layer bool array or a period `n` (default 6) where layer `il` slides iff
/// `il % n < n - 1` (every `n`-th layer, counting from 1, is global; `n = 0`: all slide).
fn gemma3_windows(
    gguf: &GgufFile,
    a: &str,
    n_layer: usize,
) -> Result<Vec<Option<usize>>, ModelError> {
    let window_key = format!("{a}.attention.sliding_window");
    let window = match gguf.get(&window_key) {
        None => 0,
        Some(_) => usize::try_from(gguf.get_u32(&window_key)?).unwrap_or(usize::MAX),
    };
    if window == 0 {
        return Ok(vec![None; n_layer]);
    }
    let pattern_key = format!("{a}.attention.sliding_window_pattern");
    let slides: Vec<bool> = match gguf.get(&pattern_key) {
        Some(v) if v.as_array().is_some() => {
            let arr = gguf.get_array(&pattern_key)?;
            let bools = arr.as_bools().ok_or_else(|| {
                ModelError::Config(format!("{pattern_key} must be an array of bools"))
            })?;
            if bools.len() != n_layer {
                return Err(ModelError::Config(format!(
                    "{pattern_key} has {} entries for {n_layer} layers",
                    bools.len()
                )));
            }
            bools.to_vec()
        }
        Some(_) => {
            let n = usize::try_from(gguf.get_u32(&pattern_key)?).unwrap_or(usize::MAX);
            (0..n_layer).map(|il| n == 0 || il % n < n - 1).collect()
        }
        None => (0..n_layer).map(|il| il % 6 < 5).collect(),
    };
    Ok(slides.into_iter().map(|s| s.then_some(window)).collect())
}

/// `rope.scaling.type` / `rope.scaling.factor`, or the older `rope.scale_linear`.
fn rope_scaling(gguf: &GgufFile, a: &str) -> Result<RopeScaling, ModelError> {
    let type_key = format!("{a}.rope.scaling.type");
    let factor_key = format!("{a}.rope.scaling.factor");
    let factor = match gguf.get(&factor_key) {
        Some(_) => Some(gguf.get_f32(&factor_key)?),
        None => None,
    };
    let kind = match gguf.get(&type_key) {
        Some(_) => gguf.get_str(&type_key)?.to_string(),
        None => {
            let old = format!("{a}.rope.scale_linear");
            return match gguf.get(&old) {
                Some(_) => linear(gguf.get_f32(&old)?, &old),
                None => Ok(RopeScaling::None),
            };
        }
    };
    match kind.as_str() {
        "none" => Ok(RopeScaling::None),
        "linear" => linear(factor.unwrap_or(1.0), &factor_key),
        _ => Err(ModelError::UnsupportedRopeScaling {
            kind,
            key: type_key,
        }),
    }
}

fn linear(factor: f32, key: &str) -> Result<RopeScaling, ModelError> {
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::Config(format!(
            "{key} = {factor}: a linear RoPE scaling factor must be finite and > 0"
        )));
    }
    Ok(if factor == 1.0 {
        RopeScaling::None
    } else {
        RopeScaling::Linear { factor }
    })
}

/// The logit width (rows of `output.weight`, else of `token_embd.weight`) and whether the
/// embeddings are tied.
pub(crate) fn vocab(gguf: &GgufFile) -> Result<(usize, bool), ModelError> {
    let (t, tied) = match gguf.tensor("output.weight") {
        Some(t) => (t, false),
        None => (
            gguf.tensor("token_embd.weight")
                .ok_or_else(|| ModelError::MissingTensor {
                    name: "token_embd.weight".into(),
                })?,
            true,
        ),
    };
    let rows = t.dims.get(1).copied().unwrap_or(0);
    let n_vocab = usize::try_from(rows).unwrap_or(0);
    if t.dims.len() != 2 || n_vocab == 0 {
        return Err(ModelError::TensorShape {
            name: t.name.clone(),
            expected: vec![t.dims.first().copied().unwrap_or(0), rows.max(1)],
            got: t.dims.clone(),
        });
    }
    Ok((n_vocab, tied))
}
