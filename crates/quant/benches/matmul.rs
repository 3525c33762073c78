//! Decode-shaped (M = 1) matmul throughput in weight bytes per second, per format, K and
//! kernel path. `cargo bench -p lockstep-quant --bench matmul -- --quick`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lockstep_quant::{Format, Kernels, QuantizedActs, quantize_row};
use std::hint::black_box;
use std::time::Duration;

const N: usize = 4864;

fn weights(format: Format, n: usize, k: usize) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut out = Vec::new();
    for _ in 0..n {
        let row: Vec<f32> = (0..k).map(|_| next()).collect();
        out.extend(quantize_row(format, &row).expect("k is a multiple of the block length"));
    }
    out
}

fn bench_matmul(c: &mut Criterion) {
    let formats = [
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
        Format::Q2_K,
        Format::Q3_K,
        Format::Q4_K,
        Format::Q5_K,
        Format::Q6_K,
        Format::F16,
        Format::BF16,
        Format::F32,
    ];
    for format in formats {
        let mut group = c.benchmark_group(format.name());
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(600));
        for k in [896usize, 1536, 2048] {
            if k % format.block_len() != 0 {
                continue;
            }
            let w = weights(format, N, k);
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            group.throughput(Throughput::Bytes(w.len() as u64));
            for ks in Kernels::all_available() {
                let mut acts = QuantizedActs::new(format.act_layout(), k).expect("valid k");
                acts.quantize_into_with(&ks, &x).expect("one row");
                let mut out = vec![0.0f32; N];
                group.bench_with_input(BenchmarkId::new(ks.name(), format!("k{k}")), &k, |b, _| {
                    b.iter(|| {
                        ks.matmul(format, black_box(&w), N, &acts, &mut out)
                            .expect("consistent shapes");
                        black_box(&out);
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_matmul);
criterion_main!(benches);
