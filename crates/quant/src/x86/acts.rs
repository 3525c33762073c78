//! SIMD activation quantizers, bit-identical to `acts::quantize_block_scalar`: amax over the
//! |x| bit patterns, the same scalar `d`/`id`, `min(v,127)`, `max(·,-127)` with x86 NaN
//! semantics, and `vcvtps2dq` in the default rounding mode (nearest even).

use crate::acts::scales;
use std::arch::x86_64::*;

/// Quantize one block (length a multiple of 16) with AVX-512; returns `d`.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL; `x.len() == q.len()`, a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn quantize_block_avx512(x: &[f32], q: &mut [i8]) -> f32 {
    let n = x.len().min(q.len()) / 16 * 16;
    let absm = _mm512_set1_epi32(0x7FFF_FFFF);
    let mut mx = _mm512_setzero_si512();
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 ≤ x.len().
        let v = unsafe { _mm512_loadu_si512(x.as_ptr().add(i) as *const __m512i) };
        mx = _mm512_max_epu32(mx, _mm512_and_si512(v, absm));
    }
    let amax = f32::from_bits(_mm512_reduce_max_epu32(mx));
    let (d, id) = scales(amax);
    let idv = _mm512_set1_ps(id);
    let hi = _mm512_set1_ps(127.0);
    let lo = _mm512_set1_ps(-127.0);
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 ≤ x.len() and ≤ q.len().
        unsafe {
            let v = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(i)), idv);
            let v = _mm512_max_ps(_mm512_min_ps(v, hi), lo);
            let b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
            _mm_storeu_si128(q.as_mut_ptr().add(i) as *mut __m128i, b);
        }
    }
    d
}

/// Quantize one block (length a multiple of 16) with AVX2; returns `d`.
///
/// # Safety
/// The CPU must support AVX2; `x.len() == q.len()`, a multiple of 16.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> f32 {
    let n = x.len().min(q.len()) / 16 * 16;
    let absm = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut mx = _mm256_setzero_si256();
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 ≤ x.len().
        let v = unsafe { _mm256_loadu_si256(x.as_ptr().add(i) as *const __m256i) };
        mx = _mm256_max_epu32(mx, _mm256_and_si256(v, absm));
    }
    let m4 = _mm_max_epu32(
        _mm256_castsi256_si128(mx),
        _mm256_extracti128_si256::<1>(mx),
    );
    let m2 = _mm_max_epu32(m4, _mm_shuffle_epi32::<0b1110>(m4));
    let m1 = _mm_max_epu32(m2, _mm_shuffle_epi32::<0b0001>(m2));
    let amax = f32::from_bits(_mm_cvtsi128_si32(m1) as u32);
    let (d, id) = scales(amax);
    let idv = _mm256_set1_ps(id);
    let hi = _mm256_set1_ps(127.0);
    let lo = _mm256_set1_ps(-127.0);
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 ≤ x.len() and ≤ q.len().
        unsafe {
            let a = conv8(x.as_ptr().add(i), idv, hi, lo);
            let b = conv8(x.as_ptr().add(i + 8), idv, hi, lo);
            let p = _mm256_permute4x64_epi64::<0b1101_1000>(_mm256_packs_epi32(a, b));
            let bytes =
                _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p));
            _mm_storeu_si128(q.as_mut_ptr().add(i) as *mut __m128i, bytes);
        }
    }
    d
}

/// 8 codes as i32: `cvt(max(min(x·id, 127), -127))`.
#[inline(always)]
unsafe fn conv8(p: *const f32, idv: __m256, hi: __m256, lo: __m256) -> __m256i {
    // SAFETY: the caller guarantees 8 readable f32 at p and enables AVX.
    unsafe {
        let v = _mm256_mul_ps(_mm256_loadu_ps(p), idv);
        _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, hi), lo))
    }
}
