//! Counter-based Gumbel noise: `g(seed, position, token)` with no sequential state.
//!
//! The noise for a token depends only on the triple, never on which other tokens were
//! evaluated or in which order, so a drafter and the verifier that use the same triple see
//! the same noise (coupling), and a verify row reproduces plain decoding exactly.
//!
//! This module is a contract: changing a constant or the construction changes every sampled
//! output for a given seed.

/// The golden-ratio increment of SplitMix64.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Salt that keeps seed 0 away from the fixed point `mix64(0) == 0` ("lockstep" in ASCII).
const SEED_SALT: u64 = 0x6C6F_636B_7374_6570;
/// `2^52`: uniform integers below it have `u < 1/2`.
const HALF: u64 = 1 << 52;
/// `2^53 - 1`: the largest 53-bit uniform integer.
const MAX53: u64 = (1 << 53) - 1;
/// `2^-53`.
const TWO_POW_M53: f64 = 1.0 / 9_007_199_254_740_992.0;

/// The largest value `g` can take: `-ln(-ln(u))` at `u = 1 - 2^-54` is below `54 ln 2`.
pub(crate) const GUMBEL_MAX: f64 = 54.0 * std::f64::consts::LN_2;

/// The SplitMix64 output function (Stafford's mix 13): a bijection on `u64` with full
/// avalanche.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The noise stream of one (seed, position): token `t` reads element `t + 1` of a SplitMix64
/// stream whose state is derived from the seed and the position.
///
/// `key = mix64(mix64(seed ^ SALT) ^ position)`, `bits(t) = mix64(key + (t + 1) * GOLDEN)`.
/// For a fixed (seed, position), distinct tokens get distinct 64-bit words (the map is a
/// bijection), and both levels are bijective in seed and in position separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NoiseKey(u64);

impl NoiseKey {
    /// The stream for `seed` at absolute `position`.
    #[inline]
    pub fn new(seed: u64, position: u64) -> Self {
        NoiseKey(mix64(mix64(seed ^ SEED_SALT) ^ position))
    }

    /// The 64 random bits of `token`.
    #[inline(always)]
    pub fn bits(self, token: u32) -> u64 {
        mix64(
            self.0
                .wrapping_add((u64::from(token).wrapping_add(1)).wrapping_mul(GOLDEN)),
        )
    }

    /// Standard Gumbel noise for `token`: see [`gumbel_from_bits`].
    #[inline]
    pub fn gumbel(self, token: u32) -> f64 {
        gumbel_from_bits(self.bits(token))
    }
}

/// Standard Gumbel noise `-ln(-ln(u))` from 64 random bits.
///
/// `u = (r + 1/2) / 2^53` with `r` the top 53 bits, an exact rational strictly inside (0, 1)
/// (never 0 or 1). The exponential variate `E = -ln(u)` is computed without rounding `u`:
/// `-ln((r + 1/2) 2^-53)` when `u < 1/2`, else `-ln_1p(-(q + 1/2) 2^-53)` with
/// `q = 2^53 - 1 - r`, so both tails keep full precision. `g = -ln(E)`, in
/// `[-ln(54 ln 2), 54 ln 2)`, about `[-3.62, 37.43)`.
///
/// `ln` and `ln_1p` are std's (the platform libm): deterministic for one binary on one
/// machine, which is what bit-identical speculation within a process needs; results may
/// differ in the last ulp across libm versions.
#[inline]
pub fn gumbel_from_bits(bits: u64) -> f64 {
    let r = bits >> 11;
    let e = if r < HALF {
        -((r as f64 + 0.5) * TWO_POW_M53).ln()
    } else {
        let q = MAX53 - r;
        -(-((q as f64 + 0.5) * TWO_POW_M53)).ln_1p()
    };
    -e.ln()
}

/// An upper bound of [`gumbel_from_bits`] that needs no logarithm, for pruning.
///
/// If `u < 1/2` then `E > ln 2` and `g < -ln(ln 2) < 0.3666`. Otherwise `E = -ln(1 - eps)
/// >= eps` with `eps = (q + 1/2) 2^-53 > 2^(floor(log2 q) - 53)`, so
/// `g <= -ln(eps) < (lz(q) - 10) ln 2` (which also covers `q = 0`, `eps = 2^-54`).
#[inline(always)]
pub(crate) fn gumbel_upper_bound(bits: u64) -> f64 {
    let r = bits >> 11;
    if r < HALF {
        0.366_6
    } else {
        let q = MAX53 - r;
        f64::from(q.leading_zeros() - 10) * std::f64::consts::LN_2
    }
}

/// Standard Gumbel noise `g(seed, position, token)`, the noise of the sampling rule.
///
/// Identical for a given triple whatever else is evaluated; see [`NoiseKey`] for the
/// construction and [`gumbel_from_bits`] for the transform.
#[inline]
pub fn gumbel(seed: u64, position: u64, token: u32) -> f64 {
    NoiseKey::new(seed, position).gumbel(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_bound_dominates_noise_at_extremes_and_random_bits() {
        let mut extremes = vec![0u64, u64::MAX, HALF << 11, (HALF - 1) << 11];
        for k in 0..64u32 {
            extremes.push(u64::MAX << k);
            extremes.push(!(1u64 << k));
        }
        let key = NoiseKey::new(7, 9);
        extremes.extend((0..200_000u32).map(|t| key.bits(t)));
        for b in extremes {
            let g = gumbel_from_bits(b);
            assert!(g.is_finite(), "bits {b:#x}");
            // Equal at most by rounding (q = 0); the race's slack covers that.
            assert!(g <= gumbel_upper_bound(b) + 1e-12, "bits {b:#x}: {g}");
            assert!(g <= GUMBEL_MAX + 1e-12);
            assert!(g > -3.7);
        }
    }

    #[test]
    fn noise_extremes_match_closed_form() {
        // r = 2^53 - 1: u = 1 - 2^-54, E ~ 2^-54, g ~ 54 ln 2.
        let top = gumbel_from_bits(u64::MAX);
        assert!((top - 54.0 * std::f64::consts::LN_2).abs() < 1e-9, "{top}");
        // r = 0: u = 2^-54, E = 54 ln 2.
        let bottom = gumbel_from_bits(0);
        assert!((bottom + (54.0 * std::f64::consts::LN_2).ln()).abs() < 1e-12);
    }
}
