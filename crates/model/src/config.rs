//! Hyperparameters read from GGUF metadata (`{arch}.*` keys, as llama.cpp writes them) and
//! the tensor table (vocabulary width).

use crate::ModelError;
use backend_cpu::RopeStyle;
use gguf::GgufFile;

/// Architectures this crate implements (`general.architecture` values).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2"];

/// A model architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama (SmolLM2, …): RMSNorm, SwiGLU, normal-style RoPE, no biases.
    Llama,
    /// Qwen2 (Qwen2.5-Coder, …): llama with Q/K/V biases and NeoX-style RoPE.
    Qwen2,
}

impl Arch {
    /// The architecture named by `general.architecture`, or
    /// [`ModelError::UnsupportedArchitecture`].
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
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
        }
    }

    /// Which elements RoPE pairs up (llama.cpp's `llama_model_rope_type`: llama is
    /// `LLAMA_ROPE_TYPE_NORM`, qwen2 `LLAMA_ROPE_TYPE_NEOX`).
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama => RopeStyle::Normal,
            Arch::Qwen2 => RopeStyle::Neox,
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
fn vocab(gguf: &GgufFile) -> Result<(usize, bool), ModelError> {
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
