//! Speculative decoding on the fake backend (G2): with every drafter, the event stream —
//! tokens, text deltas, logprobs, top logprobs, logit digests, finish reason and usage —
//! is identical to plain decoding, and the counters prove drafts were proposed, accepted
//! and rejected.

use crate::common::*;
use crate::harness::{Run, assert_spec_equals_plain, run_all};
use lockstep_engine::{
    Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams, SpecConfig, SpecStats,
    StopCause, TokenConstraint,
};
use spec::{Adversary, DrafterKind, DrafterSet, NgramConfig, Oracle, PolicyConfig};

/// [`assert_spec_equals_plain`] on one request, `cached_tokens` aside: requests with one
/// prompt are submitted together, and whether the second finds the first's prompt blocks
/// already published depends on when the engine thread sees it arrive, not on speculation.
fn assert_identical(plain: &Run, spec: &Run, what: &str) {
    assert_spec_equals_plain(
        &[plain.without_cached_tokens()],
        &[spec.without_cached_tokens()],
        what,
    );
}

fn spec_engine(drafters: DrafterSet, policy: PolicyConfig) -> Engine {
    engine(EngineConfig {
        spec: SpecConfig {
            policy,
            ..SpecConfig::auto(drafters)
        },
        ..config()
    })
    .0
}

fn plain(reqs: Vec<GenerateRequest>) -> Vec<Run> {
    let (e, _) = engine(config());
    let out = run_all(&e, reqs);
    e.shutdown();
    out
}

/// Requests whose outputs repeat (low temperature over a small vocabulary with a
/// repetition-free fake model still revisits n-grams) plus seeded sampling.
fn requests() -> Vec<GenerateRequest> {
    let mut v = crate::mixed_requests();
    v.push(request(prompt(9, 12), SamplingParams::greedy(), 60));
    v.push(request(prompt(10, 30), seeded(0.8, 5), 40));
    v
}

fn with_drafter(
    reqs: Vec<GenerateRequest>,
    plain: &[Run],
    make: impl Fn(Vec<u32>) -> Box<dyn spec::Drafter>,
) -> Vec<GenerateRequest> {
    reqs.into_iter()
        .zip(plain)
        .map(|(mut r, p)| {
            let mut expected = r.prompt.clone();
            expected.extend(p.ids());
            r.drafter = Some(make(expected));
            r.spec_policy = Some(PolicyConfig::always(6));
            r
        })
        .collect()
}

fn total(runs: &[Run]) -> SpecStats {
    let mut t = SpecStats::default();
    for r in runs {
        t.add(&r.spec());
    }
    t
}

#[test]
fn oracle_drafts_are_all_accepted_and_the_output_is_plain_decoding() {
    let reference = plain(requests());
    let (e, stats) = engine(config());
    let got = run_all(
        &e,
        with_drafter(requests(), &reference, |x| Box::new(Oracle::new(x))),
    );
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("oracle request {i}"));
    }
    let t = total(&got);
    assert!(t.cycles > 10 && t.drafted > 50, "{t:?}");
    assert_eq!(t.accepted, t.drafted, "the oracle is always right: {t:?}");
    assert_eq!((t.miss, t.partial), (0, 0), "{t:?}");
    // Fewer forwards than tokens: the verify blocks carried several tokens each.
    let tokens: usize = reference.iter().map(|r| r.tokens.len()).sum();
    let m = e.metrics();
    assert_eq!(m.spec.accepted, t.accepted, "engine aggregate");
    assert!(
        stats.forwards.load(std::sync::atomic::Ordering::SeqCst) < tokens as u64 / 2,
        "speculation saved forwards"
    );
    e.shutdown();
}

#[test]
fn adversary_drafts_are_all_rejected_and_the_output_is_still_plain_decoding() {
    let reference = plain(requests());
    let (e, _) = engine(config());
    let got = run_all(
        &e,
        with_drafter(requests(), &reference, |x| Box::new(Adversary::new(x))),
    );
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("adversary request {i}"));
    }
    let t = total(&got);
    assert!(t.cycles > 50 && t.drafted > 100, "{t:?}");
    assert_eq!(t.accepted, 0, "the adversary is always wrong: {t:?}");
    assert_eq!(t.miss, t.cycles);
    e.shutdown();
}

#[test]
fn ngram_and_fast_forward_drafting_under_the_adaptive_policy_equals_plain_decoding() {
    let reference = plain(requests());
    for (name, policy) in [
        ("adaptive", PolicyConfig::default()),
        ("always", PolicyConfig::always(5)),
    ] {
        let e = spec_engine(DrafterSet::free(3), policy);
        let got = run_all(&e, requests());
        for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
            assert_identical(p, s, &format!("{name} ngram request {i}"));
        }
        let t = total(&got);
        assert!(t.drafted > 0 && t.cycles > 0, "{name}: {t:?}");
        if name == "always" {
            assert!(t.accepted > 0 && t.accepted < t.drafted, "{name}: {t:?}");
        }
        e.shutdown();
    }
}

/// Oracle drafts that run past a stop: the output ends exactly where plain decoding ends.
#[test]
fn stops_inside_an_accepted_block_end_exactly_where_plain_decoding_does() {
    // Stop strings: the oracle replays the output of the same request without them.
    let mk = |stop: bool| {
        let mut r = request(prompt(21, 9), seeded(0.7, 11), 40);
        if stop {
            r.stop_strings = vec!["q1".into()];
        }
        r
    };
    let long = plain(vec![mk(false)]);
    let short = plain(vec![mk(true)]);
    let reason = short[0].finish.as_ref().map(|f| f.0);
    assert!(
        matches!(
            reason,
            Some(FinishReason::Stop(StopCause::StopString { .. }))
        ),
        "the stop string occurs: {reason:?}"
    );
    let (e, _) = engine(config());
    let got = run_all(
        &e,
        with_drafter(vec![mk(true)], &long, |x| Box::new(Oracle::new(x))),
    );
    assert_identical(&short[0], &got[0], "stop string");
    assert!(got[0].spec().accepted > 0);

    // EOS: find a seed whose plain output ends with EOS, replay the EOS-ignoring output.
    let mk = |seed: u64, ignore: bool| {
        let mut r = request(prompt(22, 7), seeded(1.0, seed), 60);
        r.ignore_eos = ignore;
        r
    };
    let seed = (0..200)
        .find(|&s| {
            plain(vec![mk(s, false)])[0]
                .finish
                .as_ref()
                .is_some_and(|f| {
                    f.0 == FinishReason::Stop(StopCause::Eos) && f.2.completion_tokens > 3
                })
        })
        .expect("a seed that ends with EOS");
    let long = plain(vec![mk(seed, true)]);
    let short = plain(vec![mk(seed, false)]);
    let got = run_all(
        &e,
        with_drafter(vec![mk(seed, false)], &long, |x| Box::new(Oracle::new(x))),
    );
    assert_identical(&short[0], &got[0], "EOS");
    assert!(got[0].spec().drafted > 0);

    // max_tokens: drafting stops at the limit, the usage is the limit.
    let got = run_all(
        &e,
        with_drafter(
            vec![request(prompt(23, 5), SamplingParams::greedy(), 13)],
            &plain(vec![request(prompt(23, 5), SamplingParams::greedy(), 40)]),
            |x| Box::new(Oracle::new(x)),
        ),
    );
    let p = plain(vec![request(prompt(23, 5), SamplingParams::greedy(), 13)]);
    assert_identical(&p[0], &got[0], "max_tokens");
    assert_eq!(got[0].tokens.len(), 13);
    e.shutdown();
}

/// A scripted grammar with forced runs: fast-forward drafts the forced tokens, the
/// verifier accepts them, and the output is plain decoding's.
#[test]
fn grammar_fast_forward_drafts_forced_tokens_and_matches_plain_decoding() {
    let script = || {
        let mut s: Vec<Vec<u32>> = Vec::new();
        for i in 0..6u32 {
            s.push(vec![1 + i, 10 + i, 20 + i]);
            s.push(vec![30]);
            s.push(vec![31]);
            s.push(vec![32 + i]);
        }
        s
    };
    let req = |t: f32| {
        let mut r = request(prompt(31, 10), seeded(t, 3), 64);
        r.constraint = Some(Box::new(Scripted::new(script())) as Box<dyn TokenConstraint>);
        r
    };
    let reference = plain(vec![req(0.0), req(0.9)]);
    assert!(
        reference.iter().all(|r| r
            .finish
            .as_ref()
            .is_some_and(|f| f.0 == FinishReason::Stop(StopCause::GrammarEnd))),
        "the grammar ends both"
    );
    let e = spec_engine(
        DrafterSet {
            fast_forward: true,
            ngram: None,
            draft_model: None,
            dspark: None,
            suffix: None,
            prompt_text: false,
        },
        PolicyConfig::default(),
    );
    let got = run_all(&e, vec![req(0.0), req(0.9)]);
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("fast-forward request {i}"));
        let t = s.spec();
        assert!(t.forced >= 15 && t.accepted == t.drafted, "{t:?}");
    }
    // Oracle and adversary under the grammar: drafts stay inside the mask.
    let (e2, _) = engine(config());
    let got = run_all(
        &e2,
        with_drafter(vec![req(0.0), req(0.9)], &reference, |x| {
            Box::new(Adversary::new(x))
        }),
    );
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("grammar adversary {i}"));
        let t = s.spec();
        assert!(t.drafted > 0 && t.accepted == 0, "{t:?}");
    }
    e.shutdown();
    e2.shutdown();
}

#[test]
fn a_small_step_budget_cuts_drafts_as_scheduler_skips_and_output_is_unchanged() {
    let reference = plain(requests());
    let (e, _) = engine(EngineConfig {
        step_token_budget: 6,
        ..config()
    });
    let got = run_all(
        &e,
        with_drafter(requests(), &reference, |x| Box::new(Oracle::new(x))),
    );
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("budget request {i}"));
    }
    let t = total(&got);
    assert!(t.sched_skips > 0 && t.accepted > 0, "{t:?}");
    e.shutdown();
}

#[test]
fn speculation_under_kv_pressure_and_preemption_is_unchanged() {
    let reference = plain(requests());
    let (e, _) = engine(EngineConfig {
        kv_tokens: 160,
        ..config()
    });
    let got = run_all(
        &e,
        with_drafter(requests(), &reference, |x| Box::new(Oracle::new(x))),
    );
    for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
        assert_identical(p, s, &format!("tiny pool request {i}"));
    }
    assert!(e.metrics().preemptions > 0);
    assert!(total(&got).accepted > 0);
    e.shutdown();
}

#[test]
fn an_ngram_drafter_proposes_the_prompts_repeats() {
    // A prompt that is one phrase repeated: greedy decoding of the fake model is not a
    // repeat, but the n-gram drafter must still have proposed from the prompt.
    let mut p = Vec::new();
    for _ in 0..6 {
        p.extend([5, 6, 7, 8, 9]);
    }
    let reqs = || vec![request(p.clone(), SamplingParams::greedy(), 20)];
    let reference = plain(reqs());
    let e = spec_engine(
        DrafterSet {
            fast_forward: false,
            ngram: Some(NgramConfig::default()),
            draft_model: None,
            dspark: None,
            suffix: None,
            prompt_text: false,
        },
        PolicyConfig::always(4),
    );
    let got = run_all(&e, reqs());
    assert_identical(&reference[0], &got[0], "repeat prompt");
    assert!(got[0].spec().drafted > 0);
    e.shutdown();
}

/// Requests for the cross-request test: `requests()` plus two under a scripted grammar
/// (greedy and seeded), with every seed offset by `reseed` (another seed makes earlier
/// outputs wrong after the first divergence).
fn suffix_round(reseed: u64) -> Vec<GenerateRequest> {
    let script = || {
        let mut s: Vec<Vec<u32>> = Vec::new();
        for i in 0..8u32 {
            s.push(vec![1 + i, 10 + i, 20 + i, 40 + i]);
            s.push(vec![30]);
            s.push(vec![32 + i, 50 + i]);
        }
        s
    };
    let mut v = requests();
    for t in [0.0, 0.9] {
        let mut r = request(prompt(31, 10), seeded(t, 3), 64);
        r.constraint = Some(Box::new(Scripted::new(script())) as Box<dyn TokenConstraint>);
        v.push(r);
    }
    for r in &mut v {
        if r.sampling.temperature > 0.0 {
            r.sampling.seed = r.sampling.seed.wrapping_add(reseed);
        }
    }
    v
}

/// The cross-request suffix drafter (G2): a second round of the same prompts drafts from
/// the first round's sequences; with the same seeds they are right, with other seeds wrong
/// after the first divergence. Every stream equals plain decoding, under a grammar too,
/// and the suffix counters show drafts proposed, accepted and rejected.
#[test]
fn cross_request_suffix_drafts_are_verified_and_the_output_is_plain_decoding() {
    for (name, policy) in [
        ("always", PolicyConfig::always(6)),
        ("adaptive", PolicyConfig::default()),
    ] {
        let e = spec_engine(
            DrafterSet::free_with_suffix(3, spec::SuffixConfig::default()),
            policy,
        );
        let mut all = Vec::new();
        for (round, reseed) in [(1, 0), (2, 0), (3, 1000)] {
            let reference = plain(suffix_round(reseed));
            let got = run_all(&e, suffix_round(reseed));
            for (i, (p, s)) in reference.iter().zip(&got).enumerate() {
                // This engine's prefix cache holds the earlier rounds: cached counts differ.
                let uncached = |r: &Run| {
                    let mut r = r.clone();
                    if let Some(f) = r.finish.as_mut() {
                        f.2.cached_tokens = 0;
                    }
                    r
                };
                assert_identical(
                    &uncached(p),
                    &uncached(s),
                    &format!("{name} round {round} request {i}"),
                );
            }
            if round == 2 && name == "always" {
                // Identical requests: the earlier sequences are the output, grammar or not.
                // (The adaptive policy's cost model depends on measured step times.)
                let n = got.len();
                for (i, r) in got[n - 2..].iter().enumerate() {
                    let t = r.spec();
                    assert!(
                        t.kind(DrafterKind::Suffix).accepted > 0,
                        "{name} grammar {i}: {t:?}"
                    );
                }
                let t = total(&got);
                assert!(
                    t.kind(DrafterKind::Suffix).accepted * 10
                        >= t.kind(DrafterKind::Suffix).drafted * 9,
                    "{name} round 2: {t:?}"
                );
            }
            all.extend(got);
        }
        let t = total(&all);
        assert!(
            t.kind(DrafterKind::Suffix).cycles > 0 && t.kind(DrafterKind::Suffix).accepted > 0,
            "{name}: {t:?}"
        );
        if name == "always" {
            assert!(
                t.kind(DrafterKind::Suffix).accepted < t.kind(DrafterKind::Suffix).drafted,
                "{name}: proposed, accepted and rejected: {t:?}"
            );
        }
        let m = e.metrics();
        assert_eq!(
            (
                m.spec.kind(DrafterKind::Suffix).drafted,
                m.spec.kind(DrafterKind::Suffix).accepted
            ),
            (
                t.kind(DrafterKind::Suffix).drafted,
                t.kind(DrafterKind::Suffix).accepted
            ),
            "{name}: engine aggregate"
        );
        assert!(m.spec_suffix_stored_tokens > 0, "{name}");
        e.shutdown();
    }
}
