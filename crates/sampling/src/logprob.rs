//! Log-softmax of the raw logits at temperature 1, for reporting `logprob`s.
//!
//! One full pass for the maximum, one for `sum(exp(l - max))` with a fixed-lane f32 `exp`
//! written so the compiler vectorises it; the lane order is fixed, so the result is the same
//! whether or not it was vectorised.

use crate::SampleError;

/// `exp(x)` for `x <= 0` (Cephes `expf` polynomial with Cody-Waite reduction), `0` below
/// `-87` and for NaN (NaN is detected separately). Branch-free so it vectorises; ~2 ulp.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer (ties even)
    let xc = x.max(-87.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let keep = 0u32.wrapping_sub(u32::from(x >= -87.0));
    f32::from_bits((y * scale).to_bits() & keep)
}

/// Whether the bits are a NaN.
#[inline(always)]
fn nan_bit(x: f32) -> u32 {
    u32::from((x.to_bits() & 0x7FFF_FFFF) > 0x7F80_0000)
}

/// The maximum of `xs` (`-inf` when empty) and whether any element is NaN. Four lanes (one
/// SSE register), the shape the compiler vectorises.
#[inline]
pub(crate) fn max_and_nan(xs: &[f32]) -> (f32, bool) {
    let mut lanes = [f32::NEG_INFINITY; 4];
    let mut nan = [0u32; 4];
    let chunks = xs.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..4 {
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
            nan[j] |= nan_bit(c[j]);
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        lanes[j] = if x > lanes[j] { x } else { lanes[j] };
        nan[j] |= nan_bit(x);
    }
    let m01 = if lanes[1] > lanes[0] {
        lanes[1]
    } else {
        lanes[0]
    };
    let m23 = if lanes[3] > lanes[2] {
        lanes[3]
    } else {
        lanes[2]
    };
    (
        if m23 > m01 { m23 } else { m01 },
        (nan[0] | nan[1] | nan[2] | nan[3]) != 0,
    )
}

/// The maximum of `xs` ignoring NaN (`-inf` when empty).
#[inline]
pub(crate) fn max_f32(xs: &[f32]) -> f32 {
    max_and_nan(xs).0
}

const LANES: usize = 8;

/// `(max, ln(sum(exp(l - max))))` over all logits: the log-softmax normaliser at T = 1.
///
/// Errors on NaN and `+inf`; returns `EmptyAllowedSet` when no logit is finite.
pub(crate) fn log_normalizer(logits: &[f32]) -> Result<(f32, f64), SampleError> {
    let (max, nan) = max_and_nan(logits);
    if nan || max == f32::INFINITY {
        return Err(first_bad(logits).unwrap_or(SampleError::EmptyAllowedSet));
    }
    if max == f32::NEG_INFINITY {
        return Err(SampleError::EmptyAllowedSet);
    }
    let mut lanes = [0f64; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        let mut e = [0f32; LANES];
        for j in 0..LANES {
            e[j] = exp_nonpositive(c[j] - max);
        }
        for j in 0..LANES {
            lanes[j] += f64::from(e[j]);
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        lanes[j] += f64::from(exp_nonpositive(x - max));
    }
    let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    Ok((max, sum.ln()))
}

/// The first NaN or `+inf` logit as an error.
fn first_bad(logits: &[f32]) -> Option<SampleError> {
    logits
        .iter()
        .position(|x| x.is_nan() || *x == f32::INFINITY)
        .map(|i| SampleError::NonFiniteLogit {
            token: i as u32,
            value: logits[i],
        })
}

/// A token and its log-probability under softmax of the raw logits (T = 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub token: u32,
    /// Natural-log probability.
    pub logprob: f32,
}

/// The `n` most likely tokens under softmax of the raw logits at T = 1, best first
/// (logit descending, token id ascending). Tokens with logit `-inf` are never listed.
/// Computed only on request; it costs one more pass over the logits.
pub fn top_logprobs(logits: &[f32], n: usize) -> Result<Vec<TokenLogprob>, SampleError> {
    if logits.len() > crate::choose::MAX_VOCAB {
        return Err(SampleError::VocabTooLarge(logits.len()));
    }
    let (max, lse) = log_normalizer(logits)?;
    let n = n.min(logits.len());
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut best = crate::choose::TopK::new(n);
    for (i, &l) in logits.iter().enumerate() {
        best.offer_in_order(l, i as u32);
    }
    Ok(best
        .into_sorted()
        .into_iter()
        .map(|(l, token)| TokenLogprob {
            token,
            logprob: (f64::from(l) - f64::from(max) - lse) as f32,
        })
        .collect())
}

/// `ln softmax(logits)[token]` at T = 1, given the normaliser from [`log_normalizer`].
#[inline]
pub(crate) fn logprob_with(logit: f32, max: f32, lse: f64) -> f32 {
    (f64::from(logit) - f64::from(max) - lse) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_within_a_few_ulp_of_std() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let a = exp_nonpositive(x);
            let b = x.exp();
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b, "x={x}: {a} vs {b}");
            x -= 0.000_731;
        }
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn normalizer_matches_f64_reference_and_rejects_nan_and_inf() {
        let logits: Vec<f32> = (0..1001)
            .map(|i| ((i * 37 % 101) as f32) * 0.173 - 5.0)
            .collect();
        let (max, lse) = log_normalizer(&logits).unwrap();
        let m = f64::from(max);
        let reference: f64 = logits
            .iter()
            .map(|&l| (f64::from(l) - m).exp())
            .sum::<f64>()
            .ln();
        assert!((lse - reference).abs() < 1e-6, "{lse} vs {reference}");

        let mut bad = logits.clone();
        bad[17] = f32::NAN;
        assert!(matches!(
            log_normalizer(&bad),
            Err(SampleError::NonFiniteLogit { token: 17, .. })
        ));
        bad[17] = 0.0;
        bad[900] = f32::INFINITY;
        assert!(matches!(
            log_normalizer(&bad),
            Err(SampleError::NonFiniteLogit { token: 900, .. })
        ));
        assert_eq!(
            log_normalizer(&[f32::NEG_INFINITY; 3]),
            Err(SampleError::EmptyAllowedSet)
        );
    }
}
