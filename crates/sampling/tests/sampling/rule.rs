//! The choice function obeys its definition: equal to a naive reference, a pure function of
//! its inputs, ties to the lowest id, penalties and bias as defined, errors instead of
//! choosing from nothing.

use crate::common::{Rng, realistic_logits, reference_adjusted, reference_choose};
use lockstep_sampling::{
    ChoiceContext, SampleError, Sampler, SamplingParams, TokenMask, choose, top_logprobs,
};

fn ctx(position: u64) -> ChoiceContext<'static> {
    ChoiceContext {
        position,
        ..ChoiceContext::default()
    }
}

fn random_params(rng: &mut Rng, vocab: usize) -> SamplingParams {
    let temps = [0.0f32, 0.05, 0.3, 0.7, 1.0, 1.5, 4.0, 60.0];
    let mut p = SamplingParams {
        temperature: temps[rng.below(temps.len() as u64) as usize],
        seed: rng.next_u64(),
        ..SamplingParams::default()
    };
    match rng.below(6) {
        0 => p.top_k = 1 + rng.below(40) as usize,
        1 => p.top_p = 0.05 + 0.9 * rng.unit() as f32,
        2 => p.min_p = 0.5 * rng.unit() as f32,
        3 => {
            p.top_k = 1 + rng.below(200) as usize;
            p.top_p = 0.3 + 0.7 * rng.unit() as f32;
            p.min_p = 0.1 * rng.unit() as f32;
        }
        _ => {}
    }
    if rng.below(2) == 0 {
        p.presence_penalty = (rng.unit() * 2.0 - 0.5) as f32;
        p.frequency_penalty = (rng.unit() * 2.0 - 0.5) as f32;
        p.repetition_penalty = (0.5 + rng.unit() * 1.5) as f32;
        p.repeat_last_n = rng.below(100) as usize;
    }
    for _ in 0..rng.below(4) {
        let bias = match rng.below(3) {
            0 => f32::NEG_INFINITY,
            1 => 100.0,
            _ => (rng.unit() * 10.0 - 5.0) as f32,
        };
        p.logit_bias.push((rng.below(vocab as u64) as u32, bias));
    }
    p
}

fn random_mask(rng: &mut Rng, vocab: usize, density: f64) -> TokenMask {
    let mut m = TokenMask::new(vocab);
    for t in 0..vocab as u32 {
        if rng.unit() < density {
            m.set(t, true).unwrap();
        }
    }
    m
}

#[test]
fn choose_equals_the_naive_reference_over_random_rows() {
    let mut rng = Rng(2024);
    let mut sampler = Sampler::new();
    let mut checked = 0;
    for case in 0..3_000 {
        let vocab = [1usize, 5, 63, 64, 65, 200, 1_000, 4_099][case % 8];
        let mut logits = realistic_logits(vocab, &mut rng);
        if case % 5 == 0 {
            // Heavy ties: logits on a coarse grid.
            for l in &mut logits {
                *l = (*l / 2.0).round();
            }
        }
        if case % 7 == 0 {
            logits[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
        }
        let params = random_params(&mut rng, vocab);
        let prompt: Vec<u32> = (0..rng.below(50))
            .map(|_| rng.below(vocab as u64) as u32)
            .collect();
        let generated: Vec<u32> = (0..rng.below(80))
            .map(|_| rng.below(vocab as u64) as u32)
            .collect();
        let allowed = match case % 3 {
            0 => None,
            1 => Some(random_mask(&mut rng, vocab, 0.5)),
            _ => Some(random_mask(&mut rng, vocab, 0.02)),
        };
        let never = random_mask(&mut rng, vocab, 0.05);
        let c = ChoiceContext {
            prompt_tokens: &prompt,
            generated_tokens: &generated,
            position: rng.next_u64() >> 20,
        };
        let got = sampler.choose(&logits, &c, &params, allowed.as_ref(), &never);
        let want = reference_choose(&logits, &c, &params, allowed.as_ref(), &never);
        match (got, want) {
            (Ok(choice), Some(t)) => {
                assert_eq!(choice.token, t, "case {case}: {params:?}");
                checked += 1;
            }
            (Err(SampleError::EmptyAllowedSet), None) => {}
            (got, want) => panic!("case {case}: got {got:?}, reference {want:?}"),
        }
    }
    assert!(checked > 2_000, "only {checked} rows had a choice");
}

#[test]
fn rows_with_hundreds_of_penalised_tokens_equal_the_reference() {
    // Many adjusted tokens take the patched path (a copy of the logits), few the sparse one.
    let mut rng = Rng(31);
    let mut sampler = Sampler::new();
    for case in 0..600u64 {
        let vocab = 1_000 + (case % 3) as usize * 37;
        let logits = realistic_logits(vocab, &mut rng);
        let generated: Vec<u32> = (0..[3u64, 60, 300][(case % 3) as usize])
            .map(|_| rng.below(vocab as u64 / 4) as u32)
            .collect();
        let mut params = random_params(&mut rng, vocab);
        params.presence_penalty = 0.7;
        params.frequency_penalty = 0.2;
        params.repetition_penalty = 1.3;
        params.repeat_last_n = 200;
        let allowed = (case % 2 == 0).then(|| random_mask(&mut rng, vocab, 0.6));
        let never = random_mask(&mut rng, vocab, 0.01);
        let c = ChoiceContext {
            prompt_tokens: &[1, 2, 3],
            generated_tokens: &generated,
            position: case,
        };
        let got = sampler
            .choose(&logits, &c, &params, allowed.as_ref(), &never)
            .map(|c| c.token);
        let want = reference_choose(&logits, &c, &params, allowed.as_ref(), &never);
        assert_eq!(got.ok(), want, "case {case}");
        let adj = sampler.adjusted_logits(&logits, &c, &params).unwrap();
        assert_eq!(adj, reference_adjusted(&logits, &c, &params), "case {case}");
    }
}

#[test]
fn pruned_race_equals_the_exhaustive_race_on_near_ties() {
    // Few tokens within a fraction of a nat: every pruning bound is exercised at its edge.
    let mut rng = Rng(99);
    let mut sampler = Sampler::new();
    for case in 0..40_000u64 {
        let vocab = 2 + (case % 7) as usize;
        let logits: Vec<f32> = (0..vocab).map(|_| (rng.unit() * 0.6) as f32).collect();
        let never = TokenMask::new(vocab);
        let params = SamplingParams {
            temperature: [0.5f32, 1.0, 2.0][(case % 3) as usize],
            seed: case / 100,
            ..SamplingParams::default()
        };
        let c = ctx(case);
        let got = sampler
            .choose(&logits, &c, &params, None, &never)
            .unwrap()
            .token;
        assert_eq!(
            Some(got),
            reference_choose(&logits, &c, &params, None, &never),
            "case {case}"
        );
    }
}

#[test]
fn choose_equals_the_reference_at_full_qwen_vocabulary() {
    let vocab = 151_936;
    let mut rng = Rng(7);
    let never = {
        let mut m = TokenMask::new(vocab);
        for t in 151_665..vocab as u32 {
            m.set(t, true).unwrap();
        }
        m
    };
    let mut sampler = Sampler::new();
    for case in 0..12 {
        let logits = realistic_logits(vocab, &mut rng);
        let params = SamplingParams {
            temperature: [0.8f32, 1.0, 0.2, 3.0][case % 4],
            top_p: if case % 3 == 2 { 0.9 } else { 1.0 },
            seed: case as u64,
            ..SamplingParams::default()
        };
        let c = ctx(1_000 + case as u64);
        let got = sampler.choose(&logits, &c, &params, None, &never).unwrap();
        assert_eq!(
            Some(got.token),
            reference_choose(&logits, &c, &params, None, &never)
        );
    }
}

#[test]
fn same_inputs_give_the_same_choice_with_fresh_or_reused_scratch() {
    let mut rng = Rng(11);
    let mut reused = Sampler::new();
    for case in 0..500 {
        let vocab = 300;
        let logits = realistic_logits(vocab, &mut rng);
        let params = random_params(&mut rng, vocab);
        let generated: Vec<u32> = (0..rng.below(30)).map(|_| rng.below(300) as u32).collect();
        let c = ChoiceContext {
            prompt_tokens: &[],
            generated_tokens: &generated,
            position: case,
        };
        let never = TokenMask::new(vocab);
        let a = reused.choose(&logits, &c, &params, None, &never);
        let b = choose(&logits, &c, &params, None, &never);
        assert_eq!(a, b, "case {case}");
    }
}

#[test]
fn position_and_seed_each_change_choices_across_many_trials() {
    let logits = [1.0f32, 1.2, 0.8, 1.1, 0.9, 1.0, 0.7, 1.05];
    let never = TokenMask::new(logits.len());
    let mut s = Sampler::new();
    let pick = |s: &mut Sampler, seed: u64, pos: u64| {
        let p = SamplingParams {
            seed,
            ..SamplingParams::default()
        };
        s.choose(&logits, &ctx(pos), &p, None, &never)
            .unwrap()
            .token
    };
    let trials = 2_000u64;
    let mut seed_diff = 0;
    let mut pos_diff = 0;
    for pos in 0..trials {
        let a = pick(&mut s, 1, pos);
        assert_eq!(a, pick(&mut s, 1, pos));
        seed_diff += u64::from(a != pick(&mut s, 2, pos));
        pos_diff += u64::from(a != pick(&mut s, 1, pos + 1_000_000));
    }
    // Nearly uniform over 8 tokens: independent draws differ with probability ~0.87.
    for d in [seed_diff, pos_diff] {
        assert!(
            d > trials * 8 / 10 && d < trials * 95 / 100,
            "{d} of {trials}"
        );
    }
}

#[test]
fn temperature_zero_ties_pick_the_lowest_id() {
    let mut logits = vec![0.0f32; 200];
    logits[70] = 5.0;
    logits[3] = 5.0;
    logits[150] = 5.0;
    let never = TokenMask::new(200);
    let p = SamplingParams::greedy();
    assert_eq!(choose(&logits, &ctx(0), &p, None, &never).unwrap().token, 3);
    // Masking 3 leaves 70 (across a word boundary).
    let mut allowed = TokenMask::allow_all(200);
    allowed.set(3, false).unwrap();
    assert_eq!(
        choose(&logits, &ctx(0), &p, Some(&allowed), &never)
            .unwrap()
            .token,
        70
    );
    // A biased token that ties a dense one: still the lower id wins.
    let p = SamplingParams {
        logit_bias: vec![(150, 0.0), (199, 5.0)],
        ..SamplingParams::greedy()
    };
    logits[199] = 0.0;
    assert_eq!(
        choose(&logits, &ctx(0), &p, Some(&allowed), &never)
            .unwrap()
            .token,
        70
    );
    // All-equal row: token 0.
    let flat = vec![1.5f32; 1_000];
    let never = TokenMask::new(1_000);
    let p = SamplingParams::greedy();
    assert_eq!(choose(&flat, &ctx(9), &p, None, &never).unwrap().token, 0);
}

#[test]
fn temperature_zero_ignores_truncation_and_noise() {
    let logits = [0.0f32, 3.0, 2.9, 1.0];
    let never = TokenMask::new(4);
    for seed in 0..50 {
        let p = SamplingParams {
            temperature: 0.0,
            top_k: 2,
            top_p: 0.1,
            min_p: 0.9,
            seed,
            ..SamplingParams::default()
        };
        assert_eq!(
            choose(&logits, &ctx(seed), &p, None, &never).unwrap().token,
            1
        );
    }
}

#[test]
fn an_empty_allowed_set_is_an_error_never_an_argmax() {
    let logits = [1.0f32, 2.0, 3.0];
    let none = TokenMask::new(3);
    let all = TokenMask::allow_all(3);
    for t in [0.0f32, 1.0] {
        let p = SamplingParams {
            temperature: t,
            ..SamplingParams::default()
        };
        let e = Err(SampleError::EmptyAllowedSet);
        assert_eq!(choose(&logits, &ctx(0), &p, Some(&none), &none), e);
        assert_eq!(choose(&logits, &ctx(0), &p, None, &all), e);
        let only_1 = TokenMask::from_tokens(3, &[1]).unwrap();
        assert_eq!(choose(&logits, &ctx(0), &p, Some(&only_1), &only_1), e);
        let ban_all = SamplingParams {
            logit_bias: vec![
                (0, f32::NEG_INFINITY),
                (1, f32::NEG_INFINITY),
                (2, f32::NEG_INFINITY),
            ],
            ..p.clone()
        };
        assert_eq!(choose(&logits, &ctx(0), &ban_all, None, &none), e);
        let neg = [f32::NEG_INFINITY; 3];
        assert_eq!(choose(&neg, &ctx(0), &p, None, &none), e);
        assert_eq!(choose(&[], &ctx(0), &p, None, &none), e);
        // A token whose logit is -inf is not allowed even when the mask allows only it.
        let row = [f32::NEG_INFINITY, 0.0, 1.0];
        let only_0 = TokenMask::from_tokens(3, &[0]).unwrap();
        assert_eq!(choose(&row, &ctx(0), &p, Some(&only_0), &none), e);
    }
}

#[test]
fn never_sample_and_short_masks_exclude_tokens() {
    let logits = [0.0f32, 0.0, 9.0, 8.0, 7.0];
    let never = TokenMask::from_tokens(5, &[2]).unwrap();
    let p = SamplingParams::greedy();
    assert_eq!(choose(&logits, &ctx(0), &p, None, &never).unwrap().token, 3);
    // An allowed mask shorter than the vocabulary allows nothing beyond its length.
    let short = TokenMask::allow_all(2);
    let empty = TokenMask::new(0);
    assert_eq!(
        choose(&logits, &ctx(0), &p, Some(&short), &empty)
            .unwrap()
            .token,
        0
    );
    // At T > 0, never-sampled tokens are never drawn even when dominant.
    let p = SamplingParams::default();
    for pos in 0..500 {
        assert_ne!(
            choose(&logits, &ctx(pos), &p, None, &never).unwrap().token,
            2
        );
    }
}

fn adjusted(logits: &[f32], prompt: &[u32], generated: &[u32], p: &SamplingParams) -> Vec<f32> {
    let c = ChoiceContext {
        prompt_tokens: prompt,
        generated_tokens: generated,
        position: 0,
    };
    let got = Sampler::new().adjusted_logits(logits, &c, p).unwrap();
    assert_eq!(got, reference_adjusted(logits, &c, p));
    got
}

#[test]
fn presence_and_frequency_penalties_count_generated_tokens_only() {
    let logits = [1.0f32, 1.0, 1.0, 1.0];
    let p = SamplingParams {
        presence_penalty: 0.25,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    // Token 2 generated twice: 1 - (2 * 0.5 + 0.25); token 3 once: 1 - (0.5 + 0.25);
    // token 0 is only in the prompt: untouched.
    assert_eq!(
        adjusted(&logits, &[0, 0, 0], &[2, 2, 3], &p),
        vec![1.0, 1.0, -0.25, 0.25]
    );
    // Negative penalties encourage repetition.
    let p = SamplingParams {
        presence_penalty: -1.0,
        ..SamplingParams::default()
    };
    assert_eq!(adjusted(&logits, &[], &[1], &p), vec![1.0, 2.0, 1.0, 1.0]);
}

#[test]
fn repetition_penalty_divides_positive_multiplies_negative_within_the_window() {
    let logits = [2.0f32, -1.0, 0.5, 3.0];
    let rep = |n: usize| SamplingParams {
        repetition_penalty: 2.0,
        repeat_last_n: n,
        ..SamplingParams::default()
    };
    // Window 64 covers prompt [0, 1] and generated [1, 1]: token 0 halved, token 1 doubled
    // once (not once per occurrence).
    assert_eq!(
        adjusted(&logits, &[0, 1], &[1, 1], &rep(64)),
        vec![1.0, -2.0, 0.5, 3.0]
    );
    // Window 2 = the last two tokens [1, 1]: token 0 is outside.
    assert_eq!(
        adjusted(&logits, &[0, 1], &[1, 1], &rep(2)),
        vec![2.0, -2.0, 0.5, 3.0]
    );
    // Window 3 = [1 (prompt), 1, 1]; window 4 reaches token 3 in the prompt.
    assert_eq!(
        adjusted(&logits, &[0, 1], &[1, 1], &rep(3)),
        vec![2.0, -2.0, 0.5, 3.0]
    );
    assert_eq!(
        adjusted(&logits, &[0, 3, 1], &[1, 1], &rep(4)),
        vec![2.0, -2.0, 0.5, 1.5]
    );
    // Window 0 turns it off.
    assert_eq!(
        adjusted(&logits, &[0, 1], &[1, 1], &rep(0)),
        logits.to_vec()
    );
    // A penalty below 1 rewards repetition; zero logits stay zero.
    let p = SamplingParams {
        repetition_penalty: 0.5,
        ..SamplingParams::default()
    };
    assert_eq!(adjusted(&[0.0, 4.0], &[0, 1], &[], &p), vec![0.0, 8.0]);
}

#[test]
fn penalties_apply_in_order_repetition_then_frequency_presence_then_bias() {
    let logits = [4.0f32, 0.0];
    let p = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 1.0,
        presence_penalty: 0.5,
        logit_bias: vec![(0, 0.25), (0, 0.25)],
        ..SamplingParams::default()
    };
    // 4 / 2 = 2; 2 - (1 * 1 + 0.5) = 0.5; + (0.25 + 0.25) = 1.0.
    assert_eq!(adjusted(&logits, &[], &[0], &p), vec![1.0, 0.0]);
}

#[test]
fn logit_bias_minus_inf_bans_and_plus_100_forces() {
    let logits = [5.0f32, 1.0, 0.0, -3.0];
    let never = TokenMask::new(4);
    let ban = SamplingParams {
        logit_bias: vec![(0, f32::NEG_INFINITY)],
        ..SamplingParams::default()
    };
    let force = SamplingParams {
        logit_bias: vec![(3, 100.0)],
        ..SamplingParams::default()
    };
    for pos in 0..2_000 {
        assert_ne!(
            choose(&logits, &ctx(pos), &ban, None, &never)
                .unwrap()
                .token,
            0
        );
        let c = choose(&logits, &ctx(pos), &force, None, &never).unwrap();
        assert_eq!(c.token, 3);
        // The reported logprob is the raw model's, not the biased one.
        let raw = f64::from(-3.0f32 - 5.0)
            - (logits
                .iter()
                .map(|&l| (f64::from(l) - 5.0).exp())
                .sum::<f64>())
            .ln();
        assert!((f64::from(c.logprob) - raw).abs() < 1e-5);
    }
    for (p, want) in [(ban, 1), (force, 3)] {
        let g = SamplingParams {
            temperature: 0.0,
            ..p
        };
        assert_eq!(
            choose(&logits, &ctx(0), &g, None, &never).unwrap().token,
            want
        );
    }
    // A bias never unmasks a token the grammar forbids.
    let allowed = TokenMask::from_tokens(4, &[1, 2]).unwrap();
    let force_0 = SamplingParams {
        logit_bias: vec![(0, 100.0)],
        ..SamplingParams::default()
    };
    for pos in 0..200 {
        let t = choose(&logits, &ctx(pos), &force_0, Some(&allowed), &never)
            .unwrap()
            .token;
        assert!(t == 1 || t == 2);
    }
}

#[test]
fn masking_tokens_that_did_not_win_never_changes_the_winner() {
    // The coupling property drafters rely on: the noise of a token does not depend on which
    // other tokens are in the race.
    let mut rng = Rng(5);
    let vocab = 500;
    let never = TokenMask::new(vocab);
    let mut s = Sampler::new();
    for pos in 0..400 {
        let logits = realistic_logits(vocab, &mut rng);
        let p = SamplingParams {
            temperature: 1.3,
            seed: 77,
            ..SamplingParams::default()
        };
        let full = s
            .choose(&logits, &ctx(pos), &p, None, &never)
            .unwrap()
            .token;
        let mut sub = random_mask(&mut rng, vocab, 0.3);
        sub.set(full, true).unwrap();
        assert_eq!(
            s.choose(&logits, &ctx(pos), &p, Some(&sub), &never)
                .unwrap()
                .token,
            full
        );
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let never = TokenMask::new(3);
    let logits = [0.0f32, 1.0, 2.0];
    let p = SamplingParams::default();
    let bias_oob = SamplingParams {
        logit_bias: vec![(3, 1.0)],
        ..p.clone()
    };
    assert_eq!(
        choose(&logits, &ctx(0), &bias_oob, None, &never),
        Err(SampleError::TokenOutOfRange { token: 3, vocab: 3 })
    );
    let pen = SamplingParams {
        frequency_penalty: 1.0,
        ..p.clone()
    };
    let c = ChoiceContext {
        prompt_tokens: &[],
        generated_tokens: &[9],
        position: 0,
    };
    assert_eq!(
        choose(&logits, &c, &pen, None, &never),
        Err(SampleError::TokenOutOfRange { token: 9, vocab: 3 })
    );
    // Without penalties the prefix is not read, so it cannot be out of range.
    assert!(choose(&logits, &c, &p, None, &never).is_ok());
    let nan = [0.0f32, f32::NAN, 1.0];
    assert!(matches!(
        choose(&nan, &ctx(0), &p, None, &never),
        Err(SampleError::NonFiniteLogit { token: 1, .. })
    ));
    let inf = [0.0f32, 1.0, f32::INFINITY];
    assert!(matches!(
        choose(&inf, &ctx(0), &p, None, &never),
        Err(SampleError::NonFiniteLogit { token: 2, .. })
    ));
    let bad = SamplingParams {
        temperature: -1.0,
        ..p.clone()
    };
    assert!(matches!(
        choose(&logits, &ctx(0), &bad, None, &never),
        Err(SampleError::InvalidParams(_))
    ));
    let overflow = SamplingParams {
        logit_bias: vec![(1, 3.0e38)],
        ..p
    };
    let big = [0.0f32, 3.0e38, 0.0];
    assert!(matches!(
        choose(&big, &ctx(0), &overflow, None, &never),
        Err(SampleError::AdjustedLogitOverflow { token: 1, .. })
    ));
    // The sampler is still clean after an error.
    let mut s = Sampler::new();
    let _ = s.choose(&logits, &c, &pen, None, &never);
    let ok = s
        .choose(&logits, &ctx(0), &SamplingParams::greedy(), None, &never)
        .unwrap();
    assert_eq!(ok.token, 2);
}

#[test]
fn logprob_is_the_raw_log_softmax_and_top_logprobs_are_best_first() {
    let mut rng = Rng(1);
    let logits = realistic_logits(3_001, &mut rng);
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .map(|&l| (f64::from(l - m)).exp())
        .sum::<f64>()
        .ln();
    let reference = |t: usize| f64::from(logits[t]) - f64::from(m) - lse;
    let never = TokenMask::new(logits.len());
    let p = SamplingParams {
        temperature: 0.7,
        ..SamplingParams::default()
    };
    for pos in 0..50 {
        let c = choose(&logits, &ctx(pos), &p, None, &never).unwrap();
        assert!((f64::from(c.logprob) - reference(c.token as usize)).abs() < 1e-5);
        assert!(c.top.is_none());
    }
    let top = top_logprobs(&logits, 5).unwrap();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    assert_eq!(top.len(), 5);
    for (k, tl) in top.iter().enumerate() {
        assert_eq!(tl.token as usize, order[k]);
        assert!((f64::from(tl.logprob) - reference(order[k])).abs() < 1e-5);
    }
    // Ties list the lower id first; -inf tokens are never listed.
    let tied = [1.0f32, 2.0, 2.0, f32::NEG_INFINITY];
    let t = top_logprobs(&tied, 10).unwrap();
    assert_eq!(t.iter().map(|x| x.token).collect::<Vec<_>>(), vec![1, 2, 0]);
    assert!((t[0].logprob - t[1].logprob).abs() == 0.0);
    assert!(top_logprobs(&[0.0, f32::NAN], 1).is_err());
    assert!(top_logprobs(&tied, 0).unwrap().is_empty());
}
