//! Turning a model argument (`-m NAME` or a path) into a file, for every subcommand that
//! loads a model.

use std::path::PathBuf;

use anyhow::Context;

/// Resolves a known model name (fetching it into the cache with progress on stderr if
/// needed) or a path to an existing file.
pub fn resolve(spec: &str) -> anyhow::Result<PathBuf> {
    let mut opts = hub::PullOptions::from_env();
    opts.progress = hub::Progress::auto();
    hub::resolve_model_with(spec, true, &opts).with_context(|| format!("model '{spec}'"))
}
