//! AVX-512 (F/BW/VL + FMA + F16C) kernels: one 16-lane register is exactly the 16 lane
//! accumulators of the canonical order, so every kernel mirrors `canon` lane for lane.
//!
//! Every function here is `#[target_feature]`; callers outside this module must have
//! checked `Isa::Avx512.is_supported()` (the dispatchers in `kernels` do).

use std::arch::x86_64::*;

use crate::canon;

const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// Loads 16 floats from the start of `s` (which must hold at least 16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn load(s: &[f32]) -> __m512 {
    assert!(s.len() >= 16);
    // SAFETY: `s` holds at least 16 floats (checked above); unaligned load.
    unsafe { _mm512_loadu_ps(s.as_ptr()) }
}

/// Loads the first `n < 16` floats of `s`, zeros elsewhere.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn load_partial(s: &[f32], n: usize) -> __m512 {
    assert!(n < 16 && s.len() >= n);
    // SAFETY: the mask enables only the first `n` elements, all inside `s`; masked-off
    // elements are not accessed (fault suppression).
    unsafe { _mm512_maskz_loadu_ps(tail_mask(n), s.as_ptr()) }
}

/// Stores 16 floats at the start of `d` (which must hold at least 16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn store(d: &mut [f32], v: __m512) {
    assert!(d.len() >= 16);
    // SAFETY: `d` holds at least 16 floats (checked above); unaligned store.
    unsafe { _mm512_storeu_ps(d.as_mut_ptr(), v) }
}

/// Stores the first `n < 16` lanes of `v` at the start of `d`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn store_partial(d: &mut [f32], v: __m512, n: usize) {
    assert!(n < 16 && d.len() >= n);
    // SAFETY: only the first `n` elements are written, all inside `d`.
    unsafe { _mm512_mask_storeu_ps(d.as_mut_ptr(), tail_mask(n), v) }
}

/// Loads 16 f16 values from the start of `s` and converts them exactly to f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn load_f16(s: &[u16]) -> __m512 {
    assert!(s.len() >= 16);
    // SAFETY: `s` holds at least 16 u16 (32 bytes, checked above); unaligned load.
    let h = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
    _mm512_cvtph_ps(h)
}

/// Loads the first `n < 16` f16 values of `s` as f32, zeros elsewhere.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn load_f16_partial(s: &[u16], n: usize) -> __m512 {
    assert!(n < 16 && s.len() >= n);
    // SAFETY: the 16-bit mask enables only the first `n` elements, all inside `s`;
    // masked-off elements are not accessed.
    let h = unsafe { _mm256_maskz_loadu_epi16(tail_mask(n), s.as_ptr().cast()) };
    _mm512_cvtph_ps(h)
}

#[inline]
fn tail_mask(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

/// The canonical lane tree of `canon::tree16` on one register.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
pub(crate) fn tree16(v: __m512) -> f32 {
    let upper = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `canon::exp` on 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let hi = _mm512_set1_ps(canon::EXP_HI);
    let lo = _mm512_set1_ps(canon::EXP_LO);
    // NaN lanes become `lo` here (vmaxps returns the second operand); fixed up below.
    let xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    let n = _mm512_roundscale_ps::<ROUND_NEAREST>(_mm512_mul_ps(xc, _mm512_set1_ps(canon::LOG2E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(canon::LN2_HI), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(canon::LN2_LO), r);
    let p = canon::EXP_POLY;
    let mut y = _mm512_set1_ps(p[0]);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p[1]));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p[2]));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p[3]));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p[4]));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p[5]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0));
    let ni = _mm512_cvtps_epi32(n);
    let h = _mm512_srai_epi32::<1>(ni);
    let k = _mm512_sub_epi32(ni, h);
    let bias = _mm512_set1_epi32(127);
    let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(h, bias)));
    let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k, bias)));
    let mut res = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
    res = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, hi),
        res,
        _mm512_set1_ps(f32::INFINITY),
    );
    res = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo),
        res,
        _mm512_setzero_ps(),
    );
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), res, x)
}

/// `-x` (sign flip, exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn neg(x: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ))
}

/// `canon::dot`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = _mm512_setzero_ps();
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        acc = _mm512_fmadd_ps(load(&a[i..]), load(&b[i..]), acc);
        i += 16;
    }
    if n > full {
        let r = n - full;
        let va = load_partial(&a[full..], r);
        let vb = load_partial(&b[full..], r);
        acc = _mm512_mask3_fmadd_ps(va, vb, acc, tail_mask(r));
    }
    tree16(acc)
}

/// `canon::dot_f16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = _mm512_setzero_ps();
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        acc = _mm512_fmadd_ps(load(&a[i..]), load_f16(&b[i..]), acc);
        i += 16;
    }
    if n > full {
        let r = n - full;
        let va = load_partial(&a[full..], r);
        let vb = load_f16_partial(&b[full..], r);
        acc = _mm512_mask3_fmadd_ps(va, vb, acc, tail_mask(r));
    }
    tree16(acc)
}

/// `canon::sum`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let n = x.len();
    let mut acc = _mm512_setzero_ps();
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        acc = _mm512_add_ps(acc, load(&x[i..]));
        i += 16;
    }
    if n > full {
        let r = n - full;
        acc = _mm512_mask_add_ps(acc, tail_mask(r), acc, load_partial(&x[full..], r));
    }
    tree16(acc)
}

/// Applies `f` to `x` 16 lanes at a time (masked tail) and stores into `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(__m512, __m512) -> __m512) {
    let n = out.len().min(a.len()).min(b.len());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        let v = f(load(&a[i..]), load(&b[i..]));
        store(&mut out[i..], v);
        i += 16;
    }
    if n > full {
        let r = n - full;
        let v = f(load_partial(&a[full..], r), load_partial(&b[full..], r));
        store_partial(&mut out[full..], v, r);
    }
}

/// `out_i = (x_i * inv) * w_i`, or `(x_i * inv) * (1 + w_i)` when `one_plus`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn scale_mul(x: &[f32], w: &[f32], inv: f32, one_plus: bool, out: &mut [f32]) {
    let vinv = _mm512_set1_ps(inv);
    let one = _mm512_set1_ps(1.0);
    if one_plus {
        map2(x, w, out, |x, w| {
            _mm512_mul_ps(_mm512_mul_ps(x, vinv), _mm512_add_ps(one, w))
        });
    } else {
        map2(x, w, out, |x, w| _mm512_mul_ps(_mm512_mul_ps(x, vinv), w));
    }
}

/// `out_i = silu(g_i) * u_i`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    let one = _mm512_set1_ps(1.0);
    map2(g, u, out, |g, u| {
        let e = exp16(neg(g));
        _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u)
    });
}

/// `out_i = gelu_tanh(g_i) * u_i`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn geglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    let one = _mm512_set1_ps(1.0);
    let a = _mm512_set1_ps(canon::GELU_A);
    let b2 = _mm512_set1_ps(canon::GELU_2B);
    map2(g, u, out, |g, u| {
        let z = _mm512_mul_ps(
            _mm512_mul_ps(g, _mm512_fmadd_ps(a, _mm512_mul_ps(g, g), one)),
            b2,
        );
        let e = exp16(neg(z));
        _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u)
    });
}

/// `out_i = exp(x_i - m)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn exp_shifted(x: &[f32], m: f32, out: &mut [f32]) {
    let vm = _mm512_set1_ps(m);
    map2(x, x, out, |x, _| exp16(_mm512_sub_ps(x, vm)));
}

/// `x_i = x_i * s` in place.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn scale_in_place(x: &mut [f32], s: f32) {
    let vs = _mm512_set1_ps(s);
    let n = x.len();
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        let v = _mm512_mul_ps(load(&x[i..]), vs);
        store(&mut x[i..], v);
        i += 16;
    }
    if n > full {
        let r = n - full;
        let v = _mm512_mul_ps(load_partial(&x[full..], r), vs);
        store_partial(&mut x[full..], v, r);
    }
}

/// RoPE, neox pairing, on one head: `x[i]` pairs with `x[i + half]` for `i < half`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len().min(sin.len());
    assert!(x.len() >= 2 * half);
    let (x0s, rest) = x.split_at_mut(half);
    let x1s = &mut rest[..half];
    let full = half / 16 * 16;
    let mut i = 0;
    while i < full {
        let (x0, x1) = (load(&x0s[i..]), load(&x1s[i..]));
        let (c, s) = (load(&cos[i..]), load(&sin[i..]));
        let o0 = _mm512_sub_ps(_mm512_mul_ps(x0, c), _mm512_mul_ps(x1, s));
        let o1 = _mm512_add_ps(_mm512_mul_ps(x0, s), _mm512_mul_ps(x1, c));
        store(&mut x0s[i..], o0);
        store(&mut x1s[i..], o1);
        i += 16;
    }
    if half > full {
        let r = half - full;
        let (x0, x1) = (load_partial(&x0s[full..], r), load_partial(&x1s[full..], r));
        let (c, s) = (load_partial(&cos[full..], r), load_partial(&sin[full..], r));
        let o0 = _mm512_sub_ps(_mm512_mul_ps(x0, c), _mm512_mul_ps(x1, s));
        let o1 = _mm512_add_ps(_mm512_mul_ps(x0, s), _mm512_mul_ps(x1, c));
        store_partial(&mut x0s[full..], o0, r);
        store_partial(&mut x1s[full..], o1, r);
    }
}

/// RoPE, normal (interleaved) pairing, on one head: `x[2i]` pairs with `x[2i + 1]`.
///
/// Computed as `x * C + swap(x) * S'` with `C = (c_i, c_i)`, `S' = (-s_i, s_i)`: the even
/// lane is `x0*c + x1*(-s)`, which equals `x0*c - x1*s` exactly, the odd lane
/// `x1*c + x0*s`, which equals `x0*s + x1*c` exactly.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn rope_normal(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let pairs = cos.len().min(sin.len());
    assert!(x.len() >= 2 * pairs);
    let dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let sign_even = _mm512_setr_epi32(
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
        i32::MIN,
        0,
    );
    let mut p = 0;
    while p < pairs {
        let np = (pairs - p).min(8);
        let ne = 2 * np;
        let (c8, s8) = if np == 8 {
            (load_partial8(&cos[p..]), load_partial8(&sin[p..]))
        } else {
            (load_partial(&cos[p..], np), load_partial(&sin[p..], np))
        };
        let c = _mm512_permutexvar_ps(dup, c8);
        let s = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_permutexvar_ps(dup, s8)),
            sign_even,
        ));
        let xv = if ne == 16 {
            load(&x[2 * p..])
        } else {
            load_partial(&x[2 * p..], ne)
        };
        let xs = _mm512_permute_ps::<0b10_11_00_01>(xv);
        let o = _mm512_add_ps(_mm512_mul_ps(xv, c), _mm512_mul_ps(xs, s));
        if ne == 16 {
            store(&mut x[2 * p..], o);
        } else {
            store_partial(&mut x[2 * p..], o, ne);
        }
        p += np;
    }
}

/// Loads exactly 8 floats into the low half of a register.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn load_partial8(s: &[f32]) -> __m512 {
    assert!(s.len() >= 8);
    // SAFETY: `s` holds at least 8 floats (checked above).
    let h = unsafe { _mm256_loadu_ps(s.as_ptr()) };
    _mm512_castps256_ps512(h)
}

/// Converts f32 to f16 bits with round-to-nearest-even (`vcvtps2ph`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        let h = _mm512_cvtps_ph::<ROUND_NEAREST>(load(&src[i..]));
        let d = &mut dst[i..i + 16];
        // SAFETY: `d` is exactly 16 u16 = 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), h) };
        i += 16;
    }
    for j in full..n {
        dst[j] = canon::f32_to_f16(src[j]);
    }
}

/// Converts f16 bits to f32 (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let full = n / 16 * 16;
    let mut i = 0;
    while i < full {
        store(&mut dst[i..], load_f16(&src[i..]));
        i += 16;
    }
    for j in full..n {
        dst[j] = canon::f16_to_f32(src[j]);
    }
}

/// Attention scores of one query against `out.len()` keys of `d` f16 values each, stored
/// back to back in `keys`: `out[j] = dot_f16(q, k_j) * scale`. Four keys run interleaved
/// (independent chains); each key's lane order is exactly `dot_f16`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn scores_f16(q: &[f32], keys: &[u16], d: usize, scale: f32, out: &mut [f32]) {
    let n = out.len();
    let full = d / 16 * 16;
    let mut j = 0;
    while j + 4 <= n && d == full {
        let k = &keys[j * d..(j + 4) * d];
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < d {
            let qv = load(&q[i..]);
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qv, load_f16(&k[t * d + i..]), *a);
            }
            i += 16;
        }
        for (t, a) in acc.iter().enumerate() {
            out[j + t] = tree16(*a) * scale;
        }
        j += 4;
    }
    for (jj, o) in out.iter_mut().enumerate().skip(j) {
        *o = dot_f16(q, &keys[jj * d..(jj + 1) * d]) * scale;
    }
}

/// As [`scores_f16`] for f32 keys.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn scores_f32(q: &[f32], keys: &[f32], d: usize, scale: f32, out: &mut [f32]) {
    let n = out.len();
    let full = d / 16 * 16;
    let mut j = 0;
    while j + 4 <= n && d == full {
        let k = &keys[j * d..(j + 4) * d];
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < d {
            let qv = load(&q[i..]);
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qv, load(&k[t * d + i..]), *a);
            }
            i += 16;
        }
        for (t, a) in acc.iter().enumerate() {
            out[j + t] = tree16(*a) * scale;
        }
        j += 4;
    }
    for (jj, o) in out.iter_mut().enumerate().skip(j) {
        *o = dot(q, &keys[jj * d..(jj + 1) * d]) * scale;
    }
}

/// `S` consecutive 16-column slices of the accumulator, starting at column `c`, kept in
/// registers while the value rows stream by (one fma chain per slice, rows in order).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn accumulate_slices_f16<const S: usize>(acc: &mut [f32], c: usize, e: &[f32], vals: &[u16]) {
    let d = acc.len();
    let mut a = [_mm512_setzero_ps(); S];
    for (s, r) in a.iter_mut().enumerate() {
        *r = load(&acc[c + 16 * s..]);
    }
    for (j, &w) in e.iter().enumerate() {
        let wv = _mm512_set1_ps(w);
        let row = &vals[j * d + c..];
        for (s, r) in a.iter_mut().enumerate() {
            *r = _mm512_fmadd_ps(wv, load_f16(&row[16 * s..]), *r);
        }
    }
    for (s, r) in a.iter().enumerate() {
        store(&mut acc[c + 16 * s..], *r);
    }
}

/// As [`accumulate_slices_f16`] for f32 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
fn accumulate_slices_f32<const S: usize>(acc: &mut [f32], c: usize, e: &[f32], vals: &[f32]) {
    let d = acc.len();
    let mut a = [_mm512_setzero_ps(); S];
    for (s, r) in a.iter_mut().enumerate() {
        *r = load(&acc[c + 16 * s..]);
    }
    for (j, &w) in e.iter().enumerate() {
        let wv = _mm512_set1_ps(w);
        let row = &vals[j * d + c..];
        for (s, r) in a.iter_mut().enumerate() {
            *r = _mm512_fmadd_ps(wv, load(&row[16 * s..]), *r);
        }
    }
    for (s, r) in a.iter().enumerate() {
        store(&mut acc[c + 16 * s..], *r);
    }
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])` for each value row `j` in order (f16 values).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn accumulate_f16(acc: &mut [f32], e: &[f32], vals: &[u16]) {
    let d = acc.len();
    let full = d / 16 * 16;
    let mut c = 0;
    while c + 128 <= full {
        accumulate_slices_f16::<8>(acc, c, e, vals);
        c += 128;
    }
    if c + 64 <= full {
        accumulate_slices_f16::<4>(acc, c, e, vals);
        c += 64;
    }
    if c + 32 <= full {
        accumulate_slices_f16::<2>(acc, c, e, vals);
        c += 32;
    }
    if c < full {
        accumulate_slices_f16::<1>(acc, c, e, vals);
    }
    if d > full {
        let r = d - full;
        let mut a = load_partial(&acc[full..], r);
        for (j, &w) in e.iter().enumerate() {
            let v = load_f16_partial(&vals[j * d + full..], r);
            a = _mm512_fmadd_ps(_mm512_set1_ps(w), v, a);
        }
        store_partial(&mut acc[full..], a, r);
    }
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])` for each value row `j` in order (f32 values).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) fn accumulate_f32(acc: &mut [f32], e: &[f32], vals: &[f32]) {
    let d = acc.len();
    let full = d / 16 * 16;
    let mut c = 0;
    while c + 128 <= full {
        accumulate_slices_f32::<8>(acc, c, e, vals);
        c += 128;
    }
    if c + 64 <= full {
        accumulate_slices_f32::<4>(acc, c, e, vals);
        c += 64;
    }
    if c + 32 <= full {
        accumulate_slices_f32::<2>(acc, c, e, vals);
        c += 32;
    }
    if c < full {
        accumulate_slices_f32::<1>(acc, c, e, vals);
    }
    if d > full {
        let r = d - full;
        let mut a = load_partial(&acc[full..], r);
        for (j, &w) in e.iter().enumerate() {
            let v = load_partial(&vals[j * d + full..], r);
            a = _mm512_fmadd_ps(_mm512_set1_ps(w), v, a);
        }
        store_partial(&mut acc[full..], a, r);
    }
}
