//! Kernels over the 16-row packed tiles (`crate::packed`). One `vpdpbusd` (AVX-512) or
//! `pmaddubsw`+`pmaddwd` (AVX2, per 8-row half of a tile) multiplies a vector of 4 codes of
//! every row by a broadcast of 4 activation bytes, so each i32 lane is one output row's
//! running integer sum: no horizontal reduction. Up to `MR_MAX` activation rows share every
//! weight load. Per output, the block loop and the f32 fused multiply-adds are exactly the
//! canonical ones; integer offsets of unsigned codes are removed by starting each block's
//! integer sum at `−offset·Σa` (exact).

// The kernels index several parallel register arrays (one entry per activation row) with
// one row index; iterator chains over them would obscure the canonical order.
#![allow(clippy::needless_range_loop)]

use crate::packed::{Layout, TILE};
use crate::{Format, PackedMatrix, QuantizedActs};
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Activation rows per weight-tile pass on AVX-512 (32 registers) when M takes several
/// passes. On the Zen 4 the kernels run at the `vpdpbusd` throughput (one per cycle) from
/// about 3 rows per pass: a row costs the same in a pass of 6 as of 8 (Q4_K), and 8-row
/// passes made a 256-row prefill ~2 % slower (one side-by-side run), so blocks of more than `MR_ONE` rows keep
/// 6-row passes (2026-12-07, BENCHMARKS.md "Verify cost").
const MR: usize = 6;
/// Most rows on AVX-512 that run as one pass: a speculative verify block of 7 or 8 rows
/// would otherwise pay a second pass of 1–2 rows, which decodes every weight code again for
/// little work (Q4_K: a 1-row pass costs ~1.6 rows of a full one; Q6_K ~2.4). No vector
/// spills in the Q4_K inner loop at 8 rows (the f32 accumulators live in registers too).
const MR_ONE: usize = 8;
/// Activation rows per pass on AVX2 (16 registers) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
/// Q4_K (measured: `examples/prefill.rs`, BENCHMARKS.md; since the fifth bit takes one shift
/// per chunk, Q5_0 is faster with 4 rows, no spills); the formats whose codes take more work
/// to decode (Q5_K, Q6_K: fifth bit, bits 4–5) share it over `MR` rows.
const MR_AVX2: usize = 4;
/// Most rows of Q4_K on AVX2 that run as one pass: a 5-row verify block as one pass took
/// 0.59 ms of one thread's time for 8960 × 1536 against 0.68 ms as 4 + 1 (2026-12-07,
/// `examples/prefill.rs`). Larger blocks keep passes of at most `MR_AVX2` rows: whether 5-row
/// passes speed up a prefill could not be told apart from the shared machine's noise
/// (±10 %), so a 256-row prefill still runs exactly the 64 passes of 4 it ran before.
const MR_ONE_AVX2_Q4K: usize = 5;
/// Largest pass any kernel is built for.
const MR_MAX: usize = MR_ONE;

const _: () = assert!(MR <= MR_MAX && MR_AVX2 <= MR_MAX && MR_ONE_AVX2_Q4K <= MR_MAX);

/// `(mr, one)` for a path and format: blocks of up to `one` rows run as one pass, larger
/// ones as passes of at most `mr` rows (see `split`).
fn pass_rows(avx512: bool, id: u8) -> (usize, usize) {
    if avx512 {
        return (MR, MR_ONE);
    }
    match id {
        Q5K | Q6K => (MR, MR),
        Q4K => (MR_AVX2, MR_ONE_AVX2_Q4K),
        _ => (MR_AVX2, MR_AVX2),
    }
}

/// How `n > 0` activation rows split into passes over a weight tile: `(r, n_r, s)` is `n_r`
/// passes of `r` rows, then passes of `s` rows over the rest (if any; `s < r`). Up to `one`
/// rows are one pass; more are the fewest passes of at most `mr` rows, as even as possible
/// (13 rows by 6 as 5 + 4 + 4, not 6 + 6 + 1: a pass of 1–2 rows decodes every weight code
/// for little work). Every output row's arithmetic is the same whichever pass it is in.
fn split(n: usize, mr: usize, one: usize) -> (usize, usize, usize) {
    if n <= one {
        return (n, 1, 0);
    }
    let passes = n.div_ceil(mr);
    let (base, extra) = (n / passes, n % passes);
    if extra == 0 {
        (base, passes, 0)
    } else {
        (base + 1, extra, base)
    }
}

/// Bytes of activation codes kept hot while a block of M rows walks all weight tiles.
const ACT_BUDGET: usize = 384 * 1024;
/// Bytes of weight tiles one group of passes over the M rows works on (kept in L2).
const WEIGHT_BUDGET: usize = 128 * 1024;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;
const Q4K: u8 = 5;
const Q5K: u8 = 6;
const Q6K: u8 = 7;

/// One SIMD width over the packed layout: `L` output rows per vector.
trait Pk {
    /// Rows (lanes) per vector.
    const L: usize;
    /// `dot8` computes Σ (w + Q8_OFF)·a.
    const Q8_OFF: i32;
    /// L i32 lanes.
    type V: Copy;
    /// L f32 lanes.
    type F: Copy;

    /// `4·L` code bytes.
    unsafe fn load(p: *const u8) -> Self::V;
    /// Low nibble of every byte.
    unsafe fn lo4(v: Self::V) -> Self::V;
    /// High nibble of every byte.
    unsafe fn hi4(v: Self::V) -> Self::V;
    /// `u | (h & 0x10)` per byte: the fifth bit lined up at bit 4 by `fifth_lo`/`fifth_next`.
    unsafe fn or5(u: Self::V, h: Self::V) -> Self::V;
    /// `h << 4` per i16 lane: the high-nibble chunks' fifth bits (0–3) to bits 4–7.
    unsafe fn shl4_16(h: Self::V) -> Self::V;
    /// `h >> 1` per i16 lane: the next chunk's fifth bit to bit 4 (a bit crossing from the
    /// upper byte lands at bit 7 and reaches bit 4 of no later chunk: at most 3 shifts).
    unsafe fn shr1_16(h: Self::V) -> Self::V;
    /// `u | (((h >> 2t) & 3) << 4)` per byte.
    unsafe fn hi2<const T: u32>(u: Self::V, h: Self::V) -> Self::V;
    /// `acc + Σ4 u·a` per lane; u ≤ 63 unsigned, `a` four signed bytes.
    unsafe fn dot(acc: Self::V, u: Self::V, a: i32) -> Self::V;
    /// `acc + Σ4 (w + Q8_OFF)·a` per lane, with `u = w + 128` stored (any byte).
    unsafe fn dot8(acc: Self::V, u: Self::V, a: i32) -> Self::V;
    /// `acc + Σ2 w·a` per lane over i16 pairs; `a` two i16.
    unsafe fn dotw(acc: Self::V, w: Self::V, a: i32) -> Self::V;
    /// All lanes `x`.
    unsafe fn splat_i(x: i32) -> Self::V;
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b` (low 32 bits).
    unsafe fn mullo(a: Self::V, b: Self::V) -> Self::V;
    /// L unsigned bytes, zero-extended.
    unsafe fn u8s(p: *const u8) -> Self::V;
    /// L signed bytes, sign-extended.
    unsafe fn i8s(p: *const u8) -> Self::V;
    /// 2·L unsigned bytes as L pairs of i16.
    unsafe fn u8_pairs(p: *const u8) -> Self::V;
    /// L f16, decoded exactly.
    unsafe fn f16(p: *const u8) -> Self::F;
    /// Zero.
    unsafe fn fzero() -> Self::F;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::F;
    /// `a·b`.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a·b + c`, fused.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `-a`.
    unsafe fn neg(a: Self::F) -> Self::F;
    /// i32 → f32, nearest even.
    unsafe fn cvt(v: Self::V) -> Self::F;
    /// Store L lanes.
    unsafe fn store(v: Self::F, p: *mut f32);

    /// Whether the kernels sum `u·a` products as i16 pairs (`pmaddubsw`) over several
    /// vectors before widening them once with `pmaddwd` against the sub-block scale (AVX2),
    /// instead of widening every product (AVX-512 VNNI: `vpdpbusd` widens for free). The
    /// integer block sums are the same exact integers either way; each kernel sums at most
    /// as many products as keep every i16 lane within ±32767 (|a| ≤ 128, see `i16_sums`).
    const I16: bool;
    /// i16 lanes: `u[2j]·a[2j] + u[2j+1]·a[2j+1]` of the bytes of `u` and the broadcast
    /// four bytes `a` (u ≤ 63 unsigned, `a` signed: never saturates, |lane| ≤ 16 128).
    unsafe fn mul16(u: Self::V, a: i32) -> Self::V;
    /// `a + b` per i16 lane (wrapping; the callers keep every lane in range).
    unsafe fn add16(a: Self::V, b: Self::V) -> Self::V;
    /// `acc + (p[2l]·w[2l] + p[2l+1]·w[2l+1])` per i32 lane `l`, over i16 pairs.
    unsafe fn widen(acc: Self::V, p: Self::V, w: Self::V) -> Self::V;
    /// `a − b` per i32 lane.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// Per i32 lane: the low 16 bits of `lo` in the low half, of `hi` in the high half.
    unsafe fn pair16(lo: Self::V, hi: Self::V) -> Self::V;
    /// `v << 5` per i16 lane.
    unsafe fn shl5_16(v: Self::V) -> Self::V;
}

/// Most `pmaddubsw` results of `c`-bit codes (u < 2^c) that can be summed in an i16 lane:
/// each is at most `2·(2^c − 1)·128` in magnitude.
const fn i16_sums(bits: u32) -> usize {
    (i16::MAX as usize) / (2 * ((1usize << bits) - 1) * 128)
}

const _: () = assert!(i16_sums(4) >= 8 && i16_sums(5) >= 4 && i16_sums(6) >= 2);

struct P512;

impl Pk for P512 {
    const L: usize = 16;
    const Q8_OFF: i32 = 128;
    type V = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 64 readable bytes.
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    }
    #[inline(always)]
    unsafe fn lo4(v: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_and_si512(v, _mm512_set1_epi8(0x0F)) }
    }
    #[inline(always)]
    unsafe fn hi4(v: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(0x0F)) }
    }
    #[inline(always)]
    unsafe fn or5(u: __m512i, h: __m512i) -> __m512i {
        // SAFETY: register operations (u | (h & 0x10)).
        unsafe { _mm512_ternarylogic_epi32::<0xF8>(u, h, _mm512_set1_epi8(0x10)) }
    }
    #[inline(always)]
    unsafe fn shl4_16(h: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_slli_epi16::<4>(h) }
    }
    #[inline(always)]
    unsafe fn shr1_16(h: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_srli_epi16::<1>(h) }
    }
    #[inline(always)]
    unsafe fn hi2<const T: u32>(u: __m512i, h: __m512i) -> __m512i {
        // SAFETY: register operations. 16-bit shifts move bits across bytes only into
        // positions the 0x30 mask clears.
        unsafe {
            let s = match T {
                0 => _mm512_slli_epi16::<4>(h),
                1 => _mm512_slli_epi16::<2>(h),
                2 => h,
                _ => _mm512_srli_epi16::<2>(h),
            };
            _mm512_ternarylogic_epi32::<0xF8>(u, s, _mm512_set1_epi8(0x30))
        }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m512i, u: __m512i, a: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(a)) }
    }
    #[inline(always)]
    unsafe fn dot8(acc: __m512i, u: __m512i, a: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(a)) }
    }
    #[inline(always)]
    unsafe fn dotw(acc: __m512i, w: __m512i, a: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(a)) }
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_set1_epi32(x) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn i8s(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn u8_pairs(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn fzero() -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m512) -> __m512 {
        // SAFETY: register operations (sign flip, exact).
        unsafe {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(i32::MIN),
            ))
        }
    }
    #[inline(always)]
    unsafe fn cvt(v: __m512i) -> __m512 {
        // SAFETY: register operations (default rounding: nearest even).
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn store(v: __m512, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32.
        unsafe { _mm512_storeu_ps(p, v) }
    }

    const I16: bool = false;
    #[inline(always)]
    unsafe fn mul16(u: __m512i, a: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_maddubs_epi16(u, _mm512_set1_epi32(a)) }
    }
    #[inline(always)]
    unsafe fn add16(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_add_epi16(a, b) }
    }
    #[inline(always)]
    unsafe fn widen(acc: __m512i, p: __m512i, w: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_add_epi32(acc, _mm512_madd_epi16(p, w)) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn pair16(lo: __m512i, hi: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe {
            _mm512_or_si512(
                _mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32::<16>(hi),
            )
        }
    }
    #[inline(always)]
    unsafe fn shl5_16(v: __m512i) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_slli_epi16::<5>(v) }
    }
}

struct P256;

impl Pk for P256 {
    const L: usize = 8;
    const Q8_OFF: i32 = 0;
    type V = __m256i;
    type F = __m256;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn lo4(v: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_and_si256(v, _mm256_set1_epi8(0x0F)) }
    }
    #[inline(always)]
    unsafe fn hi4(v: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F)) }
    }
    #[inline(always)]
    unsafe fn or5(u: __m256i, h: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_or_si256(u, _mm256_and_si256(h, _mm256_set1_epi8(0x10))) }
    }
    #[inline(always)]
    unsafe fn shl4_16(h: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_slli_epi16::<4>(h) }
    }
    #[inline(always)]
    unsafe fn shr1_16(h: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_srli_epi16::<1>(h) }
    }
    #[inline(always)]
    unsafe fn hi2<const T: u32>(u: __m256i, h: __m256i) -> __m256i {
        // SAFETY: register operations (see the AVX-512 version).
        unsafe {
            let s = match T {
                0 => _mm256_slli_epi16::<4>(h),
                1 => _mm256_slli_epi16::<2>(h),
                2 => h,
                _ => _mm256_srli_epi16::<2>(h),
            };
            _mm256_or_si256(u, _mm256_and_si256(s, _mm256_set1_epi8(0x30)))
        }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, u: __m256i, a: i32) -> __m256i {
        // SAFETY: register operations. u ≤ 63, |a| ≤ 127: pair sums fit in i16.
        unsafe {
            let p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(a));
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn dot8(acc: __m256i, u: __m256i, a: i32) -> __m256i {
        // SAFETY: register operations. w = u ^ 0x80; |w| ≤ 128, |a| ≤ 127: pair sums of
        // |w|·(±a) fit in i16.
        unsafe {
            let w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
            let s = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn dotw(acc: __m256i, w: __m256i, a: i32) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(a))) }
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_set1_epi32(x) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn i8s(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes.
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn u8_pairs(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes; F16C enabled.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn fzero() -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: register operations; FMA enabled.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m256) -> __m256 {
        // SAFETY: register operations (sign flip, exact).
        unsafe { _mm256_xor_ps(a, _mm256_set1_ps(-0.0)) }
    }
    #[inline(always)]
    unsafe fn cvt(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn store(v: __m256, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable f32.
        unsafe { _mm256_storeu_ps(p, v) }
    }

    const I16: bool = true;
    #[inline(always)]
    unsafe fn mul16(u: __m256i, a: i32) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_maddubs_epi16(u, _mm256_set1_epi32(a)) }
    }
    #[inline(always)]
    unsafe fn add16(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_add_epi16(a, b) }
    }
    #[inline(always)]
    unsafe fn widen(acc: __m256i, p: __m256i, w: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(p, w)) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn pair16(lo: __m256i, hi: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_blend_epi16::<0xAA>(lo, _mm256_slli_epi32::<16>(hi)) }
    }
    #[inline(always)]
    unsafe fn shl5_16(v: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_slli_epi16::<5>(v) }
    }
}

/// Everything one kernel call needs: the tiles, the activation rows, the output.
struct Call<'a> {
    tiles: *const u8,
    layout: Layout,
    acts: &'a QuantizedActs,
    /// Output rows asked for (whole matrix coordinates).
    n_range: Range<usize>,
    out: *mut f32,
    ldo: usize,
}

/// Pointers of `R` activation rows.
struct Rows<const R: usize> {
    qs: [*const u8; R],
    d: [*const f32; R],
    s32: [*const i16; R],
    s16: [*const i16; R],
}

#[inline(always)]
unsafe fn rd32(p: *const u8) -> i32 {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe { (p as *const i32).read_unaligned() }
}

/// The fifth bits of one 32-code group of the rows of a half (`4·L` bytes at `p`, see the
/// tile layout in `crate::packed`), lined up for chunk 0: the low-nibble chunks' bits
/// (4–7) as loaded, the high-nibble chunks' (0–3) shifted up by 4. Zero vectors when the
/// format has no fifth bit (`p` is then not read).
#[inline(always)]
unsafe fn fifth<P: Pk>(has: bool, p: *const u8) -> (P::V, P::V) {
    // SAFETY: the caller guarantees `4·L` readable bytes at `p` when `has`.
    unsafe {
        if has {
            let h = P::load(p);
            (h, P::shl4_16(h))
        } else {
            (P::splat_i(0), P::splat_i(0))
        }
    }
}

/// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 over the rows of half `h` of a tile.
#[inline(always)]
unsafe fn legacy<P: Pk, const R: usize, const FMT: u8>(
    base: *const u8,
    lay: &Layout,
    stream: Stream,
    h: usize,
    a: &Rows<R>,
    res: &mut [[f32; TILE]; R],
) {
    let l = P::L;
    let off: i32 = match FMT {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => P::Q8_OFF,
        _ => 0,
    };
    // SAFETY: every read below stays inside the tile (regions sized by `Layout` for
    // `lay.nb` blocks) or inside the R activation rows (k codes, k/32 sums, k/32 scales).
    unsafe {
        let codes = base.add(lay.codes + h * l * 4);
        let hi = base.add(lay.hi + h * l * 4);
        let dp = base.add(lay.d + h * l * 2);
        let mp = base.add(lay.m + h * l * 2);
        let mut acc = [P::fzero(); R];
        for b in 0..lay.nb {
            let mut asum = [0i32; R];
            let mut isum = [P::splat_i(0); R];
            for i in 0..R {
                asum[i] = i32::from(*a.s32[i].add(b));
                isum[i] = P::splat_i(-off * asum[i]);
            }
            if FMT == Q8_0 {
                let cb = codes.add(512 * b);
                for c in 0..8 {
                    stream_ahead(stream, base, h, b, c, 8);
                    let u = P::load(cb.add(64 * c));
                    for i in 0..R {
                        isum[i] = P::dot8(isum[i], u, rd32(a.qs[i].add(32 * b + 4 * c)));
                    }
                }
            } else if P::I16 {
                // Two products per step; `per` steps summed in i16, then widened.
                let bits = if FMT == Q5_0 || FMT == Q5_1 { 5 } else { 4 };
                let per = (i16_sums(bits) / 2).min(4);
                let ones = P::splat_i(0x0001_0001);
                let cb = codes.add(256 * b);
                let (mut f5l, mut f5h) = fifth::<P>(FMT == Q5_0 || FMT == Q5_1, hi.add(64 * b));
                let mut p = [P::splat_i(0); R];
                for t in 0..4 {
                    stream_ahead(stream, base, h, b, t, 4);
                    let v = P::load(cb.add(64 * t));
                    let mut lo = P::lo4(v);
                    let mut hv = P::hi4(v);
                    if FMT == Q5_0 || FMT == Q5_1 {
                        lo = P::or5(lo, f5l);
                        hv = P::or5(hv, f5h);
                        f5l = P::shr1_16(f5l);
                        f5h = P::shr1_16(f5h);
                    }
                    for i in 0..R {
                        let qa = a.qs[i].add(32 * b + 4 * t);
                        let x = P::add16(P::mul16(lo, rd32(qa)), P::mul16(hv, rd32(qa.add(16))));
                        p[i] = if t % per == 0 { x } else { P::add16(p[i], x) };
                    }
                    if t % per == per - 1 {
                        for i in 0..R {
                            isum[i] = P::widen(isum[i], p[i], ones);
                        }
                    }
                }
            } else {
                let cb = codes.add(256 * b);
                let (mut f5l, mut f5h) = fifth::<P>(FMT == Q5_0 || FMT == Q5_1, hi.add(64 * b));
                for t in 0..4 {
                    stream_ahead(stream, base, h, b, t, 4);
                    let v = P::load(cb.add(64 * t));
                    let mut lo = P::lo4(v);
                    let mut hv = P::hi4(v);
                    if FMT == Q5_0 || FMT == Q5_1 {
                        lo = P::or5(lo, f5l);
                        hv = P::or5(hv, f5h);
                        f5l = P::shr1_16(f5l);
                        f5h = P::shr1_16(f5h);
                    }
                    for i in 0..R {
                        let qa = a.qs[i].add(32 * b + 4 * t);
                        isum[i] = P::dot(isum[i], lo, rd32(qa));
                        isum[i] = P::dot(isum[i], hv, rd32(qa.add(16)));
                    }
                }
            }
            let dw = P::f16(dp.add(32 * b));
            let mut da = [P::fzero(); R];
            for i in 0..R {
                da[i] = P::splat(*a.d[i].add(b));
                acc[i] = P::fma(P::mul(dw, da[i]), P::cvt(isum[i]), acc[i]);
            }
            if FMT == Q4_1 || FMT == Q5_1 {
                let mw = P::f16(mp.add(32 * b));
                for i in 0..R {
                    acc[i] = P::fma(P::mul(mw, da[i]), P::splat(asum[i] as f32), acc[i]);
                }
            }
        }
        for i in 0..R {
            P::store(acc[i], res[i].as_mut_ptr().add(h * l));
        }
    }
}

/// Q4_K (`QH = false`) and Q5_K over the rows of half `h` of a tile.
#[inline(always)]
unsafe fn k45<P: Pk, const R: usize, const QH: bool>(
    base: *const u8,
    lay: &Layout,
    stream: Stream,
    h: usize,
    a: &Rows<R>,
    res: &mut [[f32; TILE]; R],
) {
    let l = P::L;
    // SAFETY: as in `legacy`: reads stay inside the tile's regions and the activation rows.
    unsafe {
        let codes = base.add(lay.codes + h * l * 4);
        let hi = base.add(lay.hi + h * l * 4);
        let scp = base.add(lay.sc + h * l);
        let mnp = base.add(lay.mn + h * l * 2);
        let dp = base.add(lay.d + h * l * 2);
        let mp = base.add(lay.m + h * l * 2);
        let mut acc = [P::fzero(); R];
        for b in 0..lay.nb {
            let mut isum = [P::splat_i(0); R];
            for g in 0..8 {
                stream_ahead(stream, base, h, b, g, 8);
                let sc = P::u8s(scp.add(128 * b + 16 * g));
                let cb = codes.add(2048 * b + 256 * g);
                let (mut f5l, mut f5h) = fifth::<P>(QH, hi.add(512 * b + 64 * g));
                if P::I16 {
                    // Two products per step; `per` steps summed in i16, then widened
                    // against the sub-block scale.
                    let per = (i16_sums(if QH { 5 } else { 4 }) / 2).min(4);
                    let sc16 = P::pair16(sc, sc);
                    let mut p = [P::splat_i(0); R];
                    for t in 0..4 {
                        let v = P::load(cb.add(64 * t));
                        let mut lo = P::lo4(v);
                        let mut hv = P::hi4(v);
                        if QH {
                            lo = P::or5(lo, f5l);
                            hv = P::or5(hv, f5h);
                            f5l = P::shr1_16(f5l);
                            f5h = P::shr1_16(f5h);
                        }
                        for i in 0..R {
                            let qa = a.qs[i].add(256 * b + 32 * g + 4 * t);
                            let x =
                                P::add16(P::mul16(lo, rd32(qa)), P::mul16(hv, rd32(qa.add(16))));
                            p[i] = if t % per == 0 { x } else { P::add16(p[i], x) };
                        }
                        if t % per == per - 1 {
                            for i in 0..R {
                                isum[i] = P::widen(isum[i], p[i], sc16);
                            }
                        }
                    }
                    continue;
                }
                let mut s = [P::splat_i(0); R];
                for t in 0..4 {
                    let v = P::load(cb.add(64 * t));
                    let mut lo = P::lo4(v);
                    let mut hv = P::hi4(v);
                    if QH {
                        lo = P::or5(lo, f5l);
                        hv = P::or5(hv, f5h);
                        f5l = P::shr1_16(f5l);
                        f5h = P::shr1_16(f5h);
                    }
                    for i in 0..R {
                        let qa = a.qs[i].add(256 * b + 32 * g + 4 * t);
                        s[i] = P::dot(s[i], lo, rd32(qa));
                        s[i] = P::dot(s[i], hv, rd32(qa.add(16)));
                    }
                }
                for i in 0..R {
                    isum[i] = P::add(isum[i], P::mullo(sc, s[i]));
                }
            }
            let mut msum = [P::splat_i(0); R];
            for p in 0..4 {
                let mn = P::u8_pairs(mnp.add(128 * b + 32 * p));
                for i in 0..R {
                    let pair = rd32(a.s32[i].add(8 * b + 2 * p) as *const u8);
                    msum[i] = P::dotw(msum[i], mn, pair);
                }
            }
            let dw = P::f16(dp.add(32 * b));
            let dmin = P::f16(mp.add(32 * b));
            for i in 0..R {
                let da = P::splat(*a.d[i].add(b));
                acc[i] = P::fma(P::mul(dw, da), P::cvt(isum[i]), acc[i]);
                acc[i] = P::fma(P::neg(P::mul(dmin, da)), P::cvt(msum[i]), acc[i]);
            }
        }
        for i in 0..R {
            P::store(acc[i], res[i].as_mut_ptr().add(h * l));
        }
    }
}

/// Q4_K over both 8-row halves of a tile at once (AVX2: `P::L == 8`, `P::I16`). Per output
/// the same integer block sums and the same fmas as `k45`; each activation broadcast feeds
/// both halves, so a 32-code group of R = 4 rows issues ~104 instructions per 1,024 products
/// instead of ~140 (two passes of `k45`, each broadcasting every activation again). The
/// AVX2 Q4_K kernel is bound by instructions issued, not by its multiplies: 512-row
/// matmuls at the qwen2.5-coder-1.5b shapes ran 5–9 % faster (2026-12-07, Zen 4 with AVX2
/// forced, `examples/prefill.rs`).
#[inline(always)]
unsafe fn k4_pair<P: Pk, const R: usize>(
    base: *const u8,
    lay: &Layout,
    stream: Stream,
    a: &Rows<R>,
    res: &mut [[f32; TILE]; R],
) {
    let l = P::L;
    debug_assert!(P::I16 && TILE == 2 * l);
    // All 8 `pmaddubsw` results of a group (4 chunks × low and high nibbles) summed in i16:
    // at most 16 products of 4-bit codes per lane (`i16_sums(4) >= 8` pairs).
    // SAFETY: as in `legacy`: reads stay inside the tile's regions (both halves) and the
    // activation rows.
    unsafe {
        let codes = base.add(lay.codes);
        let scp = base.add(lay.sc);
        let mnp = base.add(lay.mn);
        let dp = base.add(lay.d);
        let mp = base.add(lay.m);
        let mut acc = [[P::fzero(); 2]; R];
        let chunks = std::hint::black_box(4usize);
        for b in 0..lay.nb {
            let mut isum = [[P::splat_i(0); 2]; R];
            for g in 0..8 {
                stream_ahead(stream, base, 0, b, g, 8);
                let cb = codes.add(2048 * b + 256 * g);
                let mut p = [[P::splat_i(0); 2]; R];
                // Low nibbles of both halves against every row, then the high ones: 8
                // accumulators, 2 code vectors and one broadcast stay in registers. The
                // chunk loop is kept rolled (an opaque trip count): unrolled, the compiler
                // hoists loads of later chunks and spills the accumulators.
                macro_rules! step {
                    ($t:expr, $first:expr) => {
                        for nib in 0..2 {
                            let w = [cb.add(64 * $t), cb.add(64 * $t + 4 * l)].map(|q| {
                                let v = P::load(q);
                                if nib == 0 { P::lo4(v) } else { P::hi4(v) }
                            });
                            for i in 0..R {
                                let av = rd32(a.qs[i].add(256 * b + 32 * g + 4 * $t + 16 * nib));
                                for hh in 0..2 {
                                    let x = P::mul16(w[hh], av);
                                    p[i][hh] = if $first && nib == 0 {
                                        x
                                    } else {
                                        P::add16(p[i][hh], x)
                                    };
                                }
                            }
                        }
                    };
                }
                step!(0, true);
                for t in 1..chunks {
                    step!(t, false);
                }
                for hh in 0..2 {
                    let sc = P::u8s(scp.add(128 * b + 16 * g + hh * l));
                    let sc16 = P::pair16(sc, sc);
                    for i in 0..R {
                        // The 2·R block sums live in memory (volatile: one load-add and
                        // one store per group); kept in registers, they crowd out the
                        // accumulators above and the compiler spills those instead, in
                        // the inner loop (measured: as slow as two `k45` passes).
                        let v = std::ptr::read_volatile(&isum[i][hh]);
                        std::ptr::write_volatile(&mut isum[i][hh], P::widen(v, p[i][hh], sc16));
                    }
                }
            }
            for hh in 0..2 {
                let mut msum = [P::splat_i(0); R];
                for p in 0..4 {
                    let mn = P::u8_pairs(mnp.add(128 * b + 32 * p + 2 * l * hh));
                    for i in 0..R {
                        let pair = rd32(a.s32[i].add(8 * b + 2 * p) as *const u8);
                        msum[i] = P::dotw(msum[i], mn, pair);
                    }
                }
                let dw = P::f16(dp.add(32 * b + 2 * l * hh));
                let dmin = P::f16(mp.add(32 * b + 2 * l * hh));
                for i in 0..R {
                    let da = P::splat(*a.d[i].add(b));
                    let f = &mut acc[i][hh];
                    *f = P::fma(P::mul(dw, da), P::cvt(isum[i][hh]), *f);
                    *f = P::fma(P::neg(P::mul(dmin, da)), P::cvt(msum[i]), *f);
                }
            }
        }
        for i in 0..R {
            for hh in 0..2 {
                P::store(acc[i][hh], res[i].as_mut_ptr().add(hh * l));
            }
        }
    }
}

/// Q6_K over the rows of half `h` of a tile.
#[inline(always)]
unsafe fn q6k<P: Pk, const R: usize>(
    base: *const u8,
    lay: &Layout,
    stream: Stream,
    h: usize,
    a: &Rows<R>,
    res: &mut [[f32; TILE]; R],
) {
    let l = P::L;
    // SAFETY: as in `legacy`: reads stay inside the tile's regions and the activation rows.
    unsafe {
        let codes = base.add(lay.codes + h * l * 4);
        let hi = base.add(lay.hi + h * l * 4);
        let scp = base.add(lay.sc + h * l);
        let dp = base.add(lay.d + h * l * 2);
        let mut acc = [P::fzero(); R];
        for b in 0..lay.nb {
            let mut isum = [P::splat_i(0); R];
            for g in 0..8 {
                stream_ahead(stream, base, h, b, g, 8);
                let cb = codes.add(2048 * b + 256 * g);
                let v = [
                    P::load(cb),
                    P::load(cb.add(64)),
                    P::load(cb.add(128)),
                    P::load(cb.add(192)),
                ];
                if P::I16 {
                    // Codes u = q + 32 (≤ 63): two products summed in i16, widened against
                    // the sub-block scale; the offset, −32·(sc_j·s16_j + sc_j'·s16_j') for
                    // the two sub-blocks of this group, with one `pmaddwd`.
                    let sc0 = P::i8s(scp.add(256 * b + 32 * g));
                    let sc1 = P::i8s(scp.add(256 * b + 32 * g + 16));
                    let off = P::shl5_16(P::pair16(sc0, sc1));
                    for s in 0..2 {
                        let j = 2 * g + s;
                        let hv = P::load(hi.add(1024 * b + 128 * g + 64 * s));
                        let nib = |x| if s == 0 { P::lo4(x) } else { P::hi4(x) };
                        let u = [
                            P::hi2::<0>(nib(v[0]), hv),
                            P::hi2::<1>(nib(v[1]), hv),
                            P::hi2::<2>(nib(v[2]), hv),
                            P::hi2::<3>(nib(v[3]), hv),
                        ];
                        let scd = if s == 0 { sc0 } else { sc1 };
                        let sc16 = P::pair16(scd, scd);
                        for i in 0..R {
                            let qa = a.qs[i].add(256 * b + 16 * j);
                            let x =
                                P::add16(P::mul16(u[0], rd32(qa)), P::mul16(u[1], rd32(qa.add(4))));
                            isum[i] = P::widen(isum[i], x, sc16);
                            let x = P::add16(
                                P::mul16(u[2], rd32(qa.add(8))),
                                P::mul16(u[3], rd32(qa.add(12))),
                            );
                            isum[i] = P::widen(isum[i], x, sc16);
                        }
                    }
                    for i in 0..R {
                        let pair = rd32(a.s16[i].add(16 * b + 2 * g) as *const u8);
                        let o = P::widen(P::splat_i(0), off, P::splat_i(pair));
                        isum[i] = P::sub(isum[i], o);
                    }
                    continue;
                }
                for s in 0..2 {
                    let j = 2 * g + s;
                    let hv = P::load(hi.add(1024 * b + 128 * g + 64 * s));
                    let nib = |x| if s == 0 { P::lo4(x) } else { P::hi4(x) };
                    let u = [
                        P::hi2::<0>(nib(v[0]), hv),
                        P::hi2::<1>(nib(v[1]), hv),
                        P::hi2::<2>(nib(v[2]), hv),
                        P::hi2::<3>(nib(v[3]), hv),
                    ];
                    let sc = P::i8s(scp.add(256 * b + 16 * j));
                    for i in 0..R {
                        let qa = a.qs[i].add(256 * b + 16 * j);
                        let mut x = P::splat_i(-32 * i32::from(*a.s16[i].add(16 * b + j)));
                        for (t, &ut) in u.iter().enumerate() {
                            x = P::dot(x, ut, rd32(qa.add(4 * t)));
                        }
                        isum[i] = P::add(isum[i], P::mullo(sc, x));
                    }
                }
            }
            let dw = P::f16(dp.add(32 * b));
            for i in 0..R {
                let da = P::splat(*a.d[i].add(b));
                acc[i] = P::fma(P::mul(dw, da), P::cvt(isum[i]), acc[i]);
            }
        }
        for i in 0..R {
            P::store(acc[i], res[i].as_mut_ptr().add(h * l));
        }
    }
}

/// Bytes ahead of the kernel's read position that the weight stream is prefetched into L2
/// (0 = off). Measured on the decode of qwen2.5-coder-1.5b (BENCHMARKS.md, "Decode:
/// streaming prefetch"): into L1 (`T0`) the prefetches fill the line-fill buffers and stall
/// the loads the kernel needs now; into L2 at 16–64 KiB ahead they keep the memory stream
/// going while the core computes.
pub(crate) static STREAM_AHEAD: AtomicUsize = AtomicUsize::new(16 << 10);

/// The weight stream of one thread's tiles: where they end, how far ahead to fetch, and the
/// tile's bytes per block with their 64-byte-rounded slices (computed once per call: a
/// division per block part cost the prefill kernels up to 15 % of their time).
#[derive(Clone, Copy)]
struct Stream {
    end: *const u8,
    ahead: usize,
    /// Tile bytes per block.
    bpb: usize,
    /// `bpb` split in 4 and in 8 parts, each rounded up to whole cache lines.
    slice4: usize,
    slice8: usize,
}

impl Stream {
    fn new(end: *const u8, ahead: usize, lay: &Layout) -> Stream {
        let bpb = lay.tile / lay.nb.max(1);
        Stream {
            end,
            ahead,
            bpb,
            slice4: bpb.div_ceil(4).div_ceil(64) * 64,
            slice8: bpb.div_ceil(8).div_ceil(64) * 64,
        }
    }

    /// The same stream with prefetching off.
    fn off(self) -> Stream {
        Stream { ahead: 0, ..self }
    }
}

/// Prefetches (into L2) part `part` of `parts` of one block's share of a tile,
/// `stream.ahead` bytes ahead of block `b` of the tile at `base`. Tiles are contiguous, so
/// this runs on into the thread's next tiles; nothing past its last tile is fetched. Spread
/// over a block's inner loop, because a burst of prefetches stalls the core.
#[inline(always)]
fn stream_ahead(stream: Stream, base: *const u8, h: usize, b: usize, part: usize, parts: usize) {
    if stream.ahead == 0 || h != 0 {
        return;
    }
    let slice = if parts == 4 {
        stream.slice4
    } else {
        debug_assert_eq!(parts, 8);
        stream.slice8
    };
    let at = base.wrapping_add(b * stream.bpb + part * slice + stream.ahead);
    let mut o = 0;
    while o < slice && (at.wrapping_add(o) as usize) < stream.end as usize {
        // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(o) as *const i8) };
        o += 64;
    }
}

/// Fetches the output lines that the pass after the one at rows `m..m + R` of tile `t` will
/// write (the next R rows of the same tile, or the first R rows of the next tile), a whole
/// pass before their stores. A prefill's outputs (M × N f32, 18 MB for 512 rows of an FFN
/// up projection) are far larger than the caches, so every 64-byte line a pass writes used
/// to miss; the stores waited for their lines while the kernel ran, which cost 12–15 % of a
/// 512-row Q4_K matmul with N = 8960 on both paths (2026-12-07, `examples/prefill.rs`).
#[inline(always)]
fn prefetch_out<const R: usize>(
    c: &Call<'_>,
    tiles: &Range<usize>,
    ms: &Range<usize>,
    t: usize,
    m: usize,
) {
    let (nt, nm) = if m + 2 * R <= ms.end {
        (t, m + R)
    } else {
        (t + 1, ms.start)
    };
    if nt >= tiles.end {
        return;
    }
    // Columns of tile `nt` inside the output (the ends of a partial first or last tile).
    let c0 = (nt * TILE).max(c.n_range.start) - c.n_range.start;
    let c1 = ((nt + 1) * TILE).min(c.n_range.end) - c.n_range.start;
    for i in 0..R {
        let row = (nm + i) * c.ldo;
        // SAFETY: a prefetch is only a hint; it never faults, whatever the address (the
        // pointers are formed with wrapping arithmetic and never dereferenced).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(c.out.wrapping_add(row + c0) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.out.wrapping_add(row + c1 - 1) as *const i8);
        }
    }
}

/// Tiles `tiles` × activation rows `ms` (a multiple of R rows), R rows per pass.
#[inline(always)]
unsafe fn run<P: Pk, const R: usize, const FMT: u8>(
    c: &Call<'_>,
    tiles: Range<usize>,
    ms: Range<usize>,
) {
    let acts = c.acts;
    let k = acts.k;
    let nb = k / acts.layout.block_len();
    let lay = c.layout;
    let stream = Stream::new(
        c.tiles.wrapping_add(tiles.end * lay.tile),
        STREAM_AHEAD.load(Ordering::Relaxed),
        &lay,
    );
    for t in tiles.clone() {
        // SAFETY: t < number of tiles (the caller derives `tiles` from a validated range).
        let base = unsafe { c.tiles.add(t * lay.tile) };
        let lanes =
            c.n_range.start.max(t * TILE) - t * TILE..c.n_range.end.min((t + 1) * TILE) - t * TILE;
        let mut m = ms.start;
        while m + R <= ms.end {
            let mut rows = Rows::<R> {
                qs: [std::ptr::null(); R],
                d: [std::ptr::null(); R],
                s32: [std::ptr::null(); R],
                s16: [std::ptr::null(); R],
            };
            for i in 0..R {
                let mi = m + i;
                rows.qs[i] = acts.qs[mi * k..].as_ptr() as *const u8;
                rows.d[i] = acts.d[mi * nb..].as_ptr();
                rows.s32[i] = acts.s32[mi * k / 32..].as_ptr();
                rows.s16[i] = acts
                    .s16
                    .get(mi * k / 16..)
                    .map_or(std::ptr::null(), |s| s.as_ptr());
            }
            // Only the first pass over a tile streams the weights ahead: the later passes
            // read the tile from cache, and prefetching its successors again is wasted work.
            let stream = if m == ms.start { stream } else { stream.off() };
            prefetch_out::<R>(c, &tiles, &ms, t, m);
            let mut res = [[0.0f32; TILE]; R];
            if FMT == Q4K && P::I16 {
                // AVX2 Q4_K: both halves in one sweep (`k4_pair`).
                // SAFETY: the tile holds `lay.nb` blocks of every region for all 16 rows (the
                // last tile is padded); the rows hold k codes and their sums and scales.
                unsafe { k4_pair::<P, R>(base, &lay, stream, &rows, &mut res) };
            } else {
                for h in 0..TILE / P::L {
                    if lanes.end <= h * P::L || lanes.start >= (h + 1) * P::L {
                        continue;
                    }
                    // SAFETY: the tile holds `lay.nb` blocks of every region; the rows hold k
                    // codes and their sums and scales; the kernel matches the layout's format.
                    unsafe {
                        match FMT {
                            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => {
                                legacy::<P, R, FMT>(base, &lay, stream, h, &rows, &mut res)
                            }
                            Q4K => k45::<P, R, false>(base, &lay, stream, h, &rows, &mut res),
                            Q5K => k45::<P, R, true>(base, &lay, stream, h, &rows, &mut res),
                            _ => q6k::<P, R>(base, &lay, stream, h, &rows, &mut res),
                        }
                    }
                }
            }
            for (i, r) in res.iter().enumerate() {
                let at = (m + i) * c.ldo + t * TILE + lanes.start - c.n_range.start;
                // SAFETY: row m+i < M and columns inside n_range: inside the validated
                // output ((M − 1)·ldo + n_range.len() elements).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        r[lanes.clone()].as_ptr(),
                        c.out.add(at),
                        lanes.len(),
                    );
                }
            }
            m += R;
        }
    }
}

macro_rules! entries {
    ($name:ident, $p:ty, $feat:literal) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name<const R: usize, const FMT: u8>(
            c: &Call<'_>,
            tiles: Range<usize>,
            ms: Range<usize>,
        ) {
            // SAFETY: features enabled; forwarded contract.
            unsafe { run::<$p, R, FMT>(c, tiles, ms) }
        }
    };
}

entries!(
    run512,
    P512,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
entries!(run256, P256, "avx2,fma,f16c");

type Entry = unsafe fn(&Call<'_>, Range<usize>, Range<usize>);

macro_rules! table {
    ($name:ident, $fmt:expr) => {
        [
            $name::<1, { $fmt }> as Entry,
            $name::<2, { $fmt }> as Entry,
            $name::<3, { $fmt }> as Entry,
            $name::<4, { $fmt }> as Entry,
            $name::<5, { $fmt }> as Entry,
            $name::<6, { $fmt }> as Entry,
            $name::<7, { $fmt }> as Entry,
            $name::<8, { $fmt }> as Entry,
        ]
    };
}

const _: () = assert!(
    MR_MAX == 8,
    "`table!` lists one entry per pass size 1..=MR_MAX"
);

fn fmt_id(format: Format) -> Option<u8> {
    Some(match format {
        Format::Q4_0 => Q4_0,
        Format::Q4_1 => Q4_1,
        Format::Q5_0 => Q5_0,
        Format::Q5_1 => Q5_1,
        Format::Q8_0 => Q8_0,
        Format::Q4_K => Q4K,
        Format::Q5_K => Q5K,
        Format::Q6_K => Q6K,
        _ => return None,
    })
}

fn entries_for(avx512: bool, id: u8) -> [Entry; MR_MAX] {
    macro_rules! pick {
        ($name:ident) => {
            match id {
                Q4_0 => table!($name, Q4_0),
                Q4_1 => table!($name, Q4_1),
                Q5_0 => table!($name, Q5_0),
                Q5_1 => table!($name, Q5_1),
                Q8_0 => table!($name, Q8_0),
                Q4K => table!($name, Q4K),
                Q5K => table!($name, Q5K),
                _ => table!($name, Q6K),
            }
        };
    }
    if avx512 { pick!(run512) } else { pick!(run256) }
}

/// Packed matmul over `n_range` for all activation rows.
///
/// # Safety
/// The CPU must support the path's features (AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C when
/// `avx512`, else AVX2/FMA/F16C). `w` is tiled, `acts` matches its format and K,
/// `n_range ⊆ 0..n` is non-empty, M > 0 and `out` holds `(M − 1)·ldo + n_range.len()`.
pub(crate) unsafe fn matmul_packed(
    avx512: bool,
    w: &PackedMatrix,
    acts: &QuantizedActs,
    n_range: Range<usize>,
    out: &mut [f32],
    ldo: usize,
) {
    let (Some((buf, layout)), Some(id)) = (w.tiles(), fmt_id(w.format())) else {
        return;
    };
    let entries = entries_for(avx512, id);
    let tiles = n_range.start / TILE..n_range.end.div_ceil(TILE);
    let call = Call {
        tiles: buf.as_ptr(),
        layout: *layout,
        acts,
        n_range,
        out: out.as_mut_ptr(),
        ldo,
    };
    let (mr, one) = pass_rows(avx512, id);
    let m_total = acts.m;
    let chunk = (ACT_BUDGET / acts.k).max(one);
    // Tiles are walked in groups small enough to stay in L2, and every pass over the M
    // rows (see `split`) runs on one group before the next: weights stream from memory
    // once whatever M is (M = 7 used to read them twice).
    let group = (WEIGHT_BUDGET / layout.tile).max(1);
    let mut m0 = 0;
    while m0 < m_total {
        let m1 = (m0 + chunk).min(m_total);
        let (r, n_r, s) = split(m1 - m0, mr, one);
        let full = m0 + r * n_r;
        let mut t0 = tiles.start;
        while t0 < tiles.end {
            let t1 = (t0 + group).min(tiles.end);
            // SAFETY: forwarded contract; ranges inside 0..M and the matrix's tiles; the
            // rest after the `r`-row passes is a multiple of `s` rows.
            unsafe {
                entries[r - 1](&call, t0..t1, m0..full);
                if full < m1 {
                    entries[s - 1](&call, t0..t1, full..m1);
                }
            }
            t0 = t1;
        }
        m0 = m1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_row_once_in_passes_of_at_most_the_limit() {
        for (mr, one) in [(MR, MR_ONE), (MR_AVX2, MR_AVX2), (MR_AVX2, MR_ONE_AVX2_Q4K)] {
            for n in 1..=300 {
                let (r, n_r, s) = split(n, mr, one);
                let full = r * n_r;
                assert!(r >= 1 && n_r >= 1 && full <= n, "n={n} mr={mr}");
                let rest = n - full;
                if n <= one {
                    assert_eq!((r, n_r, rest), (n, 1, 0), "n={n} one={one}");
                    continue;
                }
                assert!(r <= mr, "n={n} mr={mr}");
                assert_eq!(
                    n_r + rest.checked_div(s).unwrap_or(0),
                    n.div_ceil(mr),
                    "n={n}"
                );
                if rest > 0 {
                    assert!(s == r - 1 && rest % s == 0, "n={n} mr={mr}: {r} {n_r} {s}");
                }
            }
        }
        assert_eq!(split(13, 6, 8), (5, 1, 4));
        assert_eq!(split(7, 6, 8), (7, 1, 0));
        assert_eq!(split(9, 6, 8), (5, 1, 4));
        assert_eq!(split(256, 4, 5), (4, 64, 0));
        assert_eq!(split(5, 4, 5), (5, 1, 0));
        assert_eq!(split(6, 4, 5), (3, 2, 0));
        assert_eq!(split(256, 6, 8), (6, 41, 5));
    }
}
