//! The disk tier of the prefix cache: full, committed KV blocks saved as files, so a
//! repeated prompt prefix survives a restart of the process or an eviction from RAM.
//!
//! **Addressing.** A block file is named by the SHA-256 of a *namespace* and the block's
//! chained hash ([`crate::prefix::chain_hash`]: its tokens and everything before them).
//! The namespace is the SHA-256 of the model's identity (the caller's hash of the model
//! file), [`KV_NUMERICS_VERSION`] and the backend's description of its KV block layout
//! (element type, shapes, windows), so a block is only ever found by the same model with
//! the same numerics and layout; anything else never matches.
//!
//! **File format** (little-endian): magic `LSKVBLK\0`, format version (u32), namespace
//! (32 bytes), chained hash (32), parent flag (u8) and parent hash (32, zero without a
//! parent), token count (u32) and the tokens (u32 each), payload length (u64) and the
//! payload (the backend's exported block), then the SHA-256 of everything before it.
//! A file is accepted only if every field matches what the reader expects, tokens
//! included; otherwise (truncated, corrupt, another model's, another version's) it is
//! removed and the block is computed as if it had never been saved.
//!
//! **Writing** happens on one writer thread behind a bounded queue: the step thread copies
//! the block out of the KV cache and hands it over; when the queue is full the write is
//! dropped (counted), never waited for. A file is written under a temporary name and
//! renamed into place, so a reader (this process or another one sharing the directory)
//! sees a whole file or none; a crash leaves at worst a temporary file, removed at a later
//! start once it is an hour old. A failed write (disk full, directory gone) turns writing
//! off with one warning: the engine goes on with the RAM prefix cache (reads of blocks
//! already saved continue).
//!
//! **Size.** The directory is kept under a byte limit by removing the least recently used
//! files (a read refreshes a file's modification time, which is the recency a later
//! start sees). Two processes on one directory each keep their own view; a file one of
//! them removed is a miss for the other, never an error.

use crate::prefix::BlockHash;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The version of the numerics a saved block was computed with. Bump it whenever the
/// canonical order (ARCHITECTURE.md, "Numerics") or anything else that changes a KV value
/// changes: every block saved before then stops matching.
pub const KV_NUMERICS_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"LSKVBLK\0";
const FILE_VERSION: u32 = 1;
const EXT: &str = "kvb";
const TMP_PREFIX: &str = ".tmp-";
/// A temporary file this old is a crashed writer's leftover (a live writer renames within
/// seconds).
const STALE_TMP: Duration = Duration::from_secs(3600);
/// Bytes of block payloads the writer queue holds at most.
const QUEUE_BYTES: usize = 256 << 20;
/// Fixed bytes of a file besides the tokens and the payload.
const FIXED: usize = 8 + 4 + 32 + 32 + 1 + 32 + 4 + 8 + 32;

/// Where the disk tier lives, how large it may grow, and which model it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCacheConfig {
    /// The directory of the block files (created if missing). Several models may share
    /// one: each file belongs to one model, and the size limit covers them all.
    pub dir: PathBuf,
    /// Bytes the directory's block files may take; least recently used files are removed
    /// beyond it.
    pub max_bytes: u64,
    /// The model's identity: the SHA-256 of the model file (or another hash that changes
    /// whenever its weights or metadata do).
    pub model_id: [u8; 32],
}

/// Whether the engine's disk tier is working, as decided at start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DiskCacheState {
    /// No disk tier was asked for.
    #[default]
    Off,
    /// A disk tier was asked for but cannot work here; the reason says why (the backend
    /// cannot save its KV, the directory cannot be created, …).
    Unavailable(String),
    /// Blocks are saved to and read back from `dir`.
    On {
        /// The directory.
        dir: PathBuf,
        /// The size limit in bytes.
        max_bytes: u64,
    },
}

/// The disk tier's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskCacheMetrics {
    /// Whether the tier is on ([`DiskCacheState::On`]).
    pub enabled: bool,
    /// Whether new blocks are still written (off after a failed write).
    pub writing: bool,
    /// Blocks read back from disk into the RAM prefix cache instead of being computed.
    pub hit_blocks: u64,
    /// Full prompt blocks found neither in RAM nor on disk when a request was admitted.
    pub miss_blocks: u64,
    /// Bytes of block files read back.
    pub bytes_read: u64,
    /// Time spent reading and checking block files, µs (`bytes_read` over it is the read
    /// rate).
    pub read_micros: u64,
    /// Bytes of block files written.
    pub bytes_written: u64,
    /// Block files written.
    pub blocks_written: u64,
    /// Block files removed to stay under the size limit.
    pub evictions: u64,
    /// Writes dropped because the writer's queue was full.
    pub dropped_writes: u64,
    /// Files found truncated, corrupt or foreign, and removed.
    pub rejected_files: u64,
    /// Writes that failed (then writing stops).
    pub write_errors: u64,
    /// Block files in the directory, as this process knows it.
    pub files: u64,
    /// Bytes of those files.
    pub bytes: u64,
    /// The size limit in bytes.
    pub max_bytes: u64,
}

#[derive(Default)]
struct Counters {
    hit_blocks: AtomicU64,
    miss_blocks: AtomicU64,
    bytes_read: AtomicU64,
    read_micros: AtomicU64,
    bytes_written: AtomicU64,
    blocks_written: AtomicU64,
    evictions: AtomicU64,
    dropped_writes: AtomicU64,
    rejected_files: AtomicU64,
    write_errors: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    size: u64,
    last_used: u64,
}

#[derive(Default)]
struct Index {
    files: HashMap<[u8; 32], Meta>,
    bytes: u64,
    /// The last recency stamp handed out (stamps are strictly increasing).
    clock: u64,
}

impl Index {
    fn stamp(&mut self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.clock = now.max(self.clock + 1);
        self.clock
    }

    fn insert(&mut self, key: [u8; 32], meta: Meta) {
        if let Some(old) = self.files.insert(key, meta) {
            self.bytes = self.bytes.saturating_sub(old.size);
        }
        self.bytes += meta.size;
    }

    fn remove(&mut self, key: &[u8; 32]) {
        if let Some(old) = self.files.remove(key) {
            self.bytes = self.bytes.saturating_sub(old.size);
        }
    }
}

/// What the step thread and the writer thread share; the engine's metrics read it live.
pub(crate) struct DiskShared {
    dir: PathBuf,
    namespace: [u8; 32],
    max_bytes: u64,
    index: Mutex<Index>,
    counters: Counters,
    writing: AtomicBool,
}

fn lock(m: &Mutex<Index>) -> MutexGuard<'_, Index> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn mtime_ns(meta: &fs::Metadata) -> u64 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

impl DiskShared {
    fn key(&self, hash: &BlockHash) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.namespace);
        h.update(hash);
        h.finalize().into()
    }

    fn path(&self, key: &[u8; 32]) -> PathBuf {
        self.dir.join(format!("{}.{EXT}", hex(key)))
    }

    /// A snapshot of the counters.
    pub(crate) fn metrics(&self) -> DiskCacheMetrics {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (files, bytes) = {
            let ix = lock(&self.index);
            (ix.files.len() as u64, ix.bytes)
        };
        DiskCacheMetrics {
            enabled: true,
            writing: self.writing.load(Ordering::Relaxed),
            hit_blocks: l(&c.hit_blocks),
            miss_blocks: l(&c.miss_blocks),
            bytes_read: l(&c.bytes_read),
            read_micros: l(&c.read_micros),
            bytes_written: l(&c.bytes_written),
            blocks_written: l(&c.blocks_written),
            evictions: l(&c.evictions),
            dropped_writes: l(&c.dropped_writes),
            rejected_files: l(&c.rejected_files),
            write_errors: l(&c.write_errors),
            files,
            bytes,
            max_bytes: self.max_bytes,
        }
    }

    /// Removes least recently used files until the directory fits the limit.
    fn evict_to_limit(&self) {
        loop {
            let victim = {
                let mut ix = lock(&self.index);
                if ix.bytes <= self.max_bytes {
                    return;
                }
                let Some((&key, _)) = ix.files.iter().min_by_key(|(k, m)| (m.last_used, **k))
                else {
                    return;
                };
                ix.remove(&key);
                key
            };
            match fs::remove_file(self.path(&victim)) {
                Ok(()) => {
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::debug!("disk cache: removing an evicted block: {e}"),
            }
        }
    }

    /// Removes a file that failed validation.
    fn reject(&self, key: &[u8; 32], why: &str) {
        lock(&self.index).remove(key);
        let path = self.path(key);
        tracing::debug!("disk cache: removing {}: {why}", path.display());
        let _ = fs::remove_file(path);
        self.counters.rejected_files.fetch_add(1, Ordering::Relaxed);
    }

    fn encode(
        &self,
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        payload: &[u8],
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + 4 * tokens.len() + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FILE_VERSION.to_le_bytes());
        out.extend_from_slice(&self.namespace);
        out.extend_from_slice(hash);
        out.push(u8::from(parent.is_some()));
        out.extend_from_slice(parent.unwrap_or(&[0u8; 32]));
        out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(payload);
        let sum: [u8; 32] = Sha256::digest(&out).into();
        out.extend_from_slice(&sum);
        out
    }

    /// Checks a file's bytes against what the reader expects; the payload's range.
    fn decode(
        &self,
        bytes: &[u8],
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[u32],
    ) -> Result<std::ops::Range<usize>, &'static str> {
        let want_len = FIXED + 4 * tokens.len();
        if bytes.len() < want_len {
            return Err("truncated");
        }
        let (body, sum) = bytes.split_at(bytes.len() - 32);
        let mut at = 0usize;
        let mut take = |n: usize| {
            let s = body.get(at..at + n);
            at += n;
            s.ok_or("truncated")
        };
        if take(8)? != MAGIC {
            return Err("not a lockstep KV block file");
        }
        if take(4)? != FILE_VERSION.to_le_bytes() {
            return Err("another file format version");
        }
        if take(32)? != self.namespace {
            return Err("another model, numerics version or KV layout");
        }
        if take(32)? != hash {
            return Err("another block");
        }
        let has_parent = take(1)?[0];
        let p = take(32)?;
        match (has_parent, parent) {
            (0, None) => {}
            (1, Some(want)) if p == want => {}
            _ => return Err("another parent block"),
        }
        if take(4)? != (tokens.len() as u32).to_le_bytes() {
            return Err("another block size");
        }
        let toks = take(4 * tokens.len())?;
        let n = u64::from_le_bytes(take(8)?.try_into().map_err(|_| "truncated")?);
        let start = at;
        if n != (body.len() - start) as u64 {
            return Err("truncated or padded");
        }
        let got: [u8; 32] = Sha256::digest(body).into();
        if got.as_slice() != sum {
            return Err("checksum mismatch");
        }
        let same_tokens = toks
            .chunks_exact(4)
            .zip(tokens)
            .all(|(c, t)| c == t.to_le_bytes());
        if !same_tokens {
            return Err("other tokens under the same hash");
        }
        Ok(start..body.len())
    }

    /// Writes one block file (temporary name, then rename) and keeps the limit.
    fn write(&self, job: &WriteJob, seq: u64) -> io::Result<()> {
        let key = self.key(&job.hash);
        let bytes = self.encode(&job.hash, job.parent.as_ref(), &job.tokens, &job.payload);
        let tmp = self.dir.join(format!(
            "{TMP_PREFIX}{}-{seq}-{}",
            std::process::id(),
            hex(&key)
        ));
        let result = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            drop(f);
            fs::rename(&tmp, self.path(&key))
        })();
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        {
            let mut ix = lock(&self.index);
            let last_used = ix.stamp();
            ix.insert(
                key,
                Meta {
                    size: bytes.len() as u64,
                    last_used,
                },
            );
        }
        let c = &self.counters;
        c.bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        c.blocks_written.fetch_add(1, Ordering::Relaxed);
        self.evict_to_limit();
        Ok(())
    }
}

/// One block to save.
struct WriteJob {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    payload: Vec<u8>,
}

enum Job {
    Write(WriteJob),
    /// Answered once every job queued before it is done.
    #[cfg(test)]
    Flush(SyncSender<()>),
}

/// A block read back from disk, checked.
pub(crate) struct ReadBlock {
    bytes: Vec<u8>,
    payload: std::ops::Range<usize>,
}

impl ReadBlock {
    /// The backend's exported block.
    pub(crate) fn payload(&self) -> &[u8] {
        &self.bytes[self.payload.clone()]
    }
}

/// The disk tier: the shared index and counters, and the writer thread.
pub(crate) struct DiskTier {
    shared: Arc<DiskShared>,
    tx: Option<SyncSender<Job>>,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.shared.dir)
            .finish_non_exhaustive()
    }
}

impl DiskTier {
    /// Opens (creating it if needed) the directory for a backend whose KV blocks are
    /// described by `layout` and take `block_bytes` bytes: indexes the block files there,
    /// removes crashed writers' leftovers, trims to the size limit and starts the writer.
    pub(crate) fn open(
        cfg: &DiskCacheConfig,
        layout: &str,
        block_bytes: usize,
    ) -> io::Result<DiskTier> {
        fs::create_dir_all(&cfg.dir)?;
        let mut ns = Sha256::new();
        ns.update(b"lockstep KV disk cache\0");
        ns.update(cfg.model_id);
        ns.update(KV_NUMERICS_VERSION.to_le_bytes());
        ns.update(layout.as_bytes());
        let mut index = Index::default();
        for entry in fs::read_dir(&cfg.dir)? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            if name.starts_with(TMP_PREFIX) {
                let age = meta.modified().ok().and_then(|t| t.elapsed().ok());
                if age.is_some_and(|a| a > STALE_TMP) {
                    let _ = fs::remove_file(entry.path());
                }
                continue;
            }
            let Some(stem) = name.strip_suffix(&format!(".{EXT}")) else {
                continue;
            };
            match unhex32(stem) {
                Some(key) => index.insert(
                    key,
                    Meta {
                        size: meta.len(),
                        last_used: mtime_ns(&meta),
                    },
                ),
                None => {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        let shared = Arc::new(DiskShared {
            dir: cfg.dir.clone(),
            namespace: ns.finalize().into(),
            max_bytes: cfg.max_bytes,
            index: Mutex::new(index),
            counters: Counters::default(),
            writing: AtomicBool::new(true),
        });
        shared.evict_to_limit();
        let (tx, rx) = sync_channel((QUEUE_BYTES / block_bytes.max(1)).clamp(4, 4096));
        let worker = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name("lockstep-kv-disk".into())
            .spawn(move || writer_loop(&worker, rx))?;
        Ok(DiskTier {
            shared,
            tx: Some(tx),
            writer: Some(writer),
        })
    }

    /// The shared index and counters (for the engine's metrics).
    pub(crate) fn shared(&self) -> Arc<DiskShared> {
        Arc::clone(&self.shared)
    }

    /// Whether new blocks are written.
    pub(crate) fn writing(&self) -> bool {
        self.shared.writing.load(Ordering::Relaxed)
    }

    /// Whether a file for `hash` exists (known, or written by another process since).
    pub(crate) fn contains(&self, hash: &BlockHash) -> bool {
        let key = self.shared.key(hash);
        if lock(&self.shared.index).files.contains_key(&key) {
            return true;
        }
        match fs::metadata(self.shared.path(&key)) {
            Ok(meta) if meta.is_file() => {
                lock(&self.shared.index).insert(
                    key,
                    Meta {
                        size: meta.len(),
                        last_used: mtime_ns(&meta),
                    },
                );
                true
            }
            _ => false,
        }
    }

    /// Reads and checks the block `hash` (which must hold `tokens` after `parent`); `None`
    /// when it is missing or was rejected (and removed). A hit refreshes its recency.
    pub(crate) fn read(
        &self,
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[u32],
    ) -> Option<ReadBlock> {
        let sh = &self.shared;
        let t0 = std::time::Instant::now();
        let key = sh.key(hash);
        let path = sh.path(&key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                lock(&sh.index).remove(&key);
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::debug!("disk cache: reading {}: {e}", path.display());
                }
                return None;
            }
        };
        match sh.decode(&bytes, hash, parent, tokens) {
            Ok(payload) => {
                sh.counters
                    .bytes_read
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                sh.counters
                    .read_micros
                    .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                {
                    let mut ix = lock(&sh.index);
                    let last_used = ix.stamp();
                    ix.insert(
                        key,
                        Meta {
                            size: bytes.len() as u64,
                            last_used,
                        },
                    );
                }
                // The recency a later start (or another process) sees.
                if let Ok(f) = fs::OpenOptions::new().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Some(ReadBlock { bytes, payload })
            }
            Err(why) => {
                sh.reject(&key, why);
                None
            }
        }
    }

    /// Removes the file of `hash` (its payload did not fit the backend).
    pub(crate) fn reject(&self, hash: &BlockHash, why: &str) {
        self.shared.reject(&self.shared.key(hash), why);
    }

    /// Counts blocks restored from disk.
    pub(crate) fn count_hits(&self, blocks: u64) {
        self.shared
            .counters
            .hit_blocks
            .fetch_add(blocks, Ordering::Relaxed);
    }

    /// Counts prompt blocks that had to be computed.
    pub(crate) fn count_misses(&self, blocks: u64) {
        self.shared
            .counters
            .miss_blocks
            .fetch_add(blocks, Ordering::Relaxed);
    }

    /// Queues a block for writing; dropped (and counted) when the queue is full or
    /// writing is off. Never blocks.
    pub(crate) fn submit(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: Vec<u32>,
        payload: Vec<u8>,
    ) {
        if !self.writing() {
            return;
        }
        let Some(tx) = &self.tx else { return };
        let job = Job::Write(WriteJob {
            hash,
            parent,
            tokens,
            payload,
        });
        if let Err(TrySendError::Full(_)) = tx.try_send(job) {
            self.shared
                .counters
                .dropped_writes
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until every block queued so far is written (or dropped after an error).
    #[cfg(test)]
    pub(crate) fn flush(&self) {
        let Some(tx) = &self.tx else { return };
        let (done_tx, done_rx) = sync_channel(1);
        if tx.send(Job::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }
}

impl Drop for DiskTier {
    /// Finishes the queued writes, then stops the writer.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

fn writer_loop(shared: &DiskShared, rx: Receiver<Job>) {
    let mut seq = 0u64;
    for job in rx {
        match job {
            #[cfg(test)]
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Write(job) => {
                if !shared.writing.load(Ordering::Relaxed) {
                    continue;
                }
                seq += 1;
                if let Err(e) = shared.write(&job, seq) {
                    shared.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    shared.writing.store(false, Ordering::Relaxed);
                    tracing::warn!(
                        "disk cache: writing a KV block to {} failed ({e}); no more blocks are \
                         written, the RAM prefix cache goes on (blocks already saved are still \
                         read)",
                        shared.dir.display()
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::chain_hash;
    use std::path::Path;
    use std::sync::atomic::AtomicUsize;

    /// A fresh directory under the system's temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(what: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "lockstep-disk-{what}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            let _ = fs::remove_dir_all(&p);
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Whether `path` names a block file (no temporary file).
    fn is_block_file(path: &Path) -> bool {
        path.extension().is_some_and(|e| e == EXT)
            && path
                .file_stem()
                .and_then(|s| s.to_str())
                .is_some_and(|s| unhex32(s).is_some())
    }

    const BS: usize = 4;
    const PAYLOAD: usize = 64;

    fn cfg(dir: &Path, max_bytes: u64, model: u8) -> DiskCacheConfig {
        DiskCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            model_id: [model; 32],
        }
    }

    /// Blocks of a token run: (hash, parent, tokens, payload).
    type Block = (BlockHash, Option<BlockHash>, Vec<u32>, Vec<u8>);

    fn blocks(seed: u32, n: usize) -> Vec<Block> {
        let mut out: Vec<Block> = Vec::new();
        for d in 0..n {
            let toks: Vec<u32> = (0..BS as u32)
                .map(|i| seed * 1000 + d as u32 * 10 + i)
                .collect();
            let parent = out.last().map(|b| b.0);
            let h = chain_hash(parent.as_ref(), &toks);
            let payload: Vec<u8> = (0..PAYLOAD)
                .map(|i| (i as u32 * 7 + seed + d as u32) as u8)
                .collect();
            out.push((h, parent, toks, payload));
        }
        out
    }

    fn save(tier: &DiskTier, bs: &[Block]) {
        for (h, p, t, pl) in bs {
            tier.submit(*h, *p, t.clone(), pl.clone());
        }
        tier.flush();
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(dir)
            .map(|r| r.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    fn read(tier: &DiskTier, b: &Block) -> Option<Vec<u8>> {
        tier.read(&b.0, b.1.as_ref(), &b.2)
            .map(|r| r.payload().to_vec())
    }

    #[test]
    fn saved_blocks_read_back_exactly_after_a_reopen() {
        let dir = TempDir::new("reopen");
        let bs = blocks(1, 3);
        {
            let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
            save(&tier, &bs);
            let m = tier.shared().metrics();
            assert_eq!((m.blocks_written, m.files), (3, 3));
            assert!(m.bytes_written > 3 * PAYLOAD as u64);
        }
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        assert_eq!(tier.shared().metrics().files, 3);
        for b in &bs {
            assert!(tier.contains(&b.0));
            assert_eq!(read(&tier, b).as_deref(), Some(b.3.as_slice()));
        }
        // Same hash, other tokens (a collision) or another parent: refused.
        let b = &bs[1];
        assert_eq!(
            tier.read(&b.0, b.1.as_ref(), &[9, 9, 9, 9]).map(|_| ()),
            None
        );
        // Another model or layout never finds them.
        let other = DiskTier::open(&cfg(&dir.0, 1 << 30, 2), "layout", PAYLOAD).unwrap();
        assert!(!other.contains(&bs[0].0));
        let other = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout2", PAYLOAD).unwrap();
        assert!(!other.contains(&bs[0].0));
    }

    #[test]
    fn truncated_corrupt_and_foreign_files_are_removed_never_trusted() {
        let dir = TempDir::new("corrupt");
        let bs = blocks(2, 4);
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        save(&tier, &bs);
        let path = |b: &Block| tier.shared.path(&tier.shared.key(&b.0));
        // Block 0: one payload bit flipped. Block 1: truncated. Block 2: another model's
        // file of the same block copied over it. Block 3: garbage.
        let mut bytes = fs::read(path(&bs[0])).unwrap();
        let at = bytes.len() - 40;
        bytes[at] ^= 1;
        fs::write(path(&bs[0]), &bytes).unwrap();
        let bytes = fs::read(path(&bs[1])).unwrap();
        fs::write(path(&bs[1]), &bytes[..bytes.len() / 2]).unwrap();
        let foreign_dir = TempDir::new("foreign");
        let foreign = DiskTier::open(&cfg(&foreign_dir.0, 1 << 30, 7), "layout", PAYLOAD).unwrap();
        save(&foreign, &bs[2..3]);
        let foreign_file = foreign.shared.path(&foreign.shared.key(&bs[2].0));
        fs::copy(foreign_file, path(&bs[2])).unwrap();
        fs::write(path(&bs[3]), b"not a block").unwrap();
        for b in &bs {
            assert_eq!(read(&tier, b), None);
            assert!(!path(b).exists(), "a rejected file is removed");
            assert!(!tier.contains(&b.0));
        }
        assert_eq!(tier.shared().metrics().rejected_files, 4);
        // An empty file, and a file whose name is not a key, at the next start.
        let stray = dir.0.join("zz.kvb");
        fs::write(&stray, b"").unwrap();
        fs::write(path(&bs[0]), b"").unwrap();
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        assert!(!stray.exists());
        assert_eq!(read(&tier, &bs[0]), None);
        assert!(files(&dir.0).is_empty(), "{:?}", files(&dir.0));
    }

    #[test]
    fn the_least_recently_used_files_go_beyond_the_limit() {
        let dir = TempDir::new("lru");
        let bs = blocks(3, 4);
        let one = {
            let probe = TempDir::new("lru-probe");
            let t = DiskTier::open(&cfg(&probe.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
            save(&t, &bs[..1]);
            t.shared().metrics().bytes
        };
        // Room for three files.
        let tier = DiskTier::open(&cfg(&dir.0, 3 * one, 1), "layout", PAYLOAD).unwrap();
        save(&tier, &bs[..3]);
        // Block 0 is used again: block 1 is now the least recently used.
        assert!(read(&tier, &bs[0]).is_some());
        save(&tier, &bs[3..]);
        let m = tier.shared().metrics();
        assert_eq!((m.files, m.evictions), (3, 1));
        assert!(m.bytes <= 3 * one);
        assert!(!tier.contains(&bs[1].0));
        for i in [0, 2, 3] {
            assert!(read(&tier, &bs[i]).is_some(), "block {i}");
        }
        // A smaller limit at the next start trims at once, oldest first.
        drop(tier);
        let tier = DiskTier::open(&cfg(&dir.0, one, 1), "layout", PAYLOAD).unwrap();
        assert_eq!(tier.shared().metrics().files, 1);
        assert!(read(&tier, &bs[3]).is_some(), "the newest file stays");
    }

    #[test]
    fn two_processes_writing_one_directory_leave_only_whole_files() {
        let dir = TempDir::new("shared");
        let a = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        let b = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        let same = blocks(4, 30);
        std::thread::scope(|s| {
            s.spawn(|| save(&a, &same));
            s.spawn(|| save(&b, &same));
        });
        let c = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        for blk in &same {
            assert_eq!(read(&c, blk).as_deref(), Some(blk.3.as_slice()));
        }
        assert!(
            files(&dir.0).iter().all(|p| is_block_file(p)),
            "no temporary files left"
        );
        assert_eq!(c.shared().metrics().rejected_files, 0);
    }

    #[test]
    fn a_failed_write_turns_writing_off_and_reads_go_on() {
        let dir = TempDir::new("fail");
        let bs = blocks(5, 3);
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        save(&tier, &bs[..1]);
        // The directory becomes unwritable: a file now stands where the temporary
        // files would go (the same failure as a full disk: the create or write fails).
        let saved = fs::read(tier.shared.path(&tier.shared.key(&bs[0].0))).unwrap();
        fs::remove_dir_all(&dir.0).unwrap();
        fs::write(&dir.0, b"in the way").unwrap();
        save(&tier, &bs[1..2]);
        let m = tier.shared().metrics();
        assert_eq!((m.write_errors, m.writing), (1, false));
        save(&tier, &bs[2..]);
        assert_eq!(
            tier.shared().metrics().write_errors,
            1,
            "no further attempts"
        );
        fs::remove_file(&dir.0).unwrap();
        fs::create_dir_all(&dir.0).unwrap();
        fs::write(tier.shared.path(&tier.shared.key(&bs[0].0)), saved).unwrap();
        assert!(read(&tier, &bs[0]).is_some(), "reads go on");
    }
}
