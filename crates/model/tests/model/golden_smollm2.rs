//! SmolLM2-135M (llama) against llama.cpp's reference log-probs and greedy tokens, and a
//! real greedy decode loop.
use crate::common::*;
use lockstep_model::BatchRow;

#[test]
fn smollm2_logprobs_and_greedy_match_llama_cpp() {
    // Measured (2026-12-04): max 0.74, mean 0.20, greedy 76/76; long: 0.63, 0.19, 2/2.
    // llama.cpp against itself: 0.81 / 0.19 and 0.47 / 0.16 (tools/numerics/FINDINGS.md).
    assert_golden(
        "smollm2-135m",
        &[
            ("smollm2-135m", 0.9, 0.25),
            ("long-smollm2-135m", 0.8, 0.25),
        ],
    );
}

#[test]
fn smollm2_greedy_decode_loop_reproduces_the_reference_tokens() {
    // Prefill the prompt, then one single-row forward per generated token, choosing the
    // argmax each time, up to the first step where the reference's top-2 are within 0.2.
    let case = golden("smollm2-135m").into_iter().next().expect("a case");
    let stop = case
        .steps
        .iter()
        .position(|s| s.top[0].1 - s.top[1].1 < 0.2)
        .unwrap_or(case.steps.len());
    assert!(stop >= 8, "the case has a usable greedy prefix ({stop})");
    let mut r = Runner::new(load("smollm2-135m", 2, 1024), 256);
    let mut seq = r.sequence();
    let n = case.prompt.len();
    let mut logits = r.run_chunks(&mut seq, &case.prompt, &[n], |i| i + 1 == n);
    let mut out = Vec::new();
    for step in 0..stop {
        let next = argmax(logits.last().expect("logits"));
        out.push(next);
        let row = [BatchRow {
            seq: 0,
            token: next,
            pos: n + step,
            wants_logits: true,
        }];
        let mut l = Vec::new();
        r.model
            .forward(&mut r.scratch, &mut r.kv, &mut [&mut seq], &row, &mut l)
            .expect("decode");
        logits = vec![l];
    }
    assert_eq!(
        out,
        case.completion[..stop],
        "greedy tokens differ from llama.cpp"
    );
    r.kv.release_sequence(seq);
}
