//! [`KvSlot`] bookkeeping over the CPU backend's paged [`KvCache`], shared by the real and
//! the fake backend so both account blocks identically (fork = refcount, copy-on-write,
//! copy-free truncation).

use crate::api::{BackendError, KvSlot};
use backend_cpu::{KvCache, SeqKv};

/// The sequences of one [`KvCache`], addressed by [`KvSlot`].
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    seqs: Vec<Option<SeqKv>>,
    free: Vec<u32>,
}

pub(crate) fn map_kv_err(e: backend_cpu::Error) -> BackendError {
    match e {
        backend_cpu::Error::OutOfBlocks { needed, free, .. } => {
            BackendError::OutOfBlocks { needed, free }
        }
        other => BackendError::model(other),
    }
}

impl SlotTable {
    /// Releases every sequence into `kv` and forgets them.
    pub(crate) fn clear(&mut self, kv: Option<&mut KvCache>) {
        if let Some(kv) = kv {
            for seq in self.seqs.drain(..).flatten() {
                kv.release_sequence(seq);
            }
        }
        self.seqs.clear();
        self.free.clear();
    }

    fn insert(&mut self, seq: SeqKv) -> KvSlot {
        match self.free.pop() {
            Some(i) => {
                self.seqs[i as usize] = Some(seq);
                KvSlot(i)
            }
            None => {
                self.seqs.push(Some(seq));
                KvSlot((self.seqs.len() - 1) as u32)
            }
        }
    }

    pub(crate) fn get(&self, slot: KvSlot) -> Result<&SeqKv, BackendError> {
        self.seqs
            .get(slot.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    pub(crate) fn get_mut(&mut self, slot: KvSlot) -> Result<&mut SeqKv, BackendError> {
        self.seqs
            .get_mut(slot.0 as usize)
            .and_then(Option::as_mut)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    /// Takes the sequences out (for a forward that needs `&mut` to several at once).
    pub(crate) fn take(&mut self, slot: KvSlot) -> Result<SeqKv, BackendError> {
        self.seqs
            .get_mut(slot.0 as usize)
            .and_then(Option::take)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    /// Puts back a sequence taken with [`SlotTable::take`].
    pub(crate) fn put_back(&mut self, slot: KvSlot, seq: SeqKv) {
        if let Some(s) = self.seqs.get_mut(slot.0 as usize) {
            *s = Some(seq);
        }
    }

    pub(crate) fn new_seq(&mut self, kv: &KvCache) -> KvSlot {
        let seq = kv.new_sequence();
        self.insert(seq)
    }

    pub(crate) fn fork(
        &mut self,
        kv: &mut KvCache,
        src: KvSlot,
        len: usize,
    ) -> Result<KvSlot, BackendError> {
        let mut seq = kv.fork(self.get(src)?);
        kv.truncate(&mut seq, len);
        Ok(self.insert(seq))
    }

    pub(crate) fn len(&self, slot: KvSlot) -> usize {
        self.get(slot).map_or(0, SeqKv::len)
    }

    /// Reserves and makes writable `from..to` of a slot; used by the fake backend only.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn prepare(
        &mut self,
        kv: &mut KvCache,
        slot: KvSlot,
        from: usize,
        to: usize,
    ) -> Result<(), BackendError> {
        let needed = self.blocks_needed(kv, slot, from, to);
        let free = kv.allocator(0).map_or(0, |a| a.free_count());
        if needed > free {
            return Err(BackendError::OutOfBlocks { needed, free });
        }
        let seq = self.get_mut(slot)?;
        kv.truncate(seq, from);
        kv.reserve(seq, to).map_err(map_kv_err)?;
        kv.make_writable(seq, from).map_err(map_kv_err)
    }

    /// Blocks [`SlotTable::prepare`] would allocate: new blocks past the cut, plus copies of
    /// shared blocks at or after `from`.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn blocks_needed(
        &self,
        kv: &KvCache,
        slot: KvSlot,
        from: usize,
        to: usize,
    ) -> usize {
        let Ok(seq) = self.get(slot) else { return 0 };
        let (Some(table), Some(alloc)) = (seq.table(0), kv.allocator(0)) else {
            return 0;
        };
        alloc.blocks_needed(table.blocks(), seq.len(), kv.config().block_size, from, to)
    }

    pub(crate) fn truncate(&mut self, kv: &mut KvCache, slot: KvSlot, len: usize) {
        if let Ok(seq) = self.get_mut(slot) {
            kv.truncate(seq, len);
        }
    }

    pub(crate) fn release(&mut self, kv: &mut KvCache, slot: KvSlot) {
        if let Some(seq) = self.seqs.get_mut(slot.0 as usize).and_then(Option::take) {
            kv.release_sequence(seq);
            self.free.push(slot.0);
        }
    }
}
