//! Record a model's logits once, replay them without the model: a deterministic bench of
//! speculation.
//!
//! Speculation's gains depend on what the drafters propose and what the target accepts,
//! and on the machine only through the verify-cost curve. A [`RecordingBackend`] wraps
//! the real backend of a plain run and keeps, for every logit row it computes, the row's
//! top [`TOP_K`] logits keyed by a hash of the row's whole token history. A
//! [`ReplayBackend`] then answers the same histories with those logits (every other entry
//! below them), without the model, and takes the time a fixed verify-cost curve says a
//! forward of that many rows takes ([`StepCurve`], slept). With a replay, the counters
//! (drafted, accepted, coverage, why a step did not draft) are those of the real model
//! and the speed-ups those of the curve, the same on a loaded machine as on a quiet one.
//!
//! A history the recording does not hold (rows after a rejected draft, whose logits the
//! verifier never reads; or a plain path that left the recording) gets flat logits
//! ([`ReplayBackend::misses`] counts them: a plain replay that follows the recording has
//! none).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use engine::{BackendError, ForwardBackend, ForwardRow, KvSlot};

/// Logits kept per recorded row.
pub const TOP_K: usize = 32;
/// File magic of a recording.
const MAGIC: &[u8; 8] = b"LSREPLY1";

/// A hash of a token history, extended one token at a time.
fn extend_hash(h: u64, pos: usize, token: u32) -> u64 {
    let mut x = h ^ (u64::from(token) << 24) ^ (pos as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The hash of the empty history.
const EMPTY: u64 = 0x6C6F_636B_7374_6570;

/// Recorded logit rows: history hash → the row's top logits (best first).
#[derive(Debug, Default)]
pub struct Recording {
    /// Logit row width of the recorded model.
    pub n_vocab: usize,
    rows: HashMap<u64, Vec<(u32, f32)>>,
}

impl Recording {
    /// An empty recording of a model with `n_vocab` logits.
    #[cfg(test)]
    pub fn new(n_vocab: usize) -> Recording {
        Recording {
            n_vocab,
            rows: HashMap::new(),
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Adds the chosen path of a finished sequence: after each prefix `tokens[..=p]`
    /// (`p` from `prompt_len - 1`), a row whose only high logit is `tokens[p + 1]`. A
    /// choice under a grammar is always among the allowed tokens, so such a row replays
    /// it at temperature 0.
    #[cfg(test)]
    pub fn add_path(&mut self, tokens: &[u32], prompt_len: usize) {
        let mut h = EMPTY;
        for (p, &t) in tokens.iter().enumerate() {
            h = extend_hash(h, p, t);
            if p + 1 >= prompt_len
                && let Some(&next) = tokens.get(p + 1)
            {
                self.rows.insert(h, vec![(next, 1.0)]);
            }
        }
    }

    /// Writes the recording to `path`.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let f = std::fs::File::create(path)
            .with_context(|| format!("creating the recording {}", path.display()))?;
        let mut w = BufWriter::new(f);
        w.write_all(MAGIC)?;
        w.write_all(&(self.n_vocab as u64).to_le_bytes())?;
        w.write_all(&(self.rows.len() as u64).to_le_bytes())?;
        let mut keys: Vec<&u64> = self.rows.keys().collect();
        keys.sort();
        for k in keys {
            let top = &self.rows[k];
            w.write_all(&k.to_le_bytes())?;
            w.write_all(&(top.len() as u32).to_le_bytes())?;
            for &(id, v) in top {
                w.write_all(&id.to_le_bytes())?;
                w.write_all(&v.to_le_bytes())?;
            }
        }
        w.flush()?;
        Ok(())
    }

    /// Reads a recording written by [`Recording::save`].
    pub fn load(path: &Path) -> anyhow::Result<Recording> {
        let f = std::fs::File::open(path)
            .with_context(|| format!("opening the recording {}", path.display()))?;
        let mut r = BufReader::new(f);
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            bail!("{} is not a lockstep logit recording", path.display());
        }
        let mut u64b = [0u8; 8];
        let mut u32b = [0u8; 4];
        r.read_exact(&mut u64b)?;
        let n_vocab = usize::try_from(u64::from_le_bytes(u64b))?;
        r.read_exact(&mut u64b)?;
        let n = u64::from_le_bytes(u64b);
        let mut rows = HashMap::new();
        for _ in 0..n {
            r.read_exact(&mut u64b)?;
            let key = u64::from_le_bytes(u64b);
            r.read_exact(&mut u32b)?;
            let k = u32::from_le_bytes(u32b) as usize;
            if k > 4 * TOP_K {
                bail!("{}: a row of {k} logits (corrupt?)", path.display());
            }
            let mut top = Vec::with_capacity(k);
            for _ in 0..k {
                r.read_exact(&mut u32b)?;
                let id = u32::from_le_bytes(u32b);
                r.read_exact(&mut u32b)?;
                let v = f32::from_le_bytes(u32b);
                if id as usize >= n_vocab || !v.is_finite() {
                    bail!("{}: a bad logit entry (corrupt?)", path.display());
                }
                top.push((id, v));
            }
            rows.insert(key, top);
        }
        Ok(Recording { n_vocab, rows })
    }
}

/// Per-slot token history and the hash of each prefix.
#[derive(Debug, Default, Clone)]
struct History {
    tokens: Vec<u32>,
    /// `hashes[p]` = hash of `tokens[..=p]`.
    hashes: Vec<u64>,
}

impl History {
    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.hashes.truncate(len);
    }

    /// Sets `pos` to `token` (cutting what follows) and returns the new prefix hash.
    fn put(&mut self, pos: usize, token: u32) -> Option<u64> {
        if pos > self.tokens.len() {
            return None;
        }
        self.truncate(pos);
        let prev = if pos == 0 {
            EMPTY
        } else {
            self.hashes[pos - 1]
        };
        let h = extend_hash(prev, pos, token);
        self.tokens.push(token);
        self.hashes.push(h);
        Some(h)
    }
}

/// Histories of the slots a backend serves.
#[derive(Debug, Default)]
struct Histories(HashMap<KvSlot, History>);

impl Histories {
    fn get_mut(&mut self, slot: KvSlot) -> &mut History {
        self.0.entry(slot).or_default()
    }

    /// The hash of each row's history (rows in order, each after the previous ones).
    fn apply(&mut self, rows: &[ForwardRow]) -> Vec<Option<u64>> {
        rows.iter()
            .map(|r| self.get_mut(r.slot).put(r.pos, r.token))
            .collect()
    }
}

/// The top `k` entries of a logit row, best first (ties: the lower id first).
fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in row.iter().enumerate() {
        if !v.is_finite() {
            continue;
        }
        if top.len() == k && top.last().is_some_and(|l| l.1 >= v) {
            continue;
        }
        let at = top.partition_point(|e| e.1 >= v);
        top.insert(at, (i as u32, v));
        top.truncate(k);
    }
    top
}

/// A backend that records the logits of another: see the module docs.
pub struct RecordingBackend {
    inner: Box<dyn ForwardBackend>,
    hist: Histories,
    rec: Arc<Mutex<Recording>>,
}

impl RecordingBackend {
    /// Wraps `inner`, adding every logit row it computes to `rec`.
    pub fn new(inner: Box<dyn ForwardBackend>, rec: Arc<Mutex<Recording>>) -> RecordingBackend {
        RecordingBackend {
            inner,
            hist: Histories::default(),
            rec,
        }
    }
}

impl ForwardBackend for RecordingBackend {
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }
    fn preferred_prefill_chunk(&self) -> usize {
        self.inner.preferred_prefill_chunk()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.hist.0.clear();
        self.inner.init_kv(max_tokens)
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn total_blocks(&self) -> usize {
        self.inner.total_blocks()
    }
    fn free_blocks(&self) -> usize {
        self.inner.free_blocks()
    }
    fn kv_new(&mut self) -> KvSlot {
        let s = self.inner.kv_new();
        self.hist.0.insert(s, History::default());
        s
    }
    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError> {
        let s = self.inner.kv_fork(src, len)?;
        let mut h = self.hist.get_mut(src).clone();
        h.truncate(len);
        self.hist.0.insert(s, h);
        Ok(s)
    }
    fn shares_prefixes(&self) -> bool {
        self.inner.shares_prefixes()
    }
    fn kv_len(&self, slot: KvSlot) -> usize {
        self.inner.kv_len(slot)
    }
    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        self.inner.kv_prepare(slot, from, to)?;
        self.hist.get_mut(slot).truncate(from);
        Ok(())
    }
    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        self.inner.kv_blocks_needed(slot, from, to)
    }
    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        self.inner.kv_truncate(slot, len);
        self.hist.get_mut(slot).truncate(len);
    }
    fn kv_release(&mut self, slot: KvSlot) {
        self.inner.kv_release(slot);
        self.hist.0.remove(&slot);
    }
    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.inner.forward(rows, logits)?;
        let hashes = self.hist.apply(rows);
        let n = self.inner.n_vocab();
        let mut rec = self.rec.lock().unwrap_or_else(|e| e.into_inner());
        let mut at = 0;
        for (r, h) in rows.iter().zip(hashes) {
            if !r.wants_logits {
                continue;
            }
            if let (Some(h), Some(row)) = (h, logits.get(at * n..(at + 1) * n)) {
                rec.rows.insert(h, top_k(row, TOP_K));
            }
            at += 1;
        }
        Ok(())
    }
}

/// The time a forward of `rows` rows takes in a replay: `t1_ms` times the row count's
/// ratio to a one-row step. The ratios up to 16 rows are the measured verify-cost curve
/// of qwen2.5-coder-1.5b on 2 CPU threads (BENCHMARKS.md "Verify cost": 2 rows 1.14, 4
/// 1.33, 6 1.46, 7 1.80, 8 1.84, 12 2.37, 16 2.83; counts between them interpolated);
/// beyond 16 rows (prefill) each row adds 0.2 (prefill runs ~5× the decode rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCurve {
    /// Time of a one-row step, ms.
    pub t1_ms: f64,
}

/// Measured ratios t(M)/t(1) at M = 1, 2, 4, 6, 7, 8, 12, 16.
const CURVE: [(usize, f64); 8] = [
    (1, 1.0),
    (2, 1.14),
    (4, 1.33),
    (6, 1.46),
    (7, 1.80),
    (8, 1.84),
    (12, 2.37),
    (16, 2.83),
];
/// Ratio added per prefill row beyond 16.
const PREFILL_ROW: f64 = 0.2;

impl StepCurve {
    /// The ratio of a `rows`-row step to a one-row step.
    pub fn ratio(rows: usize) -> f64 {
        let rows = rows.max(1);
        let (last_m, last_r) = CURVE[CURVE.len() - 1];
        if rows >= last_m {
            return last_r + (rows - last_m) as f64 * PREFILL_ROW;
        }
        for w in CURVE.windows(2) {
            let ((m0, r0), (m1, r1)) = (w[0], w[1]);
            if rows >= m0 && rows <= m1 {
                return r0 + (r1 - r0) * (rows - m0) as f64 / (m1 - m0) as f64;
            }
        }
        1.0
    }

    /// The time of a `rows`-row step, ms.
    pub fn step_ms(&self, rows: usize) -> f64 {
        self.t1_ms * StepCurve::ratio(rows)
    }
}

/// A backend that replays a [`Recording`]: see the module docs.
pub struct ReplayBackend {
    rec: Arc<Recording>,
    curve: StepCurve,
    max_context: usize,
    block_size: usize,
    total_blocks: usize,
    hist: Histories,
    next_slot: u32,
    misses: Arc<AtomicU64>,
    decode_us: Arc<AtomicU64>,
    trace: Option<Trace>,
    /// Whether a forward sleeps for its curve time (else it only reports it:
    /// [`ForwardBackend::simulated_ms`]).
    sleeps: bool,
    /// The curve time of the last forward, ms.
    last_ms: f64,
}

/// Where [`ReplayBackend::with_trace`] writes.
struct Trace {
    out: Box<dyn Write + Send>,
    tok: Arc<text::Tokenizer>,
}

impl ReplayBackend {
    /// A backend answering from `rec` with a context of `max_context`, each forward
    /// taking `curve`'s time.
    pub fn new(rec: Arc<Recording>, curve: StepCurve, max_context: usize) -> ReplayBackend {
        ReplayBackend {
            rec,
            curve,
            max_context,
            block_size: 16,
            total_blocks: 0,
            hist: Histories::default(),
            next_slot: 0,
            misses: Arc::new(AtomicU64::new(0)),
            decode_us: Arc::new(AtomicU64::new(0)),
            trace: None,
            sleeps: true,
            last_ms: 0.0,
        }
    }

    /// A replay whose forwards return at once: the engine times its steps by the curve
    /// ([`ForwardBackend::simulated_ms`]) and the decode time is
    /// [`ReplayBackend::decode_clock`]'s (a bench that reads no wall time).
    pub fn without_sleep(mut self) -> ReplayBackend {
        self.sleeps = false;
        self
    }

    /// Also writes one JSON line per sequence per forward to `out`: its first position
    /// (`pos`), the rows' tokens and text (`rows`, `text`: a verify block is the committed
    /// token and the drafts), the token the recording chose after each row (`next`, `null`
    /// where it holds none) and how many drafts that path accepts (`accepted`). Decoded
    /// with `tok`. For finding which output the drafters missed.
    pub fn with_trace(
        mut self,
        out: Box<dyn Write + Send>,
        tok: Arc<text::Tokenizer>,
    ) -> ReplayBackend {
        self.trace = Some(Trace { out, tok });
        self
    }

    fn write_trace(&mut self, rows: &[ForwardRow], hashes: &[Option<u64>]) {
        let Some(tr) = self.trace.as_mut() else {
            return;
        };
        let mut i = 0;
        while i < rows.len() {
            let slot = rows[i].slot;
            let mut j = i;
            while j < rows.len() && rows[j].slot == slot {
                j += 1;
            }
            // Prefill chunks are not traced: only blocks whose rows all want logits.
            if rows[i..j].iter().all(|r| r.wants_logits) {
                let toks: Vec<u32> = rows[i..j].iter().map(|r| r.token).collect();
                let next: Vec<Option<u32>> = hashes[i..j]
                    .iter()
                    .map(|h| {
                        h.and_then(|h| self.rec.rows.get(&h))
                            .and_then(|t| t.first())
                            .map(|e| e.0)
                    })
                    .collect();
                let accepted = (1..toks.len())
                    .take_while(|&q| next[q - 1] == Some(toks[q]))
                    .count();
                let text: Vec<String> = toks
                    .iter()
                    .map(|&t| String::from_utf8_lossy(tr.tok.token_bytes(t).unwrap_or(b"")).into())
                    .collect();
                let line = serde_json::json!({
                    "slot": slot.0,
                    "pos": rows[i].pos,
                    "rows": toks,
                    "text": text,
                    "next": next,
                    "accepted": accepted,
                });
                let _ = writeln!(tr.out, "{line}");
            }
            i = j;
        }
        let _ = tr.out.flush();
    }

    /// Counts the logit rows whose history the recording lacks, among the last row of
    /// each sequence in a forward (a plain step's only row; a verify block's last). A
    /// plain replay of the recorded requests has none when it followed the recorded paths;
    /// a speculative one may (the row after a drafted end-of-generation token is computed
    /// and never chosen from).
    pub fn misses(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.misses)
    }

    /// The curve's time of the decode and verify forwards so far (those whose rows all
    /// want logits; prefill chunks are not counted), µs: the machine-independent decode
    /// time of a replay.
    pub fn decode_clock(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.decode_us)
    }

    fn used_blocks(&self) -> usize {
        self.hist
            .0
            .values()
            .map(|h| h.tokens.len().div_ceil(self.block_size))
            .sum()
    }
}

impl ForwardBackend for ReplayBackend {
    fn n_vocab(&self) -> usize {
        self.rec.n_vocab
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.hist.0.clear();
        // Room for every slot unshared (a real pool shares prefixes).
        self.total_blocks = 16 * max_tokens.div_ceil(self.block_size);
        Ok(())
    }
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn total_blocks(&self) -> usize {
        self.total_blocks
    }
    fn free_blocks(&self) -> usize {
        self.total_blocks.saturating_sub(self.used_blocks())
    }
    fn kv_new(&mut self) -> KvSlot {
        let s = KvSlot(self.next_slot);
        self.next_slot += 1;
        self.hist.0.insert(s, History::default());
        s
    }
    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError> {
        let mut h = self
            .hist
            .0
            .get(&src)
            .cloned()
            .ok_or(BackendError::UnknownSlot(src.0))?;
        h.truncate(len);
        let s = KvSlot(self.next_slot);
        self.next_slot += 1;
        self.hist.0.insert(s, h);
        Ok(s)
    }
    fn kv_len(&self, slot: KvSlot) -> usize {
        self.hist.0.get(&slot).map_or(0, |h| h.tokens.len())
    }
    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let needed = self.kv_blocks_needed(slot, from, to);
        if needed > self.free_blocks() {
            return Err(BackendError::OutOfBlocks {
                needed,
                free: self.free_blocks(),
            });
        }
        self.hist
            .0
            .get_mut(&slot)
            .ok_or(BackendError::UnknownSlot(slot.0))?
            .truncate(from);
        Ok(())
    }
    fn kv_blocks_needed(&self, _slot: KvSlot, from: usize, to: usize) -> usize {
        to.div_ceil(self.block_size)
            .saturating_sub(from.div_ceil(self.block_size))
    }
    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        if let Some(h) = self.hist.0.get_mut(&slot) {
            h.truncate(len);
        }
    }
    fn kv_release(&mut self, slot: KvSlot) {
        self.hist.0.remove(&slot);
    }
    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let n = self.rec.n_vocab;
        let hashes = self.hist.apply(rows);
        self.write_trace(rows, &hashes);
        logits.clear();
        for (i, (r, h)) in rows.iter().zip(&hashes).enumerate() {
            if !r.wants_logits {
                continue;
            }
            let top = h.and_then(|h| self.rec.rows.get(&h));
            let at = logits.len();
            match top {
                Some(top) => {
                    let floor = top.last().map_or(0.0, |e| e.1) - 1.0;
                    logits.resize(at + n, floor);
                    for &(id, v) in top {
                        logits[at + id as usize] = v;
                    }
                }
                None => {
                    logits.resize(at + n, 0.0);
                    let last_of_seq = rows.get(i + 1).is_none_or(|nx| nx.slot != r.slot);
                    if last_of_seq {
                        self.misses.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let ms = self.curve.step_ms(rows.len()).max(0.0);
        if rows.iter().all(|r| r.wants_logits) {
            self.decode_us
                .fetch_add((ms * 1e3).round() as u64, Ordering::Relaxed);
        }
        self.last_ms = ms;
        if self.sleeps {
            std::thread::sleep(Duration::from_secs_f64(ms / 1e3));
        }
        Ok(())
    }
    fn simulated_ms(&self) -> Option<f64> {
        Some(self.last_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(slot: u32, pos: usize, token: u32) -> ForwardRow {
        ForwardRow {
            slot: KvSlot(slot),
            token,
            pos,
            wants_logits: true,
        }
    }

    #[test]
    fn the_top_entries_are_kept_best_first() {
        let r = [0.5, 3.0, -1.0, 3.0, 2.0, f32::NAN];
        assert_eq!(top_k(&r, 3), vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        assert_eq!(top_k(&r, 10).len(), 5);
    }

    #[test]
    fn a_recorded_path_is_replayed_and_other_histories_are_flat() {
        let mut rec = Recording::new(8);
        // Prompt 5 1, output 2 3 4.
        rec.add_path(&[5, 1, 2, 3, 4], 2);
        let mut b = ReplayBackend::new(Arc::new(rec), StepCurve { t1_ms: 0.0 }, 64);
        b.init_kv(64).unwrap();
        let s = b.kv_new();
        let mut logits = Vec::new();
        let prefill = [
            ForwardRow {
                wants_logits: false,
                ..row(s.0, 0, 5)
            },
            row(s.0, 1, 1),
        ];
        b.forward(&prefill, &mut logits).unwrap();
        let argmax = |l: &[f32]| {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map(|e| e.0)
        };
        assert_eq!(argmax(&logits), Some(2));
        // A verify block [2, 3, 7]: rows 0 and 1 are on the path, row 2 is not.
        b.forward(
            &[row(s.0, 2, 2), row(s.0, 3, 3), row(s.0, 4, 7)],
            &mut logits,
        )
        .unwrap();
        assert_eq!(argmax(&logits[0..8]), Some(3));
        assert_eq!(argmax(&logits[8..16]), Some(4));
        assert!(logits[16..24].iter().all(|&v| v == 0.0));
        assert_eq!(b.misses().load(Ordering::Relaxed), 1);
        // Rolled back and forked, the path is found again.
        b.kv_truncate(s, 3);
        let f = b.kv_fork(s, 3).unwrap();
        b.forward(&[row(f.0, 3, 3)], &mut logits).unwrap();
        assert_eq!(argmax(&logits), Some(4));
    }

    #[test]
    fn a_recording_survives_a_save_and_load() {
        let mut rec = Recording::new(100);
        rec.add_path(&[1, 2, 3, 4, 5, 6], 3);
        rec.rows.insert(42, vec![(7, 1.5), (9, -2.0)]);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.bin");
        rec.save(&p).unwrap();
        let back = Recording::load(&p).unwrap();
        assert_eq!(back.n_vocab, 100);
        assert_eq!(back.rows, rec.rows);
        std::fs::write(&p, b"not a recording").unwrap();
        assert!(Recording::load(&p).is_err());
    }

    #[test]
    fn the_step_curve_follows_the_measured_ratios() {
        assert_eq!(StepCurve::ratio(1), 1.0);
        assert!((StepCurve::ratio(3) - 1.235).abs() < 1e-9);
        assert!((StepCurve::ratio(7) - 1.80).abs() < 1e-9);
        assert!((StepCurve::ratio(116) - (2.83 + 20.0)).abs() < 1e-9);
        let c = StepCurve { t1_ms: 10.0 };
        assert!((c.step_ms(2) - 11.4).abs() < 1e-9);
    }
}
