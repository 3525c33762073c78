//! `--device cpu|cuda[:N]|auto`: which backend runs the forward.
//!
//! `auto` (the default) takes CUDA device 0 when this binary was built with the `cuda`
//! feature and the device opens, and says so on stderr; otherwise the CPU. Asking for
//! CUDA explicitly where it is not usable is an error, never a silent fall-back.
//!
//! The memory check follows the device: a CUDA load's context and weights are checked
//! against the device's free memory and only what stays on the host against host RAM
//! (`runtime::memory`); a CPU load against host RAM.

use std::sync::Arc;

use anyhow::{Context, bail};
use engine::{Deepseek4Backend, ForwardBackend, ModelBackend};
use gguf::GgufFile;
use runtime::load::ContextChoice;

use crate::args::ModelArgs;

/// A `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    /// CUDA when usable, else the CPU.
    Auto,
    /// The CPU backend.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl std::str::FromStr for DeviceArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DeviceArg::Auto),
            "cpu" => Ok(DeviceArg::Cpu),
            "cuda" => Ok(DeviceArg::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceArg::Cuda(n)),
                _ => Err(format!(
                    "unknown device {s:?}: use cpu, cuda, cuda:N or auto"
                )),
            },
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Auto => f.write_str("auto"),
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What [`backend`] loaded.
pub struct Loaded {
    /// The engine backend.
    pub backend: Box<dyn ForwardBackend>,
    /// Its context length.
    pub n_ctx: usize,
    /// How that context length was chosen (bounded by the memory of the device it runs
    /// on when `--ctx-size` is not given).
    pub context: ContextChoice,
    /// Its vocabulary width.
    pub n_vocab: usize,
    /// The DSpark block drafter, when one was asked for.
    pub dspark: Option<Arc<spec::DsparkDraft>>,
    /// Where the forward runs: `cuda:N`, or the CPU kernel set's name.
    pub device_name: String,
}

/// The engine backend for `args`: the model loaded on the chosen device, and with `dspark`
/// (a DSpark support file, DeepSeek V4 targets only) the block drafter checked against it,
/// with the backend capturing the rows it reads.
///
/// The context is `args.ctx_size`, else the trained one bounded by the memory of the
/// device the model runs on, with a KV cache of `kv_slots(n)` token slots for a context
/// of `n` (what the caller will ask `init_kv` for).
pub fn backend(
    gguf: &Arc<GgufFile>,
    args: &ModelArgs,
    name: &str,
    dspark: Option<&str>,
    kv_slots: &dyn Fn(usize) -> usize,
) -> anyhow::Result<Loaded> {
    if runtime::load::is_deepseek4(gguf) {
        // DeepSeek V4 runs on the CPU backend only (per-sequence compressor state).
        if let DeviceArg::Cuda(n) = args.device {
            bail!("--device cuda:{n}: {name} is a deepseek4 model, which runs on the CPU only");
        }
        let context =
            runtime::load::context_choice(gguf, args.ctx_size, model::KvType::F32, kv_slots)?;
        let model = Arc::new(
            runtime::load::load_deepseek4(gguf, args.threads(), Some(context.n_ctx))
                .with_context(|| format!("loading {name}"))?,
        );
        let (n_ctx, n_vocab) = (model.n_ctx(), model.config().n_vocab);
        let mut backend = Deepseek4Backend::new(Arc::clone(&model));
        let draft = match dspark {
            None => None,
            Some(path) => {
                let support = runtime::load::open_gguf(std::path::Path::new(path))?;
                let d = model::Dspark::load(support, model).with_context(|| {
                    format!("--dspark {path}: the support file does not fit {name}")
                })?;
                let draft = spec::DsparkDraft::new(path, Arc::new(d));
                backend.capture(draft.capture_layers())?;
                Some(draft)
            }
        };
        return Ok(Loaded {
            backend: Box::new(backend),
            n_ctx,
            context,
            n_vocab,
            dspark: draft,
            device_name: quant::kernels().name().to_string(),
        });
    }
    if let Some(path) = dspark {
        bail!(
            "--dspark {path}: the DSpark block drafter drafts for DeepSeek V4 (deepseek4) \
             models; {name} is {}",
            gguf.architecture().unwrap_or("of unknown architecture")
        );
    }
    let cuda = match args.device {
        DeviceArg::Cpu => None,
        DeviceArg::Cuda(n) => Some((n, true)),
        DeviceArg::Auto => backend_cuda::cuda_built().then_some((0, false)),
    };
    if let Some((ordinal, explicit)) = cuda {
        match cuda_backend(gguf, args, ordinal, kv_slots) {
            Ok((backend, context, n_vocab)) => {
                return Ok(Loaded {
                    backend,
                    n_ctx: context.n_ctx,
                    context,
                    n_vocab,
                    dspark: None,
                    device_name: format!("cuda:{ordinal}"),
                });
            }
            Err(e) if explicit => {
                return Err(e).with_context(|| format!("--device cuda:{ordinal} for {name}"));
            }
            Err(e) => {
                if backend_cuda::cuda_device_count() > 0 {
                    eprintln!("note: CUDA is present but {e:#}; running {name} on the CPU");
                }
            }
        }
    }
    let context =
        runtime::load::context_choice(gguf, args.ctx_size, args.kv_type.into(), kv_slots)?;
    let model = Arc::new(
        runtime::load::load_model(
            gguf,
            args.threads(),
            Some(context.n_ctx),
            args.kv_type.into(),
        )
        .with_context(|| format!("loading {name}"))?,
    );
    let (n_ctx, n_vocab) = (model.n_ctx(), model.config().n_vocab);
    Ok(Loaded {
        backend: Box::new(ModelBackend::new(model)),
        n_ctx,
        context,
        n_vocab,
        dspark: None,
        device_name: quant::kernels().name().to_string(),
    })
}

/// The CUDA backend on device `ordinal`, after the memory check against the device's free
/// memory (and host RAM for what stays on the host).
#[cfg(feature = "cuda")]
fn cuda_backend(
    gguf: &Arc<GgufFile>,
    args: &ModelArgs,
    ordinal: usize,
    kv_slots: &dyn Fn(usize) -> usize,
) -> anyhow::Result<(Box<dyn ForwardBackend>, ContextChoice, usize)> {
    use runtime::memory::{MemoryBudget, Placement};
    if args.kv_type != crate::args::KvTypeArg::F16 {
        bail!("the CUDA backend keeps its KV cache in f16 only (drop --kv-type)");
    }
    let dev = backend_cuda::Device::new(ordinal)?;
    let (free, _total) = dev.memory()?;
    let placement = Placement::Cuda(ordinal);
    let budget = MemoryBudget {
        host_available: model::available_memory(),
        device_free: Some(free as u64),
    };
    let kv_type = model::KvType::F16;
    let context = runtime::load::context_choice_within(
        gguf,
        args.ctx_size,
        kv_type,
        kv_slots,
        placement,
        &budget,
    )?;
    runtime::load::check_memory_on(gguf, kv_slots(context.n_ctx), kv_type, placement, &budget)?;
    let b = backend_cuda::CudaBackend::new(backend_cuda::CudaModel::load(
        dev,
        Arc::clone(gguf),
        Some(context.n_ctx),
    )?);
    let dev = b.model().device();
    eprintln!(
        "using CUDA device {} ({}, sm_{}{})",
        dev.ordinal(),
        dev.name(),
        dev.compute_capability().0,
        dev.compute_capability().1
    );
    let n_vocab = b.model().config().n_vocab;
    Ok((Box::new(b), context, n_vocab))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _gguf: &Arc<GgufFile>,
    _args: &ModelArgs,
    _ordinal: usize,
    _kv_slots: &dyn Fn(usize) -> usize,
) -> anyhow::Result<(Box<dyn ForwardBackend>, ContextChoice, usize)> {
    Err(backend_cuda::CudaError::NotBuilt.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_values_parse() {
        assert_eq!("cpu".parse::<DeviceArg>(), Ok(DeviceArg::Cpu));
        assert_eq!("auto".parse::<DeviceArg>(), Ok(DeviceArg::Auto));
        assert_eq!("cuda".parse::<DeviceArg>(), Ok(DeviceArg::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceArg>(), Ok(DeviceArg::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            assert!(bad.parse::<DeviceArg>().is_err(), "{bad}");
        }
        assert_eq!(DeviceArg::Cuda(2).to_string(), "cuda:2");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn explicit_cuda_without_the_feature_is_a_clear_error() {
        let mut w = gguf::GgufWriter::new();
        w.add("general.architecture", "llama").unwrap();
        let g = Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap());
        let e = cuda_backend(
            &g,
            &ModelArgs {
                model: "x".into(),
                threads: None,
                ctx_size: None,
                kv_type: crate::args::KvTypeArg::F16,
                device: DeviceArg::Cuda(0),
                prefill_chunk: None,
            },
            0,
            &|n| n,
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("built without CUDA support"), "{e}");
    }
}
