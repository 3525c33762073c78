//! The canonical arithmetic, written as plain scalar Rust: this is the contract every
//! SIMD path reproduces bit for bit (see the crate documentation for the prose version).
//!
//! Rust never contracts `a * b + c` into a fused multiply-add by itself, so every
//! rounding step below is exactly the one written; `f32::mul_add` is the one fused step.

/// Number of lane accumulators of the canonical reduction.
pub const LANES: usize = 16;

/// Sums the 16 lane accumulators with the fixed pairwise tree
/// `(j, j+8)`, then `(j, j+4)`, then `(j, j+2)`, then `(0, 1)`.
#[inline]
pub fn tree16(l: &[f32; LANES]) -> f32 {
    let mut s8 = [0.0f32; 8];
    for j in 0..8 {
        s8[j] = l[j] + l[j + 8];
    }
    let mut s4 = [0.0f32; 4];
    for j in 0..4 {
        s4[j] = s8[j] + s8[j + 4];
    }
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Canonical dot product: element `i` goes to lane `i % 16`, each lane starts at `+0.0`
/// and accumulates `lane = fma(a[i], b[i], lane)` in index order, then [`tree16`].
/// Lanes past the end of the vectors receive nothing (no padding arithmetic).
///
/// `a` and `b` must have the same length (only the common prefix is used).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut l = [0.0f32; LANES];
    for i in 0..n {
        l[i % LANES] = a[i].mul_add(b[i], l[i % LANES]);
    }
    tree16(&l)
}

/// Canonical dot product of an f32 vector with f16 values (bit patterns), each converted
/// exactly to f32 first; the same lane order as [`dot`].
pub fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    let mut l = [0.0f32; LANES];
    for i in 0..n {
        l[i % LANES] = a[i].mul_add(f16_to_f32(b[i]), l[i % LANES]);
    }
    tree16(&l)
}

/// Canonical sum: element `i` goes to lane `i % 16`, `lane = lane + x[i]` in index order
/// (each lane starts at `+0.0`), then [`tree16`].
pub fn sum(x: &[f32]) -> f32 {
    let mut l = [0.0f32; LANES];
    for (i, &v) in x.iter().enumerate() {
        l[i % LANES] += v;
    }
    tree16(&l)
}

/// Inputs above this give `+inf` (exp overflows well before).
pub const EXP_HI: f32 = 89.0;
/// Inputs below this give `+0.0` (exp(-104) is below half the smallest subnormal).
pub const EXP_LO: f32 = -104.0;
/// log2(e) rounded to f32.
pub const LOG2E: f32 = std::f32::consts::LOG2_E;
/// High part of ln 2 (16 significant bits, so `n * LN2_HI` is exact).
pub const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125
/// Low part of ln 2: `LN2_HI + LN2_LO` is ln 2 to about 2^-44.
pub const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 1.42860677e-6
/// Polynomial coefficients of `(e^r - 1 - r) / r^2` on |r| <= ln2/2, highest first
/// (Cephes `expf`: 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
/// 1.6666665459e-1, 5.0000001201e-1, rounded to f32; given as bits to pin them exactly).
pub const EXP_POLY: [f32; 6] = [
    f32::from_bits(0x3950_6967),
    f32::from_bits(0x3ab7_43ce),
    f32::from_bits(0x3c08_8908),
    f32::from_bits(0x3d2a_a9c1),
    f32::from_bits(0x3e2a_aaaa),
    f32::from_bits(0x3f00_0000),
];

/// 2^k as an f32 for `-126 <= k <= 127`.
#[inline]
pub fn pow2i(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The one `exp` of the crate (softmax, SiLU, GELU, attention).
///
/// - NaN returns the input; `x > 89` returns `+inf`; `x < -104` returns `+0.0`;
/// - otherwise `n = round_half_even(x * LOG2E)` (one f32 multiply),
///   `r = fma(-n, LN2_HI, x)`, `r = fma(-n, LN2_LO, r)`,
///   `p = EXP_POLY` by Horner with `fma` (`y = c0; y = fma(y, r, c_k)`),
///   `p = fma(p, r*r, r)`, `p = p + 1`,
///   and the result is `(p * 2^h) * 2^(n-h)` with `h = n >> 1` (arithmetic shift), so
///   overflow to `+inf` and gradual underflow round exactly once, in the last multiply.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut y = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        y = y.mul_add(r, c);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    let ni = n as i32;
    let h = ni >> 1;
    (y * pow2i(h)) * pow2i(ni - h)
}

/// SiLU: `x / (1 + exp(-x))`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `0.044715` (f32 bits 0x3d372713), the cubic coefficient of the tanh-approximated GELU.
pub const GELU_A: f32 = f32::from_bits(0x3d37_2713);
/// `2 * sqrt(2 / pi)` rounded to f32 (bits 0x3fcc422a).
pub const GELU_2B: f32 = f32::from_bits(0x3fcc_422a);

/// GELU, tanh approximation, through the identity `0.5 * (1 + tanh(z/2)) = 1/(1+exp(-z))`:
/// `z = (x * fma(GELU_A, x*x, 1)) * GELU_2B`, result `x / (1 + exp(-z))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let z = (x * GELU_A.mul_add(x * x, 1.0)) * GELU_2B;
    x / (1.0 + exp(-z))
}

/// Converts an f32 to IEEE binary16 bits with round-to-nearest-even, as F16C's
/// `vcvtps2ph` does in its default mode: overflow gives infinity, NaN stays NaN (quiet bit
/// set, top payload bits kept), values below the f16 range round to (signed) zero through
/// the subnormals.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x007f_ffff;
    if exp == 0xff {
        if man == 0 {
            return sign | 0x7c00;
        }
        return sign | 0x7e00 | (man >> 13) as u16;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // Result is an f16 subnormal (or zero, or rounds up to the smallest normal).
        let shift = (14 - e) as u32; // value / 2^-24 = m / 2^shift
        if shift > 24 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let q = m >> shift;
        let rem = m & ((1u32 << shift) - 1);
        let half = 1u32 << (shift - 1);
        let q = if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        };
        return sign | q as u16;
    }
    let q = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let q = if rem > 0x1000 || (rem == 0x1000 && q & 1 == 1) {
        q + 1
    } else {
        q
    };
    sign | q as u16
}

/// Converts IEEE binary16 bits to f32 (exact; NaNs come back quiet, as with F16C).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: normalise.
            let s = man.leading_zeros() - 21; // brings the top set bit to bit 10
            let man = (man << s) & 0x03ff;
            let exp = 113 - s; // value = 2^(10 - s - 24)
            sign | (exp << 23) | (man << 13)
        }
    } else if exp == 0x1f {
        // Infinity, or NaN with the quiet bit set (as `vcvtph2ps` does).
        sign | 0x7f80_0000
            | if man == 0 {
                0
            } else {
                0x0040_0000 | (man << 13)
            }
    } else {
        sign | ((exp + 127 - 15) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// The rotation of one RoPE pair: `(x0*c - x1*s, x0*s + x1*c)` (plain products, no fma).
#[inline]
pub fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0 * c - x1 * s, x0 * s + x1 * c)
}
