//! Choosing from device row summaries ([`FakeBackend::summarizing`], the path a GPU backend
//! takes): every request's event stream equals the one from full logit rows, and plain
//! greedy rows are never copied out.

use crate::common::*;
use lockstep_engine::{
    Engine, EngineConfig, Event, FakeBackend, FakeStats, GenerateRequest, SamplingParams,
    SpecConfig,
};
use spec::{DrafterSet, PolicyConfig};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A plain greedy request: no logprobs, no digests (the summary alone decides).
fn greedy(seed: u32, len: usize, n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt(seed, len), SamplingParams::greedy());
    r.max_tokens = Some(n);
    r.ignore_eos = true;
    r
}

/// A script where every third step allows only a few tokens (often not the argmax).
fn script(steps: usize, salt: u32) -> Scripted {
    let all: Vec<u32> = (1..N_VOCAB as u32).collect();
    Scripted::new(
        (0..steps as u32)
            .map(|i| {
                if i % 3 == 2 {
                    vec![1 + (i * 7 + salt) % 63, 1 + (i * 13 + salt) % 63]
                } else {
                    all.clone()
                }
            })
            .collect(),
    )
}

fn requests() -> Vec<GenerateRequest> {
    let mut v = vec![
        greedy(21, 9, 40),
        greedy(22, 50, 33),
        // Logprobs and digests asked: the rows are fetched.
        request(prompt(23, 12), SamplingParams::greedy(), 25),
        request(prompt(24, 30), seeded(0.8, 5), 30),
        {
            let mut r = greedy(25, 17, 30);
            r.sampling.repetition_penalty = 1.3;
            r
        },
        {
            let mut r = greedy(26, 6, 28);
            r.logprobs = Some(2);
            r
        },
    ];
    for (i, salt) in [3u32, 40].into_iter().enumerate() {
        let mut r = greedy(27 + i as u32, 11, 40);
        r.constraint = Some(Box::new(script(24, salt)));
        v.push(r);
    }
    v
}

/// Every event of each request, in order (token events with logprobs, top logprobs,
/// digests and text; the finish with reason, text and usage counts).
fn run(e: &Engine, reqs: Vec<GenerateRequest>) -> Vec<Vec<String>> {
    let hs: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
    hs.into_iter()
        .map(|h| {
            h.into_iter()
                .map(|ev| match ev {
                    Event::Finished {
                        reason,
                        text,
                        usage,
                        ..
                    } => format!(
                        "finished {reason:?} {text:?} {} {}",
                        usage.prompt_tokens, usage.completion_tokens
                    ),
                    Event::Token { .. } => format!("{ev:?}"),
                    other => format!("{other:?}"),
                })
                .collect()
        })
        .collect()
}

fn start(fake: FakeBackend, spec: bool) -> (Engine, Arc<FakeStats>) {
    let cfg = if spec {
        EngineConfig {
            spec: SpecConfig {
                policy: PolicyConfig::always(4),
                ..SpecConfig::auto(DrafterSet::free(3))
            },
            ..config()
        }
    } else {
        config()
    };
    engine_with(fake, cfg)
}

#[test]
fn choices_from_summaries_equal_choices_from_full_rows() {
    for spec in [false, true] {
        let (e, full_stats) = start(FakeBackend::new(N_VOCAB, 1024, BLOCK), spec);
        let full = run(&e, requests());
        e.shutdown();
        let (e, stats) = start(FakeBackend::new(N_VOCAB, 1024, BLOCK).summarizing(), spec);
        let got = run(&e, requests());
        let m = e.metrics();
        e.shutdown();
        for (i, (a, b)) in full.iter().zip(&got).enumerate() {
            assert!(a.iter().any(|ev| ev.starts_with("Token")), "request {i}");
            assert!(
                a.last().is_some_and(|ev| ev.starts_with("finished")),
                "{a:?}"
            );
            assert_eq!(a, b, "spec {spec}, request {i}");
        }
        assert_eq!(full_stats.rows_summarized.load(Ordering::SeqCst), 0);
        let summarized = stats.rows_summarized.load(Ordering::SeqCst);
        let fetched = stats.rows_fetched.load(Ordering::SeqCst);
        // Rows that need the full logits were fetched, the plain greedy ones were not (a
        // step summarizes only while its plain rows are at least half of its rows).
        assert!(
            summarized > 100 && fetched > 50 && fetched < summarized,
            "{fetched} of {summarized}"
        );
        if spec {
            assert!(m.spec.drafted > 0 && m.spec.accepted > 0, "{:?}", m.spec);
        }
    }
}

#[test]
fn plain_greedy_decoding_copies_no_logit_row() {
    let (e, stats) = start(FakeBackend::new(N_VOCAB, 1024, BLOCK).summarizing(), false);
    let got = run(&e, vec![greedy(31, 5, 20), greedy(32, 40, 20)]);
    e.shutdown();
    let expected: Vec<Vec<u32>> = [(31, 5), (32, 40)]
        .iter()
        .map(|&(s, l)| reference_decode(&prompt(s, l), &SamplingParams::greedy(), 20, None))
        .collect();
    for (g, want) in got.iter().zip(&expected) {
        let tokens: Vec<String> = want.iter().map(|t| format!("token: {t},")).collect();
        let toks = g.iter().filter(|ev| ev.starts_with("Token")).count();
        assert_eq!(toks, want.len());
        for (ev, t) in g.iter().zip(&tokens) {
            assert!(ev.contains(t.as_str()), "{ev} lacks {t}");
        }
    }
    assert_eq!(stats.rows_summarized.load(Ordering::SeqCst), 40);
    assert_eq!(stats.rows_fetched.load(Ordering::SeqCst), 0);
}

/// A backend that summarizes only steps of two or more plain greedy rows (CUDA's
/// default): one greedy sequence reads its rows back, two side by side are summarized, and
/// one greedy beside one sampled sequence read every row back (one row to summarize does
/// not reach two); the tokens are those of full rows in every case.
#[test]
fn summaries_only_for_steps_of_enough_plain_greedy_rows() {
    let want = |s: u32, l: usize, n: usize| {
        reference_decode(&prompt(s, l), &SamplingParams::greedy(), n, None)
    };
    let tokens = |evs: &[String]| evs.iter().filter(|ev| ev.starts_with("Token")).count();
    // One sequence: every step has one logit row.
    let (e, stats) = start(
        FakeBackend::new(N_VOCAB, 1024, BLOCK).summarizing_from(2),
        false,
    );
    let got = run(&e, vec![greedy(41, 7, 20)]);
    e.shutdown();
    assert_eq!(tokens(&got[0]), want(41, 7, 20).len());
    assert_eq!(stats.rows_summarized.load(Ordering::SeqCst), 0);
    // Two greedy sequences decoding together: their shared steps are summarized.
    let (e, stats) = start(
        FakeBackend::new(N_VOCAB, 1024, BLOCK).summarizing_from(2),
        false,
    );
    let got = run(&e, vec![greedy(42, 7, 20), greedy(43, 9, 20)]);
    e.shutdown();
    for (g, (s, l)) in got.iter().zip([(42, 7), (43, 9)]) {
        let w = want(s, l, 20);
        assert_eq!(tokens(g), w.len());
        for (ev, t) in g.iter().zip(&w) {
            assert!(ev.contains(&format!("token: {t},")), "{ev} lacks {t}");
        }
    }
    let summarized = stats.rows_summarized.load(Ordering::SeqCst);
    assert!(summarized >= 30, "{summarized}");
    assert_eq!(stats.rows_fetched.load(Ordering::SeqCst), 0);
    // A sampled sequence beside a greedy one: one plain row per step, none summarized.
    let reqs = || {
        vec![
            greedy(44, 7, 20),
            request(prompt(45, 9), seeded(0.8, 5), 20),
        ]
    };
    let (e, _) = start(FakeBackend::new(N_VOCAB, 1024, BLOCK), false);
    let full = run(&e, reqs());
    e.shutdown();
    let (e, stats) = start(
        FakeBackend::new(N_VOCAB, 1024, BLOCK).summarizing_from(2),
        false,
    );
    let got = run(&e, reqs());
    e.shutdown();
    assert_eq!(full, got);
    assert_eq!(stats.rows_summarized.load(Ordering::SeqCst), 0);
}
