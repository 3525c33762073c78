//! Rough timings of the row ops, attention decode and pool dispatch (qwen2.5-1.5B shapes:
//! 12 query heads, 2 KV heads, head_dim 128, hidden 1536, ffn 8960).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use lockstep_backend_cpu::{
    AttnParams, AttnRow, Isa, Kernels, KvCache, KvConfig, KvType, NormWeight, RopeStyle, RopeTable,
    ThreadPool, attention_with,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                / (1u32 << 24) as f32
                - 0.5
        })
        .collect()
}

fn bench_attention(c: &mut Criterion) {
    let (n_head, n_kv, d) = (12usize, 2usize, 128usize);
    for ctx in [512usize, 2048] {
        let cfg = KvConfig {
            n_kv_head: n_kv,
            head_dim: d,
            block_size: 32,
            kv_type: KvType::F16,
            windows: vec![None],
            global_blocks: ctx / 32 + 1,
            sliding_blocks: 0,
        };
        let mut kv = KvCache::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        let mut seq = kv.new_sequence();
        kv.reserve(&mut seq, ctx).unwrap_or_else(|e| panic!("{e}"));
        for p in 0..ctx {
            let k = values(n_kv * d, p as u32);
            kv.write(0, &seq, p, &k, &k)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let q = values(n_head * d, 7);
        let mut out = vec![0.0; n_head * d];
        let rows = [AttnRow {
            seq: &seq,
            pos: ctx - 1,
        }];
        let params = AttnParams::new(n_head, d);
        for threads in [1usize, 2] {
            let pool = ThreadPool::new(threads);
            for isa in [Isa::Scalar, Isa::selected()] {
                c.bench_function(
                    &format!("attention decode ctx={ctx} t={threads} {}", isa.name()),
                    |b| {
                        b.iter(|| {
                            attention_with(
                                isa,
                                &pool,
                                &kv,
                                0,
                                &rows,
                                black_box(&q),
                                &mut out,
                                params,
                            )
                            .unwrap_or_else(|e| panic!("{e}"))
                        })
                    },
                );
            }
        }
    }
}

fn bench_rows(c: &mut Criterion) {
    let k = Kernels::selected();
    let x = values(1536, 1);
    let w = values(1536, 2);
    let mut out = vec![0.0; 1536];
    c.bench_function("rms_norm 1536", |b| {
        b.iter(|| k.rms_norm(black_box(&x), &w, 1e-6, NormWeight::Plain, &mut out))
    });
    let table = RopeTable::new(1_000_000.0, 128, 1.0, 4096).unwrap_or_else(|e| panic!("{e}"));
    let mut q = values(12 * 128, 3);
    c.bench_function("rope neox 12x128", |b| {
        b.iter(|| k.rope(black_box(&mut q), 128, &[1234], &table, RopeStyle::Neox))
    });
    let g = values(8960, 4);
    let u = values(8960, 5);
    let mut o = vec![0.0; 8960];
    c.bench_function("swiglu 8960", |b| {
        b.iter(|| k.swiglu(black_box(&g), &u, &mut o))
    });
}

fn bench_pool(c: &mut Criterion) {
    let pool = ThreadPool::new(2);
    c.bench_function("pool dispatch (2 threads, empty job)", |b| {
        b.iter(|| {
            pool.broadcast(|t| {
                black_box(t);
            })
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = bench_attention, bench_rows, bench_pool
}
criterion_main!(benches);
