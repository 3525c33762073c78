//! The model-hub source: an HTTP(S) GET into `<root>/downloads/<name>/<file>.part`,
//! resumed with `Range: bytes=N-` after an interruption (in this run or a later one),
//! then verified and renamed into place.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use crate::assemble::{Assembly, Expected, sync_dir, verify_file};
use crate::progress::Meter;
use crate::space::ensure_space;
use crate::{HubError, PullOptions};

/// Attempts per pull; each one resumes where the previous stopped.
const MAX_ATTEMPTS: u32 = 4;

/// The download URL of `file` in `repo` under a Hugging Face style endpoint.
pub fn hub_url(endpoint: &str, repo: &str, file: &str) -> String {
    format!(
        "{}/{repo}/resolve/main/{file}",
        endpoint.trim_end_matches('/')
    )
}

fn agent() -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .user_agent(concat!("lockstep/", env!("CARGO_PKG_VERSION")))
        .build();
    ureq::Agent::new_with_config(config)
}

/// The start offset of a `Content-Range: bytes START-END/TOTAL` header.
fn content_range_start(value: &str) -> Option<u64> {
    value
        .trim()
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// What one request attempt ended with.
enum Attempt {
    /// The `.part` file may now be complete (its length is checked by the caller).
    BodyDone,
    /// Transient failure; the next attempt resumes.
    Retry(String),
}

/// Downloads `url` into `part` until it holds `size` bytes, resuming what is there.
pub(crate) fn download_resumable(
    url: &str,
    part: &Path,
    size: u64,
    opts: &PullOptions,
    label: &str,
) -> Result<(), HubError> {
    let agent = agent();
    let dir = part.parent().unwrap_or(Path::new("."));
    let mut last_error = String::new();
    for attempt in 0..MAX_ATTEMPTS {
        let have = file_len(part);
        if have == size {
            return Ok(());
        }
        if have > size {
            std::fs::remove_file(part).map_err(|e| HubError::io("remove", part, e))?;
            continue;
        }
        if attempt > 0 {
            tracing::info!(%url, have, "resuming download (attempt {})", attempt + 1);
            std::thread::sleep(Duration::from_millis(200 * u64::from(attempt)));
        }
        ensure_space(dir, size - have)?;
        match one_request(&agent, url, part, have, size, opts, label)? {
            Attempt::BodyDone => {
                let now = file_len(part);
                if now == size {
                    return Ok(());
                }
                if now > size {
                    let _ = std::fs::remove_file(part);
                    return Err(HubError::SizeMismatch {
                        name: label.to_string(),
                        expected: size,
                        got: now,
                    });
                }
                last_error = format!("transfer ended at {now} of {size} bytes");
            }
            Attempt::Retry(e) => last_error = e,
        }
    }
    Err(HubError::Network {
        url: url.to_string(),
        detail: format!("{last_error} (after {MAX_ATTEMPTS} attempts)"),
    })
}

fn one_request(
    agent: &ureq::Agent,
    url: &str,
    part: &Path,
    have: u64,
    size: u64,
    opts: &PullOptions,
    label: &str,
) -> Result<Attempt, HubError> {
    let mut req = agent.get(url);
    if have > 0 {
        req = req.header("Range", format!("bytes={have}-"));
    }
    let resp = match req.call() {
        Ok(r) => r,
        Err(ureq::Error::StatusCode(416)) => {
            // Our offset is past what the server has: start over.
            let _ = std::fs::remove_file(part);
            return Ok(Attempt::Retry(
                "server rejected the resume offset (416)".into(),
            ));
        }
        Err(ureq::Error::StatusCode(status)) if status >= 500 => {
            return Ok(Attempt::Retry(format!("HTTP {status}")));
        }
        Err(ureq::Error::StatusCode(status)) => {
            return Err(HubError::HttpStatus {
                url: url.to_string(),
                status,
            });
        }
        Err(e) => return Ok(Attempt::Retry(e.to_string())),
    };
    let status = resp.status().as_u16();
    let (mut file, start) = match status {
        206 if have > 0 => {
            let start = resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(content_range_start);
            if start != Some(have) {
                let _ = std::fs::remove_file(part);
                return Ok(Attempt::Retry(format!(
                    "server resumed at {start:?}, asked for {have}; restarting"
                )));
            }
            let f = OpenOptions::new()
                .append(true)
                .open(part)
                .map_err(|e| HubError::io("open", part, e))?;
            (f, have)
        }
        200 | 206 => {
            // A full body (the server ignored the range, or nothing was there yet).
            let f = File::create(part).map_err(|e| HubError::io("create", part, e))?;
            (f, 0)
        }
        _ => {
            return Err(HubError::HttpStatus {
                url: url.to_string(),
                status,
            });
        }
    };
    let mut meter = Meter::new(opts.progress, format!("{label}: downloading"), size, start);
    let mut body = resp.into_body().into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut written = start;
    let outcome = loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break Attempt::BodyDone,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Attempt::Retry(e.to_string()),
        };
        let chunk = &buf[..n];
        written += n as u64;
        if written > size {
            // Stop writing garbage; the caller sees the oversize and reports it.
            let _ = file.write_all(chunk);
            break Attempt::BodyDone;
        }
        file.write_all(chunk)
            .map_err(|e| HubError::io("write", part, e))?;
        meter.inc(n as u64);
    };
    file.sync_all().map_err(|e| HubError::io("sync", part, e))?;
    if matches!(outcome, Attempt::BodyDone) {
        meter.finish();
    }
    Ok(outcome)
}

/// Fetches the file from the hub into `final_path` via a resumable `.part` download.
pub(crate) fn fetch(
    url: &str,
    part: &Path,
    expected: &Expected<'_>,
    final_path: &Path,
    opts: &PullOptions,
) -> Result<(), HubError> {
    if let Some(dir) = part.parent() {
        std::fs::create_dir_all(dir).map_err(|e| HubError::io("create", dir, e))?;
    }
    let have = file_len(part);
    if have > 0 {
        opts.progress.note(&format!(
            "{}: resuming {url} at byte {have} of {}",
            expected.name, expected.size
        ));
    } else {
        opts.progress
            .note(&format!("{}: downloading {url}", expected.name));
    }
    download_resumable(url, part, expected.size, opts, expected.name)?;
    let label = format!("{}: verifying sha256", expected.name);
    if let Err(e) = verify_file(part, expected, opts.progress, &label) {
        // A complete but wrong file cannot be resumed into a right one.
        let _ = std::fs::remove_file(part);
        return Err(e);
    }
    match std::fs::rename(part, final_path) {
        Ok(()) => {
            sync_dir(final_path);
            if let Some(dir) = part.parent() {
                let _ = std::fs::remove_dir(dir);
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::CrossesDevices => {
            // downloads/ and models/ on different file systems: copy atomically.
            let models_dir = final_path.parent().unwrap_or(Path::new("."));
            ensure_space(models_dir, expected.size)?;
            let mut asm = Assembly::create(final_path, expected.clone(), opts.progress, &label)?;
            let mut src = File::open(part).map_err(|e| HubError::io("open", part, e))?;
            asm.append(&mut src as &mut dyn Read, part)?;
            asm.finish()?;
            let _ = std::fs::remove_file(part);
            Ok(())
        }
        Err(e) => Err(HubError::io("rename into place", final_path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_urls_use_resolve_main() {
        assert_eq!(
            hub_url("https://huggingface.co/", "Qwen/X-GGUF", "x.gguf"),
            "https://huggingface.co/Qwen/X-GGUF/resolve/main/x.gguf"
        );
    }

    #[test]
    fn content_range_start_is_parsed() {
        assert_eq!(content_range_start("bytes 100-199/200"), Some(100));
        assert_eq!(content_range_start("bytes */200"), None);
        assert_eq!(content_range_start("items 1-2/3"), None);
    }
}
