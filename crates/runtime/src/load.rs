//! Loading a model file: opening (mapping) it, the context length to run with, a memory
//! check before anything large is touched, the model, its tokenizer and its chat template
//! (DeepSeek V4's built-in one when the file has none).

use std::path::Path;
use std::sync::Arc;

use chat::ChatTemplate;
use gguf::GgufFile;
use model::{KvType, LoadOptions, MemoryEstimate, Model};
use text::Tokenizer;

use crate::LoadError;
use crate::memory::{MemoryBudget, MemoryKind, MemoryNeeds, Placement};

/// Context length used when none is given and the file does not say how long a context
/// the model was trained for.
pub const DEFAULT_CTX: usize = 4096;

/// Default contexts bounded by memory are rounded down to a multiple of this.
const CTX_STEP: usize = 256;

/// The cached file of a known model (`lockstep models` lists them), fetched on first use
/// without progress output (front ends with a terminal show their own).
pub fn ensure_model(name: &str) -> Result<std::path::PathBuf, LoadError> {
    hub::ensure_model(name).map_err(LoadError::Hub)
}

/// Opens (maps) a GGUF file.
pub fn open_gguf(path: &Path) -> Result<Arc<GgufFile>, LoadError> {
    let file = GgufFile::open(path).map_err(|error| LoadError::Gguf {
        path: path.display().to_string(),
        error,
    })?;
    Ok(Arc::new(file))
}

/// The trained context length from the metadata (`{arch}.context_length`), if present.
pub fn trained_context(gguf: &GgufFile) -> Option<usize> {
    let arch = gguf.architecture().ok()?;
    let key = format!("{arch}.context_length");
    let n = gguf
        .get_u64(&key)
        .ok()
        .or_else(|| gguf.get_u32(&key).ok().map(u64::from))?;
    usize::try_from(n).ok()
}

/// The context length to run with: `--ctx-size`, else the model's trained context bounded
/// by the memory this machine has (see [`context_choice`]). An explicit size beyond the
/// trained context is refused.
pub fn context_length(gguf: &GgufFile, requested: Option<usize>) -> Result<usize, LoadError> {
    Ok(context_choice(gguf, requested, KvType::F16, |n| n)?.n_ctx)
}

/// Why a context length was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextBound {
    /// `--ctx-size` asked for it.
    Requested,
    /// The model's trained context (it fits in memory).
    Trained,
    /// The trained context (`trained` tokens) did not fit in `memory` (`available_mib`
    /// available there): the largest context that fits.
    Memory {
        /// The model's trained context.
        trained: usize,
        /// The memory that bounded it (host RAM, or the CUDA device's).
        memory: MemoryKind,
        /// What that memory has available, in MiB.
        available_mib: u64,
    },
    /// The file does not say its trained context: [`DEFAULT_CTX`].
    Fallback,
}

/// A context length and the bound that set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextChoice {
    /// The context length in tokens.
    pub n_ctx: usize,
    /// What set it.
    pub bound: ContextBound,
}

impl ContextChoice {
    /// A short note for start-up lines: `context 32768: the model's trained context`.
    pub fn describe(&self) -> String {
        let n = self.n_ctx;
        match self.bound {
            ContextBound::Requested => format!("context {n}: --ctx-size"),
            ContextBound::Trained => format!("context {n}: the model's trained context"),
            ContextBound::Memory {
                trained,
                memory,
                available_mib,
            } => {
                let memory = match memory {
                    MemoryKind::HostRam | MemoryKind::HostRamBeside(_) => "host RAM".to_string(),
                    MemoryKind::Device(d) => format!("the memory of CUDA device {d}"),
                };
                format!(
                    "context {n}: bounded by {memory} ({available_mib} MiB available; the \
                     model was trained for {trained}; -c sets it)"
                )
            }
            ContextBound::Fallback => {
                format!("context {n}: the model file does not give its trained context")
            }
        }
    }
}

/// The context length to run with and why: `--ctx-size` when given (refused beyond the
/// trained context); else the model's trained context when its memory estimate — with a
/// KV cache of `kv_slots(n)` token slots for a context of `n` — fits in `MemAvailable`;
/// else the largest multiple of 256 tokens that fits (at least 256); [`DEFAULT_CTX`] for
/// files that do not give their trained context. For a CPU load; a CUDA load's context is
/// bounded by the device's memory ([`context_choice_within`]).
pub fn context_choice(
    gguf: &GgufFile,
    requested: Option<usize>,
    kv_type: KvType,
    kv_slots: impl Fn(usize) -> usize,
) -> Result<ContextChoice, LoadError> {
    context_choice_within(
        gguf,
        requested,
        kv_type,
        kv_slots,
        Placement::Cpu,
        &MemoryBudget::host(),
    )
}

/// [`context_choice`] for a load on `placement` with the memory of `budget` (unknown
/// amounts bound nothing): the context is the largest whose [`MemoryNeeds`] pass
/// [`MemoryNeeds::check`].
pub fn context_choice_within(
    gguf: &GgufFile,
    requested: Option<usize>,
    kv_type: KvType,
    kv_slots: impl Fn(usize) -> usize,
    placement: Placement,
    budget: &MemoryBudget,
) -> Result<ContextChoice, LoadError> {
    let trained = trained_context(gguf);
    match (requested, trained) {
        (Some(0), _) => Err(LoadError::Options("--ctx-size must be at least 1".into())),
        (Some(n), Some(t)) if n > t => Err(LoadError::Options(format!(
            "--ctx-size {n} exceeds the model's trained context of {t} tokens"
        ))),
        (Some(n), _) => Ok(ContextChoice {
            n_ctx: n,
            bound: ContextBound::Requested,
        }),
        (None, None) => Ok(ContextChoice {
            n_ctx: DEFAULT_CTX,
            bound: ContextBound::Fallback,
        }),
        (None, Some(t)) => {
            let check = |n: usize| -> Result<Result<(), LoadError>, LoadError> {
                Ok(MemoryNeeds::for_model(gguf, kv_slots(n), kv_type, placement)?.check(budget))
            };
            let fits = |n: usize| -> Result<bool, LoadError> { Ok(check(n)?.is_ok()) };
            let (memory, available_mib) = match check(t)? {
                Ok(()) => {
                    return Ok(ContextChoice {
                        n_ctx: t,
                        bound: ContextBound::Trained,
                    });
                }
                Err(LoadError::InsufficientMemory {
                    memory,
                    available_mib,
                    ..
                }) => (memory, available_mib),
                Err(e) => return Err(e),
            };
            // The largest multiple of CTX_STEP below `t` that fits (binary search: the
            // estimate grows with the context).
            let (mut lo, mut hi) = (1usize, t / CTX_STEP);
            if hi == 0 || !fits(CTX_STEP)? {
                // Not even the smallest step fits: let the memory check say why.
                lo = 1;
                hi = 1;
            }
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if fits(mid * CTX_STEP)? {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            Ok(ContextChoice {
                n_ctx: (lo * CTX_STEP).min(t),
                bound: ContextBound::Memory {
                    trained: t,
                    memory,
                    available_mib,
                },
            })
        }
    }
}

/// Compares what a CPU load of the model needs (weights, KV cache for `ctx_tokens`,
/// scratch) with `MemAvailable` and refuses with the numbers when it does not fit.
pub fn check_memory(
    gguf: &GgufFile,
    ctx_tokens: usize,
    kv_type: KvType,
) -> Result<MemoryEstimate, LoadError> {
    let needs = check_memory_on(
        gguf,
        ctx_tokens,
        kv_type,
        Placement::Cpu,
        &MemoryBudget::host(),
    )?;
    Ok(needs.host)
}

/// The memory check for a load on `placement`: on CUDA the weights, KV cache and scratch
/// against the device's free memory in `budget` and only what stays on the host against
/// host RAM; on the CPU everything against host RAM. Refuses naming the memory that is
/// short and by how much.
pub fn check_memory_on(
    gguf: &GgufFile,
    ctx_tokens: usize,
    kv_type: KvType,
    placement: Placement,
    budget: &MemoryBudget,
) -> Result<MemoryNeeds, LoadError> {
    let needs = MemoryNeeds::for_model(gguf, ctx_tokens, kv_type, placement)?;
    needs.check(budget)?;
    Ok(needs)
}

/// Whether `gguf` is a DeepSeek V4 file (run by [`model::Deepseek4`], not [`Model`]).
pub fn is_deepseek4(gguf: &GgufFile) -> bool {
    gguf.architecture().ok() == Some("deepseek4")
}

/// Loads the model in `gguf` with `threads` (`None` = one per core), the context of
/// [`context_length`] for `ctx_size` and `kv_type`, after the memory check.
pub fn load_model(
    gguf: &Arc<GgufFile>,
    threads: Option<usize>,
    ctx_size: Option<usize>,
    kv_type: KvType,
) -> Result<Model, LoadError> {
    let n_ctx = context_length(gguf, ctx_size)?;
    check_memory(gguf, n_ctx, kv_type)?;
    let opts = LoadOptions {
        threads,
        kv_type,
        n_ctx: Some(n_ctx),
    };
    Ok(Model::load(Arc::clone(gguf), &opts)?)
}

/// Loads the DeepSeek V4 model in `gguf` like [`load_model`], after the memory check (no
/// KV type applies: its state is f32).
pub fn load_deepseek4(
    gguf: &Arc<GgufFile>,
    threads: Option<usize>,
    ctx_size: Option<usize>,
) -> Result<model::Deepseek4, LoadError> {
    let n_ctx = context_length(gguf, ctx_size)?;
    check_memory(gguf, n_ctx, KvType::F32)?;
    let opts = LoadOptions {
        threads,
        kv_type: KvType::F32,
        n_ctx: Some(n_ctx),
    };
    Ok(model::Deepseek4::load(Arc::clone(gguf), &opts)?)
}

/// Builds the tokenizer from the GGUF's tokenizer metadata.
pub fn load_tokenizer(gguf: &GgufFile) -> Result<Tokenizer, LoadError> {
    Tokenizer::from_gguf(gguf).map_err(LoadError::Tokenizer)
}

/// Whether [`chat_template`] gives a template for `gguf` (without compiling it): the file
/// has one, or it is a DeepSeek V4 file (the built-in one).
pub fn has_chat_template(gguf: &GgufFile) -> bool {
    gguf.get("tokenizer.chat_template").is_some() || is_deepseek4(gguf)
}

/// The model's chat template (`tokenizer.chat_template`), compiled with the model's BOS
/// and EOS texts. A DeepSeek V4 file without one gets the built-in DeepSeek V4 encoding
/// (DeepSeek ships it as Python, not Jinja); other files without one give `None` (base
/// models).
pub fn chat_template(
    gguf: &GgufFile,
    tokenizer: &Tokenizer,
) -> Result<Option<ChatTemplate>, LoadError> {
    let Some(value) = gguf.get("tokenizer.chat_template") else {
        if is_deepseek4(gguf) {
            return Ok(Some(ChatTemplate::deepseek_v4()));
        }
        return Ok(None);
    };
    let Some(source) = value.as_str() else {
        return Err(LoadError::TemplateNotString);
    };
    let text_of = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or("")
            .to_string()
    };
    let template = ChatTemplate::new(
        source,
        &text_of(tokenizer.bos_id()),
        &text_of(tokenizer.eos_id()),
    )
    .map_err(LoadError::Template)?;
    Ok(Some(template))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_context_is_the_trained_one_unless_memory_bounds_it() {
        let path = hub::ensure_model("smollm2-135m").unwrap();
        let gguf = open_gguf(&path).unwrap();
        let slots = |n: usize| 2 * n;
        let host = |bytes: u64| MemoryBudget {
            host_available: Some(bytes),
            device_free: None,
        };
        let cpu = Placement::Cpu;
        let plenty = context_choice_within(&gguf, None, KvType::F16, slots, cpu, &host(1 << 40));
        assert_eq!(
            plenty.unwrap(),
            ContextChoice {
                n_ctx: 8192,
                bound: ContextBound::Trained
            }
        );
        // Room for a context of 2048 (and a little more, not a whole 256 step).
        let need = |n: usize| {
            MemoryEstimate::for_model(&gguf, slots(n), KvType::F16)
                .unwrap()
                .total
        };
        let available = need(2048) + (need(2304) - need(2048)) / 2;
        let bounded =
            context_choice_within(&gguf, None, KvType::F16, slots, cpu, &host(available)).unwrap();
        assert_eq!(bounded.n_ctx, 2048, "{bounded:?}");
        assert!(matches!(
            bounded.bound,
            ContextBound::Memory {
                trained: 8192,
                memory: MemoryKind::HostRam,
                ..
            }
        ));
        assert!(
            bounded.describe().contains("bounded by host RAM"),
            "{}",
            bounded.describe()
        );
        let asked =
            context_choice_within(&gguf, Some(1000), KvType::F16, slots, cpu, &host(1)).unwrap();
        assert_eq!(asked.n_ctx, 1000);
        let too_long = context_choice_within(
            &gguf,
            Some(9000),
            KvType::F16,
            slots,
            cpu,
            &MemoryBudget::default(),
        );
        assert!(
            too_long
                .unwrap_err()
                .to_string()
                .contains("trained context of 8192")
        );
    }

    #[test]
    fn a_cuda_context_is_bounded_by_device_memory_not_host_ram() {
        let path = hub::ensure_model("smollm2-135m").unwrap();
        let gguf = open_gguf(&path).unwrap();
        let slots = |n: usize| n;
        let gpu = Placement::Cuda(0);
        let needs = |n: usize| MemoryNeeds::for_model(&gguf, n, KvType::F16, gpu).unwrap();
        let device = |n: usize| needs(n).device.unwrap().total;
        // The host keeps the embedding table and a logits row, whatever the context.
        assert_eq!(needs(256).host, needs(8192).host);
        let budget = MemoryBudget {
            // Room for the host side only: far too little for a CPU load of the model.
            host_available: Some(needs(8192).host.total),
            device_free: Some(device(2048) + (device(2304) - device(2048)) / 2),
        };
        let cpu = check_memory_on(&gguf, 256, KvType::F16, Placement::Cpu, &budget);
        assert!(
            matches!(
                cpu,
                Err(LoadError::InsufficientMemory {
                    memory: MemoryKind::HostRam,
                    ..
                })
            ),
            "{cpu:?}"
        );
        let choice = context_choice_within(&gguf, None, KvType::F16, slots, gpu, &budget).unwrap();
        assert_eq!(choice.n_ctx, 2048, "{choice:?}");
        assert!(matches!(
            choice.bound,
            ContextBound::Memory {
                trained: 8192,
                memory: MemoryKind::Device(0),
                ..
            }
        ));
        assert!(
            choice
                .describe()
                .contains("bounded by the memory of CUDA device 0"),
            "{}",
            choice.describe()
        );
        assert!(check_memory_on(&gguf, 2048, KvType::F16, gpu, &budget).is_ok());
        let short = check_memory_on(&gguf, 4096, KvType::F16, gpu, &budget)
            .unwrap_err()
            .to_string();
        assert!(
            short.starts_with("not enough memory on CUDA device 0:"),
            "{short}"
        );
    }
}
