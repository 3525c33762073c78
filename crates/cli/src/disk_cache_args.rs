//! `--disk-cache DIR`, `--disk-cache-gib N`, `--no-disk-cache` (for `run`, `chat` and
//! `serve`):
//! the prefix cache's disk tier, and the model identity its blocks are keyed by (the
//! SHA-256 of the model file, computed once per file and remembered under the per-user
//! cache by path, size and modification time).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::Context;
use clap::Args;
use sha2::{Digest, Sha256};

/// The default size limit of the disk cache, GiB.
pub const DEFAULT_GIB: f64 = 8.0;

/// The prompt cache on disk.
#[derive(Debug, Clone, Args)]
pub struct DiskCacheArgs {
    /// Directory of the prompt cache on disk: the KV blocks of prompts are saved there as
    /// they are computed and read back instead of recomputed, also after a restart
    /// (output is bit-identical either way). Default: kv-cache/MODEL-ID under the
    /// per-user cache ($LOCKSTEP_HOME, else $XDG_CACHE_HOME/lockstep, else
    /// ~/.cache/lockstep)
    #[arg(long = "disk-cache", value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Size limit of the disk cache in GiB; the least recently used blocks are removed
    /// beyond it
    #[arg(long = "disk-cache-gib", value_name = "N", default_value_t = DEFAULT_GIB)]
    pub gib: f64,

    /// Keep the prompt cache in RAM only (nothing is read from or written to disk)
    #[arg(long = "no-disk-cache", conflicts_with = "dir")]
    pub off: bool,
}

impl DiskCacheArgs {
    /// The engine's disk tier for the model file at `model`, or `None` with
    /// `--no-disk-cache`, or when `unusable` says why this model or device cannot use it
    /// (said on stderr when `--disk-cache DIR` asked for it or `always_say`; the model
    /// file is then not hashed).
    pub fn config(
        &self,
        model: &Path,
        unusable: Option<&str>,
        always_say: bool,
    ) -> anyhow::Result<Option<engine::DiskCacheConfig>> {
        if self.off {
            return Ok(None);
        }
        if let Some(why) = unusable {
            if always_say || self.dir.is_some() {
                eprintln!("disk cache off: {why}");
            }
            return Ok(None);
        }
        if !self.gib.is_finite() || self.gib <= 0.0 {
            anyhow::bail!(
                "--disk-cache-gib must be a positive number of GiB, got {}",
                self.gib
            );
        }
        let root = hub::cache_root().ok();
        let model_id = model_identity(model, root.as_deref())?;
        let dir = match (&self.dir, &root) {
            (Some(d), _) => d.clone(),
            (None, Some(r)) => r.join("kv-cache").join(hex(&model_id[..8])),
            (None, None) => anyhow::bail!(
                "no per-user cache directory for the disk cache (set LOCKSTEP_HOME, give \
                 --disk-cache DIR, or --no-disk-cache)"
            ),
        };
        Ok(Some(engine::DiskCacheConfig {
            dir,
            max_bytes: (self.gib * (1u64 << 30) as f64) as u64,
            model_id,
        }))
    }
}

/// Why the model in `gguf` cannot use the disk cache, if it cannot: DeepSeek V4 shares no
/// prefixes. (Both backends save and restore their KV blocks.)
pub fn unusable(gguf: &gguf::GgufFile) -> Option<&'static str> {
    if runtime::load::is_deepseek4(gguf) {
        Some("DeepSeek V4 sequences share no prompt prefixes, so nothing is cached")
    } else {
        None
    }
}

/// The start-up line saying where the disk cache is and how full, or why it is off.
pub fn status_line(engine: &engine::Engine) -> Option<String> {
    match engine.disk_cache_state() {
        engine::DiskCacheState::Off => None,
        engine::DiskCacheState::Unavailable(why) => Some(format!("disk cache off: {why}")),
        engine::DiskCacheState::On { dir, max_bytes } => {
            let m = engine.metrics().disk;
            Some(format!(
                "disk cache: {} ({} blocks, {:.2} GiB of {:.2} GiB)",
                dir.display(),
                m.files,
                m.bytes as f64 / (1u64 << 30) as f64,
                *max_bytes as f64 / (1u64 << 30) as f64
            ))
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of the model file. Hashing a large file takes seconds, so the result is
/// remembered under `root`/kv-cache/ids by the file's canonical path, size and
/// modification time (a changed file is hashed again).
pub fn model_identity(path: &Path, root: Option<&Path>) -> anyhow::Result<[u8; 32]> {
    let canon = path
        .canonicalize()
        .with_context(|| format!("reading {}", path.display()))?;
    let meta = std::fs::metadata(&canon).with_context(|| format!("reading {}", path.display()))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let stamp = format!("{} {mtime}", meta.len());
    let memo = root.map(|r| {
        let name = Sha256::digest(canon.to_string_lossy().as_bytes());
        r.join("kv-cache").join("ids").join(hex(&name[..16]))
    });
    if let Some(m) = &memo
        && let Ok(text) = std::fs::read_to_string(m)
        && let Some((s, id)) = text.trim_end().rsplit_once(' ')
        && s == stamp
        && id.len() == 64
    {
        let mut out = [0u8; 32];
        let ok = out.iter_mut().enumerate().all(|(i, o)| {
            u8::from_str_radix(&id[2 * i..2 * i + 2], 16)
                .map(|b| *o = b)
                .is_ok()
        });
        if ok {
            return Ok(out);
        }
    }
    let mut f =
        std::fs::File::open(&canon).with_context(|| format!("reading {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let id: [u8; 32] = h.finalize().into();
    if let Some(m) = &memo {
        // Best effort: without the memo the file is hashed again next time.
        let _ = remember(m, &format!("{stamp} {}\n", hex(&id)));
    }
    Ok(id)
}

fn remember(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_identity_is_the_file_hash_and_follows_changes() {
        let dir = std::env::temp_dir().join(format!("lockstep-model-id-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("m.gguf");
        std::fs::write(&model, b"weights one").unwrap();
        let want: [u8; 32] = Sha256::digest(b"weights one").into();
        assert_eq!(model_identity(&model, Some(&dir)).unwrap(), want);
        // Remembered: a second call reads the memo (same answer).
        assert!(dir.join("kv-cache/ids").read_dir().unwrap().count() == 1);
        assert_eq!(model_identity(&model, Some(&dir)).unwrap(), want);
        // A changed file (other size) is hashed again.
        std::fs::write(&model, b"weights number two").unwrap();
        let want2: [u8; 32] = Sha256::digest(b"weights number two").into();
        assert_eq!(model_identity(&model, Some(&dir)).unwrap(), want2);
        assert!(model_identity(&dir.join("missing.gguf"), Some(&dir)).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
