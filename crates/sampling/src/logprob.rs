//! Log-softmax of the raw logits at temperature 1, for reporting `logprob`s.
//!
//! One full pass for the maximum, one for `sum(exp(l - max))` with a fixed-lane f32 `exp`
//! written so the compiler vectorises it: 256 lanes, each adding its terms in index order,
//! combined by a fixed tree, so the result is the same whether or not it was vectorised, and
//! a GPU computes the same bits with 256 threads.

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

/// The maximum of `xs` (`-inf` when empty) and whether any element is NaN: exactly
/// [`max_and_nan_ref`]'s result. Sixteen independent lanes find the value (a maximum
/// other than zero has one bit pattern, whichever element gave it, so any order gives
/// the reference's); only a maximum of ±0 asks the reference which zero it keeps.
#[inline]
pub(crate) fn max_and_nan(xs: &[f32]) -> (f32, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { max_and_nan_avx512(xs) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { max_and_nan_avx2(xs) };
        }
    }
    max_and_nan_wide(xs)
}

/// [`max_and_nan`] compiled for AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_and_nan_avx512(xs: &[f32]) -> (f32, bool) {
    max_and_nan_wide(xs)
}

/// [`max_and_nan`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_and_nan_avx2(xs: &[f32]) -> (f32, bool) {
    max_and_nan_wide(xs)
}

/// [`max_and_nan`] for any target.
#[inline(always)]
fn max_and_nan_wide(xs: &[f32]) -> (f32, bool) {
    const W: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; W];
    let mut nan = [0u32; W];
    let chunks = xs.chunks_exact(W);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..W {
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
            nan[j] |= nan_bit(c[j]);
        }
    }
    let mut m = f32::NEG_INFINITY;
    let mut any_nan = 0u32;
    for j in 0..W {
        m = if lanes[j] > m { lanes[j] } else { m };
        any_nan |= nan[j];
    }
    for &x in rest {
        m = if x > m { x } else { m };
        any_nan |= nan_bit(x);
    }
    if any_nan != 0 || m == 0.0 {
        return max_and_nan_ref(xs);
    }
    (m, false)
}

/// The reference of [`max_and_nan`]: four lanes in index order (element `i` to lane
/// `i % 4`, each keeping the earlier of equal values), then a fixed tree.
#[inline]
pub(crate) fn max_and_nan_ref(xs: &[f32]) -> (f32, bool) {
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

/// Lanes of the normaliser's sum: term `i` (the f32 `exp_nonpositive(l_i - max)` widened to
/// f64) goes to lane `i % NORM_LANES`, each lane adds its terms in index order, and the
/// lanes are combined by the adjacent-pair tree (`(l0 + l1)`, `(l2 + l3)`, ..., then pairs
/// of those, ...). 256 lanes: a device sums a row with 256 threads, each chain 1/256 of the
/// vocabulary long, and the CPU's lanes are contiguous vectors.
pub const NORM_LANES: usize = 256;
/// Lanes a [`RowSummary`] carries: lane `j` is the tree of the normaliser's lanes
/// `[32 j, 32 j + 32)`, so the last three levels of the tree are [`lse_of_lanes`]'s.
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
    Ok((max, lse_of_lanes(&lane_sums(logits, max))))
}

/// The [`SUMMARY_LANES`] partial sums of `exp(l - max)`: the [`NORM_LANES`] lane sums
/// (lane `j` adds, in index order, the terms of the logits at indices `i` with
/// `i % NORM_LANES == j`, each term the f32 `exp_nonpositive(l - max)` widened to f64),
/// folded by the adjacent-pair tree down to [`SUMMARY_LANES`] values.
///
/// On x86-64 with AVX-512F or AVX2 the same code is compiled for that instruction set and
/// chosen at run time (the baseline build vectorises only to SSE2's width): the same IEEE
/// operations in the same order per lane (Rust never fuses a multiply and an add on its
/// own), so the same bits, several times faster on a 151,936-token vocabulary.
fn lane_sums(logits: &[f32], max: f32) -> [f64; LANES] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { lane_sums_avx512(logits, max) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { lane_sums_avx2(logits, max) };
        }
    }
    lane_sums_portable(logits, max)
}

/// [`lane_sums`] compiled for AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn lane_sums_avx512(logits: &[f32], max: f32) -> [f64; LANES] {
    lane_sums_portable(logits, max)
}

/// [`lane_sums`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lane_sums_avx2(logits: &[f32], max: f32) -> [f64; LANES] {
    lane_sums_portable(logits, max)
}

/// [`lane_sums`] for any target (the reference the compiled variants equal bit for bit).
#[inline(always)]
fn lane_sums_portable(logits: &[f32], max: f32) -> [f64; LANES] {
    let mut lanes = [0f64; NORM_LANES];
    let wide = logits.chunks_exact(NORM_LANES);
    let rest = wide.remainder();
    for c in wide {
        // The exponentials side by side (as wide as the target allows), then each added
        // to its lane.
        for (l, x) in lanes.chunks_exact_mut(32).zip(c.chunks_exact(32)) {
            let mut e = [0f32; 32];
            for j in 0..32 {
                e[j] = exp_nonpositive(x[j] - max);
            }
            for j in 0..32 {
                l[j] += f64::from(e[j]);
            }
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        lanes[j] += f64::from(exp_nonpositive(x - max));
    }
    fold_lanes(&mut lanes)
}

/// The adjacent-pair tree of `lanes` ([`NORM_LANES`] values) down to [`LANES`] values:
/// level by level, value `i` of the next level is `v[2 i] + v[2 i + 1]`.
#[inline(always)]
fn fold_lanes(lanes: &mut [f64; NORM_LANES]) -> [f64; LANES] {
    let mut n = NORM_LANES;
    while n > LANES {
        n /= 2;
        for i in 0..n {
            lanes[i] = lanes[2 * i] + lanes[2 * i + 1];
        }
    }
    let mut out = [0f64; LANES];
    out.copy_from_slice(&lanes[..LANES]);
    out
}

/// `ln` of the lanes' total, combined by the same adjacent-pair tree: the normaliser `lse`.
fn lse_of_lanes(lanes: &[f64; LANES]) -> f64 {
    let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    sum.ln()
}

/// Lanes of the log-softmax normaliser's sum in a [`RowSummary`].
pub const SUMMARY_LANES: usize = LANES;

/// What a backend reports about one logit row so that a plain greedy choice (and its
/// logprob) needs no copy of the row: exactly what [`Sampler::choose`](crate::Sampler::choose)
/// would compute from the row, split where the device stops and the host goes on.
/// [`row_summary`] is the reference; a device computing it must match it bit for bit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSummary {
    /// The lowest id among the maximal logits (meaningless when `fallback`).
    pub argmax: u32,
    /// The maximal logit (meaningless when `fallback`).
    pub max: f32,
    /// Lane `j`: the adjacent-pair tree of the normaliser's lanes `[32 j, 32 j + 32)`, where
    /// normaliser lane `k` is the f64 sum, in index order, of `exp_nonpositive(l - max)` (the
    /// crate's one f32 `exp`) over the logits at indices `i % 256 == k` (zeros when
    /// `fallback`).
    pub lanes: [f64; SUMMARY_LANES],
    /// The row holds a NaN or `+inf`, or no logit above `-inf` (or is empty): the caller
    /// must choose from the full row, which reports the error.
    pub fallback: bool,
}

impl RowSummary {
    /// The token and logprob [`Sampler::choose`](crate::Sampler::choose) returns for this
    /// row when its choice is the plain argmax (temperature 0, no penalties, no bias, the
    /// argmax allowed); `None` when the row must be read in full (`fallback`).
    pub fn greedy(&self) -> Option<(u32, f32)> {
        if self.fallback {
            return None;
        }
        let lse = lse_of_lanes(&self.lanes);
        Some((self.argmax, logprob_with(self.max, self.max, lse)))
    }
}

/// The reference [`RowSummary`] of a logit row (what a device must reproduce bit for bit).
pub fn row_summary(logits: &[f32]) -> RowSummary {
    let (max, nan) = max_and_nan(logits);
    if nan || !max.is_finite() {
        return RowSummary {
            argmax: 0,
            max,
            lanes: [0.0; LANES],
            fallback: true,
        };
    }
    let argmax = logits.iter().position(|&x| x == max).unwrap_or(0) as u32;
    RowSummary {
        argmax,
        max,
        lanes: lane_sums(logits, max),
        fallback: false,
    }
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

    /// The lane sums as the canonical order states them, one element at a time.
    fn lane_sums_plain(logits: &[f32], max: f32) -> [f64; LANES] {
        let mut lanes = [0f64; NORM_LANES];
        for (i, &x) in logits.iter().enumerate() {
            lanes[i % NORM_LANES] += f64::from(exp_nonpositive(x - max));
        }
        // The adjacent-pair tree of each 32 consecutive lanes, written recursively.
        fn tree(v: &[f64]) -> f64 {
            match v.len() {
                1 => v[0],
                n => tree(&v[..n / 2]) + tree(&v[n / 2..]),
            }
        }
        std::array::from_fn(|j| tree(&lanes[32 * j..32 * j + 32]))
    }

    /// A 64-bit LCG's high bits: reproducible test values.
    fn lcg(mut seed: u64) -> impl FnMut() -> u32 {
        move || {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) as u32
        }
    }

    /// Rows with ties, signed zeros, infinities, NaNs and values around the `exp` cut-off,
    /// of lengths around every width the fast paths use.
    fn awkward_rows() -> Vec<Vec<f32>> {
        let mut next = lcg(0x5eed);
        let mut rows = Vec::new();
        for len in [
            0usize, 1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 100, 255, 256, 257, 1000, 4099,
        ] {
            for case in 0..8 {
                let row: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = next();
                        match (case, r % 11) {
                            (0, _) => (r % 2000) as f32 / 100.0 - 10.0,
                            (1, _) => (r % 5) as f32,
                            (2, 0) => -0.0,
                            (2, 1) => 0.0,
                            (2, _) => -((r % 100) as f32),
                            (3, 0) => f32::NEG_INFINITY,
                            (3, _) => -87.0 - (r % 3) as f32 * 0.5,
                            (4, 0) if len > 8 => f32::NAN,
                            (5, _) => 0.0,
                            (6, _) => -0.0,
                            (7, 0) => f32::INFINITY,
                            _ => (r % 1000) as f32 / 37.0 - 20.0,
                        }
                    })
                    .collect();
                rows.push(row);
            }
        }
        rows
    }

    #[test]
    fn fast_max_and_lane_sums_equal_their_references_bit_for_bit() {
        for row in awkward_rows() {
            let (m, n) = max_and_nan(&row);
            let (mr, nr) = max_and_nan_ref(&row);
            assert_eq!((m.to_bits(), n), (mr.to_bits(), nr), "{row:?}");
            if n || !m.is_finite() {
                continue;
            }
            let fast = lane_sums(&row, m);
            let plain = lane_sums_plain(&row, m);
            assert_eq!(fast.map(f64::to_bits), plain.map(f64::to_bits), "{row:?}");
        }
    }

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
    fn summary_greedy_equals_the_full_choice() {
        use crate::{ChoiceContext, Sampler, SamplingParams, TokenMask};
        let params = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        assert!(params.is_plain_greedy());
        assert!(!SamplingParams::default().is_plain_greedy());
        let ctx = ChoiceContext::default();
        let mut sampler = Sampler::new();
        let mut next = lcg(7);
        for len in [1usize, 7, 8, 9, 63, 64, 65, 1000, 4099] {
            for case in 0..6 {
                // Coarse values make ties; some -inf; case 5 is all -inf but one.
                let mut row: Vec<f32> = (0..len)
                    .map(|_| match next() % 11 {
                        0 => f32::NEG_INFINITY,
                        v => (v as f32 - 5.0) * if case % 2 == 0 { 0.25 } else { 3.7 },
                    })
                    .collect();
                if case == 5 {
                    row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                    row[len / 2] = -1.5;
                }
                if case == 4 && len > 3 {
                    row[1] = -0.0;
                    row[2] = 0.0;
                }
                let never = TokenMask::new(len);
                let full = sampler.choose(&row, &ctx, &params, None, &never).unwrap();
                let summary = row_summary(&row);
                assert_eq!(
                    summary.greedy(),
                    Some((full.token, full.logprob)),
                    "len {len} case {case}"
                );
                let (_, lse) = log_normalizer(&row).unwrap();
                assert_eq!(lse_of_lanes(&summary.lanes).to_bits(), lse.to_bits());
            }
        }
        for bad in [f32::NAN, f32::INFINITY] {
            let mut row = vec![1.0f32; 20];
            row[13] = bad;
            assert!(row_summary(&row).fallback);
            assert!(row_summary(&row).greedy().is_none());
        }
        assert!(row_summary(&[f32::NEG_INFINITY; 9]).fallback);
        assert!(row_summary(&[]).fallback);
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
