//! Scalar decoding of one weight block into integer codes and scales — the single source of
//! the format definitions that the scalar reference kernels and dequantization share.

use crate::Format;
use crate::tables::{IQ2XXS_GRID, KVALUES_MXFP4, e8m0_to_f32_half, ksigns};

/// f16 at a byte offset (little-endian), decoded exactly to f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// u32 at a byte offset (little-endian).
#[inline]
pub(crate) fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// One weight block in integer form: `w_i = (d·sc_j)·code_i − (m·mn_j)` for k-quants and
/// IQ2_XXS, or the legacy forms `d·code_i` / `d·code_i + m` (MXFP4 as Q8_0: `d·code_i`).
pub(crate) struct IntBlock {
    /// Signed codes, `len` of them (after subtracting the format's offset where it has one).
    pub codes: [i8; 256],
    /// Sub-block scales (k-quants; `sub_len` weights each).
    pub sc: [i32; 16],
    /// Sub-block minimums (Q2_K, Q4_K, Q5_K).
    pub mn: [i32; 16],
    /// Block scale (`d`; IQ2_XXS: the f16 `d` times 0.125, exact; MXFP4: `2^(e−128)`).
    pub d: f32,
    /// Second f16 field: `m` (Q4_1, Q5_1) or `dmin` (Q2_K, Q4_K, Q5_K); 0 otherwise.
    pub m: f32,
}

/// Weights per sub-block scale for a k-quant format (the whole block for legacy ones).
pub(crate) fn sub_len(format: Format) -> usize {
    match format {
        Format::Q2_K | Format::Q3_K | Format::Q6_K => 16,
        Format::Q4_K | Format::Q5_K | Format::IQ2_XXS => 32,
        _ => format.block_len(),
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block (ggml `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
    if j < 4 {
        (i32::from(q[j] & 63), i32::from(q[j + 4] & 63))
    } else {
        (
            i32::from((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            i32::from((q[j + 4] >> 4) | ((q[j] >> 6) << 4)),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (already minus 32), from its 12 scale bytes.
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Decode one block of a quantized format. `b` is exactly one block.
pub(crate) fn decode(format: Format, b: &[u8]) -> IntBlock {
    let mut ib = IntBlock {
        codes: [0; 256],
        sc: [0; 16],
        mn: [0; 16],
        d: 0.0,
        m: 0.0,
    };
    match format {
        Format::Q4_0 | Format::Q4_1 => {
            let (qs, off) = if format == Format::Q4_0 {
                (&b[2..18], 8)
            } else {
                ib.m = f16_at(b, 2);
                (&b[4..20], 0)
            };
            ib.d = f16_at(b, 0);
            for (j, &q) in qs.iter().enumerate() {
                ib.codes[j] = (q & 0xF) as i8 - off;
                ib.codes[j + 16] = (q >> 4) as i8 - off;
            }
        }
        Format::Q5_0 | Format::Q5_1 => {
            let (qh, qs, off) = if format == Format::Q5_0 {
                (u32_at(b, 2), &b[6..22], 16)
            } else {
                ib.m = f16_at(b, 2);
                (u32_at(b, 4), &b[8..24], 0)
            };
            ib.d = f16_at(b, 0);
            for (j, &q) in qs.iter().enumerate() {
                let h0 = ((qh >> j) & 1) as u8;
                let h1 = ((qh >> (j + 16)) & 1) as u8;
                ib.codes[j] = ((q & 0xF) | (h0 << 4)) as i8 - off;
                ib.codes[j + 16] = ((q >> 4) | (h1 << 4)) as i8 - off;
            }
        }
        Format::Q8_0 => {
            ib.d = f16_at(b, 0);
            for (j, &q) in b[2..34].iter().enumerate() {
                ib.codes[j] = q as i8;
            }
        }
        Format::Q2_K => {
            let scales = &b[0..16];
            let qs = &b[16..80];
            ib.d = f16_at(b, 80);
            ib.m = f16_at(b, 82);
            for (j, &s) in scales.iter().enumerate() {
                ib.sc[j] = i32::from(s & 0xF);
                ib.mn[j] = i32::from(s >> 4);
            }
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        ib.codes[128 * h + 32 * s + l] = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
                    }
                }
            }
        }
        Format::Q3_K => {
            let hmask = &b[0..32];
            let qs = &b[32..96];
            let sc = q3k_scales(&b[96..108]);
            ib.d = f16_at(b, 108);
            for (j, &s) in sc.iter().enumerate() {
                ib.sc[j] = i32::from(s);
            }
            for h in 0..2 {
                for s in 0..4 {
                    let bit = 4 * h + s;
                    for l in 0..32 {
                        let q2 = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
                        let hi = (hmask[l] >> bit) & 1;
                        ib.codes[128 * h + 32 * s + l] = q2 - if hi == 1 { 0 } else { 4 };
                    }
                }
            }
        }
        Format::Q4_K | Format::Q5_K => {
            ib.d = f16_at(b, 0);
            ib.m = f16_at(b, 2);
            let scales = &b[4..16];
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, scales);
                ib.sc[j] = sc;
                ib.mn[j] = mn;
            }
            let (qh, qs): (&[u8], &[u8]) = if format == Format::Q4_K {
                (&[], &b[16..144])
            } else {
                (&b[16..48], &b[48..176])
            };
            for j in 0..4 {
                for l in 0..32 {
                    let q = qs[32 * j + l];
                    let (h0, h1) = if qh.is_empty() {
                        (0, 0)
                    } else {
                        ((qh[l] >> (2 * j)) & 1, (qh[l] >> (2 * j + 1)) & 1)
                    };
                    ib.codes[64 * j + l] = ((q & 0xF) | (h0 << 4)) as i8;
                    ib.codes[64 * j + 32 + l] = ((q >> 4) | (h1 << 4)) as i8;
                }
            }
        }
        Format::Q6_K => {
            let ql = &b[0..128];
            let qh = &b[128..192];
            ib.d = f16_at(b, 208);
            for j in 0..16 {
                ib.sc[j] = i32::from(b[192 + j] as i8);
            }
            for h in 0..2 {
                let ql = &ql[64 * h..64 * h + 64];
                let qh = &qh[32 * h..32 * h + 32];
                for l in 0..32 {
                    let q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    let q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    let q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    let q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    let base = 128 * h + l;
                    ib.codes[base] = q1 as i8 - 32;
                    ib.codes[base + 32] = q2 as i8 - 32;
                    ib.codes[base + 64] = q3 as i8 - 32;
                    ib.codes[base + 96] = q4 as i8 - 32;
                }
            }
        }
        Format::IQ2_XXS => {
            // ggml: w = d·(0.5 + s)·0.25·grid·sign = (d/8)·(2s + 1)·(grid·sign).
            ib.d = f16_at(b, 0) * 0.125;
            for g in 0..8 {
                let idx = u32_at(b, 2 + 8 * g);
                let aux = u32_at(b, 6 + 8 * g);
                ib.sc[g] = 2 * (aux >> 28) as i32 + 1;
                for l in 0..4 {
                    let grid = IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize].to_le_bytes();
                    let signs = ksigns(((aux >> (7 * l)) & 127) as usize);
                    for (j, &v) in grid.iter().enumerate() {
                        let v = v as i8;
                        ib.codes[32 * g + 8 * l + j] = if signs & (1 << j) != 0 { -v } else { v };
                    }
                }
            }
        }
        Format::MXFP4 => {
            ib.d = e8m0_to_f32_half(b[0]);
            for (j, &q) in b[1..17].iter().enumerate() {
                ib.codes[j] = KVALUES_MXFP4[usize::from(q & 0xF)];
                ib.codes[j + 16] = KVALUES_MXFP4[usize::from(q >> 4)];
            }
        }
        Format::F32 | Format::F16 | Format::BF16 => {}
    }
    ib
}

/// Decode one float element of a float format; `b` is exactly one element.
#[inline]
pub(crate) fn float_at(format: Format, b: &[u8], i: usize) -> f32 {
    match format {
        Format::F32 => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
        Format::F16 => f16_at(b, 2 * i),
        _ => f32::from_bits(u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16),
    }
}
