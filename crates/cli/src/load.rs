//! What the generation commands resolve before anything loads: `-m` (a file, or a known
//! model fetched on first use with a progress bar), its display name, and the error for
//! chat on a base model. Opening, the context length, the memory check, the model, its
//! tokenizer and chat template are the `runtime` crate's ([`runtime::load`]).

use std::path::{Path, PathBuf};

use anyhow::bail;

use crate::model_arg;

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

/// A short display name for a model: the known name, or the file stem of a path.
pub fn display_name(spec: &str, path: &Path) -> String {
    if path == Path::new(spec) {
        path.file_stem()
            .map_or_else(|| spec.to_string(), |s| s.to_string_lossy().into_owned())
    } else {
        spec.to_string()
    }
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
