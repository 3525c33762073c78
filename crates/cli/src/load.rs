//! Loading what the generation commands need: the model file (resolved, fetched on first
//! use), a memory check before anything large is touched, the model, its tokenizer and its
//! chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use gguf::GgufFile;
use model::{KvType, LoadOptions, MemoryEstimate, Model};
use text::Tokenizer;

use crate::args::ModelArgs;
use crate::model_arg;

/// Context length used when `--ctx-size` is not given (capped at the trained context).
pub const DEFAULT_CTX: usize = 4096;

/// Resolves `-m`: a path to an existing file, or a known model name (fetched into the
/// cache with a progress bar on first use). Something that looks like a path but is not a
/// file is reported as a missing file rather than an unknown model name.
pub fn resolve_model_path(spec: &str) -> anyhow::Result<PathBuf> {
    let looks_like_path = spec.contains(std::path::MAIN_SEPARATOR)
        || spec.contains('/')
        || spec.ends_with(".gguf")
        || spec.starts_with('.');
    let path = Path::new(spec);
    if looks_like_path && !path.is_file() {
        if path.exists() {
            bail!("model path {spec} is not a file");
        }
        bail!(
            "model file {spec} does not exist (give a path to a .gguf file or a known model \
             name; `lockstep models` lists them)"
        );
    }
    model_arg::resolve(spec)
}

/// Opens (maps) a GGUF file.
pub fn open_gguf(path: &Path) -> anyhow::Result<Arc<GgufFile>> {
    let file = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Arc::new(file))
}

/// A short display name for a model: the known name, or the file stem of a path.
pub fn display_name(spec: &str, path: &Path) -> String {
    if path == Path::new(spec) {
        path.file_stem()
            .map_or_else(|| spec.to_string(), |s| s.to_string_lossy().into_owned())
    } else {
        spec.to_string()
    }
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

/// The context length to run with: `--ctx-size`, else [`DEFAULT_CTX`] capped at the
/// trained context. An explicit size beyond the trained context is refused.
pub fn context_length(gguf: &GgufFile, requested: Option<usize>) -> anyhow::Result<usize> {
    let trained = trained_context(gguf);
    match (requested, trained) {
        (Some(0), _) => bail!("--ctx-size must be at least 1"),
        (Some(n), Some(t)) if n > t => {
            bail!("--ctx-size {n} exceeds the model's trained context of {t} tokens")
        }
        (Some(n), _) => Ok(n),
        (None, Some(t)) => Ok(t.min(DEFAULT_CTX)),
        (None, None) => Ok(DEFAULT_CTX),
    }
}

/// Compares what the model needs (weights, KV cache for `ctx_tokens`, scratch) with
/// `MemAvailable` and refuses with the numbers when it does not fit.
pub fn check_memory(
    gguf: &GgufFile,
    ctx_tokens: usize,
    kv_type: KvType,
) -> anyhow::Result<MemoryEstimate> {
    let estimate = MemoryEstimate::for_model(gguf, ctx_tokens, kv_type)?;
    if let Some(available) = model::available_memory() {
        model::check_memory(&estimate, available)?;
    }
    Ok(estimate)
}

/// Loads the model in `gguf` with the threads, context and KV type of `args`, after the
/// memory check.
pub fn load_model(gguf: &Arc<GgufFile>, args: &ModelArgs) -> anyhow::Result<Model> {
    let n_ctx = context_length(gguf, args.ctx_size)?;
    let kv_type = args.kv_type.into();
    check_memory(gguf, n_ctx, kv_type)?;
    let opts = LoadOptions {
        threads: args.threads(),
        kv_type,
        n_ctx: Some(n_ctx),
    };
    Ok(Model::load(Arc::clone(gguf), &opts)?)
}

/// Whether `gguf` is a DeepSeek V4 file (run by [`model::Deepseek4`], not [`Model`]).
pub fn is_deepseek4(gguf: &GgufFile) -> bool {
    gguf.architecture().ok() == Some("deepseek4")
}

/// Loads the DeepSeek V4 model in `gguf` with the threads and context of `args`, after the
/// memory check (`--kv-type` does not apply: its state is f32).
pub fn load_deepseek4(gguf: &Arc<GgufFile>, args: &ModelArgs) -> anyhow::Result<model::Deepseek4> {
    let n_ctx = context_length(gguf, args.ctx_size)?;
    check_memory(gguf, n_ctx, KvType::F32)?;
    let opts = LoadOptions {
        threads: args.threads(),
        kv_type: KvType::F32,
        n_ctx: Some(n_ctx),
    };
    Ok(model::Deepseek4::load(Arc::clone(gguf), &opts)?)
}

/// Builds the tokenizer from the GGUF's tokenizer metadata.
pub fn load_tokenizer(gguf: &GgufFile) -> anyhow::Result<Tokenizer> {
    Tokenizer::from_gguf(gguf).context("reading the tokenizer from the model file")
}

/// The model's chat template (`tokenizer.chat_template`), compiled with the model's BOS
/// and EOS texts; `None` when the file has no template (base models).
pub fn chat_template(
    gguf: &GgufFile,
    tokenizer: &Tokenizer,
) -> anyhow::Result<Option<chat::ChatTemplate>> {
    let Some(value) = gguf.get("tokenizer.chat_template") else {
        return Ok(None);
    };
    let Some(source) = value.as_str() else {
        bail!("tokenizer.chat_template is not a string");
    };
    let text_of = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or("")
            .to_string()
    };
    let template = chat::ChatTemplate::new(
        source,
        &text_of(tokenizer.bos_id()),
        &text_of(tokenizer.eos_id()),
    )
    .context("compiling the model's chat template")?;
    Ok(Some(template))
}

/// The error for `--chat` (or `lockstep chat`) on a model without a chat template.
pub fn no_template_error(name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{name} has no chat template (tokenizer.chat_template): it is a base model, not a \
         chat model. Run it without --chat on a raw prompt, e.g. `lockstep run -m {name} -p \
         \"Once upon a time\"`"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_path_is_reported_as_a_missing_file() {
        for spec in ["/no/such/dir/model.gguf", "./nope.gguf", "nope.gguf"] {
            let msg = format!("{:#}", resolve_model_path(spec).unwrap_err());
            assert!(msg.contains("does not exist"), "{spec}: {msg}");
            assert!(msg.contains(spec), "{spec}: {msg}");
        }
    }

    #[test]
    fn display_name_keeps_known_names_and_shortens_paths() {
        assert_eq!(
            display_name("smollm2-135m", Path::new("/c/models/smollm2-135m.gguf")),
            "smollm2-135m"
        );
        assert_eq!(
            display_name("/x/my-model.gguf", Path::new("/x/my-model.gguf")),
            "my-model"
        );
    }
}
