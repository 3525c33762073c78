//! Decode-shaped (M = 1) or verify-shaped (M = 2–16) packed matmul against memory
//! bandwidth, on a working set far larger than the last-level cache: how close the kernels
//! come to streaming speed, and whether a verify block's extra rows overlap the stream.
//!
//! ```text
//! cargo run --release -p lockstep-quant --example stream -- [format] [n] [k] [mib] [m]
//! ```
//! Defaults: Q4_K, N = 8960, K = 1536, 512 MiB of weights, M = 1 activation row (several matrices of N × K,
//! walked in order, as a decode step walks the layers). Prints, for 1 and 2 threads: a plain
//! sum over the same bytes, the matmul with no synchronisation between matrices, and the
//! matmul with a barrier after every matrix (as the engine's pool does). `LOCKSTEP_PREFETCH`
//! sets the kernels' L2 stream prefetch distance in bytes (0 = off).

use lockstep_quant::{Format, PackedMatrix, QuantizedActs, kernels, quantize_row};
use std::sync::Barrier;
use std::time::Instant;

fn weights(format: Format, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1Du64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let row: Vec<f32> = (0..k).map(|_| next()).collect();
    let one = quantize_row(format, &row).expect("k fits the block length");
    let mut out = Vec::with_capacity(one.len() * n);
    for _ in 0..n {
        out.extend_from_slice(&one);
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let format = match args.get(1).map_or("q4_k", String::as_str) {
        "q4_0" => Format::Q4_0,
        "q8_0" => Format::Q8_0,
        "q5_0" => Format::Q5_0,
        "q6_k" => Format::Q6_K,
        _ => Format::Q4_K,
    };
    let n: usize = args.get(2).map_or(8960, |s| s.parse().expect("n"));
    let k: usize = args.get(3).map_or(1536, |s| s.parse().expect("k"));
    let mib: usize = args.get(4).map_or(512, |s| s.parse().expect("mib"));
    let mrows: usize = args.get(5).map_or(1, |s| s.parse().expect("m"));
    if let Some(d) = std::env::var("LOCKSTEP_PREFETCH")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        lockstep_quant::set_stream_prefetch(d);
    }
    let bytes = weights(format, n, k, 1);
    let one = PackedMatrix::pack(format, &bytes, n, k).expect("packs");
    let count = (mib << 20) / one.bytes().max(1) + 1;
    let mats: Vec<PackedMatrix> = (0..count)
        .map(|i| PackedMatrix::pack(format, &weights(format, n, k, i as u64), n, k).expect("packs"))
        .collect();
    let per_pass: usize = mats.iter().map(|m| m.bytes()).sum();
    // Small working sets are walked several times per timing (thread start-up amortised).
    let passes = ((512usize << 20) / per_pass).max(1);
    let total = per_pass * passes;
    let x: Vec<f32> = (0..k * mrows).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut acts = QuantizedActs::new(format.act_layout(), k).expect("acts");
    acts.quantize_into(&x).expect("quantize");
    // A plain read of the same bytes (the raw rows, same total) for the bound.
    let raw: Vec<Vec<u64>> = (0..count).map(|_| vec![1u64; one.bytes() / 8]).collect();
    println!(
        "{format:?} N={n} K={k} M={mrows}: {count} matrices, {:.1} MiB (walked {passes} times); kernels {}",
        per_pass as f64 / (1 << 20) as f64,
        kernels().name()
    );
    for threads in [1usize, 2] {
        let split = |t: usize| {
            let per = n.div_ceil(threads).div_ceil(16) * 16;
            (t * per).min(n)..((t + 1) * per).min(n)
        };
        let time = |f: &(dyn Fn(usize, &Barrier) + Sync)| {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let barrier = Barrier::new(threads);
                let t0 = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let b = &barrier;
                        s.spawn(move || f(t, b));
                    }
                });
                best = best.min(t0.elapsed().as_secs_f64());
            }
            total as f64 / best / 1e9
        };
        let sum = time(&|t, _| {
            let mut acc = 0u64;
            for r in std::iter::repeat_n(&raw, passes).flatten() {
                let len = r.len();
                let lo = t * len / threads;
                let hi = (t + 1) * len / threads;
                for &v in &r[lo..hi] {
                    acc = acc.wrapping_add(v);
                }
            }
            std::hint::black_box(acc);
        });
        let free = time(&|t, _| {
            let r = split(t);
            let mut out = vec![0.0f32; r.len() * mrows];
            for m in std::iter::repeat_n(&mats, passes).flatten() {
                kernels()
                    .matmul_packed(m, &acts, r.clone(), &mut out, r.len())
                    .expect("matmul");
            }
            std::hint::black_box(&out);
        });
        let synced = time(&|t, b| {
            let r = split(t);
            let mut out = vec![0.0f32; r.len() * mrows];
            for m in std::iter::repeat_n(&mats, passes).flatten() {
                kernels()
                    .matmul_packed(m, &acts, r.clone(), &mut out, r.len())
                    .expect("matmul");
                b.wait();
            }
            std::hint::black_box(&out);
        });
        println!(
            "threads {threads}: sum {sum:.1} GB/s, matmul {free:.1} GB/s ({:.0}%), with a barrier per matrix {synced:.1} GB/s ({:.0}%)",
            100.0 * free / sum,
            100.0 * synced / sum
        );
    }
}
