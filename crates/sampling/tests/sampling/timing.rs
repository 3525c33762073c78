//! Per-call cost of `choose` at the Qwen vocabulary (151,936 logits). Printed, not asserted:
//! run with `cargo test -p lockstep-sampling --test sampling timing -- --nocapture`.

use crate::common::{Rng, realistic_logits};
use lockstep_sampling::{ChoiceContext, Sampler, SamplingParams, TokenMask, top_logprobs};
use std::time::Instant;

const VOCAB: usize = 151_936;

/// Wall nanoseconds per call of `f`, the best of several batches (the machine is shared, so
/// the minimum is the least disturbed estimate).
fn measure(calls: u64, mut f: impl FnMut(u64)) -> f64 {
    let mut best = f64::INFINITY;
    for batch in 0..7 {
        let start = Instant::now();
        for i in 0..calls {
            f(batch * calls + i);
        }
        best = best.min(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    best
}

fn report(label: &str, ns: f64) {
    println!(
        "{label}: {ns:.0} ns/call ({:.1} us, best of 7 batches)",
        ns / 1e3
    );
}

fn time(label: &str, params: &SamplingParams, generated: &[u32], allowed: Option<&TokenMask>) {
    let mut rng = Rng(42);
    let rows: Vec<Vec<f32>> = (0..8).map(|_| realistic_logits(VOCAB, &mut rng)).collect();
    let mut never = TokenMask::new(VOCAB);
    for t in 151_665..VOCAB as u32 {
        never.set(t, true).unwrap();
    }
    let mut sampler = Sampler::new();
    let prompt: Vec<u32> = (0..500).map(|i| i * 7).collect();
    let mut sink = 0u64;
    // Warm the scratch.
    for pos in 0..8 {
        let ctx = ChoiceContext {
            prompt_tokens: &prompt,
            generated_tokens: generated,
            position: pos,
        };
        sink += u64::from(
            sampler
                .choose(&rows[0], &ctx, params, allowed, &never)
                .unwrap()
                .token,
        );
    }
    let m = measure(80, |i| {
        let ctx = ChoiceContext {
            prompt_tokens: &prompt,
            generated_tokens: generated,
            position: 500 + i,
        };
        let logits = &rows[(i % 8) as usize];
        sink += u64::from(
            sampler
                .choose(logits, &ctx, params, allowed, &never)
                .unwrap()
                .token,
        );
    });
    report(&format!("choose vocab {VOCAB} {label} [{}]", sink % 7), m);
}

#[test]
fn choose_timing_at_qwen_vocabulary() {
    let greedy = SamplingParams::greedy();
    let t08 = SamplingParams {
        temperature: 0.8,
        seed: 1,
        ..SamplingParams::default()
    };
    time("T=0", &greedy, &[], None);
    time("T=0.8", &t08, &[], None);
    let mut grammar = TokenMask::new(VOCAB);
    for t in (0..VOCAB as u32).step_by(3) {
        grammar.set(t, true).unwrap();
    }
    time(
        "T=0.8, grammar mask (1/3 allowed)",
        &t08,
        &[],
        Some(&grammar),
    );
    let generated: Vec<u32> = (0..1_000).map(|i| (i * 131) % 151_000).collect();
    let penalised = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.1,
        logit_bias: vec![(5, 2.0), (9, f32::NEG_INFINITY)],
        ..t08.clone()
    };
    time(
        "T=0.8, penalties over 1000 generated + bias",
        &penalised,
        &generated,
        None,
    );
    let k = SamplingParams {
        top_k: 40,
        ..t08.clone()
    };
    time("T=0.8, top_k=40", &k, &[], None);
    let p = SamplingParams {
        top_p: 0.95,
        ..t08.clone()
    };
    time("T=0.8, top_p=0.95", &p, &[], None);
    let m = SamplingParams {
        min_p: 0.05,
        ..t08.clone()
    };
    time("T=0.8, min_p=0.05", &m, &[], None);
    let all = SamplingParams {
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        ..t08
    };
    time("T=0.8, top_k=40 top_p=0.95 min_p=0.05", &all, &[], None);

    let mut rng = Rng(1);
    let logits = realistic_logits(VOCAB, &mut rng);
    let m = measure(40, |_| n_sink(top_logprobs(&logits, 0).unwrap().len()));
    report(&format!("log-softmax normaliser alone, vocab {VOCAB}"), m);
    let mut n = 0;
    let m = measure(40, |_| n += top_logprobs(&logits, 20).unwrap().len());
    report(&format!("top_logprobs(n=20) vocab {VOCAB} [{n}]"), m);
}

fn n_sink(n: usize) {
    assert!(n < usize::MAX);
}
