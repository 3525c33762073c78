//! [`Deepseek4Backend`]: the [`ForwardBackend`] over a loaded [`model::Deepseek4`].
//!
//! DeepSeek V4 keeps no paged KV cache: each sequence owns a [`Deepseek4State`] (raw rows of
//! its sliding window, compressor frontiers, compressed rows, indexer keys) whose truncation
//! restores exactly the state of that length, so speculative rollback is
//! [`ForwardBackend::kv_truncate`] as for the other models.
//!
//! Accounting: the engine schedules in blocks of [`backend_cpu::DEFAULT_BLOCK_SIZE`] token
//! slots. The pool given to [`ForwardBackend::init_kv`] is a token budget: a sequence holds
//! `ceil(reserved / block_size)` blocks of it, `reserved` being the end of its last
//! [`ForwardBackend::kv_prepare`] (or its truncated length), whatever its state really
//! occupies (a V4 state grows by a few compressed rows per block, far less than a KV cache).
//!
//! Forks are refused ([`ForwardBackend::kv_fork`] errs): a state cannot share its logs, and
//! copying one per published block would cost more than recomputing the prompt. The engine
//! then computes every prompt in full (no prefix reuse); output is the same either way.
//!
//! With a DSpark drafter attached ([`Deepseek4Backend::capture`]), every sequence's state
//! also captures the target rows the drafter reads ([`ForwardBackend::target_rows`]); they
//! are truncated with the state. Without one nothing is captured.

use crate::api::{BackendError, ForwardBackend, ForwardRow, KvSlot};
use model::{Batch, Deepseek4, Deepseek4Scratch, Deepseek4State, ModelError};
use std::sync::Arc;

#[derive(Debug)]
struct Slot {
    state: Deepseek4State,
    /// Positions `0..reserved` may be written (what the block accounting counts).
    reserved: usize,
}

/// The DeepSeek V4 model behind the engine (see the module docs for the accounting).
#[derive(Debug)]
pub struct Deepseek4Backend {
    model: Arc<Deepseek4>,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<u32>,
    scratch: Deepseek4Scratch,
    block_size: usize,
    total_blocks: usize,
    used_blocks: usize,
    /// Layers whose input rows new states capture (DSpark).
    capture: Option<Vec<usize>>,
}

fn model_err(e: ModelError) -> BackendError {
    BackendError::model(e)
}

impl Deepseek4Backend {
    /// Wraps a loaded model (the pool is sized by [`ForwardBackend::init_kv`], which
    /// [`crate::Engine::start`] calls).
    pub fn new(model: Arc<Deepseek4>) -> Deepseek4Backend {
        let scratch = model.new_scratch();
        Deepseek4Backend {
            model,
            slots: Vec::new(),
            free_slots: Vec::new(),
            scratch,
            block_size: backend_cpu::DEFAULT_BLOCK_SIZE,
            total_blocks: 0,
            used_blocks: 0,
            capture: None,
        }
    }

    /// Makes every sequence created from now on capture the input rows of `layers` (a
    /// DSpark drafter's target layers). Errors when a layer is outside the model, repeated,
    /// or the list is empty.
    pub fn capture(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        self.model.new_capturing_state(layers).map_err(model_err)?;
        self.capture = Some(layers.to_vec());
        Ok(())
    }

    /// The layers new sequences capture (`None`: nothing is captured).
    pub fn capture_layers(&self) -> Option<&[usize]> {
        self.capture.as_deref()
    }

    /// The model.
    pub fn model(&self) -> &Arc<Deepseek4> {
        &self.model
    }

    /// Bytes the sequences' states hold now.
    pub fn state_bytes(&self) -> usize {
        self.slots.iter().flatten().map(|s| s.state.bytes()).sum()
    }

    fn blocks(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn slot(&self, slot: KvSlot) -> Result<&Slot, BackendError> {
        self.slots
            .get(slot.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    fn slot_mut(&mut self, slot: KvSlot) -> Result<&mut Slot, BackendError> {
        self.slots
            .get_mut(slot.0 as usize)
            .and_then(Option::as_mut)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    /// Blocks `prepare(slot, from, to)` adds: the reservation cut back to `from`, then
    /// extended to `to`.
    fn needed(&self, s: &Slot, from: usize, to: usize) -> usize {
        let kept = self.blocks(s.reserved.min(from));
        self.blocks(to).saturating_sub(kept)
    }

    /// Sets `slot`'s reservation to `reserved`, keeping the block count in step.
    fn set_reserved(&mut self, slot: KvSlot, reserved: usize) -> Result<(), BackendError> {
        let old = self.blocks(self.slot(slot)?.reserved);
        let new = self.blocks(reserved);
        self.slot_mut(slot)?.reserved = reserved;
        self.used_blocks = self.used_blocks - old + new;
        Ok(())
    }
}

impl ForwardBackend for Deepseek4Backend {
    fn n_vocab(&self) -> usize {
        self.model.config().n_vocab
    }

    fn max_context(&self) -> usize {
        self.model.n_ctx()
    }

    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.slots.clear();
        self.free_slots.clear();
        self.used_blocks = 0;
        self.total_blocks = self.blocks(max_tokens);
        Ok(())
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn total_blocks(&self) -> usize {
        self.total_blocks
    }

    fn free_blocks(&self) -> usize {
        self.total_blocks.saturating_sub(self.used_blocks)
    }

    fn kv_new(&mut self) -> KvSlot {
        let state = match &self.capture {
            // Validated by `capture`.
            Some(layers) => self
                .model
                .new_capturing_state(layers)
                .unwrap_or_else(|_| self.model.new_state()),
            None => self.model.new_state(),
        };
        let slot = Slot { state, reserved: 0 };
        match self.free_slots.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(slot);
                KvSlot(i)
            }
            None => {
                self.slots.push(Some(slot));
                KvSlot((self.slots.len() - 1) as u32)
            }
        }
    }

    fn shares_prefixes(&self) -> bool {
        false
    }

    fn kv_fork(&mut self, src: KvSlot, _len: usize) -> Result<KvSlot, BackendError> {
        self.slot(src)?;
        Err(BackendError::Unsupported(
            "deepseek4 sequences do not share state (no prefix reuse); the prompt is computed"
                .into(),
        ))
    }

    fn kv_len(&self, slot: KvSlot) -> usize {
        self.slot(slot).map_or(0, |s| s.reserved)
    }

    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let s = self.slot(slot)?;
        let needed = self.needed(s, from, to);
        let free = self.free_blocks();
        if needed > free {
            return Err(BackendError::OutOfBlocks { needed, free });
        }
        if from > s.state.len() {
            return Err(BackendError::Invalid(format!(
                "cannot prepare positions {from}..{to}: only 0..{} are computed",
                s.state.len()
            )));
        }
        self.slot_mut(slot)?
            .state
            .truncate(from)
            .map_err(model_err)?;
        self.set_reserved(slot, to.max(from))
    }

    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        self.slot(slot).map_or(0, |s| self.needed(s, from, to))
    }

    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        let Ok(s) = self.slot_mut(slot) else { return };
        // Below the floor (never asked by the engine: it truncates at or after the start of
        // the last forward) the state stays as it is and the next forward from there is
        // refused, never computed on a wrong state.
        if s.state.truncate(len).is_ok() {
            let reserved = s.reserved.min(len);
            let _ = self.set_reserved(slot, reserved);
        }
    }

    fn kv_release(&mut self, slot: KvSlot) {
        let Ok(s) = self.slot(slot) else { return };
        let blocks = self.blocks(s.reserved);
        self.used_blocks -= blocks;
        self.slots[slot.0 as usize] = None;
        self.free_slots.push(slot.0);
    }

    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        logits.clear();
        let Batch {
            slots: order,
            rows: batch,
            ..
        } = Batch::from_rows(rows, self.n_vocab(), self.max_context())?;
        for r in rows {
            let reserved = self.slot(r.slot)?.reserved;
            if r.pos >= reserved {
                return Err(BackendError::Invalid(format!(
                    "row at position {} is outside the prepared space 0..{reserved}",
                    r.pos
                )));
            }
        }
        let mut taken: Vec<Slot> = Vec::with_capacity(order.len());
        for &slot in &order {
            // Present: checked above.
            if let Some(s) = self.slots.get_mut(slot.0 as usize).and_then(Option::take) {
                taken.push(s);
            }
        }
        let result = if taken.len() == order.len() {
            let mut refs: Vec<&mut Deepseek4State> =
                taken.iter_mut().map(|s| &mut s.state).collect();
            self.model
                .forward(&mut self.scratch, &mut refs, &batch, logits)
                .map_err(model_err)
        } else {
            Err(BackendError::Internal("a slot appears twice".into()))
        };
        for (slot, s) in order.into_iter().zip(taken) {
            self.slots[slot.0 as usize] = Some(s);
        }
        result
    }

    fn target_rows(&self, slot: KvSlot) -> Option<&dyn model::TargetRows> {
        let s = self.slot(slot).ok()?;
        (s.state.capture_width() > 0).then_some(&s.state as &dyn model::TargetRows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn backend() -> Deepseek4Backend {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/deepseek4/small-ratios.gguf");
        let file = Arc::new(gguf::GgufFile::open(path).expect("fixture"));
        let model = Deepseek4::load(file, &model::LoadOptions::default()).expect("loads");
        Deepseek4Backend::new(Arc::new(model))
    }

    #[test]
    fn blocks_follow_reservations_and_releases() {
        let mut b = backend();
        b.init_kv(320).unwrap();
        assert_eq!(b.total_blocks(), 10);
        let s = b.kv_new();
        assert_eq!(b.kv_blocks_needed(s, 0, 40), 2);
        b.kv_prepare(s, 0, 40).unwrap();
        assert_eq!(b.free_blocks(), 8);
        let rows: Vec<ForwardRow> = (0..40)
            .map(|p| ForwardRow {
                slot: s,
                token: (p % 200 + 2) as u32,
                pos: p,
                wants_logits: p == 39,
            })
            .collect();
        let mut logits = Vec::new();
        b.forward(&rows, &mut logits).unwrap();
        assert_eq!(logits.len(), b.n_vocab());
        b.kv_truncate(s, 30);
        assert_eq!(b.kv_len(s), 30);
        assert_eq!(b.free_blocks(), 9);
        assert!(b.kv_fork(s, 30).is_err());
        assert!(matches!(
            b.kv_prepare(s, 30, 400),
            Err(BackendError::OutOfBlocks {
                needed: 12,
                free: 9
            })
        ));
        // A forward from 30 makes 30 the floor: rewinding below it is refused.
        b.kv_prepare(s, 30, 35).unwrap();
        b.forward(&rows[30..35], &mut logits).unwrap();
        assert!(b.kv_prepare(s, 10, 20).is_err());
        b.kv_truncate(s, 10);
        assert_eq!(b.kv_len(s), 35, "a refused truncation changes nothing");
        b.kv_release(s);
        assert_eq!(b.free_blocks(), 10);
        assert!(matches!(
            b.forward(&rows[..1], &mut logits),
            Err(BackendError::UnknownSlot(_))
        ));
    }
}
