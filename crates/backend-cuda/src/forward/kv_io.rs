//! Saving and restoring whole KV blocks of a [`CudaBackend`] sequence (the engine's disk
//! tier): the f16 bits of every layer's K and V rows of one block, copied between device and
//! host memory unchanged, so a restored sequence is exactly the one that computed them.

use super::{CudaBackend, be};
use model::{BackendError, ForwardBackend, KvSlot};

/// Bytes of one f16 element.
const F16_BYTES: usize = 2;

impl CudaBackend {
    /// The layout string of a saved block (part of the disk tier's key): element type,
    /// shapes and bytes, so a block saved by another layout never matches.
    pub(super) fn kv_layout(&self) -> Option<String> {
        let kv = self.kv.as_ref()?;
        let cfg = &self.model.cfg;
        Some(format!(
            "cuda paged KV v1: {} layers, {} KV heads of {}, blocks of {}, F16, {} bytes",
            cfg.n_layer,
            cfg.n_head_kv,
            cfg.head_dim,
            kv.bsz,
            self.kv_bytes_per_block()
        ))
    }

    /// Bytes of one saved block: every layer's K then V rows of the block, f16 little-endian.
    pub(super) fn kv_bytes_per_block(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| {
            self.model.cfg.n_layer * 2 * kv.per_block * F16_BYTES
        })
    }

    /// Appends logical block `block` of `slot` (layer by layer, K then V) to `out`.
    pub(super) fn export_kv_block(
        &self,
        slot: KvSlot,
        block: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        let kv = self.kv_ref()?;
        let seq = self.seq(slot)?;
        if (block + 1) * kv.bsz > seq.len {
            return Err(BackendError::Invalid(format!(
                "KV block {block} is not complete: the sequence holds {} positions",
                seq.len
            )));
        }
        let phys = *seq
            .blocks
            .get(block)
            .ok_or_else(|| BackendError::Invalid(format!("KV block {block} is not reserved")))?
            as usize;
        let pb = kv.per_block;
        let dev = &self.model.dev;
        let mut rows = vec![0u16; pb];
        out.reserve(self.kv_bytes_per_block());
        for li in 0..kv.k.len() {
            for buf in [&kv.k[li], &kv.v[li]] {
                dev.read_into(buf, phys * pb, &mut rows).map_err(be)?;
                for x in &rows {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Appends one block holding `data` (as [`CudaBackend::export_kv_block`] wrote it) to
    /// `slot`, whose length must be a whole number of blocks. Nothing changes on an error.
    pub(super) fn restore_kv_block(
        &mut self,
        slot: KvSlot,
        data: &[u8],
    ) -> Result<(), BackendError> {
        let want = self.kv_bytes_per_block();
        if data.len() != want {
            return Err(BackendError::BadKvBlock(format!(
                "a restored KV block has {} bytes, this model's blocks have {want}",
                data.len()
            )));
        }
        let len = self.seq(slot)?.len;
        let bsz = self.kv_ref()?.bsz;
        if len % bsz != 0 {
            return Err(BackendError::Invalid(format!(
                "a restored block must start at a block boundary, the sequence has {len} \
                 positions"
            )));
        }
        self.kv_prepare(slot, len, len + bsz)?;
        let phys = self.seq(slot)?.blocks[len / bsz] as usize;
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        let pb = kv.per_block;
        let dev = &self.model.dev;
        let mut rows = vec![0u16; pb];
        let mut chunks = data.chunks_exact(pb * F16_BYTES);
        let mut result = Ok(());
        'layers: for li in 0..kv.k.len() {
            for buf in [&mut kv.k[li], &mut kv.v[li]] {
                let Some(chunk) = chunks.next() else {
                    result = Err(BackendError::BadKvBlock(
                        "a restored KV block is short".into(),
                    ));
                    break 'layers;
                };
                for (dst, c) in rows.iter_mut().zip(chunk.chunks_exact(F16_BYTES)) {
                    *dst = u16::from_le_bytes([c[0], c[1]]);
                }
                if let Err(e) = dev.write_at(&rows, buf, phys * pb) {
                    result = Err(be(e));
                    break 'layers;
                }
            }
        }
        if result.is_err() {
            self.kv_truncate(slot, len);
            return result;
        }
        self.model.dev.sync().map_err(be)
    }
}
