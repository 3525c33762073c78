//! AVX2 + FMA + F16C kernels. The 16 canonical lane accumulators are two 8-lane
//! registers (`lo` = lanes 0..8, `hi` = lanes 8..16); element-wise kernels run 8 lanes at
//! a time with the scalar `canon` functions on the tail (element-wise results do not
//! depend on the lane an element sits in).
//!
//! Every function here is `#[target_feature]`; callers outside this module must have
//! checked `Isa::Avx2.is_supported()` (the dispatchers in `kernels` do).

use std::arch::x86_64::*;

use crate::canon;

const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load(s: &[f32]) -> __m256 {
    assert!(s.len() >= 8);
    // SAFETY: `s` holds at least 8 floats (checked above); unaligned load.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store(d: &mut [f32], v: __m256) {
    assert!(d.len() >= 8);
    // SAFETY: `d` holds at least 8 floats (checked above); unaligned store.
    unsafe { _mm256_storeu_ps(d.as_mut_ptr(), v) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f16(s: &[u16]) -> __m256 {
    assert!(s.len() >= 8);
    // SAFETY: `s` holds at least 8 u16 = 16 bytes (checked above); unaligned load.
    let h = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
    _mm256_cvtph_ps(h)
}

/// Spills 16 lane accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn spill(lo: __m256, hi: __m256) -> [f32; 16] {
    let mut l = [0.0f32; 16];
    store(&mut l[..8], lo);
    store(&mut l[8..], hi);
    l
}

/// The canonical lane tree of `canon::tree16` on two registers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tree16(lo: __m256, hi: __m256) -> f32 {
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `canon::exp` on 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let hi = _mm256_set1_ps(canon::EXP_HI);
    let lo = _mm256_set1_ps(canon::EXP_LO);
    // NaN lanes become `lo` here (vmaxps returns the second operand); fixed up below.
    let xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    let n = _mm256_round_ps::<ROUND_NEAREST>(_mm256_mul_ps(xc, _mm256_set1_ps(canon::LOG2E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(canon::LN2_HI), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(canon::LN2_LO), r);
    let p = canon::EXP_POLY;
    let mut y = _mm256_set1_ps(p[0]);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p[1]));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p[2]));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p[3]));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p[4]));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p[5]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
    let ni = _mm256_cvtps_epi32(n);
    let h = _mm256_srai_epi32::<1>(ni);
    let k = _mm256_sub_epi32(ni, h);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(h, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, bias)));
    let mut res = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    res = _mm256_blendv_ps(
        res,
        _mm256_set1_ps(f32::INFINITY),
        _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi),
    );
    res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
    _mm256_blendv_ps(res, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn neg(x: __m256) -> __m256 {
    _mm256_xor_ps(x, _mm256_set1_ps(-0.0))
}

/// `canon::dot`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        lo = _mm256_fmadd_ps(load(&a[i..]), load(&b[i..]), lo);
        hi = _mm256_fmadd_ps(load(&a[i + 8..]), load(&b[i + 8..]), hi);
        i += 16;
    }
    if n == full {
        return tree16(lo, hi);
    }
    let mut l = spill(lo, hi);
    for k in full..n {
        l[k - full] = a[k].mul_add(b[k], l[k - full]);
    }
    canon::tree16(&l)
}

/// `canon::dot_f16`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        lo = _mm256_fmadd_ps(load(&a[i..]), load_f16(&b[i..]), lo);
        hi = _mm256_fmadd_ps(load(&a[i + 8..]), load_f16(&b[i + 8..]), hi);
        i += 16;
    }
    if n == full {
        return tree16(lo, hi);
    }
    let mut l = spill(lo, hi);
    for k in full..n {
        l[k - full] = a[k].mul_add(canon::f16_to_f32(b[k]), l[k - full]);
    }
    canon::tree16(&l)
}

/// `canon::sum`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let n = x.len();
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        lo = _mm256_add_ps(lo, load(&x[i..]));
        hi = _mm256_add_ps(hi, load(&x[i + 8..]));
        i += 16;
    }
    if n == full {
        return tree16(lo, hi);
    }
    let mut l = spill(lo, hi);
    for k in full..n {
        l[k - full] += x[k];
    }
    canon::tree16(&l)
}

/// Applies `f` 8 lanes at a time and `g` (its scalar twin) to the tail.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn map2(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    f: impl Fn(__m256, __m256) -> __m256,
    g: impl Fn(f32, f32) -> f32,
) {
    let n = out.len().min(a.len()).min(b.len());
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        let v = f(load(&a[i..]), load(&b[i..]));
        store(&mut out[i..], v);
        i += 8;
    }
    for k in full..n {
        out[k] = g(a[k], b[k]);
    }
}

/// `out_i = (x_i * inv) * w_i`, or `(x_i * inv) * (1 + w_i)` when `one_plus`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scale_mul(x: &[f32], w: &[f32], inv: f32, one_plus: bool, out: &mut [f32]) {
    let vinv = _mm256_set1_ps(inv);
    let one = _mm256_set1_ps(1.0);
    if one_plus {
        map2(
            x,
            w,
            out,
            |x, w| _mm256_mul_ps(_mm256_mul_ps(x, vinv), _mm256_add_ps(one, w)),
            |x, w| (x * inv) * (1.0 + w),
        );
    } else {
        map2(
            x,
            w,
            out,
            |x, w| _mm256_mul_ps(_mm256_mul_ps(x, vinv), w),
            |x, w| (x * inv) * w,
        );
    }
}

/// `out_i = silu(g_i) * u_i`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    let one = _mm256_set1_ps(1.0);
    map2(
        g,
        u,
        out,
        |g, u| _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp8(neg(g)))), u),
        |g, u| canon::silu(g) * u,
    );
}

/// `out_i = gelu_tanh(g_i) * u_i`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn geglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    let one = _mm256_set1_ps(1.0);
    let a = _mm256_set1_ps(canon::GELU_A);
    let b2 = _mm256_set1_ps(canon::GELU_2B);
    map2(
        g,
        u,
        out,
        |g, u| {
            let z = _mm256_mul_ps(
                _mm256_mul_ps(g, _mm256_fmadd_ps(a, _mm256_mul_ps(g, g), one)),
                b2,
            );
            _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp8(neg(z)))), u)
        },
        |g, u| canon::gelu_tanh(g) * u,
    );
}

/// `out_i = exp(x_i - m)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    let vm = _mm256_set1_ps(m);
    map2(
        x,
        x,
        out,
        |x, _| exp8(_mm256_sub_ps(x, vm)),
        |x, _| canon::exp(x - m),
    );
}

/// `x_i = x_i * s` in place.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scale_in_place(x: &mut [f32], s: f32) {
    let vs = _mm256_set1_ps(s);
    let n = x.len();
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        let v = _mm256_mul_ps(load(&x[i..]), vs);
        store(&mut x[i..], v);
        i += 8;
    }
    for v in &mut x[full..] {
        *v *= s;
    }
}

/// RoPE, neox pairing, on one head: `x[i]` pairs with `x[i + half]` for `i < half`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len().min(sin.len());
    assert!(x.len() >= 2 * half);
    let (x0s, rest) = x.split_at_mut(half);
    let x1s = &mut rest[..half];
    let full = half / 8 * 8;
    let mut i = 0;
    while i < full {
        let (x0, x1) = (load(&x0s[i..]), load(&x1s[i..]));
        let (c, s) = (load(&cos[i..]), load(&sin[i..]));
        let o0 = _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s));
        let o1 = _mm256_add_ps(_mm256_mul_ps(x0, s), _mm256_mul_ps(x1, c));
        store(&mut x0s[i..], o0);
        store(&mut x1s[i..], o1);
        i += 8;
    }
    for k in full..half {
        (x0s[k], x1s[k]) = canon::rotate(x0s[k], x1s[k], cos[k], sin[k]);
    }
}

/// RoPE, normal (interleaved) pairing, on one head (see the AVX-512 twin for why
/// `x*C + swap(x)*S'` is exact).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rope_normal(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let pairs = cos.len().min(sin.len());
    assert!(x.len() >= 2 * pairs);
    let dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let sign_even = _mm256_setr_ps(-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0);
    let full = pairs / 4 * 4;
    let mut p = 0;
    while p < full {
        let c4 = load4(&cos[p..]);
        let s4 = load4(&sin[p..]);
        let c = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(c4), dup);
        let s = _mm256_xor_ps(
            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), dup),
            sign_even,
        );
        let xv = load(&x[2 * p..]);
        let xs = _mm256_permute_ps::<0b10_11_00_01>(xv);
        store(
            &mut x[2 * p..],
            _mm256_add_ps(_mm256_mul_ps(xv, c), _mm256_mul_ps(xs, s)),
        );
        p += 4;
    }
    for k in full..pairs {
        (x[2 * k], x[2 * k + 1]) = canon::rotate(x[2 * k], x[2 * k + 1], cos[k], sin[k]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load4(s: &[f32]) -> __m128 {
    assert!(s.len() >= 4);
    // SAFETY: `s` holds at least 4 floats (checked above).
    unsafe { _mm_loadu_ps(s.as_ptr()) }
}

/// Converts f32 to f16 bits with round-to-nearest-even (`vcvtps2ph`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(load(&src[i..]));
        let d = &mut dst[i..i + 8];
        // SAFETY: `d` is exactly 8 u16 = 16 bytes; unaligned store.
        unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), h) };
        i += 8;
    }
    for j in full..n {
        dst[j] = canon::f32_to_f16(src[j]);
    }
}

/// Converts f16 bits to f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        store(&mut dst[i..], load_f16(&src[i..]));
        i += 8;
    }
    for j in full..n {
        dst[j] = canon::f16_to_f32(src[j]);
    }
}

/// Attention scores against `out.len()` f16 keys of `d` values each.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scores_f16(q: &[f32], keys: &[u16], d: usize, scale: f32, out: &mut [f32]) {
    // Four keys at a time when `d` fills whole 16-lane steps: each key keeps its own two
    // lane registers and canonical order (`dot_f16`), but the four fma chains interleave
    // (one key's chain is latency-bound) and share the loads of `q`.
    let mut j = 0;
    if d.is_multiple_of(16) && q.len() == d {
        while j + 4 <= out.len() {
            let k = &keys[j * d..(j + 4) * d];
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < d {
                let (qa, qb) = (load(&q[i..]), load(&q[i + 8..]));
                for t in 0..4 {
                    let kt = &k[t * d + i..];
                    lo[t] = _mm256_fmadd_ps(qa, load_f16(kt), lo[t]);
                    hi[t] = _mm256_fmadd_ps(qb, load_f16(&kt[8..]), hi[t]);
                }
                i += 16;
            }
            for t in 0..4 {
                out[j + t] = tree16(lo[t], hi[t]) * scale;
            }
            j += 4;
        }
    }
    for (jj, o) in out.iter_mut().enumerate().skip(j) {
        *o = dot_f16(q, &keys[jj * d..(jj + 1) * d]) * scale;
    }
}

/// Attention scores against `out.len()` f32 keys of `d` values each.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scores_f32(q: &[f32], keys: &[f32], d: usize, scale: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(q, &keys[j * d..(j + 1) * d]) * scale;
    }
}

/// `S` consecutive 8-column slices of the accumulator from column `c`, kept in registers
/// while the value rows stream by (one fma chain per slice, rows in order).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn accumulate_slices_f16<const S: usize>(acc: &mut [f32], c: usize, e: &[f32], vals: &[u16]) {
    let d = acc.len();
    let mut a = [_mm256_setzero_ps(); S];
    for (s, r) in a.iter_mut().enumerate() {
        *r = load(&acc[c + 8 * s..]);
    }
    for (j, &w) in e.iter().enumerate() {
        let wv = _mm256_set1_ps(w);
        let row = &vals[j * d + c..];
        for (s, r) in a.iter_mut().enumerate() {
            *r = _mm256_fmadd_ps(wv, load_f16(&row[8 * s..]), *r);
        }
    }
    for (s, r) in a.iter().enumerate() {
        store(&mut acc[c + 8 * s..], *r);
    }
}

/// As [`accumulate_slices_f16`] for f32 values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn accumulate_slices_f32<const S: usize>(acc: &mut [f32], c: usize, e: &[f32], vals: &[f32]) {
    let d = acc.len();
    let mut a = [_mm256_setzero_ps(); S];
    for (s, r) in a.iter_mut().enumerate() {
        *r = load(&acc[c + 8 * s..]);
    }
    for (j, &w) in e.iter().enumerate() {
        let wv = _mm256_set1_ps(w);
        let row = &vals[j * d + c..];
        for (s, r) in a.iter_mut().enumerate() {
            *r = _mm256_fmadd_ps(wv, load(&row[8 * s..]), *r);
        }
    }
    for (s, r) in a.iter().enumerate() {
        store(&mut acc[c + 8 * s..], *r);
    }
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])` for each value row `j` in order (f16 values).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn accumulate_f16(acc: &mut [f32], e: &[f32], vals: &[u16]) {
    let d = acc.len();
    let full = d / 8 * 8;
    let mut c = 0;
    while c + 64 <= full {
        accumulate_slices_f16::<8>(acc, c, e, vals);
        c += 64;
    }
    while c + 16 <= full {
        accumulate_slices_f16::<2>(acc, c, e, vals);
        c += 16;
    }
    if c < full {
        accumulate_slices_f16::<1>(acc, c, e, vals);
    }
    for k in full..d {
        for (j, &w) in e.iter().enumerate() {
            acc[k] = w.mul_add(canon::f16_to_f32(vals[j * d + k]), acc[k]);
        }
    }
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])` for each value row `j` in order (f32 values).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn accumulate_f32(acc: &mut [f32], e: &[f32], vals: &[f32]) {
    let d = acc.len();
    let full = d / 8 * 8;
    let mut c = 0;
    while c + 64 <= full {
        accumulate_slices_f32::<8>(acc, c, e, vals);
        c += 64;
    }
    while c + 16 <= full {
        accumulate_slices_f32::<2>(acc, c, e, vals);
        c += 16;
    }
    if c < full {
        accumulate_slices_f32::<1>(acc, c, e, vals);
    }
    for k in full..d {
        for (j, &w) in e.iter().enumerate() {
            acc[k] = w.mul_add(vals[j * d + k], acc[k]);
        }
    }
}
