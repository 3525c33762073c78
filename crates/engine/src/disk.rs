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
//! **File format** (little-endian, version 2): magic `LSKVBLK\0`, format version (u32),
//! namespace (32 bytes), chained hash (32), parent flag (u8) and parent hash (32, zero
//! without a parent), token count (u32) and the tokens (u32 each), payload length (u64)
//! and the payload (the backend's exported block), then the CRC-32 (u32) of everything
//! before it. The checksum guards against damage (a torn or bit-rotted file), not against
//! a forger: the name and the header fields already tie the file to its block. A file is
//! accepted only if every field matches what the reader expects, tokens included;
//! otherwise (truncated, corrupt, another model's, another format version's — version 1
//! files ended in a SHA-256 instead) it is removed and the block is computed as if it had
//! never been saved. At start the writer thread also reads the header of every file and
//! removes those of another format version, so old files do not sit in the size limit.
//!
//! **Reading** runs on a few reader threads: to restore a chain of blocks the engine
//! hands over the whole chain (`DiskTier::read_chain`), the readers read and check the
//! files up to a bounded number of bytes ahead, and the engine copies each checked block
//! into the KV pool in chain order while the next ones are being read. The first block
//! missing or rejected ends the chain (the rest is computed).
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
use std::collections::{HashMap, VecDeque};
use std::fs;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError, channel, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The version of the numerics a saved block was computed with. Bump it whenever the
/// canonical order (ARCHITECTURE.md, "Numerics") or anything else that changes a KV value
/// changes: every block saved before then stops matching.
pub const KV_NUMERICS_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"LSKVBLK\0";
const FILE_VERSION: u32 = 2;
const EXT: &str = "kvb";
const TMP_PREFIX: &str = ".tmp-";
/// A temporary file this old is a crashed writer's leftover (a live writer renames within
/// seconds).
const STALE_TMP: Duration = Duration::from_secs(3600);
/// Bytes of block payloads the writer queue holds at most.
const QUEUE_BYTES: usize = 256 << 20;
/// Fixed bytes of a file besides the tokens and the payload.
const FIXED: usize = 8 + 4 + 32 + 32 + 1 + 32 + 4 + 8 + 4;
/// Reader threads (they mostly wait on the disk; several keep a fast device busy).
const READERS: usize = 4;
/// Bytes of block files read ahead of the engine's copy into the KV pool, at most.
const READ_AHEAD_BYTES: usize = 32 << 20;

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
    /// Bytes of block files read and checked (blocks read ahead and then not needed
    /// included; [`Self::restored_bytes`] counts those restored).
    pub bytes_read: u64,
    /// Time the reader threads spent reading and checking block files, µs, summed over
    /// the readers (they read in parallel: [`Self::restore_micros`] is the wall time).
    pub read_micros: u64,
    /// Chains of blocks restored (one per waiting request that found blocks on disk).
    pub restores: u64,
    /// Bytes of the block files restored into the KV pool.
    pub restored_bytes: u64,
    /// Wall time of those restores, µs: reading, checking and copying into the KV pool,
    /// from the first block asked for to the last one copied (`restored_bytes` over it
    /// is the restore rate).
    pub restore_micros: u64,
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
    restores: AtomicU64,
    restored_bytes: AtomicU64,
    restore_micros: AtomicU64,
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
            restores: l(&c.restores),
            restored_bytes: l(&c.restored_bytes),
            restore_micros: l(&c.restore_micros),
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
        let sum = crc32fast::hash(&out);
        out.extend_from_slice(&sum.to_le_bytes());
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
        let (body, sum) = bytes.split_at(bytes.len() - 4);
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
        if crc32fast::hash(body).to_le_bytes() != sum {
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

impl DiskShared {
    /// Reads and checks one block file; `None` when it is missing or was rejected (and
    /// removed). A hit refreshes its recency.
    fn read(
        &self,
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[u32],
    ) -> Option<ReadBlock> {
        let t0 = std::time::Instant::now();
        let key = self.key(hash);
        let path = self.path(&key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                lock(&self.index).remove(&key);
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::debug!("disk cache: reading {}: {e}", path.display());
                }
                return None;
            }
        };
        match self.decode(&bytes, hash, parent, tokens) {
            Ok(payload) => {
                self.counters
                    .bytes_read
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                self.counters
                    .read_micros
                    .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
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
                // The recency a later start (or another process) sees.
                if let Ok(f) = fs::OpenOptions::new().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Some(ReadBlock { bytes, payload })
            }
            Err(why) => {
                self.reject(&key, why);
                None
            }
        }
    }

    /// Removes the files among `keys` whose header is not this format version's (files
    /// of an older lockstep, or not block files at all).
    fn sweep_other_formats(&self, keys: &[[u8; 32]]) {
        let mut want = [0u8; 12];
        want[..8].copy_from_slice(MAGIC);
        want[8..].copy_from_slice(&FILE_VERSION.to_le_bytes());
        for key in keys {
            let mut head = [0u8; 12];
            let read = fs::File::open(self.path(key)).and_then(|mut f| f.read_exact(&mut head));
            match read {
                Ok(()) if head == want => {}
                Ok(()) => self.reject(key, "another file format version, or not a block file"),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => self.reject(key, "truncated"),
                // Gone (evicted, or removed by another process) or unreadable now: a
                // read will decide.
                Err(_) => {}
            }
        }
    }
}

/// One block of a chain to restore: its hash, its parent's, and the tokens it must hold.
pub(crate) struct ChainBlock {
    /// The block's chained hash.
    pub(crate) hash: BlockHash,
    /// The previous block's chained hash (`None` for the first block of a sequence).
    pub(crate) parent: Option<BlockHash>,
    /// The block's tokens.
    pub(crate) tokens: Vec<u32>,
}

/// One block for a reader thread.
struct ReadJob {
    block: ChainBlock,
    /// Set when the engine no longer wants the chain (skip the read).
    cancel: Arc<AtomicBool>,
    done: SyncSender<Option<ReadBlock>>,
}

/// A chain being read ahead by the reader threads ([`DiskTier::read_chain`]).
pub(crate) struct ChainRead<'a> {
    tier: &'a DiskTier,
    /// Blocks not yet handed to a reader.
    todo: VecDeque<ChainBlock>,
    /// Blocks handed to the readers, in chain order.
    pending: VecDeque<Receiver<Option<ReadBlock>>>,
    cancel: Arc<AtomicBool>,
    /// Blocks read ahead at most.
    ahead: usize,
}

impl ChainRead<'_> {
    /// The next block of the chain, checked; `None` at the end of the chain or at the
    /// first block missing or rejected (the chain ends there).
    pub(crate) fn next(&mut self) -> Option<ReadBlock> {
        while self.pending.len() < self.ahead {
            let Some(block) = self.todo.pop_front() else {
                break;
            };
            let (done, rx) = sync_channel(1);
            let job = ReadJob {
                block,
                cancel: Arc::clone(&self.cancel),
                done,
            };
            let unsent = match &self.tier.read_tx {
                Some(tx) => tx.send(job).err().map(|e| e.0),
                None => Some(job),
            };
            if let Some(job) = unsent {
                // No reader thread (none could be started): read here.
                let b = &job.block;
                let got = self.tier.shared.read(&b.hash, b.parent.as_ref(), &b.tokens);
                let _ = job.done.send(got);
            }
            self.pending.push_back(rx);
        }
        let got = self.pending.pop_front()?.recv().ok().flatten();
        if got.is_none() {
            self.todo.clear();
            self.pending.clear();
            self.cancel.store(true, Ordering::Relaxed);
        }
        got
    }
}

impl Drop for ChainRead<'_> {
    /// Blocks read ahead and not taken are dropped; those not yet started are skipped.
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

fn reader_loop(shared: &DiskShared, rx: &Mutex<Receiver<ReadJob>>) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(e) => e.into_inner().recv(),
        };
        let Ok(job) = job else { return };
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let b = &job.block;
        let got = shared.read(&b.hash, b.parent.as_ref(), &b.tokens);
        let _ = job.done.send(got);
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

    /// Bytes of the whole file.
    pub(crate) fn file_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }
}

/// The disk tier: the shared index and counters, the writer thread and the readers.
pub(crate) struct DiskTier {
    shared: Arc<DiskShared>,
    tx: Option<SyncSender<Job>>,
    writer: Option<JoinHandle<()>>,
    read_tx: Option<Sender<ReadJob>>,
    readers: Vec<JoinHandle<()>>,
    /// Bytes of one block's payload.
    block_bytes: usize,
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
        let keys: Vec<[u8; 32]> = lock(&shared.index).files.keys().copied().collect();
        let (tx, rx) = sync_channel((QUEUE_BYTES / block_bytes.max(1)).clamp(4, 4096));
        let worker = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name("lockstep-kv-disk".into())
            .spawn(move || {
                worker.sweep_other_formats(&keys);
                writer_loop(&worker, rx);
            })?;
        let (read_tx, read_rx) = channel();
        let read_rx = Arc::new(Mutex::new(read_rx));
        let mut readers = Vec::new();
        for i in 0..READERS {
            let (sh, rx) = (Arc::clone(&shared), Arc::clone(&read_rx));
            match std::thread::Builder::new()
                .name(format!("lockstep-kv-read-{i}"))
                .spawn(move || reader_loop(&sh, &rx))
            {
                Ok(h) => readers.push(h),
                Err(e) => {
                    tracing::debug!("disk cache: starting a reader thread: {e}");
                    break;
                }
            }
        }
        Ok(DiskTier {
            shared,
            tx: Some(tx),
            writer: Some(writer),
            read_tx: (!readers.is_empty()).then_some(read_tx),
            readers,
            block_bytes,
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

    /// Reads and checks the block `hash` (which must hold `tokens` after `parent`) on the
    /// calling thread; `None` when it is missing or was rejected (and removed).
    #[cfg(test)]
    pub(crate) fn read(
        &self,
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[u32],
    ) -> Option<ReadBlock> {
        self.shared.read(hash, parent, tokens)
    }

    /// Starts reading the chain `blocks` (each the child of the one before) on the reader
    /// threads; [`ChainRead::next`] hands the checked blocks back in order.
    pub(crate) fn read_chain(&self, blocks: Vec<ChainBlock>) -> ChainRead<'_> {
        ChainRead {
            tier: self,
            todo: blocks.into(),
            pending: VecDeque::new(),
            cancel: Arc::new(AtomicBool::new(false)),
            ahead: (READ_AHEAD_BYTES / self.block_bytes.max(1)).clamp(2, 64),
        }
    }

    /// Counts one restored chain: `bytes` of block files copied into the KV pool in
    /// `took`, and says so in the log.
    pub(crate) fn count_restore(&self, blocks: u64, bytes: u64, took: Duration) {
        let c = &self.shared.counters;
        c.restores.fetch_add(1, Ordering::Relaxed);
        c.restored_bytes.fetch_add(bytes, Ordering::Relaxed);
        c.restore_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        tracing::info!(
            "disk cache: restored {blocks} blocks ({:.1} MB) in {:.3} s ({:.2} GB/s)",
            bytes as f64 / 1e6,
            secs,
            if secs > 0.0 {
                bytes as f64 / secs / 1e9
            } else {
                0.0
            }
        );
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
    /// Finishes the queued writes, then stops the writer and the readers.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.read_tx = None;
        for r in self.readers.drain(..) {
            let _ = r.join();
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
    fn files_of_another_format_version_are_removed_at_start_and_at_read() {
        let dir = TempDir::new("version");
        let bs = blocks(6, 3);
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        save(&tier, &bs);
        let path = |b: &Block| tier.shared.path(&tier.shared.key(&b.0));
        // Block 0 as an older lockstep wrote it: version 1, the same name.
        let mut old = fs::read(path(&bs[0])).unwrap();
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        fs::write(path(&bs[0]), &old).unwrap();
        // Read now (no sweep since): refused and removed.
        assert_eq!(read(&tier, &bs[0]), None);
        assert!(!path(&bs[0]).exists());
        // Written again as version 1, plus a file under a block's name that is no block
        // file: the next start removes both without being asked for them.
        fs::write(path(&bs[0]), &old).unwrap();
        fs::write(path(&bs[1]), b"some other program's file").unwrap();
        let (p0, p1, p2) = (path(&bs[0]), path(&bs[1]), path(&bs[2]));
        drop(tier);
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        tier.flush();
        assert!(!p0.exists() && !p1.exists(), "{:?}", files(&dir.0));
        assert!(p2.exists(), "a current file stays");
        let m = tier.shared().metrics();
        assert_eq!((m.rejected_files, m.files), (2, 1), "{m:?}");
        assert_eq!(read(&tier, &bs[2]).as_deref(), Some(bs[2].3.as_slice()));
    }

    fn chain(bs: &[Block]) -> Vec<ChainBlock> {
        bs.iter()
            .map(|b| ChainBlock {
                hash: b.0,
                parent: b.1,
                tokens: b.2.clone(),
            })
            .collect()
    }

    #[test]
    fn a_chain_is_read_ahead_in_order_and_ends_at_the_first_bad_block() {
        let dir = TempDir::new("chain");
        let bs = blocks(7, 40);
        let tier = DiskTier::open(&cfg(&dir.0, 1 << 30, 1), "layout", PAYLOAD).unwrap();
        save(&tier, &bs);
        // Whole: every block, in chain order, exactly.
        let mut reads = tier.read_chain(chain(&bs));
        for (i, b) in bs.iter().enumerate() {
            let got = reads.next().unwrap_or_else(|| panic!("block {i}"));
            assert_eq!(got.payload(), b.3.as_slice(), "block {i}");
            assert_eq!(
                got.file_bytes(),
                fs::metadata(tier.shared.path(&tier.shared.key(&b.0)))
                    .unwrap()
                    .len()
            );
        }
        assert!(reads.next().is_none(), "the end of the chain");
        drop(reads);
        // Block 25 corrupt: blocks 0..25, then the end (nothing after it is handed out).
        let p25 = tier.shared.path(&tier.shared.key(&bs[25].0));
        let mut bytes = fs::read(&p25).unwrap();
        let at = bytes.len() - 10;
        bytes[at] ^= 0x10;
        fs::write(&p25, &bytes).unwrap();
        let mut reads = tier.read_chain(chain(&bs));
        for (i, b) in bs[..25].iter().enumerate() {
            assert_eq!(
                reads.next().map(|r| r.payload().to_vec()).as_deref(),
                Some(b.3.as_slice()),
                "block {i}"
            );
        }
        assert!(
            reads.next().is_none(),
            "the chain ends at the corrupt block"
        );
        assert!(reads.next().is_none(), "and stays ended");
        drop(reads);
        assert!(!p25.exists(), "the corrupt block was removed");
        assert_eq!(tier.shared().metrics().rejected_files, 1);
        // Dropped half way: the readers go on serving later chains.
        let mut reads = tier.read_chain(chain(&bs[..20]));
        assert!(reads.next().is_some());
        drop(reads);
        let mut reads = tier.read_chain(chain(&bs[..3]));
        assert!((0..3).all(|_| reads.next().is_some()));
        drop(reads);
        // A chain whose tokens differ from the saved ones (another prompt under the
        // same hashes) hands out nothing.
        let mut other = chain(&bs[..3]);
        other[0].tokens[0] += 1;
        assert!(tier.read_chain(other).next().is_none());
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
