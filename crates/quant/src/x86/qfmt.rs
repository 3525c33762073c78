//! Per-format SIMD block routines: decode one weight block to unsigned codes, 32 at a time,
//! and return its exact integer partial sums (see `Isa`). Offsets of signed codes are
//! removed exactly with the activation code sums; k-quant sub-block scales are applied per
//! i32 lane (a lane never spans two sub-blocks).

use super::isa::{Isa, reduce8};
use crate::tables::{IQ2XXS_GRID, KSIGNS64};
use std::arch::x86_64::*;

/// One activation block, as pointers into a `QuantizedActs` row.
#[derive(Clone, Copy)]
pub(crate) struct ActBlock {
    /// `block_len` codes.
    pub qs: *const i8,
    /// Code sums per 16 (k-quants only; dangling otherwise).
    pub s16: *const i16,
    /// Code sums per 32.
    pub s32: *const i16,
    /// Sum of all codes of a 32-block (legacy only).
    pub asum: i32,
}

/// How the f32 accumulation of a format goes after `fma(d·da, isum, acc)`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mins {
    /// Nothing more.
    None,
    /// `fma(m·da, asum, acc)` (Q4_1, Q5_1).
    Act,
    /// `fma(-(dmin·da), msum, acc)` (Q2_K, Q4_K, Q5_K).
    K,
}

/// One quantized weight format's SIMD routine.
pub(crate) trait QFmt {
    /// Bytes per block.
    const BB: usize;
    /// Offset of the 4 bytes read for `d` (and `m`/`dmin`).
    const GATHER_OFF: usize;
    /// `d` is in the high half of those 4 bytes.
    const D_HI: bool;
    /// Kind of minimum term (its f16 is the high half of the gathered 4 bytes).
    const MINS: Mins;
    /// Offset to subtract times the activation block sum (legacy formats, MXFP4).
    fn act_offset<I: Isa>() -> i32;
    /// The f32 weight scale of each row from the 4 bytes read at `GATHER_OFF` (one lane per
    /// row): the f16 `d` by default.
    #[inline(always)]
    unsafe fn scale<I: Isa>(g: I::I) -> I::F {
        // SAFETY: register operations.
        unsafe {
            if Self::D_HI {
                I::f16_hi(g)
            } else {
                I::f16_lo(g)
            }
        }
    }
    /// (isum partials, msum partials) of the block at `w`.
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i);
}

#[inline(always)]
unsafe fn u32_at_ptr(p: *const u8) -> u32 {
    // SAFETY: the caller guarantees 4 readable bytes; x86 is little-endian.
    unsafe { (p as *const u32).read_unaligned() }
}

#[inline(always)]
unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[inline(always)]
unsafe fn load128(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 16 readable bytes.
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

/// 16 bytes of nibbles → 32 codes: low nibbles (elements 0..16) then high nibbles (16..32).
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes at p; register operations.
    unsafe {
        let y = _mm256_broadcastsi128_si256(load128(p));
        let y = _mm256_srlv_epi64(y, _mm256_set_epi64x(4, 4, 0, 0));
        _mm256_and_si256(y, _mm256_set1_epi8(0x0F))
    }
}

#[inline(always)]
unsafe fn srl16(x: __m256i, n: i32) -> __m256i {
    // SAFETY: register operations.
    unsafe { _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)) }
}

/// Σ_j sc_j·(sub-block sum j) for one 128-weight half of a 16-sub-block format: `ps[t]` is
/// the dot of chunk t (lanes 0..4 → sub-block 2t, 4..8 → 2t+1), `s_h` the half's 8 scales.
/// Two rounds of `phadd` leave the sub-block sums in the lane order [0,2,4,6,1,3,5,7].
#[inline(always)]
unsafe fn scaled_half16(ps: &[__m256i; 4], s_h: __m256i) -> __m256i {
    // SAFETY: register operations.
    unsafe {
        let h0 = _mm256_hadd_epi32(ps[0], ps[1]);
        let h1 = _mm256_hadd_epi32(ps[2], ps[3]);
        let sums = _mm256_hadd_epi32(h0, h1);
        let sc = _mm256_permutevar8x32_epi32(s_h, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        _mm256_mullo_epi32(sums, sc)
    }
}

/// Q4_0: `w = d·(q − 8)`.
pub(crate) struct Q4_0;
impl QFmt for Q4_0 {
    const BB: usize = 18;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        8
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole block, a.qs has 32 codes.
        unsafe {
            let u = nibbles32(w.add(2));
            let p = I::dot_u8(_mm256_setzero_si256(), u, load256(a.qs as *const u8));
            (p, _mm256_setzero_si256())
        }
    }
}

/// Q4_1: `w = d·q + m`.
pub(crate) struct Q4_1;
impl QFmt for Q4_1 {
    const BB: usize = 20;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::Act;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole block, a.qs has 32 codes.
        unsafe {
            let u = nibbles32(w.add(4));
            let p = I::dot_u8(_mm256_setzero_si256(), u, load256(a.qs as *const u8));
            (p, _mm256_setzero_si256())
        }
    }
}

/// Q5_0: `w = d·(q − 16)`.
pub(crate) struct Q5_0;
impl QFmt for Q5_0 {
    const BB: usize = 22;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        16
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole block, a.qs has 32 codes.
        unsafe {
            let hb = I::bits_to_bytes(u32_at_ptr(w.add(2)), _mm256_set1_epi8(0x10));
            let u = _mm256_or_si256(nibbles32(w.add(6)), hb);
            let p = I::dot_u8(_mm256_setzero_si256(), u, load256(a.qs as *const u8));
            (p, _mm256_setzero_si256())
        }
    }
}

/// Q5_1: `w = d·q + m`.
pub(crate) struct Q5_1;
impl QFmt for Q5_1 {
    const BB: usize = 24;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::Act;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole block, a.qs has 32 codes.
        unsafe {
            let hb = I::bits_to_bytes(u32_at_ptr(w.add(4)), _mm256_set1_epi8(0x10));
            let u = _mm256_or_si256(nibbles32(w.add(8)), hb);
            let p = I::dot_u8(_mm256_setzero_si256(), u, load256(a.qs as *const u8));
            (p, _mm256_setzero_si256())
        }
    }
}

/// Q8_0: `w = d·q`.
pub(crate) struct Q8_0;
impl QFmt for Q8_0 {
    const BB: usize = 34;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        I::I8_OFF
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole block, a.qs has 32 codes.
        unsafe {
            let p = I::dot_i8(
                _mm256_setzero_si256(),
                load256(w.add(2)),
                load256(a.qs as *const u8),
            );
            (p, _mm256_setzero_si256())
        }
    }
}

/// Q2_K: `w = d·sc_j·q − dmin·m_j`, 16 sub-blocks of 16, codes 0..3.
pub(crate) struct Q2K;
impl QFmt for Q2K {
    const BB: usize = 84;
    const GATHER_OFF: usize = 80;
    const D_HI: bool = false;
    const MINS: Mins = Mins::K;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole 84-byte block; a has 256 codes and 16 sums per 16.
        unsafe {
            let sm = load128(w);
            let m4 = _mm_set1_epi8(0x0F);
            let sc = _mm_and_si128(sm, m4);
            let mn = _mm_and_si128(_mm_srli_epi16::<4>(sm), m4);
            let s_half = [
                _mm256_cvtepu8_epi32(sc),
                _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(sc)),
            ];
            let mut parts = _mm256_setzero_si256();
            for (h, &s_h) in s_half.iter().enumerate() {
                let q = load256(w.add(16 + 32 * h));
                let mut ps = [_mm256_setzero_si256(); 4];
                for (s, p) in ps.iter_mut().enumerate() {
                    let u = _mm256_and_si256(srl16(q, 2 * s as i32), _mm256_set1_epi8(3));
                    let av = load256(a.qs.add(128 * h + 32 * s) as *const u8);
                    *p = I::dot_u8(_mm256_setzero_si256(), u, av);
                }
                parts = _mm256_add_epi32(parts, scaled_half16(&ps, s_h));
            }
            let m16 = _mm256_cvtepu8_epi16(mn);
            let mparts = _mm256_madd_epi16(m16, load256(a.s16 as *const u8));
            (parts, mparts)
        }
    }
}

/// The 16 Q3_K scales (minus 32) as 16 signed bytes.
#[inline(always)]
unsafe fn q3k_scales_vec(s: *const u8) -> __m128i {
    // SAFETY: 12 readable bytes at s.
    unsafe {
        const KM1: u32 = 0x0303_0303;
        const KM2: u32 = 0x0f0f_0f0f;
        let a0 = u32_at_ptr(s);
        let a1 = u32_at_ptr(s.add(4));
        let tmp = u32_at_ptr(s.add(8));
        let x2 = ((a0 >> 4) & KM2) | (((tmp >> 4) & KM1) << 4);
        let x3 = ((a1 >> 4) & KM2) | (((tmp >> 6) & KM1) << 4);
        let x0 = (a0 & KM2) | ((tmp & KM1) << 4);
        let x1 = (a1 & KM2) | (((tmp >> 2) & KM1) << 4);
        let v = _mm_setr_epi32(x0 as i32, x1 as i32, x2 as i32, x3 as i32);
        _mm_sub_epi8(v, _mm_set1_epi8(32))
    }
}

/// Q3_K: `w = d·sc_j·(q − 4)`, q = 2 low bits | high bit << 2.
pub(crate) struct Q3K;
impl QFmt for Q3K {
    const BB: usize = 110;
    const GATHER_OFF: usize = 106;
    const D_HI: bool = true;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole 110-byte block; a has 256 codes and 16 sums per 16.
        unsafe {
            let sc = q3k_scales_vec(w.add(96));
            let s_half = [
                _mm256_cvtepi8_epi32(sc),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)),
            ];
            let hm = load256(w);
            let mut parts = _mm256_setzero_si256();
            for (h, &s_h) in s_half.iter().enumerate() {
                let q = load256(w.add(32 + 32 * h));
                let mut ps = [_mm256_setzero_si256(); 4];
                for (s, p) in ps.iter_mut().enumerate() {
                    let lo = _mm256_and_si256(srl16(q, 2 * s as i32), _mm256_set1_epi8(3));
                    let hb = _mm256_and_si256(srl16(hm, (4 * h + s) as i32), _mm256_set1_epi8(1));
                    let u = _mm256_or_si256(lo, _mm256_slli_epi16::<2>(hb));
                    let av = load256(a.qs.add(128 * h + 32 * s) as *const u8);
                    *p = I::dot_u8(_mm256_setzero_si256(), u, av);
                }
                parts = _mm256_add_epi32(parts, scaled_half16(&ps, s_h));
            }
            // Σ_j sc_j·Σ(q−4)·a = Σ_j sc_j·Σ q·a − 4·Σ_j sc_j·asum16_j
            let corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), load256(a.s16 as *const u8));
            parts = _mm256_sub_epi32(parts, _mm256_slli_epi32::<2>(corr));
            (parts, _mm256_setzero_si256())
        }
    }
}

/// Q4_K/Q5_K scales and mins: bytes 0..8 scales, 8..16 mins (ggml's `utmp` unpacking).
#[inline(always)]
unsafe fn k4_scales_mins(s: *const u8) -> __m128i {
    // SAFETY: 12 readable bytes at s.
    unsafe {
        const KM1: u32 = 0x3f3f_3f3f;
        const KM2: u32 = 0x0f0f_0f0f;
        const KM3: u32 = 0x0303_0303;
        let u0 = u32_at_ptr(s);
        let u1 = u32_at_ptr(s.add(4));
        let u2 = u32_at_ptr(s.add(8));
        let x3 = ((u2 >> 4) & KM2) | (((u1 >> 6) & KM3) << 4);
        let x2 = u1 & KM1;
        let x1 = (u2 & KM2) | (((u0 >> 6) & KM3) << 4);
        let x0 = u0 & KM1;
        _mm_setr_epi32(x0 as i32, x1 as i32, x2 as i32, x3 as i32)
    }
}

/// Shared body of Q4_K (`QH = false`) and Q5_K.
#[inline(always)]
unsafe fn q45k_parts<I: Isa, const QH: bool>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
    // SAFETY: w is one whole Q4_K/Q5_K block; a has 256 codes and 8 sums per 32.
    unsafe {
        let smv = k4_scales_mins(w.add(4));
        let sc = _mm256_cvtepu8_epi32(smv);
        let mn = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(smv));
        let mparts = _mm256_zextsi128_si256(_mm_madd_epi16(mn, load128(a.s32 as *const u8)));
        let qs = if QH { w.add(48) } else { w.add(16) };
        let qh = if QH {
            load256(w.add(16))
        } else {
            _mm256_setzero_si256()
        };
        let m4 = _mm256_set1_epi8(0x0F);
        let mut ps = [_mm256_setzero_si256(); 8];
        for j in 0..4 {
            let q = load256(qs.add(32 * j));
            let halves = [_mm256_and_si256(q, m4), _mm256_and_si256(srl16(q, 4), m4)];
            for (t, &nib) in halves.iter().enumerate() {
                let c = 2 * j + t;
                let u = if QH {
                    let hb = _mm256_and_si256(srl16(qh, c as i32), _mm256_set1_epi8(1));
                    _mm256_or_si256(nib, _mm256_slli_epi16::<4>(hb))
                } else {
                    nib
                };
                let av = load256(a.qs.add(32 * c) as *const u8);
                ps[c] = I::dot_u8(_mm256_setzero_si256(), u, av);
            }
        }
        // Lane c = sum of chunk c = sub-block c; one multiply by the 8 scales.
        (_mm256_mullo_epi32(reduce8(&ps), sc), mparts)
    }
}

/// Q4_K: `w = d·sc_j·q − dmin·m_j`, 8 sub-blocks of 32, codes 0..15.
pub(crate) struct Q4K;
impl QFmt for Q4K {
    const BB: usize = 144;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::K;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: forwarded contract.
        unsafe { q45k_parts::<I, false>(w, a) }
    }
}

/// Q5_K: as Q4_K with a fifth bit from `qh`, codes 0..31.
pub(crate) struct Q5K;
impl QFmt for Q5K {
    const BB: usize = 176;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::K;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: forwarded contract.
        unsafe { q45k_parts::<I, true>(w, a) }
    }
}

/// Q6_K: `w = d·sc_j·(q − 32)`, 16 signed sub-block scales, codes 0..63.
pub(crate) struct Q6K;
impl QFmt for Q6K {
    const BB: usize = 210;
    const GATHER_OFF: usize = 206;
    const D_HI: bool = true;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole 210-byte block; a has 256 codes and 16 sums per 16.
        unsafe {
            let sc = load128(w.add(192));
            let s_half = [
                _mm256_cvtepi8_epi32(sc),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)),
            ];
            let m4 = _mm256_set1_epi8(0x0F);
            let m30 = _mm256_set1_epi8(0x30);
            let mut parts = _mm256_setzero_si256();
            for (h, &s_h) in s_half.iter().enumerate() {
                let l0 = load256(w.add(64 * h));
                let l1 = load256(w.add(64 * h + 32));
                let qh = load256(w.add(128 + 32 * h));
                let us = [
                    _mm256_or_si256(
                        _mm256_and_si256(l0, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(l1, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                    ),
                ];
                let mut ps = [_mm256_setzero_si256(); 4];
                for (t, (p, &u)) in ps.iter_mut().zip(us.iter()).enumerate() {
                    let av = load256(a.qs.add(128 * h + 32 * t) as *const u8);
                    *p = I::dot_u8(_mm256_setzero_si256(), u, av);
                }
                parts = _mm256_add_epi32(parts, scaled_half16(&ps, s_h));
            }
            let corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), load256(a.s16 as *const u8));
            parts = _mm256_sub_epi32(parts, _mm256_slli_epi32::<5>(corr));
            (parts, _mm256_setzero_si256())
        }
    }
}

/// IQ2_XXS: `w = (d/8)·(2s_j + 1)·(grid·sign)`, 8 groups of 32, grid magnitudes 8..43.
/// The signs go onto the activation codes (|a| ≤ 127, so negation is exact), the unsigned
/// grid bytes are the `u` of the unsigned×signed product.
pub(crate) struct Iq2Xxs;
impl QFmt for Iq2Xxs {
    const BB: usize = 66;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        0
    }
    #[inline(always)]
    unsafe fn scale<I: Isa>(g: I::I) -> I::F {
        // SAFETY: register operations. d/8 is exact (an f16 times a power of two).
        unsafe { I::mul(I::f16_lo(g), I::splat(0.125)) }
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole 66-byte block; a has 256 codes.
        unsafe {
            let mut ps = [_mm256_setzero_si256(); 8];
            let mut ls = [0i32; 8];
            for (g, p) in ps.iter_mut().enumerate() {
                let idx = u32_at_ptr(w.add(2 + 8 * g));
                let aux = u32_at_ptr(w.add(6 + 8 * g));
                ls[g] = 2 * (aux >> 28) as i32 + 1;
                let grid = |l: u32| IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize] as i64;
                let sign = |l: u32| KSIGNS64[((aux >> (7 * l)) & 127) as usize] as i64;
                let u = _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3));
                let sm = _mm256_setr_epi64x(sign(0), sign(1), sign(2), sign(3));
                let av = load256(a.qs.add(32 * g) as *const u8);
                // (a ^ m) − m negates the bytes where m = 0xFF.
                let sa = _mm256_sub_epi8(_mm256_xor_si256(av, sm), sm);
                *p = I::dot_u8(_mm256_setzero_si256(), u, sa);
            }
            let lsv = _mm256_loadu_si256(ls.as_ptr() as *const __m256i);
            // Lane g = sum of group g; one multiply by the 8 group scales.
            (
                _mm256_mullo_epi32(reduce8(&ps), lsv),
                _mm256_setzero_si256(),
            )
        }
    }
}

/// MXFP4: `w = kvalue[q]·2^(e−128)`. The codes map through a byte shuffle to
/// `kvalue + 12` (0..24, unsigned); the offset is removed with the activation block sum.
pub(crate) struct Mxfp4;
impl QFmt for Mxfp4 {
    const BB: usize = 17;
    const GATHER_OFF: usize = 0;
    const D_HI: bool = false;
    const MINS: Mins = Mins::None;
    #[inline(always)]
    fn act_offset<I: Isa>() -> i32 {
        12
    }
    #[inline(always)]
    unsafe fn scale<I: Isa>(g: I::I) -> I::F {
        // SAFETY: register operations; the E8M0 byte is the low byte of each lane.
        unsafe { I::e8m0_half(g) }
    }
    #[inline(always)]
    unsafe fn parts<I: Isa>(w: *const u8, a: &ActBlock) -> (__m256i, __m256i) {
        // SAFETY: w is one whole 17-byte block, a.qs has 32 codes.
        unsafe {
            let lut = _mm256_setr_epi8(
                12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18,
                20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
            );
            let u = _mm256_shuffle_epi8(lut, nibbles32(w.add(1)));
            let p = I::dot_u8(_mm256_setzero_si256(), u, load256(a.qs as *const u8));
            (p, _mm256_setzero_si256())
        }
    }
}
