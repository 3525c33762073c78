//! [`ModelBackend`]: the [`ForwardBackend`] over a loaded [`model::Model`] and its paged KV
//! cache.

use crate::api::{BackendError, ForwardBackend, ForwardRow, KvSlot};
use crate::slots::SlotTable;
use model::{BatchRow, ForwardScratch, KvCache, Model, ModelError, SeqKv};
use std::sync::Arc;

/// The real model behind the engine. Global-attention architectures (llama, qwen2): one
/// block pool.
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
        other => BackendError::Other(other.to_string()),
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
        self.kv
            .as_mut()
            .ok_or_else(|| BackendError::Other("KV pool not initialised".into()))
    }
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
        self.kv = Some(self.model.new_kv_cache(max_tokens).map_err(model_err)?);
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
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| BackendError::Other("KV pool not initialised".into()))?;
        self.slots.fork(kv, src, len)
    }

    fn kv_len(&self, slot: KvSlot) -> usize {
        self.slots.len(slot)
    }

    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| BackendError::Other("KV pool not initialised".into()))?;
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
    }

    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        logits.clear();
        // Distinct slots in order of first appearance; rows name them by index.
        let mut order: Vec<KvSlot> = Vec::new();
        let mut batch: Vec<BatchRow> = Vec::with_capacity(rows.len());
        for r in rows {
            let seq = match order.iter().position(|&s| s == r.slot) {
                Some(i) => i,
                None => {
                    order.push(r.slot);
                    order.len() - 1
                }
            };
            batch.push(BatchRow {
                seq,
                token: r.token,
                pos: r.pos,
                wants_logits: r.wants_logits,
            });
        }
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
