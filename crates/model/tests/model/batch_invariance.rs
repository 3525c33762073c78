//! G1: a row's logits are bit-identical however the rows were batched — token by token,
//! one chunk, random chunkings across KV block boundaries, 1, 2 or 3 threads, alone or
//! batched with another sequence.
use crate::common::*;
use lockstep_model::BatchRow;

/// A prompt of `n` tokens from the golden prompts (real text, repeated as needed).
fn prompt(file: &str, n: usize) -> Vec<u32> {
    let cases = golden(file);
    let mut out = Vec::new();
    while out.len() < n {
        for c in &cases {
            out.extend(&c.prompt);
            out.extend(&c.completion);
        }
    }
    out.truncate(n);
    out
}

/// A deterministic pseudo-random chunking of `n` tokens (sizes 1..=max).
fn random_chunks(seed: u64, n: usize, max: usize) -> Vec<usize> {
    let mut s = seed;
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let c = ((s >> 33) as usize % max + 1).min(left);
        out.push(c);
        left -= c;
    }
    out
}

fn all_logits(r: &mut Runner, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<u32>> {
    let mut seq = r.sequence();
    let l = r.run_chunks(&mut seq, tokens, chunks, |_| true);
    r.kv.release_sequence(seq);
    l.iter().map(|v| bits(v)).collect()
}

#[test]
fn smollm2_logits_do_not_depend_on_chunking_or_threads() {
    let tokens = prompt("smollm2-135m", 100);
    let mut r1 = Runner::new(load("smollm2-135m", 1, 2048), 512);
    let reference = all_logits(&mut r1, &tokens, &[usize::MAX]);
    assert_eq!(reference.len(), tokens.len());
    let one_by_one = all_logits(&mut r1, &tokens, &[1]);
    assert!(
        one_by_one == reference,
        "token-by-token decode differs from one prefill chunk"
    );
    for threads in [2, 3] {
        let mut r = Runner::new(load("smollm2-135m", threads, 2048), 512);
        let whole = all_logits(&mut r, &tokens, &[usize::MAX]);
        assert!(
            whole == reference,
            "one chunk with {threads} threads differs"
        );
        for seed in 0..3u64 {
            let chunks = random_chunks(seed * 7 + threads as u64, tokens.len(), 40);
            let got = all_logits(&mut r, &tokens, &chunks);
            assert!(
                got == reference,
                "chunking {chunks:?} with {threads} threads differs"
            );
        }
    }
    // Chunk boundaries exactly at and around the 32-token KV blocks.
    let got = all_logits(&mut r1, &tokens, &[31, 1, 32, 33, 3]);
    assert!(got == reference, "block-boundary chunking differs");
}

#[test]
fn smollm2_two_sequences_batched_equal_each_alone() {
    let a = prompt("smollm2-135m", 70);
    let b: Vec<u32> = prompt("long-smollm2-135m", 45);
    let mut r = Runner::new(load("smollm2-135m", 2, 2048), 512);
    let alone_a = all_logits(&mut r, &a, &[usize::MAX]);
    let alone_b = all_logits(&mut r, &b, &[usize::MAX]);
    // Batched: prefill a[..40] and b[..25] together (interleaved rows), then a verify-like
    // block of a with single decode rows of b, then the rest of both together.
    let mut sa = r.sequence();
    let mut sb = r.sequence();
    let n_vocab = r.model.config().n_vocab;
    let mut got_a: Vec<Vec<u32>> = Vec::new();
    let mut got_b: Vec<Vec<u32>> = Vec::new();
    let steps: [((usize, usize), (usize, usize)); 4] = [
        ((0, 40), (0, 25)),
        ((40, 45), (25, 26)),
        ((45, 50), (26, 27)),
        ((50, 70), (27, 45)),
    ];
    let mut logits = Vec::new();
    for ((a0, a1), (b0, b1)) in steps {
        let mut rows = Vec::new();
        let (mut ia, mut ib) = (a0, b0);
        while ia < a1 || ib < b1 {
            if ib < b1 {
                rows.push(BatchRow {
                    seq: 1,
                    token: b[ib],
                    pos: ib,
                    wants_logits: true,
                });
                ib += 1;
            }
            if ia < a1 {
                rows.push(BatchRow {
                    seq: 0,
                    token: a[ia],
                    pos: ia,
                    wants_logits: true,
                });
                ia += 1;
            }
        }
        r.model
            .forward(
                &mut r.scratch,
                &mut r.kv,
                &mut [&mut sa, &mut sb],
                &rows,
                &mut logits,
            )
            .expect("batched forward");
        for (row, l) in rows.iter().zip(logits.chunks_exact(n_vocab)) {
            if row.seq == 0 {
                got_a.push(bits(l))
            } else {
                got_b.push(bits(l))
            }
        }
    }
    assert!(got_a == alone_a, "sequence a batched differs from alone");
    assert!(got_b == alone_b, "sequence b batched differs from alone");
    r.kv.release_sequence(sa);
    r.kv.release_sequence(sb);
}

#[test]
fn rewriting_positions_after_rollback_reproduces_the_logits() {
    // Speculative rollback: forward a block, cut the sequence back, forward other tokens at
    // the same positions, then the original ones again: logits equal the first time.
    let tokens = prompt("smollm2-135m", 60);
    let mut r = Runner::new(load("smollm2-135m", 2, 2048), 512);
    let reference = all_logits(&mut r, &tokens, &[usize::MAX]);
    let mut seq = r.sequence();
    r.run_chunks(&mut seq, &tokens[..50], &[50], |_| false);
    let wrong: Vec<u32> = tokens[50..].iter().map(|t| (t + 17) % 1000).collect();
    r.run_chunks(&mut seq, &wrong, &[10], |_| true);
    r.kv.truncate(&mut seq, 50);
    let again = r.run_chunks(&mut seq, &tokens[50..], &[4, 6], |_| true);
    let again: Vec<Vec<u32>> = again.iter().map(|v| bits(v)).collect();
    assert!(again == reference[50..], "logits after rollback differ");
    r.kv.release_sequence(seq);
}

#[test]
fn qwen05_logits_do_not_depend_on_chunking_or_threads() {
    let tokens = prompt("qwen2.5-coder-0.5b", 48);
    let mut r1 = Runner::new(load("qwen2.5-coder-0.5b", 1, 1024), 256);
    let reference = all_logits(&mut r1, &tokens, &[usize::MAX]);
    let mut r3 = Runner::new(load("qwen2.5-coder-0.5b", 3, 1024), 256);
    let got = all_logits(&mut r3, &tokens, &random_chunks(5, tokens.len(), 20));
    assert!(
        got == reference,
        "qwen2.5-coder-0.5b: chunked, 3 threads differs"
    );
    let got = all_logits(&mut r3, &tokens, &[1]);
    assert!(
        got == reference,
        "qwen2.5-coder-0.5b: token by token differs"
    );
}
