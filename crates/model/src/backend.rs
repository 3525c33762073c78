//! The backend contract: what the engine's step loop asks of a model with a paged KV cache
//! ([`ForwardBackend`]), the rows of a batched forward ([`ForwardRow`], grouped by sequence
//! in a [`Batch`]), KV slots and errors, and the target rows a DSpark drafter reads
//! ([`TargetRows`]). It lives below the engine so backends (the CPU model here, the CUDA
//! backend) implement it without depending on the engine or its drafters.

use crate::BatchRow;
use std::sync::Arc;

/// An opaque handle to one sequence's KV block table inside a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvSlot(pub u32);

/// One row of a batched forward: `token` of the sequence `slot` at absolute position `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardRow {
    /// The sequence.
    pub slot: KvSlot,
    /// Token id.
    pub token: u32,
    /// Absolute position.
    pub pos: usize,
    /// Whether this row's logits are wanted.
    pub wants_logits: bool,
}

/// Backend failures, by what a caller can do about them.
///
/// The engine preempts or waits on [`BackendError::OutOfBlocks`], takes another way where a
/// backend lacks an operation ([`BackendError::Unsupported`]: computes a prompt instead of
/// forking a prefix), and removes a disk-cache file whose block does not fit
/// ([`BackendError::BadKvBlock`]); every other error ends the sequences it concerns.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The KV pool lacks blocks (nothing was changed).
    #[error("KV pool out of blocks: {needed} needed, {free} free")]
    OutOfBlocks {
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A slot that does not exist (released or never created).
    #[error("unknown KV slot {0}")]
    UnknownSlot(u32),
    /// The KV pool does not exist yet ([`ForwardBackend::init_kv`] was not called).
    #[error("KV pool not initialised")]
    NoKvPool,
    /// This backend cannot do what was asked, at all (keep logit rows, save its KV cache,
    /// share a DeepSeek V4 sequence's state) or for this sequence (share a prefix whose
    /// sliding-window blocks were released). Nothing was changed.
    #[error("{0}")]
    Unsupported(String),
    /// A call outside the contract: a forward's rows (a token outside the vocabulary, a
    /// position past the context or outside the prepared space, rows of a sequence not
    /// consecutive), a KV block or position that is not there, a logit row the last
    /// forward did not keep. The caller's bug.
    #[error("{0}")]
    Invalid(String),
    /// A saved KV block handed to [`ForwardBackend::kv_restore_block`] does not fit this
    /// backend (its size): the data, not the backend, is at fault.
    #[error("{0}")]
    BadKvBlock(String),
    /// The model, its kernels or its KV cache refused the operation (a malformed tensor, a
    /// kernel that refused its arguments, KV bookkeeping); the source says which.
    #[error(transparent)]
    Model(Arc<dyn std::error::Error + Send + Sync>),
    /// The device failed: a driver call, an allocation, a copy or a launch (the CUDA
    /// backend); the source says which.
    #[error(transparent)]
    Device(Arc<dyn std::error::Error + Send + Sync>),
    /// A state the backend should never be in (its own bug).
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    /// [`BackendError::Model`] with `source`.
    pub fn model(source: impl std::error::Error + Send + Sync + 'static) -> BackendError {
        BackendError::Model(Arc::new(source))
    }

    /// [`BackendError::Device`] with `source`.
    pub fn device(source: impl std::error::Error + Send + Sync + 'static) -> BackendError {
        BackendError::Device(Arc::new(source))
    }
}

/// A model plus its paged KV cache, as the step loop sees it: KV bookkeeping per sequence
/// (opaque [`KvSlot`]s over refcounted blocks) and one batched forward over rows of
/// several sequences. Implemented by the engine's `ModelBackend` (the CPU model),
/// `Deepseek4Backend` and `FakeBackend` (deterministic pseudo-logits for tests), and by
/// `lockstep_backend_cuda::CudaBackend`.
///
/// Contract (G1): a row's logits depend only on its sequence's tokens at positions
/// `0..=pos`, never on the other rows of the batch or how the sequence was split into
/// forwards.
pub trait ForwardBackend: Send {
    /// Width of a logit row.
    fn n_vocab(&self) -> usize;
    /// The largest context the backend supports (positions `0..max_context`).
    fn max_context(&self) -> usize;
    /// (Re)creates the KV pool with room for `max_tokens` token slots (whole blocks);
    /// every slot is dropped. Called once by the engine's `Engine::start`.
    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError>;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Blocks in the pool.
    fn total_blocks(&self) -> usize;
    /// Blocks free now.
    fn free_blocks(&self) -> usize;
    /// A new empty sequence.
    fn kv_new(&mut self) -> KvSlot;
    /// A new sequence sharing `src`'s blocks for positions `0..len` (refcounts + 1; `len`
    /// is clamped to `src`'s length). Writing into a shared block copies it first.
    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError>;
    /// Whether [`ForwardBackend::kv_fork`] can share a prefix at all. A backend whose
    /// sequence state cannot be shared (DeepSeek V4's compressor and indexer state) says
    /// no, and the engine then keeps no prefix index instead of asking on every step.
    fn shares_prefixes(&self) -> bool {
        true
    }
    /// Positions reserved in `slot`.
    fn kv_len(&self, slot: KvSlot) -> usize;
    /// Prepares `slot` for writing positions `from..to`: cuts it back to `from`, reserves
    /// blocks up to `to`, and copies shared blocks at or after `from` (copy-on-write).
    /// [`BackendError::OutOfBlocks`] when the pool is short (see
    /// [`ForwardBackend::kv_blocks_needed`]).
    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError>;
    /// Free blocks [`ForwardBackend::kv_prepare`] with these arguments would take.
    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize;
    /// Rolls `slot` back to `len` positions (speculative rollback; copy-free).
    fn kv_truncate(&mut self, slot: KvSlot, len: usize);
    /// Gives back every block of `slot`; the slot is gone.
    fn kv_release(&mut self, slot: KvSlot);
    /// One batched forward. Rows of one sequence are consecutive positions in row order,
    /// starting at most at its cached length, inside space made by
    /// [`ForwardBackend::kv_prepare`]. `logits` is cleared, then gets `n_vocab` values for
    /// each row with `wants_logits`, in row order.
    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError>;
    /// The time the last [`ForwardBackend::forward`] takes on the machine this backend
    /// simulates, ms: `Some` for a backend that replays recorded logits on a fixed cost
    /// curve instead of computing them (the engine then times its steps by it, so its
    /// cost model decides the same on any machine, loaded or not); `None` (the default)
    /// for a backend that computes.
    fn simulated_ms(&self) -> Option<f64> {
        None
    }
    /// Rows of one sequence's prompt this backend takes best in one forward: the engine's
    /// default prefill chunk (and at least its step's row budget). 256 by default (a CPU's
    /// cost grows with the rows anyway); a GPU's tensor-core tiles want more rows at once.
    /// Chunking never changes a bit (G1), only the time to first token and how long a
    /// prefill step holds up the sequences decoding beside it.
    fn preferred_prefill_chunk(&self) -> usize {
        256
    }
    /// Whether this backend implements [`ForwardBackend::forward_summaries`] (one that
    /// keeps the logits where it computed them, a GPU). `false` by default: the engine
    /// then calls [`ForwardBackend::forward`] and reads every logit row.
    fn summarizes(&self) -> bool {
        false
    }
    /// With [`ForwardBackend::summarizes`]: the fewest logit rows a step must have, every
    /// one of them decidable from its summary alone (plain greedy, no logprobs, digests or
    /// verify block), for the engine to take summaries; other steps read every row back
    /// with [`ForwardBackend::forward`]. 1 by default (summarize whenever possible); a
    /// backend whose summaries cost more than one row's copy sets more.
    fn summary_min_rows(&self) -> usize {
        1
    }
    /// One batched forward like [`ForwardBackend::forward`], but the logit rows stay in
    /// the backend: `summaries` is cleared, then gets one [`sampling::RowSummary`] per row
    /// with `wants_logits`, in row order, each equal bit for bit to
    /// [`sampling::row_summary`] of that row. Until the next forward,
    /// [`ForwardBackend::logit_row`] copies out any of those rows. The engine chooses a
    /// plain greedy token from the summary alone and fetches a row only when the choice
    /// needs it (sampling, penalties, logprobs, digests, a constraint that rejects the
    /// argmax).
    fn forward_summaries(
        &mut self,
        rows: &[ForwardRow],
        summaries: &mut Vec<sampling::RowSummary>,
    ) -> Result<(), BackendError> {
        let _ = (rows, summaries);
        Err(BackendError::Unsupported(
            "this backend does not summarize logit rows".into(),
        ))
    }
    /// Copies logit row `i` (in the numbering of the last
    /// [`ForwardBackend::forward_summaries`]'s summaries) into `out` (cleared first).
    fn logit_row(&mut self, i: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        let _ = (i, out);
        Err(BackendError::Unsupported(
            "this backend does not keep logit rows".into(),
        ))
    }
    /// How this backend's KV blocks are laid out when saved
    /// ([`ForwardBackend::kv_export_block`]): element type, shapes, layer windows — part of
    /// the disk tier's key, so a different layout never matches. `None` (the default) when
    /// the KV cannot be saved and restored: the disk tier is then off.
    fn kv_block_format(&self) -> Option<String> {
        None
    }
    /// Bytes of one exported block.
    fn kv_block_bytes(&self) -> usize {
        0
    }
    /// Appends to `out` the stored K/V, every layer, of logical block `block` (positions
    /// `block * B..(block + 1) * B`) of `slot`: the exact bits a restore writes back.
    fn kv_export_block(
        &self,
        slot: KvSlot,
        block: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        let _ = (slot, block, out);
        Err(BackendError::Unsupported(
            "this backend cannot save its KV cache".into(),
        ))
    }
    /// Appends one block holding `data` (as [`ForwardBackend::kv_export_block`] wrote it)
    /// to `slot`, whose length must be a whole number of blocks; layers of a sliding
    /// window keep only what the next query sees. Afterwards the sequence is exactly the
    /// one that computed those positions. [`BackendError::OutOfBlocks`] when the pool is
    /// short (nothing changed).
    fn kv_restore_block(&mut self, slot: KvSlot, data: &[u8]) -> Result<(), BackendError> {
        let _ = (slot, data);
        Err(BackendError::Unsupported(
            "this backend cannot restore its KV cache".into(),
        ))
    }
    /// The target rows `slot`'s forwards captured (a DSpark drafter reads them), when this
    /// backend captures; `None` by default.
    fn target_rows(&self, slot: KvSlot) -> Option<&dyn TargetRows> {
        let _ = slot;
        None
    }
}

/// The target's captured hidden rows of one sequence (what the DSpark drafter reads): one
/// row per computed position, i.e. every committed token but the last, whose forward rides
/// in the next verify block.
pub trait TargetRows {
    /// Values per row.
    fn width(&self) -> usize;
    /// Positions computed: rows may exist for `0..len()`.
    fn len(&self) -> usize;
    /// Whether no position is computed.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The rows of positions `from..to`, contiguous; `None` when one is not held (older
    /// rows are released with the target's sliding window).
    fn rows(&self, from: usize, to: usize) -> Option<&[f32]>;
}

impl TargetRows for crate::Deepseek4State {
    fn width(&self) -> usize {
        self.capture_width()
    }

    fn len(&self) -> usize {
        crate::Deepseek4State::len(self)
    }

    fn rows(&self, from: usize, to: usize) -> Option<&[f32]> {
        self.captured(from, to)
    }
}

/// A forward's rows grouped by sequence, checked once for every backend: token ids inside
/// the vocabulary, positions inside the context, and each sequence's rows consecutive
/// positions in row order (a prefill chunk, one decode row or a verify block); rows of
/// different sequences may interleave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The distinct sequences, in order of first appearance.
    pub slots: Vec<KvSlot>,
    /// Each sequence's first and last position in the batch (the order of `slots`).
    pub spans: Vec<(usize, usize)>,
    /// The rows in the caller's order, each naming its sequence by index into `slots`.
    pub rows: Vec<BatchRow>,
}

impl Batch {
    /// Groups and checks `rows` for a model of `n_vocab` tokens and `max_context`
    /// positions; an error names the first offending row.
    pub fn from_rows(
        rows: &[ForwardRow],
        n_vocab: usize,
        max_context: usize,
    ) -> Result<Batch, BackendError> {
        let mut b = Batch {
            slots: Vec::new(),
            spans: Vec::new(),
            rows: Vec::with_capacity(rows.len()),
        };
        for (i, r) in rows.iter().enumerate() {
            if r.token as usize >= n_vocab {
                return Err(BackendError::Invalid(format!(
                    "row {i}: token id {} is outside the vocabulary (0..{n_vocab})",
                    r.token
                )));
            }
            if r.pos >= max_context {
                return Err(BackendError::Invalid(format!(
                    "row {i}: position {} is past the context ({max_context})",
                    r.pos
                )));
            }
            let seq = match b.slots.iter().position(|&s| s == r.slot) {
                None => {
                    b.slots.push(r.slot);
                    b.spans.push((r.pos, r.pos));
                    b.slots.len() - 1
                }
                Some(j) => {
                    if r.pos != b.spans[j].1 + 1 {
                        return Err(BackendError::Invalid(format!(
                            "row {i}: sequence {} goes from position {} to {}; rows of one \
                             sequence must be consecutive positions",
                            r.slot.0, b.spans[j].1, r.pos
                        )));
                    }
                    b.spans[j].1 = r.pos;
                    j
                }
            };
            b.rows.push(BatchRow {
                seq,
                token: r.token,
                pos: r.pos,
                wants_logits: r.wants_logits,
            });
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(slot: u32, token: u32, pos: usize) -> ForwardRow {
        ForwardRow {
            slot: KvSlot(slot),
            token,
            pos,
            wants_logits: true,
        }
    }

    #[test]
    fn batch_groups_rows_by_first_appearance() {
        let rows = [
            row(7, 1, 4),
            row(2, 3, 0),
            row(7, 5, 5),
            row(2, 9, 1),
            row(2, 0, 2),
        ];
        let b = Batch::from_rows(&rows, 10, 16).unwrap();
        assert_eq!(b.slots, vec![KvSlot(7), KvSlot(2)]);
        assert_eq!(b.spans, vec![(4, 5), (0, 2)]);
        let seqs: Vec<usize> = b.rows.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![0, 1, 0, 1, 1]);
        assert_eq!(b.rows[2].token, 5);
        assert_eq!(b.rows[2].pos, 5);
    }

    #[test]
    fn batch_rejects_bad_rows_naming_them() {
        let err = |rows: &[ForwardRow]| Batch::from_rows(rows, 10, 16).unwrap_err().to_string();
        assert!(err(&[row(1, 10, 0)]).starts_with("row 0: token id 10"));
        assert!(err(&[row(1, 1, 0), row(2, 1, 16)]).starts_with("row 1: position 16"));
        assert!(err(&[row(1, 1, 3), row(1, 1, 5)]).contains("consecutive"));
        assert!(err(&[row(1, 1, 3), row(1, 1, 3)]).contains("consecutive"));
        assert!(Batch::from_rows(&[], 10, 16).unwrap().rows.is_empty());
    }
}
