//! G1 for attention: a row's output is bit-identical however it is batched (alone, in a
//! whole-sequence batch, in random chunks, mixed with other sequences, any thread count,
//! any ISA path), and close to an f64 softmax-attention reading the same cached K/V.

use crate::common::{Rng, assert_same, bits};
use lockstep_backend_cpu::{
    AttnParams, AttnRow, Error, Isa, KvCache, KvConfig, KvType, SeqKv, ThreadPool, attention_with,
};

struct Case {
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    kv_type: KvType,
    lens: Vec<usize>,
}

/// A cache with one layer, several sequences written with random K/V, and random Q rows
/// for every position of every sequence.
struct World {
    kv: KvCache,
    seqs: Vec<SeqKv>,
    /// q[s][p] = n_head * head_dim values
    q: Vec<Vec<Vec<f32>>>,
    params: AttnParams,
    d: usize,
}

fn build(case: &Case, seed: u64) -> World {
    let cfg = KvConfig {
        n_kv_head: case.n_kv_head,
        head_dim: case.head_dim,
        block_size: case.block_size,
        kv_type: case.kv_type,
        windows: vec![case.window],
        global_blocks: 256,
        sliding_blocks: 256,
    };
    let mut kv = KvCache::new(cfg).unwrap();
    let mut rng = Rng(seed);
    let kvw = case.n_kv_head * case.head_dim;
    let mut seqs = Vec::new();
    let mut q = Vec::new();
    for &len in &case.lens {
        let mut s = kv.new_sequence();
        kv.reserve(&mut s, len).unwrap();
        for p in 0..len {
            let k = rng.vec(kvw, -2.0, 2.0);
            let v = rng.vec(kvw, -1.0, 1.0);
            kv.write(0, &s, p, &k, &v).unwrap();
        }
        q.push(
            (0..len)
                .map(|_| rng.vec(case.n_head * case.head_dim, -2.0, 2.0))
                .collect(),
        );
        seqs.push(s);
    }
    World {
        kv,
        seqs,
        q,
        params: AttnParams::new(case.n_head, case.head_dim),
        d: case.head_dim,
    }
}

impl World {
    /// Runs attention over the given (sequence, position) rows, returns per-row outputs.
    fn run(&self, isa: Isa, pool: &ThreadPool, rows: &[(usize, usize)]) -> Vec<Vec<f32>> {
        let w = self.params.n_head * self.d;
        let attn: Vec<AttnRow<'_>> = rows
            .iter()
            .map(|&(s, p)| AttnRow {
                seq: &self.seqs[s],
                pos: p,
            })
            .collect();
        let q: Vec<f32> = rows
            .iter()
            .flat_map(|&(s, p)| self.q[s][p].iter().copied())
            .collect();
        let mut out = vec![f32::NAN; rows.len() * w];
        attention_with(isa, pool, &self.kv, 0, &attn, &q, &mut out, self.params).unwrap();
        out.chunks(w).map(|c| c.to_vec()).collect()
    }

    /// f64 reference: plain softmax attention over the cached (converted) K/V.
    fn reference(&self, s: usize, p: usize, window: Option<usize>, n_kv: usize) -> Vec<f64> {
        let (d, n_head) = (self.d, self.params.n_head);
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for j in lo..=p {
            let (mut k, mut v) = (vec![0.0; n_kv * d], vec![0.0; n_kv * d]);
            self.kv.read(0, &self.seqs[s], j, &mut k, &mut v).unwrap();
            ks.push(k);
            vs.push(v);
        }
        let mut out = vec![0.0f64; n_head * d];
        for h in 0..n_head {
            let g = h / (n_head / n_kv);
            let q = &self.q[s][p][h * d..(h + 1) * d];
            let scores: Vec<f64> = ks
                .iter()
                .map(|k| {
                    let dot: f64 = (0..d).map(|i| q[i] as f64 * k[g * d + i] as f64).sum();
                    dot * self.params.scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, v) in vs.iter().enumerate() {
                for i in 0..d {
                    out[h * d + i] += e[j] / z * v[g * d + i] as f64;
                }
            }
        }
        out
    }
}

fn all_rows(world: &World) -> Vec<(usize, usize)> {
    world
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| (0..seq.len()).map(move |p| (s, p)))
        .collect()
}

/// The full G1 check for one case.
fn check_batch_invariance(case: Case, seed: u64) {
    let world = build(&case, seed);
    let mut rng = Rng(seed ^ 0xabcdef);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let isa = Isa::selected();
    let rows = all_rows(&world);

    // Reference: every row alone (decode), one thread, scalar path.
    let alone: Vec<Vec<f32>> = rows
        .iter()
        .map(|&r| world.run(Isa::Scalar, &pools[0], &[r]).remove(0))
        .collect();

    // (a) whole batch, every pool, every ISA path.
    for pool in &pools {
        for path in Isa::supported() {
            let got = world.run(path, pool, &rows);
            for (i, g) in got.iter().enumerate() {
                assert_same(
                    &bits(g),
                    &bits(&alone[i]),
                    &format!("batch row {i} {path:?} t={}", pool.n_threads()),
                );
            }
        }
    }
    // (b) each row alone on the selected path with more threads.
    for (i, &r) in rows.iter().enumerate().step_by(3) {
        let got = world.run(isa, &pools[2], &[r]).remove(0);
        assert_same(&bits(&got), &bits(&alone[i]), "alone, 3 threads");
    }
    // (c) random chunkings of each sequence (prefill chunks / verify blocks).
    for _ in 0..3 {
        let mut start = 0;
        while start < rows.len() {
            let n = 1 + rng.below(9);
            let end = (start + n).min(rows.len());
            let pool = &pools[rng.below(3)];
            let got = world.run(isa, pool, &rows[start..end]);
            for (k, g) in got.iter().enumerate() {
                assert_same(&bits(g), &bits(&alone[start + k]), "chunked");
            }
            start = end;
        }
    }
    // (d) rows of different sequences mixed in a random order.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mixed: Vec<(usize, usize)> = order.iter().map(|&i| rows[i]).collect();
    for pool in &pools {
        let got = world.run(isa, pool, &mixed);
        for (k, g) in got.iter().enumerate() {
            assert_same(&bits(g), &bits(&alone[order[k]]), "mixed");
        }
    }
    // Accuracy against the f64 reference on the same cached values.
    for (i, &(s, p)) in rows.iter().enumerate() {
        let want = world.reference(s, p, case.window, case.n_kv_head);
        for (j, (&g, &w)) in alone[i].iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * w.abs().max(0.05),
                "row {i} (seq {s} pos {p}) elem {j}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn attention_rows_are_batch_invariant_gqa_head_dim_64() {
    check_batch_invariance(
        Case {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 64,
            block_size: 32,
            window: None,
            kv_type: KvType::F16,
            lens: vec![70, 1, 33, 96],
        },
        21,
    );
}

#[test]
fn attention_rows_are_batch_invariant_head_dim_128_and_small_blocks() {
    check_batch_invariance(
        Case {
            n_head: 3,
            n_kv_head: 1,
            head_dim: 128,
            block_size: 16,
            window: None,
            kv_type: KvType::F16,
            lens: vec![50, 17],
        },
        22,
    );
}

#[test]
fn attention_rows_are_batch_invariant_head_dim_256_f32_cache() {
    check_batch_invariance(
        Case {
            n_head: 2,
            n_kv_head: 2,
            head_dim: 256,
            block_size: 32,
            window: None,
            kv_type: KvType::F32,
            lens: vec![40, 5],
        },
        23,
    );
}

#[test]
fn sliding_window_attention_is_batch_invariant() {
    check_batch_invariance(
        Case {
            n_head: 4,
            n_kv_head: 1,
            head_dim: 64,
            block_size: 8,
            window: Some(21),
            kv_type: KvType::F16,
            lens: vec![64, 9, 30],
        },
        24,
    );
}

#[test]
fn odd_head_dims_run_the_same_order_on_every_path() {
    check_batch_invariance(
        Case {
            n_head: 2,
            n_kv_head: 1,
            head_dim: 40,
            block_size: 8,
            window: Some(13),
            kv_type: KvType::F16,
            lens: vec![20, 3],
        },
        25,
    );
}

#[test]
fn attention_after_window_release_matches_attention_before() {
    let case = Case {
        n_head: 2,
        n_kv_head: 1,
        head_dim: 64,
        block_size: 8,
        window: Some(20),
        kv_type: KvType::F16,
        lens: vec![60],
    };
    let mut world = build(&case, 26);
    let pool = ThreadPool::new(2);
    let rows: Vec<(usize, usize)> = (50..60).map(|p| (0, p)).collect();
    let before = world.run(Isa::selected(), &pool, &rows);
    let mut seq = std::mem::take(&mut world.seqs[0]);
    world.kv.release_outside_window(&mut seq, 50);
    assert!(seq.table(0).unwrap().held() < 8);
    world.seqs[0] = seq;
    let after = world.run(Isa::selected(), &pool, &rows);
    for (a, b) in after.iter().zip(&before) {
        assert_eq!(bits(a), bits(b));
    }
    // A row whose window reaches a released block is an error, not garbage.
    let attn = [AttnRow {
        seq: &world.seqs[0],
        pos: 30,
    }];
    let q = vec![0.0; 2 * 64];
    let mut out = vec![0.0; 2 * 64];
    let err = attention_with(
        Isa::selected(),
        &pool,
        &world.kv,
        0,
        &attn,
        &q,
        &mut out,
        world.params,
    );
    assert!(matches!(err, Err(Error::Released { .. })), "{err:?}");
}

#[test]
fn attention_rejects_unreserved_positions_and_bad_shapes() {
    let case = Case {
        n_head: 2,
        n_kv_head: 1,
        head_dim: 16,
        block_size: 4,
        window: None,
        kv_type: KvType::F16,
        lens: vec![5],
    };
    let world = build(&case, 27);
    let pool = ThreadPool::new(1);
    let q = vec![0.0; 32];
    let mut out = vec![0.0; 32];
    let isa = Isa::selected();
    let row = |pos| {
        [AttnRow {
            seq: &world.seqs[0],
            pos,
        }]
    };
    assert!(matches!(
        attention_with(
            isa,
            &pool,
            &world.kv,
            0,
            &row(5),
            &q,
            &mut out,
            world.params
        ),
        Err(Error::NotReserved { pos: 5, len: 5 })
    ));
    assert!(
        attention_with(
            isa,
            &pool,
            &world.kv,
            0,
            &row(4),
            &q[..16],
            &mut out,
            world.params
        )
        .is_err()
    );
    assert!(
        attention_with(
            isa,
            &pool,
            &world.kv,
            1,
            &row(4),
            &q,
            &mut out,
            world.params
        )
        .is_err()
    );
    let bad = AttnParams {
        n_head: 3,
        scale: 1.0,
    };
    assert!(attention_with(isa, &pool, &world.kv, 0, &row(4), &q, &mut out, bad).is_err());
    attention_with(
        isa,
        &pool,
        &world.kv,
        0,
        &row(4),
        &q,
        &mut out,
        world.params,
    )
    .unwrap();
    // q = 0: uniform weights, the output is the mean of the visible values.
    let (mut k, mut v) = (vec![0.0; 16], vec![0.0; 16]);
    let mut mean = [0.0f64; 16];
    for p in 0..5 {
        world.kv.read(0, &world.seqs[0], p, &mut k, &mut v).unwrap();
        for i in 0..16 {
            mean[i] += v[i] as f64 / 5.0;
        }
    }
    for i in 0..16 {
        assert!((out[i] as f64 - mean[i]).abs() < 1e-6);
        assert_eq!(out[i].to_bits(), out[16 + i].to_bits());
    }
}
