//! [`FakeBackend`]: a deterministic stand-in for a model, so the step loop, scheduler,
//! prefix reuse and preemption are tested quickly and checkably.
//!
//! Its "KV" is real: the same paged [`KvCache`] as the CPU backend (one layer, one head,
//! f32), holding each position's token id and position. A row's logits are a pure
//! function of the token history *read back from the cache* ([`fake_logits`]), so a wrong
//! block table, a missed copy-on-write or a bad prefix fork changes the logits and the
//! tests see it.

use crate::api::{BackendError, ForwardBackend, ForwardRow, KvSlot};
use crate::slots::{SlotTable, map_kv_err};
use backend_cpu::{KvCache, KvConfig, KvType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters of a [`FakeBackend`], readable while the engine owns the backend.
#[derive(Debug, Default)]
pub struct FakeStats {
    /// Forward calls.
    pub forwards: AtomicU64,
    /// Rows computed.
    pub rows: AtomicU64,
    /// Largest number of distinct sequences in one forward.
    pub max_seqs_in_forward: AtomicU64,
    /// Free blocks after the last `kv_release`/`forward` (the pool's state as last seen).
    pub free_blocks: AtomicU64,
    /// Per forward, the rows of each sequence in it (in order of first appearance).
    pub batches: Mutex<Vec<Vec<usize>>>,
    /// Logit rows summarized (with [`FakeBackend::summarizing`]).
    pub rows_summarized: AtomicU64,
    /// Logit rows copied out through `logit_row` (with [`FakeBackend::summarizing`]).
    pub rows_fetched: AtomicU64,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The fake model: logits over `n_vocab` tokens after `history` (the tokens at positions
/// `0..=pos`). Values in `[-4, 4)`, a pure function of (n_vocab, history).
pub fn fake_logits(n_vocab: usize, history: &[u32]) -> Vec<f32> {
    let mut h = 0x6C6F_636B_7374_6570u64; // "lockstep"
    for (p, &t) in history.iter().enumerate() {
        h = splitmix(h ^ (u64::from(t) << 20) ^ p as u64);
    }
    (0..n_vocab as u64)
        .map(|v| {
            let r = splitmix(h ^ v.wrapping_mul(0xA24B_AED4_963E_E407));
            (r >> 40) as f32 * (8.0 / (1u64 << 24) as f32) - 4.0
        })
        .collect()
}

/// A deterministic backend for tests: see the module docs.
#[derive(Debug)]
pub struct FakeBackend {
    n_vocab: usize,
    max_context: usize,
    block_size: usize,
    kv: Option<KvCache>,
    slots: SlotTable,
    stats: Arc<FakeStats>,
    fail_on_token: Option<u32>,
    /// Serve `forward_summaries`, keeping the last forward's logits in `kept`.
    summarizing: bool,
    summary_min_rows: usize,
    kept: Vec<f32>,
}

impl FakeBackend {
    /// A fake model with `n_vocab` logits, a context of `max_context` and KV blocks of
    /// `block_size` tokens.
    pub fn new(n_vocab: usize, max_context: usize, block_size: usize) -> FakeBackend {
        FakeBackend {
            n_vocab,
            max_context,
            block_size,
            kv: None,
            slots: SlotTable::default(),
            stats: Arc::new(FakeStats::default()),
            fail_on_token: None,
            summarizing: false,
            summary_min_rows: 1,
            kept: Vec::new(),
        }
    }

    /// Makes every forward that contains a row with `token` fail (a backend fault).
    pub fn fail_on_token(mut self, token: u32) -> FakeBackend {
        self.fail_on_token = Some(token);
        self
    }

    /// Answers [`ForwardBackend::forward_summaries`] as a GPU backend does: the logits stay
    /// here, the engine gets [`sampling::row_summary`] of each row and fetches rows one by
    /// one when a choice needs them.
    pub fn summarizing(mut self) -> FakeBackend {
        self.summarizing = true;
        self
    }

    /// Like [`FakeBackend::summarizing`], for steps of at least `rows` logit rows only
    /// ([`ForwardBackend::summary_min_rows`], as the CUDA backend's default).
    pub fn summarizing_from(mut self, rows: usize) -> FakeBackend {
        self.summarizing = true;
        self.summary_min_rows = rows;
        self
    }

    /// The counters (shared: keep a clone before handing the backend to the engine).
    pub fn stats(&self) -> Arc<FakeStats> {
        self.stats.clone()
    }

    fn note_free(&self) {
        let free = self.free_blocks() as u64;
        self.stats.free_blocks.store(free, Ordering::SeqCst);
    }
}

impl ForwardBackend for FakeBackend {
    fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.slots.clear(self.kv.as_mut());
        let kv = KvCache::new(KvConfig {
            n_kv_head: 1,
            head_dim: 1,
            block_size: self.block_size,
            kv_type: KvType::F32,
            windows: vec![None],
            global_blocks: max_tokens.div_ceil(self.block_size.max(1)),
            sliding_blocks: 0,
        })
        .map_err(map_kv_err)?;
        self.kv = Some(kv);
        self.note_free();
        Ok(())
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn total_blocks(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|kv| kv.allocator(0))
            .map_or(0, |a| a.capacity())
    }

    fn free_blocks(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|kv| kv.allocator(0))
            .map_or(0, |a| a.free_count())
    }

    fn kv_new(&mut self) -> KvSlot {
        match &self.kv {
            Some(kv) => self.slots.new_seq(kv),
            None => KvSlot(u32::MAX),
        }
    }

    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError> {
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        self.slots.fork(kv, src, len)
    }

    fn kv_len(&self, slot: KvSlot) -> usize {
        self.slots.len(slot)
    }

    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        self.slots.prepare(kv, slot, from, to)
    }

    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        match &self.kv {
            Some(kv) => self.slots.blocks_needed(kv, slot, from, to),
            None => 0,
        }
    }

    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        if let Some(kv) = self.kv.as_mut() {
            self.slots.truncate(kv, slot, len);
        }
    }

    fn kv_release(&mut self, slot: KvSlot) {
        if let Some(kv) = self.kv.as_mut() {
            self.slots.release(kv, slot);
        }
        self.note_free();
    }

    fn summarizes(&self) -> bool {
        self.summarizing
    }

    fn summary_min_rows(&self) -> usize {
        self.summary_min_rows
    }

    fn forward_summaries(
        &mut self,
        rows: &[ForwardRow],
        summaries: &mut Vec<sampling::RowSummary>,
    ) -> Result<(), BackendError> {
        summaries.clear();
        let mut kept = std::mem::take(&mut self.kept);
        let r = self.forward(rows, &mut kept);
        if r.is_ok() {
            summaries.extend(kept.chunks_exact(self.n_vocab).map(sampling::row_summary));
            self.stats
                .rows_summarized
                .fetch_add(summaries.len() as u64, Ordering::SeqCst);
        } else {
            kept.clear();
        }
        self.kept = kept;
        r
    }

    fn logit_row(&mut self, i: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        let n = self.n_vocab;
        let row = self.kept.get(i * n..(i + 1) * n).ok_or_else(|| {
            BackendError::Invalid(format!("no logit row {i} in the last forward"))
        })?;
        out.extend_from_slice(row);
        self.stats.rows_fetched.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        logits.clear();
        if let Some(bad) = self.fail_on_token
            && rows.iter().any(|r| r.token == bad)
        {
            return Err(BackendError::Internal(format!(
                "injected fault on token {bad}"
            )));
        }
        // Same checks and KV steps as the model's forward: per sequence, rows are
        // consecutive and start at most at the cached length; cut back, reserve,
        // copy-on-write, then write every row before any row reads.
        let batch = model::Batch::from_rows(rows, self.n_vocab, self.max_context)?;
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        for (&slot, &(first, last)) in batch.slots.iter().zip(&batch.spans) {
            let seq = self.slots.get_mut(slot)?;
            if first > seq.len() {
                return Err(BackendError::Invalid(format!(
                    "slot {}: first row at {first} but only {} positions cached",
                    slot.0,
                    seq.len()
                )));
            }
            kv.truncate(seq, first);
            kv.reserve(seq, last + 1).map_err(map_kv_err)?;
            kv.make_writable(seq, first).map_err(map_kv_err)?;
        }
        for r in rows {
            let seq = self.slots.get(r.slot)?;
            kv.write(0, seq, r.pos, &[r.token as f32], &[r.pos as f32])
                .map_err(map_kv_err)?;
        }
        let mut history = Vec::new();
        let (mut k, mut v) = ([0f32], [0f32]);
        for r in rows.iter().filter(|r| r.wants_logits) {
            let seq = self.slots.get(r.slot)?;
            history.clear();
            for p in 0..=r.pos {
                kv.read(0, seq, p, &mut k, &mut v).map_err(map_kv_err)?;
                if v[0] != p as f32 {
                    return Err(BackendError::Internal(format!(
                        "KV of position {p} holds position {}",
                        v[0]
                    )));
                }
                history.push(k[0] as u32);
            }
            logits.extend(fake_logits(self.n_vocab, &history));
        }
        self.stats.forwards.fetch_add(1, Ordering::SeqCst);
        self.stats
            .rows
            .fetch_add(rows.len() as u64, Ordering::SeqCst);
        self.stats
            .max_seqs_in_forward
            .fetch_max(batch.slots.len() as u64, Ordering::SeqCst);
        if let Ok(mut b) = self.stats.batches.lock() {
            b.push(batch.spans.iter().map(|s| s.1 + 1 - s.0).collect());
        }
        self.note_free();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(slot: KvSlot, tokens: &[u32], from: usize) -> Vec<ForwardRow> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| ForwardRow {
                slot,
                token,
                pos: from + i,
                wants_logits: i + 1 == tokens.len(),
            })
            .collect()
    }

    #[test]
    fn blocks_needed_predicts_prepare_exactly_through_fork_cow_and_truncate() {
        let mut b = FakeBackend::new(16, 256, 4);
        b.init_kv(40).unwrap(); // 10 blocks
        let a = b.kv_new();
        let toks: Vec<u32> = (1..=8).collect();
        assert_eq!(b.kv_blocks_needed(a, 0, 8), 2);
        b.kv_prepare(a, 0, 8).unwrap();
        let mut logits = Vec::new();
        b.forward(&rows(a, &toks, 0), &mut logits).unwrap();
        assert_eq!(logits, fake_logits(16, &toks));
        assert_eq!(b.free_blocks(), 8);

        // A fork shares both blocks; rewriting its last position copies one block.
        let f = b.kv_fork(a, 8).unwrap();
        assert_eq!(b.free_blocks(), 8);
        let need = b.kv_blocks_needed(f, 7, 9);
        assert_eq!(need, 2, "one copy + one new block");
        b.kv_prepare(f, 7, 9).unwrap();
        assert_eq!(b.free_blocks(), 8 - need);
        b.forward(&rows(f, &[8, 9], 7), &mut logits).unwrap();
        let mut hist = toks.clone();
        hist.push(9);
        assert_eq!(logits, fake_logits(16, &hist));
        // The original is untouched by the fork's writes.
        b.kv_prepare(a, 7, 8).unwrap();
        b.forward(&rows(a, &[8], 7), &mut logits).unwrap();
        assert_eq!(logits, fake_logits(16, &toks));

        // Truncation is copy-free and gives back whole blocks only.
        b.kv_truncate(f, 5);
        assert_eq!(b.kv_len(f), 5);
        assert_eq!(b.free_blocks(), 8 - need + 1);
        b.kv_release(f);
        b.kv_release(a);
        assert_eq!(b.free_blocks(), 10);
        let n = b.kv_new();
        assert!(matches!(
            b.kv_prepare(n, 0, 44),
            Err(BackendError::OutOfBlocks {
                needed: 11,
                free: 10
            })
        ));
    }

    #[test]
    fn logits_depend_on_the_history_read_back_from_the_cache() {
        assert_eq!(fake_logits(8, &[1, 2]), fake_logits(8, &[1, 2]));
        assert_ne!(fake_logits(8, &[1, 2]), fake_logits(8, &[2, 1]));
        assert!(
            fake_logits(8, &[3])
                .iter()
                .all(|&x| (-4.0..4.0).contains(&x))
        );
    }
}
