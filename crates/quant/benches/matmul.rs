//! Matmul throughput. `rowmajor/*`: decode-shaped (M = 1) weight bytes per second, per
//! format, K and kernel path. `packed/*`: the packed tiles against the row-major kernels on
//! the fastest path, M = 1 in weight bytes and M = 64/512 in multiply-adds, timed in
//! thread CPU time (the machine is shared; wall time would count other processes).
//! `cargo bench -p lockstep-quant --bench matmul -- packed`; set
//! `LOCKSTEP_BENCH_ALL_PATHS=1` to include every available path in `packed/*`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lockstep_quant::{Format, Kernels, PackedMatrix, QuantizedActs, quantize_row};
use std::hint::black_box;
use std::time::Duration;

/// CPU time consumed by the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

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
        Format::IQ2_XXS,
        Format::MXFP4,
        Format::F16,
        Format::BF16,
        Format::F32,
    ];
    for format in formats {
        let mut group = c.benchmark_group(format!("rowmajor/{}", format.name()));
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

/// Packed vs row-major on the same weights and activations, one thread, CPU time.
fn bench_packed(c: &mut Criterion) {
    let formats = [
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
        Format::Q4_K,
        Format::Q5_K,
        Format::Q6_K,
    ];
    let all_paths = std::env::var_os("LOCKSTEP_BENCH_ALL_PATHS").is_some();
    let mut paths = Kernels::all_available();
    paths.retain(|k| k.name() != "scalar");
    if !all_paths {
        paths.drain(..paths.len().saturating_sub(1));
    }
    let k = 1536;
    for format in formats {
        let mut group = c.benchmark_group(format!("packed/{}", format.name()));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(800));
        for (m, n) in [(1usize, 4864usize), (64, 1024), (512, 256)] {
            let w = weights(format, n, k);
            let packed = PackedMatrix::pack(format, &w, n, k).expect("consistent shapes");
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            if m == 1 {
                group.throughput(Throughput::Bytes(w.len() as u64));
            } else {
                group.throughput(Throughput::Elements((m * n * k) as u64));
            }
            for ks in &paths {
                let mut acts = QuantizedActs::new(format.act_layout(), k).expect("valid k");
                acts.quantize_into_with(ks, &x).expect("whole rows");
                let mut out = vec![0.0f32; m * n];
                for variant in ["rowmajor", "packed"] {
                    let id = BenchmarkId::new(format!("{}/{variant}", ks.name()), format!("m{m}"));
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            let t0 = thread_cpu_time();
                            for _ in 0..iters {
                                if variant == "packed" {
                                    ks.matmul_packed(black_box(&packed), &acts, 0..n, &mut out, n)
                                } else {
                                    ks.matmul(format, black_box(&w), n, &acts, &mut out)
                                }
                                .expect("consistent shapes");
                                black_box(&out);
                            }
                            thread_cpu_time() - t0
                        })
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_packed, bench_matmul);
criterion_main!(benches);
