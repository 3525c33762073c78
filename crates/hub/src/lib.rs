//! Model cache: the known-model table, fetching, verification and atomic assembly.
//!
//! (Initial version: the table and cache paths. Fetching is being added.)

use std::path::PathBuf;

/// Errors from the model cache.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The name is neither a known model nor an existing file.
    #[error("unknown model '{0}'")]
    UnknownModel(String),
    /// The model is known but not in the cache.
    #[error("model '{0}' is not in the cache at {1}")]
    NotCached(String, PathBuf),
    /// No cache directory could be determined.
    #[error("no cache directory: set LOCKSTEP_HOME")]
    NoCacheDir,
}

/// The cache root: `$LOCKSTEP_HOME`, else `$XDG_CACHE_HOME/lockstep`, else `~/.cache/lockstep`.
pub fn cache_root() -> Result<PathBuf, HubError> {
    if let Some(h) = std::env::var_os("LOCKSTEP_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(x).join("lockstep"));
    }
    std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("lockstep"))
        .ok_or(HubError::NoCacheDir)
}

/// Path of a known model's file in the cache (it may not exist yet).
pub fn cached_path(name: &str) -> Result<PathBuf, HubError> {
    Ok(cache_root()?.join("models").join(format!("{name}.gguf")))
}

/// Returns the path of a known model, fetching it into the cache if needed.
pub fn ensure_model(name: &str) -> Result<PathBuf, HubError> {
    let p = cached_path(name)?;
    if p.is_file() {
        Ok(p)
    } else {
        Err(HubError::NotCached(name.to_string(), p))
    }
}
