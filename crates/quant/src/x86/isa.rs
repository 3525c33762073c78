//! The two SIMD instruction sets behind one trait, so that each format's block routine and
//! the tile driver are written once. Everything here is `#[inline(always)]` and is only ever
//! instantiated inside `#[target_feature]` functions of the matching feature set.
//!
//! A tile is NR weight rows (8 for AVX2, 16 for AVX-512); per-row block partial sums are
//! `__m256i` vectors of 8 i32 lanes (lane j sums the products of bytes 4j..4j+3 of a 32-byte
//! chunk, for both `vpdpbusd` and `pmaddubsw`+`pmaddwd`), reduced to one i32 per row.

use std::arch::x86_64::*;

/// One SIMD instruction set.
pub(crate) trait Isa {
    /// Rows per tile.
    const NR: usize;
    /// `dot_i8` computes Σ (w + I8_OFF)·a; the caller subtracts `I8_OFF·Σa`.
    const I8_OFF: i32;
    /// NR f32 lanes.
    type F: Copy;
    /// NR i32 lanes.
    type I: Copy;

    /// `acc + Σ4 u·a` per i32 lane (u unsigned, at most 63 for the AVX2 path, a signed).
    unsafe fn dot_u8(acc: __m256i, u: __m256i, a: __m256i) -> __m256i;
    /// `acc + Σ4 (w + I8_OFF)·a` per i32 lane (w, a signed).
    unsafe fn dot_i8(acc: __m256i, w: __m256i, a: __m256i) -> __m256i;
    /// Byte j = byte j of `val` where bit j of `bits` is set, else 0.
    unsafe fn bits_to_bytes(bits: u32, val: __m256i) -> __m256i;
    /// Lane r = sum of the lanes of `parts[r]`, r < NR.
    unsafe fn reduce(parts: &[__m256i; 16]) -> Self::I;
    /// `v - s` in every lane.
    unsafe fn sub_splat(v: Self::I, s: i32) -> Self::I;
    /// i32 → f32, round to nearest even.
    unsafe fn to_f32(v: Self::I) -> Self::F;
    /// Lane r = unaligned u32 at `base + idx[r]`.
    unsafe fn gather_u32(base: *const u8, idx: Self::I) -> Self::I;
    /// Decode the low 16 bits of each lane as f16.
    unsafe fn f16_lo(v: Self::I) -> Self::F;
    /// Decode the high 16 bits of each lane as f16.
    unsafe fn f16_hi(v: Self::I) -> Self::F;
    /// Decode the low 16 bits of each lane as bf16.
    unsafe fn bf16_lo(v: Self::I) -> Self::F;
    /// Decode the high 16 bits of each lane as bf16.
    unsafe fn bf16_hi(v: Self::I) -> Self::F;
    /// The lanes as f32 bit patterns.
    unsafe fn as_f32(v: Self::I) -> Self::F;
    /// Decode the low byte of each lane as an E8M0 exponent, halved (ggml
    /// `GGML_E8M0_TO_FP32_HALF`: `2^(e−128)` from bits, subnormal for e < 2).
    unsafe fn e8m0_half(v: Self::I) -> Self::F;
    /// Row offsets (first NR used).
    unsafe fn load_idx(idx: &[i32; 16]) -> Self::I;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::F;
    /// Zero.
    unsafe fn zero() -> Self::F;
    /// `a·b`.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a·b + c`, fused.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `-a` (sign flip, exact).
    unsafe fn neg(a: Self::F) -> Self::F;
    /// Store the first `count` lanes.
    unsafe fn store(v: Self::F, out: *mut f32, count: usize);
}

/// Sum each of 8 vectors horizontally: lane r of the result = Σ lanes of `v[r]`.
#[inline(always)]
pub(crate) unsafe fn reduce8(v: &[__m256i]) -> __m256i {
    // SAFETY: plain AVX2 register operations; the caller enables AVX2.
    unsafe {
        let t0 = _mm256_hadd_epi32(v[0], v[1]);
        let t1 = _mm256_hadd_epi32(v[2], v[3]);
        let t2 = _mm256_hadd_epi32(v[4], v[5]);
        let t3 = _mm256_hadd_epi32(v[6], v[7]);
        let u0 = _mm256_hadd_epi32(t0, t1);
        let u1 = _mm256_hadd_epi32(t2, t3);
        let lo = _mm256_permute2x128_si256::<0x20>(u0, u1);
        let hi = _mm256_permute2x128_si256::<0x31>(u0, u1);
        _mm256_add_epi32(lo, hi)
    }
}

/// u16 lanes (in the low half of each i32) packed into 8 consecutive u16.
#[inline(always)]
unsafe fn pack_u16_avx2(v: __m256i) -> __m128i {
    // SAFETY: register operations; the caller enables AVX2.
    unsafe {
        let p = _mm256_packus_epi32(v, v);
        let p = _mm256_permute4x64_epi64::<0b1000>(p);
        _mm256_castsi256_si128(p)
    }
}

/// AVX2 + FMA + F16C.
pub(crate) struct Avx2;

impl Isa for Avx2 {
    const NR: usize = 8;
    const I8_OFF: i32 = 0;
    type F = __m256;
    type I = __m256i;

    #[inline(always)]
    unsafe fn dot_u8(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
        // SAFETY: register operations; enabled features include AVX2.
        unsafe {
            let p = _mm256_maddubs_epi16(u, a);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn dot_i8(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        // SAFETY: register operations. |w| ≤ 128 and |a| ≤ 127, so pair sums stay below
        // i16 saturation.
        unsafe {
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn bits_to_bytes(bits: u32, val: __m256i) -> __m256i {
        // SAFETY: register operations.
        unsafe {
            let v = _mm256_set1_epi32(bits as i32);
            let shuf = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            );
            let bytes = _mm256_shuffle_epi8(v, shuf);
            let bitmask = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let sel = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bitmask), bitmask);
            _mm256_and_si256(sel, val)
        }
    }
    #[inline(always)]
    unsafe fn reduce(parts: &[__m256i; 16]) -> __m256i {
        // SAFETY: register operations.
        unsafe { reduce8(&parts[..8]) }
    }
    #[inline(always)]
    unsafe fn sub_splat(v: __m256i, s: i32) -> __m256i {
        // SAFETY: register operations.
        unsafe { _mm256_sub_epi32(v, _mm256_set1_epi32(s)) }
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn gather_u32(base: *const u8, idx: __m256i) -> __m256i {
        // SAFETY: the caller guarantees 4 readable bytes at base + idx[r] for every lane.
        unsafe { _mm256_i32gather_epi32::<1>(base as *const i32, idx) }
    }
    #[inline(always)]
    unsafe fn f16_lo(v: __m256i) -> __m256 {
        // SAFETY: register operations; F16C enabled.
        unsafe {
            _mm256_cvtph_ps(pack_u16_avx2(_mm256_and_si256(
                v,
                _mm256_set1_epi32(0xFFFF),
            )))
        }
    }
    #[inline(always)]
    unsafe fn f16_hi(v: __m256i) -> __m256 {
        // SAFETY: register operations; F16C enabled.
        unsafe { _mm256_cvtph_ps(pack_u16_avx2(_mm256_srli_epi32::<16>(v))) }
    }
    #[inline(always)]
    unsafe fn bf16_lo(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)) }
    }
    #[inline(always)]
    unsafe fn bf16_hi(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe {
            _mm256_castsi256_ps(_mm256_and_si256(
                v,
                _mm256_set1_epi32(0xFFFF_0000_u32 as i32),
            ))
        }
    }
    #[inline(always)]
    unsafe fn as_f32(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_castsi256_ps(v) }
    }
    #[inline(always)]
    unsafe fn e8m0_half(v: __m256i) -> __m256 {
        // SAFETY: register operations.
        unsafe {
            let e = _mm256_and_si256(v, _mm256_set1_epi32(0xFF));
            let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
            let sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
            let is_normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1));
            _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, is_normal))
        }
    }
    #[inline(always)]
    unsafe fn load_idx(idx: &[i32; 16]) -> __m256i {
        // SAFETY: reads 8 i32 from a 16-element array.
        unsafe { _mm256_loadu_si256(idx.as_ptr() as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: register operations.
        unsafe { _mm256_setzero_ps() }
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
        // SAFETY: register operations.
        unsafe { _mm256_xor_ps(a, _mm256_set1_ps(-0.0)) }
    }
    #[inline(always)]
    unsafe fn store(v: __m256, out: *mut f32, count: usize) {
        // SAFETY: the caller guarantees `count` writable f32 at `out`.
        unsafe {
            if count == 8 {
                _mm256_storeu_ps(out, v);
            } else {
                let mut tmp = [0.0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, count.min(8));
            }
        }
    }
}

/// AVX-512 F/BW/VL + VNNI (and AVX2/FMA/F16C, which every such CPU has).
pub(crate) struct Avx512;

impl Isa for Avx512 {
    const NR: usize = 16;
    const I8_OFF: i32 = 128;
    type F = __m512;
    type I = __m512i;

    #[inline(always)]
    unsafe fn dot_u8(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
        // SAFETY: register operations; AVX512-VNNI + VL enabled.
        unsafe { _mm256_dpbusd_epi32(acc, u, a) }
    }
    #[inline(always)]
    unsafe fn dot_i8(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        // SAFETY: register operations. w ^ 0x80 = w + 128 as an unsigned byte.
        unsafe { _mm256_dpbusd_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), a) }
    }
    #[inline(always)]
    unsafe fn bits_to_bytes(bits: u32, val: __m256i) -> __m256i {
        // SAFETY: register operations; AVX512-BW + VL enabled.
        unsafe { _mm256_maskz_mov_epi8(bits, val) }
    }
    #[inline(always)]
    unsafe fn reduce(parts: &[__m256i; 16]) -> __m512i {
        // SAFETY: register operations.
        unsafe {
            let lo = reduce8(&parts[..8]);
            let hi = reduce8(&parts[8..]);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }
    }
    #[inline(always)]
    unsafe fn sub_splat(v: __m512i, s: i32) -> __m512i {
        // SAFETY: register operations.
        unsafe { _mm512_sub_epi32(v, _mm512_set1_epi32(s)) }
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m512i) -> __m512 {
        // SAFETY: register operations (default rounding: nearest even).
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn gather_u32(base: *const u8, idx: __m512i) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes at base + idx[r] for every lane.
        unsafe { _mm512_i32gather_epi32::<1>(idx, base as *const i32) }
    }
    #[inline(always)]
    unsafe fn f16_lo(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)) }
    }
    #[inline(always)]
    unsafe fn f16_hi(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v))) }
    }
    #[inline(always)]
    unsafe fn bf16_lo(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)) }
    }
    #[inline(always)]
    unsafe fn bf16_hi(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe {
            _mm512_castsi512_ps(_mm512_and_si512(
                v,
                _mm512_set1_epi32(0xFFFF_0000_u32 as i32),
            ))
        }
    }
    #[inline(always)]
    unsafe fn as_f32(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_castsi512_ps(v) }
    }
    #[inline(always)]
    unsafe fn e8m0_half(v: __m512i) -> __m512 {
        // SAFETY: register operations.
        unsafe {
            let e = _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
            let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
            let sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
            let is_normal = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(1));
            _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_normal, sub, normal))
        }
    }
    #[inline(always)]
    unsafe fn load_idx(idx: &[i32; 16]) -> __m512i {
        // SAFETY: reads 16 i32 from a 16-element array.
        unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: register operations.
        unsafe { _mm512_setzero_ps() }
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
        // SAFETY: register operations.
        unsafe {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(i32::MIN),
            ))
        }
    }
    #[inline(always)]
    unsafe fn store(v: __m512, out: *mut f32, count: usize) {
        // SAFETY: the caller guarantees `count` (≤ 16) writable f32 at `out`; masked lanes
        // are not touched.
        unsafe {
            let mask: __mmask16 = if count >= 16 {
                0xFFFF
            } else {
                ((1u32 << count) - 1) as u16
            };
            _mm512_mask_storeu_ps(out, mask, v);
        }
    }
}
