//! [`ModelBackend`]: the [`ForwardBackend`] over a loaded [`model::Model`] and its paged KV
//! cache.
//!
//! The cache has one block pool per layer group (global layers, and the layers of each
//! sliding window). The engine accounts in blocks of the *accounting group* — the global
//! group (or the first group, should every layer slide) — and the sliding groups never
//! bind:
//!
//! - a sliding group's blocks mirror the accounting group's (same table lengths, the same
//!   forks and copies), minus the blocks that left the window, so it never holds more;
//! - its pool starts small and grows on demand (never past the accounting pool), so its
//!   memory follows what the windows really hold: about `window / block_size + 1` blocks
//!   per running sequence (plus the partly filled chunk being written);
//! - [`ForwardBackend::kv_prepare`] from position `from` drops the sliding blocks no query
//!   at or after `from` can see (the engine never cuts a sequence below the start of its
//!   next write), and [`ForwardBackend::kv_fork`] keeps in the new sequence only the window
//!   its next query needs, and refuses a fork whose window was already dropped.

use crate::api::{BackendError, ForwardBackend, ForwardRow, KvSlot};
use crate::slots::{SlotTable, map_kv_err};
use model::{Batch, ForwardScratch, KvCache, Model, ModelError, SeqKv};
use std::sync::Arc;

/// How full one block pool of the KV cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPoolUsage {
    /// The layer group's window (`None` = global attention).
    pub window: Option<usize>,
    /// Blocks in the pool now (sliding pools grow on demand).
    pub capacity: usize,
    /// Blocks free now.
    pub free: usize,
}

impl KvPoolUsage {
    /// Blocks in use (held by sequences or the prefix cache).
    pub fn used(&self) -> usize {
        self.capacity - self.free
    }
}

/// The real model behind the engine: llama, qwen2 (one global block pool) and gemma3
/// (a global pool and a sliding-window pool; see the module docs for the accounting).
#[derive(Debug)]
pub struct ModelBackend {
    model: Arc<Model>,
    kv: Option<KvCache>,
    slots: SlotTable,
    scratch: ForwardScratch,
}

fn model_err(e: ModelError) -> BackendError {
    match e {
        ModelError::Backend(backend_cpu::Error::OutOfBlocks { needed, free, .. }) => {
            BackendError::OutOfBlocks { needed, free }
        }
        other => BackendError::model(other),
    }
}

impl ModelBackend {
    /// Wraps a loaded model (the KV pool is made by [`ForwardBackend::init_kv`], which
    /// [`crate::Engine::start`] calls).
    pub fn new(model: Arc<Model>) -> ModelBackend {
        let scratch = model.new_scratch();
        ModelBackend {
            model,
            kv: None,
            slots: SlotTable::default(),
            scratch,
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    fn kv_mut(&mut self) -> Result<&mut KvCache, BackendError> {
        self.kv.as_mut().ok_or(BackendError::NoKvPool)
    }

    /// Every block pool of the KV cache, by layer group (empty before
    /// [`ForwardBackend::init_kv`]).
    pub fn kv_pools(&self) -> Vec<KvPoolUsage> {
        let Some(kv) = &self.kv else {
            return Vec::new();
        };
        (0..kv.n_groups())
            .filter_map(|g| {
                kv.allocator(g).map(|a| KvPoolUsage {
                    window: kv.group_window(g),
                    capacity: a.capacity(),
                    free: a.free_count(),
                })
            })
            .collect()
    }
}

/// The group the engine accounts in: the global one, else the first.
fn accounting_group(kv: &KvCache) -> usize {
    (0..kv.n_groups())
        .find(|&g| kv.group_window(g).is_none())
        .unwrap_or(0)
}

/// Blocks of the accounting group that `prepare(seq, from, to)` allocates: new blocks past
/// the cut, plus copies of shared blocks at or after `from`. Every other group needs at
/// most as many.
fn blocks_needed(kv: &KvCache, seq: &SeqKv, from: usize, to: usize) -> usize {
    let g = accounting_group(kv);
    let (Some(table), Some(alloc)) = (seq.table(g), kv.allocator(g)) else {
        return 0;
    };
    alloc.blocks_needed(table.blocks(), seq.len(), kv.config().block_size, from, to)
}

/// Grows every sliding pool that has fewer than `needed` free blocks: doubling, at least
/// to `needed` free, never past the accounting pool's capacity (which a sliding group, a
/// subset of its blocks, never needs to exceed).
fn grow_sliding_pools(kv: &mut KvCache, needed: usize) -> Result<(), BackendError> {
    let acct = accounting_group(kv);
    let limit = kv.allocator(acct).map_or(0, |a| a.capacity());
    for g in 0..kv.n_groups() {
        if g == acct {
            continue;
        }
        let Some(a) = kv.allocator(g) else { continue };
        if a.free_count() >= needed {
            continue;
        }
        let used = a.capacity() - a.free_count();
        let want = (used + needed)
            .max(a.capacity() * 2)
            .min(limit.max(used + needed));
        kv.grow_pool(g, want).map_err(map_kv_err)?;
    }
    Ok(())
}

/// Whether every sliding group of `seq` still holds the blocks a query at `pos` reads.
fn window_intact(kv: &KvCache, seq: &SeqKv, pos: usize) -> bool {
    let bs = kv.config().block_size.max(1);
    (0..kv.n_groups()).all(|g| {
        let Some(w) = kv.group_window(g) else {
            return true;
        };
        let Some(table) = seq.table(g) else {
            return false;
        };
        let first = (pos + 1).saturating_sub(w) / bs;
        let last = pos.min(seq.len().saturating_sub(1)) / bs;
        seq.is_empty() || (first..=last).all(|b| table.block(b).is_some())
    })
}

impl ForwardBackend for ModelBackend {
    fn n_vocab(&self) -> usize {
        self.model.config().n_vocab
    }

    fn max_context(&self) -> usize {
        self.model.n_ctx()
    }

    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.slots.clear(self.kv.as_mut());
        self.kv = None;
        let mut cfg = self.model.kv_config(max_tokens);
        if let Some(w) = self.model.config().max_window() {
            // Room for two sequences' windows to start with; grown on demand.
            let per_seq = w.div_ceil(cfg.block_size) + 1;
            cfg.sliding_blocks = cfg.global_blocks.min(2 * per_seq);
        }
        self.kv = Some(KvCache::new(cfg).map_err(map_kv_err)?);
        Ok(())
    }

    fn block_size(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(backend_cpu::DEFAULT_BLOCK_SIZE, |kv| kv.config().block_size)
    }

    fn total_blocks(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|kv| kv.allocator(accounting_group(kv)))
            .map_or(0, |a| a.capacity())
    }

    fn free_blocks(&self) -> usize {
        self.kv
            .as_ref()
            .and_then(|kv| kv.allocator(accounting_group(kv)))
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
        let slot = self.slots.fork(kv, src, len)?;
        // The fork's next query sits at or after its last position: keep only that window.
        let seq = self.slots.get_mut(slot)?;
        let last = seq.len().saturating_sub(1);
        kv.release_outside_window(seq, last);
        if !window_intact(kv, seq, last) {
            self.slots.release(kv, slot);
            return Err(BackendError::Unsupported(format!(
                "cannot share positions 0..{len}: blocks of their sliding window were \
                 already released"
            )));
        }
        Ok(slot)
    }

    fn kv_len(&self, slot: KvSlot) -> usize {
        self.slots.len(slot)
    }

    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        let seq = self.slots.get_mut(slot)?;
        let needed = blocks_needed(kv, seq, from, to);
        let free = kv
            .allocator(accounting_group(kv))
            .map_or(0, |a| a.free_count());
        if needed > free {
            return Err(BackendError::OutOfBlocks { needed, free });
        }
        kv.truncate(seq, from);
        // Positions before `from` are final: every later query sits at or after it.
        kv.release_outside_window(seq, from);
        grow_sliding_pools(kv, needed)?;
        kv.reserve(seq, to).map_err(map_kv_err)?;
        kv.make_writable(seq, from).map_err(map_kv_err)
    }

    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        match (&self.kv, self.slots.get(slot)) {
            (Some(kv), Ok(seq)) => blocks_needed(kv, seq, from, to),
            _ => 0,
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
    }

    fn kv_block_format(&self) -> Option<String> {
        let kv = self.kv.as_ref()?;
        let c = kv.config();
        Some(format!(
            "cpu paged KV v1: {} layers, {} KV heads of {}, blocks of {}, {:?}, windows {:?}, \
             {} bytes",
            c.windows.len(),
            c.n_kv_head,
            c.head_dim,
            c.block_size,
            c.kv_type,
            c.windows,
            kv.block_bytes()
        ))
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, KvCache::block_bytes)
    }

    fn kv_export_block(
        &self,
        slot: KvSlot,
        block: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        let kv = self.kv.as_ref().ok_or(BackendError::NoKvPool)?;
        kv.export_block(self.slots.get(slot)?, block, out)
            .map_err(map_kv_err)
    }

    fn kv_restore_block(&mut self, slot: KvSlot, data: &[u8]) -> Result<(), BackendError> {
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        if data.len() != kv.block_bytes() {
            return Err(BackendError::BadKvBlock(format!(
                "imported KV block bytes: expected {} elements, got {}",
                kv.block_bytes(),
                data.len()
            )));
        }
        let bs = kv.config().block_size.max(1);
        let seq = self.slots.get_mut(slot)?;
        let len = seq.len();
        if len % bs != 0 {
            return Err(BackendError::Invalid(format!(
                "a restored block must start at a block boundary, the sequence has {len} \
                 positions"
            )));
        }
        let free = kv
            .allocator(accounting_group(kv))
            .map_or(0, |a| a.free_count());
        if free == 0 {
            return Err(BackendError::OutOfBlocks { needed: 1, free });
        }
        grow_sliding_pools(kv, 1)?;
        kv.reserve(seq, len + bs).map_err(map_kv_err)?;
        if let Err(e) = kv.import_block(seq, len / bs, data) {
            kv.truncate(seq, len);
            return Err(map_kv_err(e));
        }
        // As after computing the block: only the window of the next query stays.
        kv.release_outside_window(seq, len + bs - 1);
        Ok(())
    }

    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        logits.clear();
        // Distinct slots in order of first appearance; rows name them by index.
        let Batch {
            slots: order,
            rows: batch,
            ..
        } = Batch::from_rows(rows, self.n_vocab(), self.max_context())?;
        let mut taken: Vec<SeqKv> = Vec::with_capacity(order.len());
        let mut failed = None;
        for &slot in &order {
            match self.slots.take(slot) {
                Ok(seq) => taken.push(seq),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let result = match failed {
            Some(e) => Err(e),
            None => {
                let mut scratch = std::mem::take(&mut self.scratch);
                let model = self.model.clone();
                let r = match self.kv_mut() {
                    Ok(kv) => {
                        let mut refs: Vec<&mut SeqKv> = taken.iter_mut().collect();
                        model
                            .forward(&mut scratch, kv, &mut refs, &batch, logits)
                            .map_err(model_err)
                    }
                    Err(e) => Err(e),
                };
                self.scratch = scratch;
                r
            }
        };
        for (slot, seq) in order.into_iter().zip(taken) {
            self.slots.put_back(slot, seq);
        }
        result
    }
}
