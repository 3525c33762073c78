//! Atomic assembly: parts are streamed into `<file>.tmp-<pid>-<n>` beside the final file
//! while being hashed; only a file whose size and SHA-256 match is renamed into place.
//! A temporary file is removed on every error path (and on drop), so a half file never
//! looks complete.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::HubError;
use crate::progress::{Meter, Progress};

const BUF_SIZE: usize = 1 << 20;

/// Distinguishes temporary files of one process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// What the assembled file must be.
#[derive(Debug, Clone)]
pub(crate) struct Expected<'a> {
    /// Model name (for messages).
    pub name: &'a str,
    /// Exact size in bytes.
    pub size: u64,
    /// Lowercase hex SHA-256.
    pub sha256: &'a str,
}

/// A file being assembled under a temporary name.
pub(crate) struct Assembly<'a> {
    expected: Expected<'a>,
    final_path: PathBuf,
    tmp_path: PathBuf,
    file: File,
    hasher: Sha256,
    written: u64,
    committed: bool,
    meter: Option<Meter>,
    buf: Vec<u8>,
}

/// The prefix of every temporary name for `final_path` (used to clean stale ones).
pub(crate) fn tmp_prefix(final_path: &Path) -> String {
    let file_name = final_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{file_name}.tmp-")
}

/// Removes temporary files of `final_path` left by a killed process. Call only while
/// holding the model's lock (a live assembly always holds it).
pub(crate) fn remove_stale_tmp_files(final_path: &Path) {
    let (Some(dir), prefix) = (final_path.parent(), tmp_prefix(final_path)) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            tracing::debug!(path = %entry.path().display(), "removing stale temporary file");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl<'a> Assembly<'a> {
    /// Creates the temporary file beside `final_path`.
    pub(crate) fn create(
        final_path: &Path,
        expected: Expected<'a>,
        progress: Progress,
        label: &str,
    ) -> Result<Self, HubError> {
        let tmp_path = final_path.with_file_name(format!(
            "{}{}-{}",
            tmp_prefix(final_path),
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp_path)
            .map_err(|e| HubError::io("create", &tmp_path, e))?;
        let meter = Meter::new(progress, label, expected.size, 0);
        Ok(Assembly {
            expected,
            final_path: final_path.to_path_buf(),
            tmp_path,
            file,
            hasher: Sha256::new(),
            written: 0,
            committed: false,
            meter: Some(meter),
            buf: vec![0; BUF_SIZE],
        })
    }

    /// Path of the temporary file.
    #[cfg(test)]
    pub(crate) fn tmp_path(&self) -> &Path {
        &self.tmp_path
    }

    /// Streams all of `reader` (a part read from `source`) into the file, hashing it.
    /// Fails early when the data outgrows the expected size.
    pub(crate) fn append(&mut self, reader: &mut dyn Read, source: &Path) -> Result<u64, HubError> {
        let mut total = 0u64;
        loop {
            let n = match reader.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(HubError::io("read", source, e)),
            };
            let chunk = &self.buf[..n];
            self.written += n as u64;
            if self.written > self.expected.size {
                return Err(HubError::SizeMismatch {
                    name: self.expected.name.to_string(),
                    expected: self.expected.size,
                    got: self.written,
                });
            }
            self.hasher.update(chunk);
            self.file
                .write_all(chunk)
                .map_err(|e| HubError::io("write", &self.tmp_path, e))?;
            if let Some(m) = &mut self.meter {
                m.inc(n as u64);
            }
            total += n as u64;
        }
        Ok(total)
    }

    /// Checks size and checksum, syncs, and renames the file into place.
    pub(crate) fn finish(mut self) -> Result<PathBuf, HubError> {
        if let Some(m) = self.meter.take() {
            m.finish();
        }
        if self.written != self.expected.size {
            return Err(HubError::SizeMismatch {
                name: self.expected.name.to_string(),
                expected: self.expected.size,
                got: self.written,
            });
        }
        let got = to_hex(&std::mem::take(&mut self.hasher).finalize());
        if got != self.expected.sha256 {
            return Err(HubError::ChecksumMismatch {
                name: self.expected.name.to_string(),
                expected: self.expected.sha256.to_string(),
                got,
            });
        }
        self.file
            .sync_all()
            .map_err(|e| HubError::io("sync", &self.tmp_path, e))?;
        std::fs::rename(&self.tmp_path, &self.final_path)
            .map_err(|e| HubError::io("rename into place", &self.final_path, e))?;
        self.committed = true;
        sync_dir(&self.final_path);
        Ok(self.final_path.clone())
    }
}

impl Drop for Assembly<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

/// Makes a rename durable by syncing the directory that holds `path` (best effort).
pub(crate) fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent()
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// Hashes an existing file, checking its size and SHA-256 against `expected`.
pub(crate) fn verify_file(
    path: &Path,
    expected: &Expected<'_>,
    progress: Progress,
    label: &str,
) -> Result<(), HubError> {
    let mut file = File::open(path).map_err(|e| HubError::io("open", path, e))?;
    let mut meter = Meter::new(progress, label, expected.size, 0);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; BUF_SIZE];
    let mut size = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(HubError::io("read", path, e)),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
        meter.inc(n as u64);
    }
    meter.finish();
    if size != expected.size {
        return Err(HubError::SizeMismatch {
            name: expected.name.to_string(),
            expected: expected.size,
            got: size,
        });
    }
    let got = to_hex(&hasher.finalize());
    if got != expected.sha256 {
        return Err(HubError::ChecksumMismatch {
            name: expected.name.to_string(),
            expected: expected.sha256.to_string(),
            got,
        });
    }
    Ok(())
}

/// Lowercase hex of a byte string.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha_hex(data: &[u8]) -> String {
        to_hex(&Sha256::digest(data))
    }

    /// A reader that yields `data` and then fails, like a broken download or a disk error.
    struct FailingReader<'a> {
        data: &'a [u8],
    }

    impl Read for FailingReader<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.data.is_empty() {
                return Err(std::io::Error::other("connection reset (simulated)"));
            }
            let n = buf.len().min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn dir_entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn hex_of_sha256_matches_known_vector() {
        assert_eq!(
            sha_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn parts_concatenate_in_order_and_rename_into_place() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let final_path = dir.path().join("m.gguf");
        let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
        let all = [a.clone(), b.clone()].concat();
        let sha = sha_hex(&all);
        let expected = Expected {
            name: "m",
            size: all.len() as u64,
            sha256: &sha,
        };
        let mut asm = Assembly::create(&final_path, expected, Progress::Hidden, "m")?;
        asm.append(&mut a.as_slice(), Path::new("a"))?;
        assert!(
            !final_path.exists(),
            "final file must not exist before finish"
        );
        asm.append(&mut b.as_slice(), Path::new("b"))?;
        let p = asm.finish()?;
        assert_eq!(p, final_path);
        assert_eq!(std::fs::read(&final_path).ok(), Some(all));
        assert_eq!(dir_entries(dir.path()), vec!["m.gguf".to_string()]);
        Ok(())
    }

    #[test]
    fn interrupted_assembly_leaves_no_final_and_no_temporary_file() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let final_path = dir.path().join("m.gguf");
        let data = vec![7u8; 10_000];
        let sha = sha_hex(&data);
        let expected = Expected {
            name: "m",
            size: data.len() as u64,
            sha256: &sha,
        };
        let mut asm = Assembly::create(&final_path, expected.clone(), Progress::Hidden, "m")?;
        let tmp = asm.tmp_path().to_path_buf();
        let err = asm.append(
            &mut FailingReader {
                data: &data[..4000],
            },
            Path::new("part1"),
        );
        assert!(
            matches!(err, Err(HubError::Io { action: "read", .. })),
            "{err:?}"
        );
        assert!(tmp.exists(), "the temporary file exists while assembling");
        drop(asm);
        assert!(!final_path.exists());
        assert!(
            dir_entries(dir.path()).is_empty(),
            "{:?}",
            dir_entries(dir.path())
        );

        // Stopped between parts (a panic or kill after part 1): same result.
        let mut asm = Assembly::create(&final_path, expected, Progress::Hidden, "m")?;
        asm.append(&mut &data[..5000], Path::new("part1"))?;
        drop(asm);
        assert!(dir_entries(dir.path()).is_empty());
        Ok(())
    }

    #[test]
    fn corrupt_data_gives_checksum_error_and_no_file() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let final_path = dir.path().join("m.gguf");
        let good = vec![9u8; 4096];
        let sha = sha_hex(&good);
        let mut bad = good.clone();
        bad[100] ^= 1;
        let expected = Expected {
            name: "m",
            size: good.len() as u64,
            sha256: &sha,
        };
        let mut asm = Assembly::create(&final_path, expected, Progress::Hidden, "m")?;
        asm.append(&mut bad.as_slice(), Path::new("p"))?;
        match asm.finish() {
            Err(HubError::ChecksumMismatch { expected, got, .. }) => {
                assert_eq!(expected, sha);
                assert_eq!(got, sha_hex(&bad));
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
        assert!(dir_entries(dir.path()).is_empty());
        Ok(())
    }

    #[test]
    fn too_long_or_too_short_data_gives_size_error_and_no_file() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let final_path = dir.path().join("m.gguf");
        let data = vec![3u8; 2000];
        let sha = sha_hex(&data);
        let expected = Expected {
            name: "m",
            size: 1000,
            sha256: &sha,
        };
        let mut asm = Assembly::create(&final_path, expected.clone(), Progress::Hidden, "m")?;
        let r = asm.append(&mut data.as_slice(), Path::new("p"));
        assert!(
            matches!(r, Err(HubError::SizeMismatch { expected: 1000, .. })),
            "{r:?}"
        );
        drop(asm);
        let mut asm = Assembly::create(&final_path, expected, Progress::Hidden, "m")?;
        asm.append(&mut &data[..999], Path::new("p"))?;
        let r = asm.finish();
        assert!(
            matches!(
                r,
                Err(HubError::SizeMismatch {
                    expected: 1000,
                    got: 999,
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(dir_entries(dir.path()).is_empty());
        Ok(())
    }

    #[test]
    fn stale_temporary_files_are_removed_but_others_kept() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let final_path = dir.path().join("m.gguf");
        for name in [
            "m.gguf.tmp-1234-0",
            "m.gguf.tmp-99-3",
            "other.gguf.tmp-1-0",
            "m.gguf",
        ] {
            std::fs::write(dir.path().join(name), b"x")
                .map_err(|e| HubError::io("write", name, e))?;
        }
        remove_stale_tmp_files(&final_path);
        assert_eq!(
            dir_entries(dir.path()),
            vec!["m.gguf".to_string(), "other.gguf.tmp-1-0".to_string()]
        );
        Ok(())
    }

    #[test]
    fn verify_file_checks_size_and_checksum() -> Result<(), HubError> {
        let dir = tempfile::tempdir().map_err(|e| HubError::io("create", "tmp", e))?;
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello").map_err(|e| HubError::io("write", &p, e))?;
        let sha = sha_hex(b"hello");
        let ok = Expected {
            name: "f",
            size: 5,
            sha256: &sha,
        };
        verify_file(&p, &ok, Progress::Hidden, "f")?;
        let wrong_size = Expected {
            size: 6,
            ..ok.clone()
        };
        assert!(matches!(
            verify_file(&p, &wrong_size, Progress::Hidden, "f"),
            Err(HubError::SizeMismatch { .. })
        ));
        let other = sha_hex(b"other");
        let wrong_sha = Expected {
            sha256: &other,
            ..ok
        };
        assert!(matches!(
            verify_file(&p, &wrong_sha, Progress::Hidden, "f"),
            Err(HubError::ChecksumMismatch { .. })
        ));
        Ok(())
    }
}
