//! Weights repacked once at load time into N-interleaved tiles of 16 output rows, so that
//! one `vpdpbusd` over a broadcast of 4 activation bytes accumulates 16 rows × 4 k at once
//! and every scale of a block is one 16-lane vector.
//!
//! # Layout of one tile (16 rows, `nb` blocks per row)
//!
//! A tile is a sequence of regions, each starting on a 64-byte boundary; a region holds the
//! same field for every block of the tile in block order. Inside a region, per-row items
//! are row-innermost, so an 8-lane (AVX2) reader takes rows 0..8 and 8..16 as two halves of
//! each 16-row item. Codes are stored unsigned (`u = code + offset`; Q4_0 +8, Q5_0 +16,
//! Q8_0 +128, Q6_K +32, others 0); the kernels remove offsets exactly with the activation
//! code sums, so the f32 arithmetic is the canonical one unchanged.
//!
//! Per 32-weight group `g` of a block (the block itself for legacy formats, sub-block `g`
//! of a k-quant), with `kk` the index inside the group, `r` the row, `j = kk % 4`:
//!
//! - 4-bit codes (256 bytes): byte `64·((kk % 16) / 4) + 4r + j`, low nibble for
//!   `kk < 16`, high nibble for `kk ≥ 16`. One 64-byte vector thus holds chunks `t` and
//!   `t + 4` (a chunk is 4 consecutive k of all 16 rows).
//! - 8-bit codes (Q8_0, 512 bytes): byte `64·(kk / 4) + 4r + j`.
//! - fifth bit (Q5_0, Q5_1, Q5_K; 64 bytes): byte `4r + j`, bit `4 + kk / 4` for `kk < 16`
//!   and bit `(kk − 16) / 4` for `kk ≥ 16` (`fifth_bit`). The byte of a code position thus
//!   holds the fifth bits of all 8 chunks through it, lined up with the code bytes: a kernel
//!   loads them once per group and moves chunk `t`'s bit to bit 4 with one shift by 1 per
//!   chunk (bits 4–7 for the low nibbles, bits 0–3 shifted up by 4 for the high ones).
//! - bits 4–5 (Q6_K; 128 bytes): bits `2·((kk % 16) / 4)` of byte `64·(kk / 16) + 4r + j`.
//!
//! Per block: sub-block scales (Q4_K/Q5_K: `16j + r`, u8; Q6_K: `16j + r`, i8), Q4_K/Q5_K
//! mins as u8 pairs (`32·(j / 2) + 2r + j % 2`), and the f16 fields exactly as stored
//! (`d`, then `m`/`dmin` where the format has one), 16 of each (`2r`).
//!
//! Memory: the same bytes as the GGUF weights for the legacy formats and Q6_K; 4 more per
//! row and super-block for Q4_K/Q5_K (+2.8 %/+2.3 %, scales and mins unpacked to bytes);
//! plus padding of the last tile to 16 rows and of each region to 64 bytes.

use crate::blocks::{IntBlock, decode, f16_at};
use crate::dequant::dequantize_block;
use crate::{Format, QuantError};

/// Output rows per packed tile.
pub(crate) const TILE: usize = 16;

/// Packed matrices of at least this many bytes are packed by several threads.
const PACK_PARALLEL_BYTES: usize = 1 << 20;
/// Most threads one matrix is packed by.
const PACK_THREADS: usize = 8;

/// One 64-byte-aligned line of the packed buffer.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A zero-initialised byte buffer aligned to 64 bytes.
struct AlignedBuf {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes. Allocated zeroed (large buffers come as fresh pages that the
    /// kernel zeroes at first touch), not filled: the pages fault in where the packing
    /// writes them, in the packing threads, instead of in one memset before them.
    fn zeroed(len: usize) -> Result<AlignedBuf, QuantError> {
        let count = len.div_ceil(64);
        if count == 0 {
            return Ok(AlignedBuf {
                lines: Vec::new(),
                len,
            });
        }
        let layout = std::alloc::Layout::array::<Line>(count).map_err(|_| QuantError::TooLarge)?;
        // SAFETY: the layout's size is non-zero (count > 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut Line;
        if ptr.is_null() {
            return Err(QuantError::TooLarge);
        }
        // SAFETY: `ptr` was allocated by the global allocator with the layout of `count`
        // `Line`s (what a `Vec<Line>` of capacity `count` uses), and all its bytes are zero,
        // a valid `Line`; the vector takes ownership of the allocation.
        let lines = unsafe { Vec::from_raw_parts(ptr, count, count) };
        Ok(AlignedBuf { lines, len })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `Line` is `repr(C)` over `[u8; 64]` (no padding), so the vector's
        // storage is `64·lines.len() ≥ len` initialised, contiguous bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u8, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u8, self.len) }
    }
}

/// Region offsets of a tile and the bytes per block of each region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Blocks per row.
    pub nb: usize,
    /// Offset of the code region.
    pub codes: usize,
    /// Offset of the high-bit region (Q5_*: fifth bit; Q6_K: bits 4–5).
    pub hi: usize,
    /// Offset of the sub-block scales (k-quants).
    pub sc: usize,
    /// Offset of the sub-block mins (Q4_K, Q5_K).
    pub mn: usize,
    /// Offset of the f16 `d` of the 16 rows.
    pub d: usize,
    /// Offset of the f16 `m`/`dmin` of the 16 rows.
    pub m: usize,
    /// Bytes per tile.
    pub tile: usize,
}

/// Per-block bytes of each region (codes, hi, sc, mn, d, m) for a tiled format.
fn block_sizes(format: Format) -> Option<[usize; 6]> {
    Some(match format {
        Format::Q4_0 => [256, 0, 0, 0, 32, 0],
        Format::Q4_1 => [256, 0, 0, 0, 32, 32],
        Format::Q5_0 => [256, 64, 0, 0, 32, 0],
        Format::Q5_1 => [256, 64, 0, 0, 32, 32],
        Format::Q8_0 => [512, 0, 0, 0, 32, 0],
        Format::Q4_K => [2048, 0, 128, 128, 32, 32],
        Format::Q5_K => [2048, 512, 128, 128, 32, 32],
        Format::Q6_K => [2048, 1024, 256, 0, 32, 0],
        _ => return None,
    })
}

/// Offset added to the signed codes to store them unsigned.
fn code_offset(format: Format) -> i32 {
    match format {
        Format::Q4_0 => 8,
        Format::Q5_0 => 16,
        Format::Q8_0 => 128,
        Format::Q6_K => 32,
        _ => 0,
    }
}

/// Byte offsets of the f16 `d` and (if any) `m`/`dmin` inside an original block.
fn f16_offsets(format: Format) -> (usize, Option<usize>) {
    match format {
        Format::Q4_1 | Format::Q5_1 | Format::Q4_K | Format::Q5_K => (0, Some(2)),
        Format::Q6_K => (208, None),
        _ => (0, None),
    }
}

impl Layout {
    fn new(format: Format, nb: usize) -> Option<Result<Layout, QuantError>> {
        let sizes = block_sizes(format)?;
        let mut offs = [0usize; 6];
        let mut at = 0usize;
        for (o, &s) in offs.iter_mut().zip(&sizes) {
            *o = at;
            let bytes = match s.checked_mul(nb) {
                Some(b) => b.next_multiple_of(64),
                None => return Some(Err(QuantError::TooLarge)),
            };
            at = match at.checked_add(bytes) {
                Some(v) => v,
                None => return Some(Err(QuantError::TooLarge)),
            };
        }
        Some(Ok(Layout {
            nb,
            codes: offs[0],
            hi: offs[1],
            sc: offs[2],
            mn: offs[3],
            d: offs[4],
            m: offs[5],
            tile: at,
        }))
    }
}

enum Repr {
    /// N-interleaved tiles.
    Tiled { buf: AlignedBuf, layout: Layout },
    /// The GGUF row-major bytes, for formats without a tiled layout.
    Plain(AlignedBuf),
}

/// A weight matrix (N rows of K) repacked once, at load time, for
/// [`Kernels::matmul_packed`](crate::Kernels::matmul_packed).
///
/// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K are stored in 16-row N-interleaved
/// tiles (see [`PackedMatrix::is_tiled`]); the other formats keep their row-major bytes (a
/// copy) and run the row-major kernels. The matrix owns its 64-byte-aligned buffer, so the
/// caller can drop the mapped file view afterwards. Memory: about the size of the weights
/// (exactly for the legacy formats and Q6_K, +2.8 % for Q4_K, +2.3 % for Q5_K), plus the
/// padding of the last tile to 16 rows. Results are bit-identical to
/// [`Kernels::matmul`](crate::Kernels::matmul) on the original bytes.
pub struct PackedMatrix {
    format: Format,
    n: usize,
    k: usize,
    repr: Repr,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("format", &self.format)
            .field("n", &self.n)
            .field("k", &self.k)
            .field("tiled", &self.is_tiled())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl PackedMatrix {
    /// Output rows per tile: splitting N at multiples of this avoids recomputing a tile in
    /// two threads.
    pub const TILE: usize = TILE;

    /// Whether `format` has a tiled layout (otherwise packing copies the row-major bytes).
    pub fn tiles_format(format: Format) -> bool {
        block_sizes(format).is_some()
    }

    /// Repack `bytes`, N rows of K weights of `format` in GGUF row-major order.
    pub fn pack(format: Format, bytes: &[u8], n: usize, k: usize) -> Result<Self, QuantError> {
        let row_bytes = format.row_bytes(k)?;
        let total = n.checked_mul(row_bytes).ok_or(QuantError::TooLarge)?;
        if bytes.len() != total {
            return Err(QuantError::Length {
                what: "weight bytes (N rows)",
                expected: total,
                got: bytes.len(),
            });
        }
        let nb = k / format.block_len();
        let Some(layout) = Layout::new(format, nb) else {
            let mut buf = AlignedBuf::zeroed(total)?;
            buf.as_mut_slice().copy_from_slice(bytes);
            return Ok(PackedMatrix {
                format,
                n,
                k,
                repr: Repr::Plain(buf),
            });
        };
        let layout = layout?;
        let tiles = n.div_ceil(TILE);
        let size = tiles.checked_mul(layout.tile).ok_or(QuantError::TooLarge)?;
        let mut buf = AlignedBuf::zeroed(size)?;
        if row_bytes > 0 && layout.tile > 0 {
            // Tiles are independent: large matrices are packed by several threads, each
            // over its own run of whole tiles (a model load spends most of its time here).
            let threads = if size >= PACK_PARALLEL_BYTES {
                std::thread::available_parallelism()
                    .map_or(1, |t| t.get())
                    .min(PACK_THREADS)
            } else {
                1
            };
            let per = tiles.div_ceil(threads).max(1);
            let run = |first_tile: usize, out: &mut [u8]| {
                let rows =
                    first_tile * TILE..((first_tile + out.len() / layout.tile) * TILE).min(n);
                pack_rows(
                    format,
                    &layout,
                    &bytes[rows.start * row_bytes..rows.end * row_bytes],
                    row_bytes,
                    out,
                );
            };
            let out = buf.as_mut_slice();
            if threads == 1 {
                run(0, out);
            } else {
                std::thread::scope(|s| {
                    for (i, chunk) in out.chunks_mut(per * layout.tile).enumerate() {
                        s.spawn(move || run(i * per, chunk));
                    }
                });
            }
        }
        Ok(PackedMatrix {
            format,
            n,
            k,
            repr: Repr::Tiled { buf, layout },
        })
    }

    /// The weight format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Number of rows N (outputs).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Row length K.
    pub fn k(&self) -> usize {
        self.k
    }

    /// True when the matrix is stored in 16-row tiles (see [`PackedMatrix::tiles_format`]).
    pub fn is_tiled(&self) -> bool {
        matches!(self.repr, Repr::Tiled { .. })
    }

    /// Bytes of weight storage held.
    pub fn bytes(&self) -> usize {
        match &self.repr {
            Repr::Tiled { buf, .. } | Repr::Plain(buf) => buf.len,
        }
    }

    /// Dequantize row `row` into `out` (K values), as [`crate::dequantize_row`] does on the
    /// original bytes (bit-identical).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), QuantError> {
        if row >= self.n {
            return Err(QuantError::Row { row, rows: self.n });
        }
        if out.len() != self.k {
            return Err(QuantError::Length {
                what: "dequantize_row output (K)",
                expected: self.k,
                got: out.len(),
            });
        }
        match &self.repr {
            Repr::Plain(buf) => {
                let rb = self.format.row_bytes(self.k)?;
                crate::dequantize_row(self.format, &buf.as_slice()[row * rb..(row + 1) * rb], out)
            }
            Repr::Tiled { .. } => {
                let bl = self.format.block_len();
                for (b, ys) in out.chunks_exact_mut(bl).enumerate() {
                    dequantize_block(self.format, &self.decode_block(row, b), ys);
                }
                Ok(())
            }
        }
    }

    /// The row-major bytes of a plain (untiled) matrix.
    pub(crate) fn plain_bytes(&self) -> Option<&[u8]> {
        match &self.repr {
            Repr::Plain(buf) => Some(buf.as_slice()),
            Repr::Tiled { .. } => None,
        }
    }

    /// The tiles and their layout (tiled matrices).
    pub(crate) fn tiles(&self) -> Option<(&[u8], &Layout)> {
        match &self.repr {
            Repr::Tiled { buf, layout } => Some((buf.as_slice(), layout)),
            Repr::Plain(_) => None,
        }
    }

    /// Block `b` of row `row` of a tiled matrix, decoded from the tile layout (the scalar
    /// reference reads the packed form through this). Caller: tiled, `row < n`, `b < nb`.
    pub(crate) fn decode_block(&self, row: usize, b: usize) -> IntBlock {
        let mut ib = IntBlock {
            codes: [0; 256],
            sc: [0; 16],
            mn: [0; 16],
            d: 0.0,
            m: 0.0,
        };
        let Some((buf, layout)) = self.tiles() else {
            return ib;
        };
        let tile = &buf[row / TILE * layout.tile..(row / TILE + 1) * layout.tile];
        let r = row % TILE;
        let format = self.format;
        let groups = format.block_len() / 32;
        let off = code_offset(format);
        let sizes = block_sizes(format).unwrap_or([0; 6]);
        let codes = &tile[layout.codes + b * sizes[0]..];
        let hi = &tile[layout.hi + b * sizes[1]..];
        for g in 0..groups {
            for kk in 0..32 {
                let j = kk % 4;
                let mut u = if format == Format::Q8_0 {
                    i32::from(codes[64 * (kk / 4) + 4 * r + j])
                } else {
                    let byte = codes[256 * g + 64 * ((kk % 16) / 4) + 4 * r + j];
                    i32::from(if kk < 16 { byte & 0xF } else { byte >> 4 })
                };
                match format {
                    Format::Q5_0 | Format::Q5_1 | Format::Q5_K => {
                        let byte = hi[64 * g + 4 * r + j];
                        u |= i32::from((byte >> fifth_bit(kk)) & 1) << 4;
                    }
                    Format::Q6_K => {
                        let byte = hi[128 * g + 64 * (kk / 16) + 4 * r + j];
                        u |= i32::from((byte >> (2 * ((kk % 16) / 4))) & 3) << 4;
                    }
                    _ => {}
                }
                ib.codes[32 * g + kk] = (u - off) as i8;
            }
        }
        match format {
            Format::Q4_K | Format::Q5_K => {
                for j in 0..8 {
                    ib.sc[j] = i32::from(tile[layout.sc + 128 * b + 16 * j + r]);
                    ib.mn[j] = i32::from(tile[layout.mn + 128 * b + 32 * (j / 2) + 2 * r + j % 2]);
                }
            }
            Format::Q6_K => {
                for j in 0..16 {
                    ib.sc[j] = i32::from(tile[layout.sc + 256 * b + 16 * j + r] as i8);
                }
            }
            _ => {}
        }
        ib.d = f16_at(tile, layout.d + 32 * b + 2 * r);
        if sizes[5] != 0 {
            ib.m = f16_at(tile, layout.m + 32 * b + 2 * r);
        }
        ib
    }
}

/// The bit of a fifth-bit byte (Q5_0, Q5_1, Q5_K) that holds the fifth bit of code `kk` of
/// a 32-code group: 4–7 for the low-nibble chunks `kk / 4` (`kk < 16`), 0–3 for the
/// high-nibble chunks `(kk − 16) / 4`.
fn fifth_bit(kk: usize) -> usize {
    if kk < 16 { 4 + kk / 4 } else { (kk - 16) / 4 }
}

/// Packs `bytes` (whole rows of `row_bytes`, the first of them row 0 of the first tile of
/// `out`) into the tiles `out`.
fn pack_rows(format: Format, layout: &Layout, bytes: &[u8], row_bytes: usize, out: &mut [u8]) {
    let bb = format.block_bytes();
    for (row, rb) in bytes.chunks_exact(row_bytes).enumerate() {
        let tile = &mut out[row / TILE * layout.tile..(row / TILE + 1) * layout.tile];
        for (b, blk) in rb.chunks_exact(bb).enumerate() {
            pack_block(format, layout, tile, row % TILE, b, blk);
        }
    }
}

/// Write block `b` (`blk`, original bytes) of tile row `r` into `tile` (zeroed before).
/// Every byte of the row's codes and high bits is assembled in a register and stored once
/// (`tests::pack_block_reference` writes the same bytes bit by bit).
fn pack_block(format: Format, layout: &Layout, tile: &mut [u8], r: usize, b: usize, blk: &[u8]) {
    let ib = decode(format, blk);
    let sizes = block_sizes(format).unwrap_or([0; 6]);
    let groups = format.block_len() / 32;
    let off = code_offset(format);
    let cbase = layout.codes + b * sizes[0];
    let hbase = layout.hi + b * sizes[1];
    for g in 0..groups {
        // The group's 32 codes made unsigned (bits 4 and up: Q5's fifth bit, Q6_K's two).
        let u: [u8; 32] = std::array::from_fn(|kk| (i32::from(ib.codes[32 * g + kk]) + off) as u8);
        if format == Format::Q8_0 {
            for (kk, &x) in u.iter().enumerate() {
                tile[cbase + 64 * (kk / 4) + 4 * r + kk % 4] = x;
            }
            continue;
        }
        // Chunk q, byte j: code 4q + j in the low nibble, code 16 + 4q + j in the high one.
        for q in 0..4 {
            let at = cbase + 256 * g + 64 * q + 4 * r;
            for j in 0..4 {
                tile[at + j] = (u[4 * q + j] & 0xF) | ((u[16 + 4 * q + j] & 0xF) << 4);
            }
        }
        match format {
            Format::Q5_0 | Format::Q5_1 | Format::Q5_K => {
                for j in 0..4 {
                    let mut v = 0u8;
                    for kk in (j..32).step_by(4) {
                        v |= ((u[kk] >> 4) & 1) << fifth_bit(kk);
                    }
                    tile[hbase + 64 * g + 4 * r + j] = v;
                }
            }
            Format::Q6_K => {
                for h in 0..2 {
                    for j in 0..4 {
                        let mut v = 0u8;
                        for q in 0..4 {
                            v |= ((u[16 * h + 4 * q + j] >> 4) & 3) << (2 * q);
                        }
                        tile[hbase + 128 * g + 64 * h + 4 * r + j] = v;
                    }
                }
            }
            _ => {}
        }
    }
    pack_scales(format, layout, tile, r, b, blk, &ib);
}

/// The sub-block scales and mins and the f16 `d`/`m` of block `b` of tile row `r`.
fn pack_scales(
    format: Format,
    layout: &Layout,
    tile: &mut [u8],
    r: usize,
    b: usize,
    blk: &[u8],
    ib: &IntBlock,
) {
    match format {
        Format::Q4_K | Format::Q5_K => {
            for j in 0..8 {
                tile[layout.sc + 128 * b + 16 * j + r] = ib.sc[j] as u8;
                tile[layout.mn + 128 * b + 32 * (j / 2) + 2 * r + j % 2] = ib.mn[j] as u8;
            }
        }
        Format::Q6_K => {
            for j in 0..16 {
                tile[layout.sc + 256 * b + 16 * j + r] = ib.sc[j] as i8 as u8;
            }
        }
        _ => {}
    }
    let (d_off, m_off) = f16_offsets(format);
    let d = f16_field(blk, d_off);
    tile[layout.d + 32 * b + 2 * r..][..2].copy_from_slice(&d);
    if let Some(mo) = m_off {
        let m = f16_field(blk, mo);
        tile[layout.m + 32 * b + 2 * r..][..2].copy_from_slice(&m);
    }
}

/// The two bytes of an f16 field, as stored.
fn f16_field(blk: &[u8], off: usize) -> [u8; 2] {
    [blk[off], blk[off + 1]]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packing as first written: every code's bits or-ed into place one at a time.
    fn pack_block_reference(
        format: Format,
        layout: &Layout,
        tile: &mut [u8],
        r: usize,
        b: usize,
        blk: &[u8],
    ) {
        let ib = decode(format, blk);
        let sizes = block_sizes(format).unwrap_or([0; 6]);
        let groups = format.block_len() / 32;
        let off = code_offset(format);
        let cbase = layout.codes + b * sizes[0];
        let hbase = layout.hi + b * sizes[1];
        for g in 0..groups {
            for kk in 0..32 {
                let j = kk % 4;
                let u = (i32::from(ib.codes[32 * g + kk]) + off) as u8;
                if format == Format::Q8_0 {
                    tile[cbase + 64 * (kk / 4) + 4 * r + j] = u;
                } else {
                    let at = cbase + 256 * g + 64 * ((kk % 16) / 4) + 4 * r + j;
                    tile[at] |= if kk < 16 { u & 0xF } else { (u & 0xF) << 4 };
                }
                match format {
                    Format::Q5_0 | Format::Q5_1 | Format::Q5_K => {
                        tile[hbase + 64 * g + 4 * r + j] |= ((u >> 4) & 1) << fifth_bit(kk);
                    }
                    Format::Q6_K => {
                        let at = hbase + 128 * g + 64 * (kk / 16) + 4 * r + j;
                        tile[at] |= ((u >> 4) & 3) << (2 * ((kk % 16) / 4));
                    }
                    _ => {}
                }
            }
        }
        pack_scales(format, layout, tile, r, b, blk, &ib);
    }

    /// Packs `n × k` weights of `format` (quantized from a fixed pseudo-random stream) both
    /// ways and compares the tiles byte for byte.
    fn packs_like_the_reference(format: Format, n: usize, k: usize) {
        let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (n * 31 + k) as u64;
        let mut bytes = Vec::new();
        for _ in 0..n {
            let row: Vec<f32> = (0..k)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
                })
                .collect();
            bytes.extend(crate::quantize_row(format, &row).unwrap());
        }
        let packed = PackedMatrix::pack(format, &bytes, n, k).unwrap();
        let (tiles, layout) = packed.tiles().unwrap();
        let mut want = vec![0u8; tiles.len()];
        let row_bytes = format.row_bytes(k).unwrap();
        for (row, rb) in bytes.chunks_exact(row_bytes).enumerate() {
            let tile = &mut want[row / TILE * layout.tile..(row / TILE + 1) * layout.tile];
            for (b, blk) in rb.chunks_exact(format.block_bytes()).enumerate() {
                pack_block_reference(format, layout, tile, row % TILE, b, blk);
            }
        }
        let first = tiles.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(first, None, "{format:?} n {n} k {k}: first differing byte");
    }

    #[test]
    fn packing_writes_the_reference_bytes_for_every_tiled_format() {
        let tiled = Format::ALL
            .into_iter()
            .filter(|&f| PackedMatrix::tiles_format(f));
        assert_eq!(tiled.clone().count(), 8);
        for format in tiled {
            // A partial last tile, several blocks per row.
            packs_like_the_reference(format, 37, 512);
        }
        // Over PACK_PARALLEL_BYTES: packed by several threads (on a machine with several
        // cores), each over its own tiles; the last run of tiles is partial.
        packs_like_the_reference(Format::Q4_K, 7_301, 256);
        packs_like_the_reference(Format::Q6_K, 1_300, 1_024);
        packs_like_the_reference(Format::Q8_0, 1_001, 1_024);
    }

    #[test]
    fn regions_are_64_byte_aligned_and_sized_per_block() {
        let l = Layout::new(Format::Q4_K, 3).unwrap().unwrap();
        assert_eq!(l.codes, 0);
        assert_eq!(l.hi, 3 * 2048);
        assert_eq!(l.sc, 3 * 2048);
        assert_eq!(l.mn, l.sc + 384);
        assert_eq!(l.d, l.mn + 384);
        assert_eq!(l.m, l.d + 128);
        assert_eq!(l.tile, l.m + 128);
        let l = Layout::new(Format::Q4_0, 1).unwrap().unwrap();
        assert_eq!((l.d, l.tile), (256, 320));
        assert!(Layout::new(Format::Q2_K, 1).is_none());
    }
}
