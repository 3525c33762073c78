//! G1 on gemma3 (sliding-window layers): a row's logits are bit-identical whether the
//! sequence ran token by token, in one chunk or in random chunkings — including chunks
//! that cross the 512-token window edge and the 32-token KV pages, with the blocks that
//! left the window released between forwards — on 1, 2 or 3 threads, alone or batched.
use crate::common::*;
use lockstep_model::{BatchRow, SeqKv};

const N: usize = 600;
const WINDOW: usize = 512;

/// `n` tokens of the long golden prompt (real text, 2,371 tokens).
fn tokens(n: usize) -> Vec<u32> {
    let case = golden("long-gemma3-270m")
        .into_iter()
        .next()
        .expect("a case");
    assert!(case.prompt.len() >= n);
    case.prompt[..n].to_vec()
}

/// Rows whose logits are compared: around the window edge, around page boundaries, and a
/// spread over the rest (the 262,144-wide head is the expensive part of a row).
fn wanted(i: usize) -> bool {
    i.abs_diff(WINDOW) <= 3
        || i.is_multiple_of(32)
        || i % 32 == 31
        || i.is_multiple_of(29)
        || i + 1 == N
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

/// Runs `tokens` in forwards of `chunks` (exact sizes), releasing before each forward the
/// sliding-window blocks no later query can see; returns the wanted rows' logit bits and
/// the most blocks the sliding group held at once.
fn run(r: &mut Runner, tokens: &[u32], chunks: &[usize]) -> (Vec<Vec<u32>>, usize) {
    assert_eq!(chunks.iter().sum::<usize>(), tokens.len());
    let mut seq: SeqKv = r.sequence();
    let sliding = (0..r.kv.n_groups())
        .find(|&g| r.kv.group_window(g) == Some(WINDOW))
        .expect("a sliding group");
    let mut out = Vec::new();
    let mut held = 0;
    let mut at = 0;
    for &c in chunks {
        r.kv.release_outside_window(&mut seq, at);
        let l = r.run_chunks(&mut seq, &tokens[at..at + c], &[c], |i| wanted(at + i));
        out.extend(l.iter().map(|v| bits(v)));
        held = held.max(seq.table(sliding).expect("table").held());
        at += c;
    }
    r.kv.release_sequence(seq);
    (out, held)
}

#[test]
fn gemma3_logits_do_not_depend_on_chunking_threads_or_window_release() {
    let toks = tokens(N);
    let mut r1 = Runner::new(load("gemma3-270m", 1, 2048), 1024);
    // Reference: one chunk, nothing released.
    let mut seq = r1.sequence();
    let reference: Vec<Vec<u32>> = r1
        .run_chunks(&mut seq, &toks, &[N], wanted)
        .iter()
        .map(|v| bits(v))
        .collect();
    r1.kv.release_sequence(seq);
    assert_eq!(reference.len(), (0..N).filter(|&i| wanted(i)).count());

    let (one_by_one, held) = run(&mut r1, &toks, &[1; N]);
    assert!(
        one_by_one == reference,
        "token-by-token decode differs from one prefill chunk"
    );
    // Decoding past the window, the sliding group holds at most window/32 + 1 blocks.
    assert!(held <= WINDOW / 32 + 1, "sliding group held {held} blocks");

    let edge_chunkings: [&[usize]; 4] = [
        &[500, 30, 70],            // one chunk straddles the window edge
        &[511, 1, 1, 87],          // single rows at the edge
        &[31, 1, 32, 448, 33, 55], // page boundaries, then across the edge
        &[256, 257, 1, 86],        // two half windows
    ];
    for chunks in edge_chunkings {
        let (got, _) = run(&mut r1, &toks, chunks);
        assert!(got == reference, "chunking {chunks:?} differs");
    }
    for threads in [2, 3] {
        let mut r = Runner::new(load("gemma3-270m", threads, 2048), 1024);
        let (whole, _) = run(&mut r, &toks, &[N]);
        assert!(
            whole == reference,
            "one chunk with {threads} threads differs"
        );
        for seed in 0..1u64 {
            let chunks = random_chunks(seed * 7 + threads as u64, N, 80);
            let (got, _) = run(&mut r, &toks, &chunks);
            assert!(
                got == reference,
                "chunking {chunks:?} with {threads} threads differs"
            );
        }
    }
}

#[test]
fn gemma3_two_sequences_batched_across_the_window_equal_each_alone() {
    let a = tokens(560);
    let b: Vec<u32> = tokens(600)[40..].to_vec();
    let mut r = Runner::new(load("gemma3-270m", 2, 2048), 2048);
    let alone = |r: &mut Runner, t: &[u32]| -> Vec<Vec<u32>> {
        let mut seq = r.sequence();
        let l = r.run_chunks(&mut seq, t, &[usize::MAX], |i| i >= 500);
        r.kv.release_sequence(seq);
        l.iter().map(|v| bits(v)).collect()
    };
    let alone_a = alone(&mut r, &a);
    let alone_b = alone(&mut r, &b);
    let mut sa = r.sequence();
    let mut sb = r.sequence();
    r.run_chunks(&mut sa, &a[..500], &[500], |_| false);
    r.run_chunks(&mut sb, &b[..500], &[250], |_| false);
    // Then both together, interleaved, in blocks of 7 rows each, across the window edge.
    let n_vocab = r.model.config().n_vocab;
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let mut logits = Vec::new();
    let mut at = 500;
    while at < 560 {
        let end = (at + 7).min(560);
        r.kv.release_outside_window(&mut sa, at);
        r.kv.release_outside_window(&mut sb, at);
        let mut rows = Vec::new();
        for (seq, t) in [(1, &b), (0, &a)] {
            rows.extend((at..end).map(|pos| BatchRow {
                seq,
                token: t[pos],
                pos,
                wants_logits: true,
            }));
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
                got_a.push(bits(l));
            } else {
                got_b.push(bits(l));
            }
        }
        at = end;
    }
    assert!(
        got_a == alone_a[..60],
        "sequence a batched differs from alone"
    );
    assert!(
        got_b == alone_b[..60],
        "sequence b batched differs from alone"
    );
    r.kv.release_sequence(sa);
    r.kv.release_sequence(sb);
}

#[test]
fn gemma3_rewinding_into_a_released_window_is_an_error_not_wrong_logits() {
    let toks = tokens(N);
    let mut r = Runner::new(load("gemma3-270m", 2, 2048), 1024);
    let mut seq = r.sequence();
    r.run_chunks(&mut seq, &toks[..590], &[590], |_| false);
    r.kv.release_outside_window(&mut seq, 590);
    // A query at 100 would need keys from position 0 of the sliding layers: released.
    r.kv.truncate(&mut seq, 100);
    let row = [BatchRow {
        seq: 0,
        token: toks[100],
        pos: 100,
        wants_logits: true,
    }];
    let mut logits = Vec::new();
    let err = r
        .model
        .forward(
            &mut r.scratch,
            &mut r.kv,
            &mut [&mut seq],
            &row,
            &mut logits,
        )
        .expect_err("the window was released");
    assert!(err.to_string().contains("released"), "{err}");
    r.kv.release_sequence(seq);
}
