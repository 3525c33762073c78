//! The rule samples the target distribution: Gumbel-max frequencies match softmax(l/T), and
//! truncations keep exactly the sets their definitions name, renormalised.

use crate::common::{Rng, chi_square, softmax};
use lockstep_sampling::{ChoiceContext, Sampler, SamplingParams, TokenMask, gumbel};

/// Above the 1 - 1e-6 quantile of chi-square for these degrees of freedom (fixed seeds make
/// the tests deterministic; the bound is generous, and the power checks show it can fail).
fn bound(dof: usize) -> f64 {
    3.0 * dof as f64 + 25.0
}

/// Counts of choices over `trials` consecutive positions (seed fixed).
fn frequencies(logits: &[f32], params: &SamplingParams, trials: u64) -> Vec<u64> {
    let mut sampler = Sampler::new();
    let never = TokenMask::new(logits.len());
    let mut counts = vec![0u64; logits.len()];
    for pos in 0..trials {
        let ctx = ChoiceContext {
            position: pos,
            ..ChoiceContext::default()
        };
        let c = sampler.choose(logits, &ctx, params, None, &never).unwrap();
        counts[c.token as usize] += 1;
    }
    counts
}

const LOGITS: [f32; 6] = [1.0, 2.5, 0.0, 2.0, -1.0, 1.7];

#[test]
fn gumbel_max_frequencies_match_softmax_at_several_temperatures() {
    let l64: Vec<f64> = LOGITS.iter().map(|&l| f64::from(l)).collect();
    for t in [0.3f32, 0.8, 1.0, 2.0] {
        let params = SamplingParams {
            temperature: t,
            seed: 1234,
            ..SamplingParams::default()
        };
        let counts = frequencies(&LOGITS, &params, 100_000);
        let target = softmax(&l64, f64::from(t));
        let chi = chi_square(&counts, &target);
        assert!(
            chi < bound(5),
            "T={t}: chi2 {chi} counts {counts:?} target {target:?}"
        );
        // Power: the same counts against a distribution 20% hotter or colder are rejected.
        for wrong_t in [f64::from(t) * 1.2, f64::from(t) / 1.2] {
            let wrong = chi_square(&counts, &softmax(&l64, wrong_t));
            assert!(
                wrong > 4.0 * bound(5),
                "T={t} vs {wrong_t}: chi2 only {wrong}"
            );
        }
    }
}

#[test]
fn frequencies_over_seeds_at_one_position_match_softmax() {
    let l64: Vec<f64> = LOGITS.iter().map(|&l| f64::from(l)).collect();
    let mut sampler = Sampler::new();
    let never = TokenMask::new(LOGITS.len());
    let mut counts = [0u64; 6];
    for seed in 0..60_000u64 {
        let params = SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        };
        let ctx = ChoiceContext {
            position: 77,
            ..ChoiceContext::default()
        };
        counts[sampler
            .choose(&LOGITS, &ctx, &params, None, &never)
            .unwrap()
            .token as usize] += 1;
    }
    let chi = chi_square(&counts, &softmax(&l64, 1.0));
    assert!(chi < bound(5), "chi2 {chi} counts {counts:?}");
}

#[test]
fn gumbel_noise_has_standard_gumbel_moments_and_quantiles() {
    let n = 1_000_000u32;
    let mut sum = 0.0;
    let mut sum2 = 0.0;
    let mut below_median = 0u32;
    let median = -(std::f64::consts::LN_2.ln()); // -ln(ln 2)
    for t in 0..n {
        let g = gumbel(99, u64::from(t) / 1000, t % 1000);
        sum += g;
        sum2 += g * g;
        below_median += u32::from(g < median);
    }
    let mean = sum / f64::from(n);
    let var = sum2 / f64::from(n) - mean * mean;
    let euler = 0.577_215_664_901_532_9;
    let pi2_6 = std::f64::consts::PI.powi(2) / 6.0;
    // Standard errors: sqrt(1.645 / 1e6) ~ 0.0013 for the mean, ~0.005 for the variance.
    assert!((mean - euler).abs() < 0.007, "mean {mean}");
    assert!((var - pi2_6).abs() < 0.03, "variance {var}");
    let frac = f64::from(below_median) / f64::from(n);
    assert!((frac - 0.5).abs() < 0.003, "median fraction {frac}");
}

/// Logits whose softmax at T = 1 is exactly `probs` (up to rounding).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn renormalised(probs: &[f64], keep: &[usize]) -> Vec<f64> {
    let z: f64 = keep.iter().map(|&i| probs[i]).sum();
    (0..probs.len())
        .map(|i| if keep.contains(&i) { probs[i] / z } else { 0.0 })
        .collect()
}

const PROBS: [f64; 7] = [0.04, 0.25, 0.4, 0.1, 0.15, 0.05, 0.01];

fn check_truncation(params: SamplingParams, keep: &[usize]) {
    let logits = logits_of(&PROBS);
    let counts = frequencies(&logits, &params, 60_000);
    for (i, &c) in counts.iter().enumerate() {
        assert_eq!(
            c > 0,
            keep.contains(&i),
            "token {i} count {c} (keep {keep:?})"
        );
    }
    let chi = chi_square(&counts, &renormalised(&PROBS, keep));
    assert!(chi < bound(keep.len() - 1), "chi2 {chi} counts {counts:?}");
    // Power: against the untruncated distribution the counts are rejected outright.
    assert!(chi_square(&counts, &PROBS) > 4.0 * bound(PROBS.len() - 1));
}

#[test]
fn top_k_keeps_the_k_best_tokens_renormalised() {
    let params = SamplingParams {
        top_k: 3,
        seed: 5,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1, 4]);
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
    // Sorted: 0.4, 0.25, 0.15, 0.1, ... cumulative 0.4, 0.65, 0.80: p = 0.7 keeps three.
    let params = SamplingParams {
        top_p: 0.7,
        seed: 6,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1, 4]);
    // p = 0.85 crosses at the fourth token (0.90).
    let params = SamplingParams {
        top_p: 0.85,
        seed: 7,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1, 4, 3]);
}

#[test]
fn min_p_keeps_tokens_at_least_min_p_times_the_best() {
    // 0.2 * 0.4 = 0.08: keeps 0.4, 0.25, 0.15, 0.1.
    let params = SamplingParams {
        min_p: 0.2,
        seed: 8,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1, 4, 3]);
}

#[test]
fn truncations_compose_top_k_then_top_p_and_min_p_on_what_is_left() {
    // top_k 4 leaves {0.4, 0.25, 0.15, 0.1} (mass 0.9); top_p 0.7 of that = 0.63:
    // cumulative 0.4, 0.65 reaches it -> {2, 1}; min_p 0.5 keeps >= 0.2 -> {2, 1} too.
    let params = SamplingParams {
        top_k: 4,
        top_p: 0.7,
        min_p: 0.5,
        seed: 9,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1]);
    // Without top-k, top_p 0.7 keeps three.
    let params = SamplingParams {
        top_p: 0.7,
        min_p: 0.3,
        seed: 10,
        ..SamplingParams::default()
    };
    check_truncation(params, &[2, 1, 4]);
}

#[test]
fn truncations_apply_at_temperature_to_softmax_of_logit_over_t() {
    // At T = 0.5 the probabilities square (renormalised): 0.16, 0.0625, 0.0225, 0.01 ...
    // top of mass 0.16 / 0.2571 = 0.62, so top_p 0.6 keeps one token only.
    let params = SamplingParams {
        temperature: 0.5,
        top_p: 0.6,
        seed: 11,
        ..SamplingParams::default()
    };
    let counts = frequencies(&logits_of(&PROBS), &params, 2_000);
    assert_eq!(counts[2], 2_000, "{counts:?}");
    // At T = 1 the same top_p keeps two.
    let params = SamplingParams {
        temperature: 1.0,
        ..params
    };
    let counts = frequencies(&logits_of(&PROBS), &params, 2_000);
    assert!(counts[2] > 0 && counts[1] > 0 && counts[2] + counts[1] == 2_000);
}

#[test]
fn large_vocabulary_frequencies_match_softmax_on_the_dense_path() {
    // 5,000 tokens, 16 of them in contention; the rest far below but nonzero in total.
    let mut rng = Rng(3);
    let mut logits: Vec<f32> = (0..5_000).map(|_| (rng.normal() - 8.0) as f32).collect();
    let hot: Vec<usize> = (0..16).map(|k| 300 * k + 17).collect();
    for (k, &i) in hot.iter().enumerate() {
        logits[i] = (k % 4) as f32 * 0.5;
    }
    let params = SamplingParams {
        seed: 21,
        ..SamplingParams::default()
    };
    let counts = frequencies(&logits, &params, 40_000);
    let l64: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
    let p = softmax(&l64, 1.0);
    // Cells: the 16 hot tokens and "everything else".
    let mut cells_c: Vec<u64> = hot.iter().map(|&i| counts[i]).collect();
    let mut cells_p: Vec<f64> = hot.iter().map(|&i| p[i]).collect();
    cells_c.push(counts.iter().sum::<u64>() - cells_c.iter().sum::<u64>());
    cells_p.push(1.0 - cells_p.iter().sum::<f64>());
    let chi = chi_square(&cells_c, &cells_p);
    assert!(chi < bound(16), "chi2 {chi}");
}
