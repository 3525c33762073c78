//! Paged KV storage: fixed-size token blocks, one block pool per layer group, per-sequence
//! block tables, refcounts for sharing, copy-free truncation and sliding-window release.
//!
//! Layers are grouped by attention window: all global layers form one group, the layers
//! of each distinct sliding window `W` another. A group has its own block pool; a block id
//! of a group names the same token range in every layer of that group. A sequence
//! ([`SeqKv`]) has one [`BlockTable`] per group; logical block `b` of a table covers
//! absolute positions `[b*B, (b+1)*B)` (`B` = block size = attention chunk size).
//!
//! Storage layout of one block of one layer, for K and V separately:
//! `[kv_head][token in block][head_dim]`, so the keys one attention head visits in a chunk
//! are one contiguous run of `B * head_dim` values. Values are f16 (round-to-nearest-even
//! from f32, `vcvtps2ph` semantics) or f32 ([`KvType`]).

use crate::canon;
use crate::error::{Error, Result, check_len};
use crate::isa::Isa;
use crate::kernels;

/// Default block size in tokens (= attention chunk size).
pub const DEFAULT_BLOCK_SIZE: usize = 32;
/// Largest supported block size.
pub const MAX_BLOCK_SIZE: usize = 256;
/// Table entry of a block released because it fell out of a sliding window.
const RELEASED: u32 = u32::MAX;

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// IEEE binary16, rounded to nearest-even from f32.
    #[default]
    F16,
    /// f32, stored exactly.
    F32,
}

/// Shape and sizing of a [`KvCache`].
#[derive(Clone, Debug, PartialEq)]
pub struct KvConfig {
    /// KV heads per layer.
    pub n_kv_head: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Tokens per block (and attention chunk size); 1..=[`MAX_BLOCK_SIZE`].
    pub block_size: usize,
    /// Element type.
    pub kv_type: KvType,
    /// One entry per layer: `None` for global attention, `Some(W)` for a sliding window
    /// of `W` keys (a query at `p` sees keys `max(0, p-W+1)..=p`).
    pub windows: Vec<Option<usize>>,
    /// Blocks in the pool of the global group.
    pub global_blocks: usize,
    /// Blocks in the pool of each sliding-window group.
    pub sliding_blocks: usize,
}

/// Free list and per-block reference counts of one block pool.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    refcount: Vec<u32>,
    free: Vec<u32>,
}

impl BlockAllocator {
    /// A pool of `n` free blocks.
    pub fn new(n: usize) -> BlockAllocator {
        BlockAllocator {
            refcount: vec![0; n],
            free: (0..n as u32).rev().collect(),
        }
    }

    /// Takes a free block (refcount 1), lowest id first; `None` when the pool is empty.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refcount[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to a live block (sharing).
    pub fn retain(&mut self, block: u32) {
        if let Some(rc) = self.refcount.get_mut(block as usize) {
            debug_assert!(*rc > 0, "retain of a free block");
            *rc += 1;
        }
    }

    /// Drops a reference; the block returns to the free list when none remain.
    pub fn release(&mut self, block: u32) {
        if let Some(rc) = self.refcount.get_mut(block as usize) {
            debug_assert!(*rc > 0, "release of a free block");
            if *rc > 0 {
                *rc -= 1;
                if *rc == 0 {
                    self.free.push(block);
                }
            }
        }
    }

    /// References to `block` (0 = free).
    pub fn refcount(&self, block: u32) -> u32 {
        self.refcount.get(block as usize).copied().unwrap_or(0)
    }

    /// The blocks a prepare takes from this pool (ARCHITECTURE.md, `crates/backend-cpu`:
    /// "the blocks a prepare takes"), for a sequence whose table here is `blocks`
    /// (logical order; released entries are never shared) over `len` positions of
    /// `block_size`: cutting back to `from` keeps the blocks before it (all of them when
    /// `from` is at or past `len`), reserving up to `to` allocates the blocks past those,
    /// and copy-on-write copies each kept block at or after `from` that another sequence
    /// shares. Every backend over this allocator (the CPU `KvCache`, the CUDA backend's
    /// device pool) answers `kv_blocks_needed` with it.
    pub fn blocks_needed(
        &self,
        blocks: &[u32],
        len: usize,
        block_size: usize,
        from: usize,
        to: usize,
    ) -> usize {
        let bs = block_size.max(1);
        let kept = if from < len {
            from.div_ceil(bs).min(blocks.len())
        } else {
            blocks.len()
        };
        let new = to.div_ceil(bs).saturating_sub(kept);
        let shared = blocks
            .get(from / bs..kept)
            .unwrap_or_default()
            .iter()
            .filter(|&&b| self.refcount(b) > 1)
            .count();
        new + shared
    }

    /// Blocks currently free.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.refcount.len()
    }

    /// Grows the pool to `n` blocks (a smaller `n` does nothing). The new blocks are free
    /// and handed out after the ones already free.
    pub fn grow(&mut self, n: usize) {
        let old = self.refcount.len();
        if n <= old {
            return;
        }
        self.refcount.resize(n, 0);
        self.free.splice(0..0, (old as u32..n as u32).rev());
    }
}

/// One sequence's blocks in one layer group: logical block `b` covers positions
/// `[b*B, (b+1)*B)`; released entries (out of a sliding window) are kept as holes so the
/// index stays the position divided by `B`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// The block ids by logical index (`u32::MAX` = released).
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The block holding logical index `b`, if allocated and not released.
    pub fn block(&self, b: usize) -> Option<u32> {
        self.blocks.get(b).copied().filter(|&id| id != RELEASED)
    }

    /// Blocks held (not released).
    pub fn held(&self) -> usize {
        self.blocks.iter().filter(|&&b| b != RELEASED).count()
    }
}

/// The KV bookkeeping of one sequence: its reserved length and one [`BlockTable`] per
/// layer group. Created by [`KvCache::new_sequence`]; must be given back with
/// [`KvCache::release_sequence`] (dropping it leaks its blocks until the cache is dropped).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SeqKv {
    len: usize,
    tables: Vec<BlockTable>,
}

impl SeqKv {
    /// Positions `0..len` have blocks (reserved; their K/V may or may not be written yet).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is reserved.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The table of layer group `group`.
    pub fn table(&self, group: usize) -> Option<&BlockTable> {
        self.tables.get(group)
    }
}

/// Backing values of one layer.
#[derive(Debug)]
enum Values {
    F16 { k: Vec<u16>, v: Vec<u16> },
    F32 { k: Vec<f32>, v: Vec<f32> },
}

/// One layer group: its window, its layers, its block pool and their storage.
#[derive(Debug)]
struct Group {
    window: Option<usize>,
    layers: Vec<usize>,
    alloc: BlockAllocator,
    storage: Vec<Values>,
}

/// Read-only view of the keys or values of one (layer, block, kv head): `B * head_dim`
/// values, token-major.
#[derive(Clone, Copy)]
pub(crate) enum BlockSlice<'a> {
    F16(&'a [u16]),
    F32(&'a [f32]),
}

/// The paged KV cache of a model: every layer's K and V for all sequences.
#[derive(Debug)]
pub struct KvCache {
    cfg: KvConfig,
    groups: Vec<Group>,
    /// layer → (group, index of the layer inside the group)
    layer_map: Vec<(usize, usize)>,
    isa: Isa,
}

impl KvCache {
    /// Builds the cache and allocates its storage (zeroed).
    pub fn new(cfg: KvConfig) -> Result<KvCache> {
        KvCache::with_isa(cfg, Isa::selected())
    }

    /// As [`KvCache::new`] with the f32 → f16 conversion of `isa` (all paths round
    /// identically; this exists for tests).
    pub fn with_isa(cfg: KvConfig, isa: Isa) -> Result<KvCache> {
        if cfg.n_kv_head == 0 || cfg.head_dim == 0 {
            return Err(Error::Config("n_kv_head and head_dim must be > 0".into()));
        }
        if cfg.block_size == 0 || cfg.block_size > MAX_BLOCK_SIZE {
            return Err(Error::Config(format!(
                "block_size must be in 1..={MAX_BLOCK_SIZE}, got {}",
                cfg.block_size
            )));
        }
        if cfg.windows.contains(&Some(0)) {
            return Err(Error::Config("a sliding window must be > 0".into()));
        }
        if cfg.global_blocks.max(cfg.sliding_blocks) >= RELEASED as usize {
            return Err(Error::Config("too many blocks".into()));
        }
        let per_block = cfg
            .n_kv_head
            .checked_mul(cfg.head_dim)
            .and_then(|x| x.checked_mul(cfg.block_size))
            .ok_or_else(|| Error::Config("block too large".into()))?;
        let mut groups: Vec<Group> = Vec::new();
        let mut layer_map = Vec::with_capacity(cfg.windows.len());
        for (layer, &window) in cfg.windows.iter().enumerate() {
            let g = match groups.iter().position(|g| g.window == window) {
                Some(g) => g,
                None => {
                    let n = if window.is_none() {
                        cfg.global_blocks
                    } else {
                        cfg.sliding_blocks
                    };
                    groups.push(Group {
                        window,
                        layers: Vec::new(),
                        alloc: BlockAllocator::new(n),
                        storage: Vec::new(),
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[g];
            let n = per_block
                .checked_mul(group.alloc.capacity())
                .ok_or_else(|| Error::Config("KV cache too large".into()))?;
            group.storage.push(match cfg.kv_type {
                KvType::F16 => Values::F16 {
                    k: vec![0; n],
                    v: vec![0; n],
                },
                KvType::F32 => Values::F32 {
                    k: vec![0.0; n],
                    v: vec![0.0; n],
                },
            });
            layer_map.push((g, group.layers.len()));
            group.layers.push(layer);
        }
        Ok(KvCache {
            cfg,
            groups,
            layer_map,
            isa: isa.checked(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// Number of layer groups (distinct windows, in order of first appearance).
    pub fn n_groups(&self) -> usize {
        self.groups.len()
    }

    /// The layer group of `layer`.
    pub fn group_of(&self, layer: usize) -> Result<usize> {
        self.layer_map
            .get(layer)
            .map(|&(g, _)| g)
            .ok_or(Error::Layer {
                layer,
                n_layers: self.layer_map.len(),
            })
    }

    /// The window of a layer group (`None` = global).
    pub fn group_window(&self, group: usize) -> Option<usize> {
        self.groups.get(group).and_then(|g| g.window)
    }

    /// The block allocator of a layer group (read-only: free counts, refcounts).
    pub fn allocator(&self, group: usize) -> Option<&BlockAllocator> {
        self.groups.get(group).map(|g| &g.alloc)
    }

    /// Grows the block pool of layer group `group` to `capacity` blocks (a smaller
    /// capacity does nothing): the new blocks are free and zeroed; existing blocks, tables
    /// and refcounts are untouched. Lets a sliding-window group start small and follow its
    /// real use (it never needs more blocks than the global group holds).
    pub fn grow_pool(&mut self, group: usize, capacity: usize) -> Result<()> {
        let per_block = self.cfg.n_kv_head * self.cfg.head_dim * self.cfg.block_size;
        let n_groups = self.groups.len();
        let g = self.groups.get_mut(group).ok_or_else(|| {
            Error::Config(format!(
                "layer group {group} does not exist ({n_groups} groups)"
            ))
        })?;
        if capacity <= g.alloc.capacity() {
            return Ok(());
        }
        if capacity >= RELEASED as usize {
            return Err(Error::Config("too many blocks".into()));
        }
        let n = per_block
            .checked_mul(capacity)
            .ok_or_else(|| Error::Config("KV cache too large".into()))?;
        for values in &mut g.storage {
            match values {
                Values::F16 { k, v } => {
                    k.resize(n, 0);
                    v.resize(n, 0);
                }
                Values::F32 { k, v } => {
                    k.resize(n, 0.0);
                    v.resize(n, 0.0);
                }
            }
        }
        g.alloc.grow(capacity);
        Ok(())
    }

    /// An empty sequence (no blocks).
    pub fn new_sequence(&self) -> SeqKv {
        SeqKv {
            len: 0,
            tables: vec![BlockTable::default(); self.groups.len()],
        }
    }

    /// Makes positions `0..new_len` available for writing: allocates the missing blocks of
    /// every group. All or nothing: on [`Error::OutOfBlocks`] nothing changed. A smaller
    /// `new_len` than the current length does nothing (use [`KvCache::truncate`]).
    pub fn reserve(&mut self, seq: &mut SeqKv, new_len: usize) -> Result<()> {
        self.check_seq(seq)?;
        if new_len <= seq.len {
            return Ok(());
        }
        let need_blocks = new_len.div_ceil(self.cfg.block_size);
        for (g, (group, table)) in self.groups.iter().zip(&seq.tables).enumerate() {
            let needed = need_blocks.saturating_sub(table.blocks.len());
            if needed > group.alloc.free_count() {
                return Err(Error::OutOfBlocks {
                    group: g,
                    needed,
                    free: group.alloc.free_count(),
                });
            }
        }
        for (group, table) in self.groups.iter_mut().zip(&mut seq.tables) {
            while table.blocks.len() < need_blocks {
                let b = group.alloc.alloc().ok_or(Error::OutOfBlocks {
                    group: 0,
                    needed: 1,
                    free: 0,
                })?;
                table.blocks.push(b);
            }
        }
        seq.len = new_len;
        Ok(())
    }

    /// Rolls the sequence back to `len` positions (speculative rollback): blocks wholly at
    /// or beyond `len` are released, nothing is copied. A `len` at or beyond the current
    /// length does nothing.
    pub fn truncate(&mut self, seq: &mut SeqKv, len: usize) {
        if len >= seq.len {
            return;
        }
        let keep = len.div_ceil(self.cfg.block_size);
        for (group, table) in self.groups.iter_mut().zip(&mut seq.tables) {
            for b in table.blocks.drain(keep.min(table.blocks.len())..) {
                if b != RELEASED {
                    group.alloc.release(b);
                }
            }
        }
        seq.len = len;
    }

    /// Releases, in every sliding-window group, the blocks no future query can see.
    ///
    /// `committed` is the number of positions whose K/V are final (every later query of
    /// this sequence sits at a position `>= committed`, so it sees keys
    /// `>= committed + 1 - W`); blocks lying wholly below that are released. Truncation
    /// never goes below `committed`, so released blocks are never needed again.
    pub fn release_outside_window(&mut self, seq: &mut SeqKv, committed: usize) {
        let bsz = self.cfg.block_size;
        for (group, table) in self.groups.iter_mut().zip(&mut seq.tables) {
            let Some(w) = group.window else { continue };
            let first_visible = (committed + 1).saturating_sub(w);
            // Block b lies wholly below `first_visible` iff (b+1)*B <= first_visible.
            let n_dead = (first_visible / bsz).min(table.blocks.len());
            for slot in &mut table.blocks[..n_dead] {
                if *slot != RELEASED {
                    group.alloc.release(*slot);
                    *slot = RELEASED;
                }
            }
        }
    }

    /// Gives back every block of the sequence.
    pub fn release_sequence(&mut self, mut seq: SeqKv) {
        self.truncate(&mut seq, 0);
    }

    /// A new sequence sharing all of `seq`'s blocks (refcounts + 1): prefix reuse. Writes
    /// into shared blocks are refused until [`KvCache::make_writable`] copies them.
    pub fn fork(&mut self, seq: &SeqKv) -> SeqKv {
        for (group, table) in self.groups.iter_mut().zip(&seq.tables) {
            for &b in &table.blocks {
                if b != RELEASED {
                    group.alloc.retain(b);
                }
            }
        }
        SeqKv {
            len: seq.len,
            tables: seq.tables.clone(),
        }
    }

    /// Copy-on-write: gives `seq` private copies (all layers of the group) of the shared
    /// blocks that hold positions `from..seq.len()`. All or nothing on
    /// [`Error::OutOfBlocks`].
    pub fn make_writable(&mut self, seq: &mut SeqKv, from: usize) -> Result<()> {
        self.check_seq(seq)?;
        let bsz = self.cfg.block_size;
        let first = from / bsz;
        for (g, (group, table)) in self.groups.iter().zip(&seq.tables).enumerate() {
            let needed = table
                .blocks
                .iter()
                .skip(first)
                .filter(|&&b| b != RELEASED && group.alloc.refcount(b) > 1)
                .count();
            if needed > group.alloc.free_count() {
                return Err(Error::OutOfBlocks {
                    group: g,
                    needed,
                    free: group.alloc.free_count(),
                });
            }
        }
        let per_block = self.cfg.n_kv_head * self.cfg.head_dim * bsz;
        for (group, table) in self.groups.iter_mut().zip(&mut seq.tables) {
            for slot in table.blocks.iter_mut().skip(first) {
                let old = *slot;
                if old == RELEASED || group.alloc.refcount(old) <= 1 {
                    continue;
                }
                let new = group.alloc.alloc().ok_or(Error::OutOfBlocks {
                    group: 0,
                    needed: 1,
                    free: 0,
                })?;
                let (src, dst) = (old as usize * per_block, new as usize * per_block);
                for values in &mut group.storage {
                    match values {
                        Values::F16 { k, v } => {
                            k.copy_within(src..src + per_block, dst);
                            v.copy_within(src..src + per_block, dst);
                        }
                        Values::F32 { k, v } => {
                            k.copy_within(src..src + per_block, dst);
                            v.copy_within(src..src + per_block, dst);
                        }
                    }
                }
                group.alloc.release(old);
                *slot = new;
            }
        }
        Ok(())
    }

    fn check_seq(&self, seq: &SeqKv) -> Result<()> {
        check_len(
            "sequence tables (one per layer group)",
            self.groups.len(),
            seq.tables.len(),
        )
    }

    /// Locates position `pos` of `seq` in `layer`: (group, layer in group, block id,
    /// token offset in the block).
    pub(crate) fn locate(
        &self,
        layer: usize,
        seq: &SeqKv,
        pos: usize,
    ) -> Result<(usize, usize, u32, usize)> {
        let &(g, li) = self.layer_map.get(layer).ok_or(Error::Layer {
            layer,
            n_layers: self.layer_map.len(),
        })?;
        if pos >= seq.len {
            return Err(Error::NotReserved { pos, len: seq.len });
        }
        let bsz = self.cfg.block_size;
        let table = seq.tables.get(g).ok_or(Error::Shape {
            what: "sequence tables (one per layer group)",
            expected: self.groups.len(),
            got: seq.tables.len(),
        })?;
        let block = table
            .block(pos / bsz)
            .ok_or(Error::Released { pos, group: g })?;
        Ok((g, li, block, pos % bsz))
    }

    /// Writes the K and V rows (`n_kv_head * head_dim` f32 each, head-major) of position
    /// `pos` of `seq` into `layer`, converting to the cache type.
    pub fn write(
        &mut self,
        layer: usize,
        seq: &SeqKv,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let (nh, d, bsz) = (self.cfg.n_kv_head, self.cfg.head_dim, self.cfg.block_size);
        check_len("kv write k", nh * d, k.len())?;
        check_len("kv write v", nh * d, v.len())?;
        let (g, li, block, off) = self.locate(layer, seq, pos)?;
        let group = &mut self.groups[g];
        if group.alloc.refcount(block) > 1 {
            return Err(Error::SharedBlock { pos, group: g });
        }
        let isa = self.isa;
        let base = block as usize * nh * bsz * d;
        for h in 0..nh {
            let at = base + (h * bsz + off) * d;
            let (ks, vs) = (&k[h * d..(h + 1) * d], &v[h * d..(h + 1) * d]);
            match &mut group.storage[li] {
                Values::F16 { k, v } => {
                    kernels::f32_to_f16(isa, ks, &mut k[at..at + d]);
                    kernels::f32_to_f16(isa, vs, &mut v[at..at + d]);
                }
                Values::F32 { k, v } => {
                    k[at..at + d].copy_from_slice(ks);
                    v[at..at + d].copy_from_slice(vs);
                }
            }
        }
        Ok(())
    }

    /// Batched [`KvCache::write`]: row `r` of `k` and `v` (each `rows.len()` rows of
    /// `n_kv_head * head_dim`) goes to `rows[r]`. Stops at the first error (earlier rows
    /// stay written).
    pub fn write_rows(
        &mut self,
        layer: usize,
        rows: &[crate::attention::AttnRow<'_>],
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let w = self.cfg.n_kv_head * self.cfg.head_dim;
        check_len("kv write_rows k", rows.len() * w, k.len())?;
        check_len("kv write_rows v", rows.len() * w, v.len())?;
        for (r, row) in rows.iter().enumerate() {
            self.write(
                layer,
                row.seq,
                row.pos,
                &k[r * w..(r + 1) * w],
                &v[r * w..(r + 1) * w],
            )?;
        }
        Ok(())
    }

    /// Reads back (as f32) the K and V rows of position `pos` of `seq` in `layer`, exactly
    /// as attention sees them.
    pub fn read(
        &self,
        layer: usize,
        seq: &SeqKv,
        pos: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<()> {
        let (nh, d) = (self.cfg.n_kv_head, self.cfg.head_dim);
        check_len("kv read k", nh * d, k.len())?;
        check_len("kv read v", nh * d, v.len())?;
        let (g, li, block, off) = self.locate(layer, seq, pos)?;
        for h in 0..nh {
            let (ko, vo) = (&mut k[h * d..(h + 1) * d], &mut v[h * d..(h + 1) * d]);
            for (src, out) in [
                (self.block_keys(g, li, block, h), ko),
                (self.block_values(g, li, block, h), vo),
            ] {
                match src {
                    BlockSlice::F16(s) => {
                        for (o, &x) in out.iter_mut().zip(&s[off * d..(off + 1) * d]) {
                            *o = canon::f16_to_f32(x);
                        }
                    }
                    BlockSlice::F32(s) => out.copy_from_slice(&s[off * d..(off + 1) * d]),
                }
            }
        }
        Ok(())
    }

    /// Bytes of one block of every layer as [`KvCache::export_block`] writes it: per
    /// layer, the block's keys then its values (`n_kv_head * block_size * head_dim`
    /// elements each, little-endian f16 bits or f32).
    pub fn block_bytes(&self) -> usize {
        let elem = match self.cfg.kv_type {
            KvType::F16 => 2,
            KvType::F32 => 4,
        };
        2 * self.layer_map.len()
            * self.cfg.n_kv_head
            * self.cfg.block_size
            * self.cfg.head_dim
            * elem
    }

    /// Appends to `out` the stored K/V of logical block `b` of `seq` in every layer (the
    /// exact stored bits, layout of [`KvCache::block_bytes`]). [`Error::Released`] when a
    /// group no longer holds the block (it left a sliding window), [`Error::NotReserved`]
    /// when the sequence does not reach it.
    pub fn export_block(&self, seq: &SeqKv, b: usize, out: &mut Vec<u8>) -> Result<()> {
        self.check_seq(seq)?;
        let bsz = self.cfg.block_size;
        if (b + 1) * bsz > seq.len {
            return Err(Error::NotReserved {
                pos: (b + 1) * bsz - 1,
                len: seq.len,
            });
        }
        let per_block = self.cfg.n_kv_head * self.cfg.head_dim * bsz;
        out.reserve(self.block_bytes());
        for &(g, li) in &self.layer_map {
            let block = seq.tables[g].block(b).ok_or(Error::Released {
                pos: b * bsz,
                group: g,
            })?;
            let r = block as usize * per_block..(block as usize + 1) * per_block;
            // Keys then values, each element little-endian (whole-slice loops: this runs
            // on the step thread for every saved block).
            match &self.groups[g].storage[li] {
                Values::F16 { k, v } => {
                    for half in [&k[r.clone()], &v[r]] {
                        let at = out.len();
                        out.resize(at + 2 * half.len(), 0);
                        for (o, x) in out[at..].chunks_exact_mut(2).zip(half) {
                            o.copy_from_slice(&x.to_le_bytes());
                        }
                    }
                }
                Values::F32 { k, v } => {
                    for half in [&k[r.clone()], &v[r]] {
                        let at = out.len();
                        out.resize(at + 4 * half.len(), 0);
                        for (o, x) in out[at..].chunks_exact_mut(4).zip(half) {
                            o.copy_from_slice(&x.to_le_bytes());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes `data` (the layout of [`KvCache::export_block`]) into logical block `b` of
    /// `seq` in every layer whose group holds it: the stored bits are exactly those
    /// exported. Groups whose table has released the block are skipped (a sliding window
    /// that no longer reaches it). The block must be reserved and not shared
    /// ([`Error::SharedBlock`]); a wrong length is [`Error::Shape`]. Nothing is written
    /// unless every check passes.
    pub fn import_block(&mut self, seq: &SeqKv, b: usize, data: &[u8]) -> Result<()> {
        self.check_seq(seq)?;
        check_len("imported KV block bytes", self.block_bytes(), data.len())?;
        let bsz = self.cfg.block_size;
        if (b + 1) * bsz > seq.len {
            return Err(Error::NotReserved {
                pos: (b + 1) * bsz - 1,
                len: seq.len,
            });
        }
        for (g, (group, table)) in self.groups.iter().zip(&seq.tables).enumerate() {
            if let Some(block) = table.block(b)
                && group.alloc.refcount(block) > 1
            {
                return Err(Error::SharedBlock {
                    pos: b * bsz,
                    group: g,
                });
            }
        }
        let per_block = self.cfg.n_kv_head * self.cfg.head_dim * bsz;
        let layer_bytes = data.len() / self.layer_map.len().max(1);
        for (&(g, li), chunk) in self.layer_map.iter().zip(data.chunks_exact(layer_bytes)) {
            let Some(block) = seq.tables[g].block(b) else {
                continue;
            };
            let r = block as usize * per_block..(block as usize + 1) * per_block;
            // Keys then values (the layout of `export_block`), whole-slice loops.
            let (kb, vb) = chunk.split_at(chunk.len() / 2);
            match &mut self.groups[g].storage[li] {
                Values::F16 { k, v } => {
                    for (dst, src) in [(&mut k[r.clone()], kb), (&mut v[r], vb)] {
                        for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                            *d = u16::from_le_bytes([c[0], c[1]]);
                        }
                    }
                }
                Values::F32 { k, v } => {
                    for (dst, src) in [(&mut k[r.clone()], kb), (&mut v[r], vb)] {
                        for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Keys of (group, layer in group, block, kv head).
    pub(crate) fn block_keys(&self, g: usize, li: usize, block: u32, h: usize) -> BlockSlice<'_> {
        self.block_slice(g, li, block, h, true)
    }

    /// Values of (group, layer in group, block, kv head).
    pub(crate) fn block_values(&self, g: usize, li: usize, block: u32, h: usize) -> BlockSlice<'_> {
        self.block_slice(g, li, block, h, false)
    }

    fn block_slice(&self, g: usize, li: usize, block: u32, h: usize, keys: bool) -> BlockSlice<'_> {
        let (nh, d, bsz) = (self.cfg.n_kv_head, self.cfg.head_dim, self.cfg.block_size);
        let at = (block as usize * nh + h) * bsz * d;
        let r = at..at + bsz * d;
        match &self.groups[g].storage[li] {
            Values::F16 { k, v } => BlockSlice::F16(if keys { &k[r] } else { &v[r] }),
            Values::F32 { k, v } => BlockSlice::F32(if keys { &k[r] } else { &v[r] }),
        }
    }

    /// (group, layer in group) of a layer.
    pub(crate) fn layer_slot(&self, layer: usize) -> Result<(usize, usize)> {
        self.layer_map.get(layer).copied().ok_or(Error::Layer {
            layer,
            n_layers: self.layer_map.len(),
        })
    }
}
