//! Per-ISA dispatch of the primitive kernels. Each function takes the [`Isa`] explicitly
//! (tests run every supported path against [`Isa::Scalar`]); the scalar arm is the
//! reference written with `canon`.

use crate::canon;
use crate::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::simd::{avx2, avx512};

/// Expands to a match over the three paths; `$scalar` is the reference expression.
macro_rules! dispatch {
    ($isa:expr, $name:ident($($arg:expr),*), $scalar:expr) => {
        match $isa.checked() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `checked()` returned Avx512 only because the CPU supports it.
            Isa::Avx512 => unsafe { avx512::$name($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `checked()` returned Avx2 only because the CPU supports it.
            Isa::Avx2 => unsafe { avx2::$name($($arg),*) },
            _ => $scalar,
        }
    };
}

/// Canonical dot product (`canon::dot`).
pub(crate) fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    dispatch!(isa, dot(a, b), canon::dot(a, b))
}

/// Canonical dot product with f16 values (`canon::dot_f16`).
pub(crate) fn dot_f16(isa: Isa, a: &[f32], b: &[u16]) -> f32 {
    dispatch!(isa, dot_f16(a, b), canon::dot_f16(a, b))
}

/// Canonical sum (`canon::sum`).
pub(crate) fn sum(isa: Isa, x: &[f32]) -> f32 {
    dispatch!(isa, sum(x), canon::sum(x))
}

/// `out_i = (x_i * inv) * w_i` (or `* (1 + w_i)`).
pub(crate) fn scale_mul(isa: Isa, x: &[f32], w: &[f32], inv: f32, one_plus: bool, out: &mut [f32]) {
    dispatch!(isa, scale_mul(x, w, inv, one_plus, out), {
        for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
            *o = if one_plus {
                (x * inv) * (1.0 + w)
            } else {
                (x * inv) * w
            };
        }
    })
}

/// `out_i = silu(g_i) * u_i`.
pub(crate) fn swiglu(isa: Isa, g: &[f32], u: &[f32], out: &mut [f32]) {
    dispatch!(isa, swiglu(g, u, out), {
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = canon::silu(g) * u;
        }
    })
}

/// `out_i = gelu_tanh(g_i) * u_i`.
pub(crate) fn geglu(isa: Isa, g: &[f32], u: &[f32], out: &mut [f32]) {
    dispatch!(isa, geglu(g, u, out), {
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = canon::gelu_tanh(g) * u;
        }
    })
}

/// `out_i = exp(x_i - m)`.
pub(crate) fn exp_shifted(isa: Isa, x: &[f32], m: f32, out: &mut [f32]) {
    dispatch!(isa, exp_shifted(x, m, out), {
        for (o, &x) in out.iter_mut().zip(x) {
            *o = canon::exp(x - m);
        }
    })
}

/// `x_i = x_i * s`.
pub(crate) fn scale_in_place(isa: Isa, x: &mut [f32], s: f32) {
    dispatch!(isa, scale_in_place(x, s), {
        for v in x.iter_mut() {
            *v *= s;
        }
    })
}

/// RoPE on one head, neox pairing `(i, i + half)`.
pub(crate) fn rope_neox(isa: Isa, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    dispatch!(isa, rope_neox(x, cos, sin), {
        let half = cos.len();
        for i in 0..half {
            (x[i], x[i + half]) = canon::rotate(x[i], x[i + half], cos[i], sin[i]);
        }
    })
}

/// RoPE on one head, normal pairing `(2i, 2i + 1)`.
pub(crate) fn rope_normal(isa: Isa, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    dispatch!(isa, rope_normal(x, cos, sin), {
        for i in 0..cos.len() {
            (x[2 * i], x[2 * i + 1]) = canon::rotate(x[2 * i], x[2 * i + 1], cos[i], sin[i]);
        }
    })
}

/// f32 → f16 bits, round-to-nearest-even.
pub(crate) fn f32_to_f16(isa: Isa, src: &[f32], dst: &mut [u16]) {
    dispatch!(isa, f32_to_f16(src, dst), {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = canon::f32_to_f16(s);
        }
    })
}

/// f16 bits → f32 (exact).
pub(crate) fn f16_to_f32(isa: Isa, src: &[u16], dst: &mut [f32]) {
    dispatch!(isa, f16_to_f32(src, dst), {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = canon::f16_to_f32(s);
        }
    })
}

/// `out[j] = dot_f16(q, k_j) * scale` for `out.len()` keys of `d` values.
pub(crate) fn scores_f16(isa: Isa, q: &[f32], keys: &[u16], d: usize, scale: f32, out: &mut [f32]) {
    dispatch!(isa, scores_f16(q, keys, d, scale, out), {
        for (j, o) in out.iter_mut().enumerate() {
            *o = canon::dot_f16(q, &keys[j * d..(j + 1) * d]) * scale;
        }
    })
}

/// `out[j] = dot(q, k_j) * scale` for `out.len()` keys of `d` values.
pub(crate) fn scores_f32(isa: Isa, q: &[f32], keys: &[f32], d: usize, scale: f32, out: &mut [f32]) {
    dispatch!(isa, scores_f32(q, keys, d, scale, out), {
        for (j, o) in out.iter_mut().enumerate() {
            *o = canon::dot(q, &keys[j * d..(j + 1) * d]) * scale;
        }
    })
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])`, rows `j` in order, f16 values.
pub(crate) fn accumulate_f16(isa: Isa, acc: &mut [f32], e: &[f32], vals: &[u16]) {
    dispatch!(isa, accumulate_f16(acc, e, vals), {
        let d = acc.len();
        for (j, &w) in e.iter().enumerate() {
            for (i, a) in acc.iter_mut().enumerate() {
                *a = w.mul_add(canon::f16_to_f32(vals[j * d + i]), *a);
            }
        }
    })
}

/// `acc[i] = fma(e[j], v_j[i], acc[i])`, rows `j` in order, f32 values.
pub(crate) fn accumulate_f32(isa: Isa, acc: &mut [f32], e: &[f32], vals: &[f32]) {
    dispatch!(isa, accumulate_f32(acc, e, vals), {
        let d = acc.len();
        for (j, &w) in e.iter().enumerate() {
            for (i, a) in acc.iter_mut().enumerate() {
                *a = w.mul_add(vals[j * d + i], *a);
            }
        }
    })
}
