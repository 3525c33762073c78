//! Prefill-shaped (M = 256, the engine's prefill chunk) packed matmul on one thread, in
//! integer multiply-adds per second of thread CPU time (the machine may be shared: wall time
//! would count other processes).
//!
//! ```text
//! cargo run --release -p lockstep-quant --example prefill -- [format] [n] [k] [m] [reps]
//! ```
//! Defaults: Q4_K, N = 8960, K = 1536 (qwen2.5-coder-1.5b's FFN up/gate), M = 256, 3 reps;
//! `all` as the format runs Q4_1 (smollm2-135m), Q5_0 (qwen2.5-coder-0.5b), Q4_K and Q6_K
//! (qwen2.5-coder-1.5b) at FFN shapes of those models.
//! Prints the best of the repetitions for every available SIMD path.

use lockstep_quant::{Format, Kernels, PackedMatrix, QuantizedActs, quantize_row};
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

fn parse_format(s: &str) -> Format {
    match s {
        "q4_0" => Format::Q4_0,
        "q4_1" => Format::Q4_1,
        "q5_0" => Format::Q5_0,
        "q5_1" => Format::Q5_1,
        "q8_0" => Format::Q8_0,
        "q5_k" => Format::Q5_K,
        "q6_k" => Format::Q6_K,
        _ => Format::Q4_K,
    }
}

fn one(format: Format, n: usize, k: usize, m: usize, reps: usize) {
    let w = weights(format, n, k);
    let packed = PackedMatrix::pack(format, &w, n, k).expect("consistent shapes");
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    for ks in Kernels::all_available() {
        if ks.name() == "scalar" {
            continue;
        }
        let mut acts = QuantizedActs::new(format.act_layout(), k).expect("valid k");
        acts.quantize_into_with(&ks, &x).expect("m rows");
        let mut out = vec![0.0f32; m * n];
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t0 = thread_cpu_time();
            ks.matmul_packed(&packed, &acts, 0..n, &mut out, n)
                .expect("consistent shapes");
            best = best.min((thread_cpu_time() - t0).as_secs_f64());
        }
        std::hint::black_box(&out);
        let macs = (m * n * k) as f64;
        println!(
            "{:<6} {:<8} n={n:<5} k={k:<5} m={m:<4} {:>8.2} ms  {:>6.2} GMAC/s",
            format.name(),
            ks.name(),
            best * 1e3,
            macs / best / 1e9
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let fmt = args.get(1).map_or("q4_k", String::as_str);
    let n: usize = args.get(2).map_or(8960, |s| s.parse().expect("n"));
    let k: usize = args.get(3).map_or(1536, |s| s.parse().expect("k"));
    let m: usize = args.get(4).map_or(256, |s| s.parse().expect("m"));
    let reps: usize = args.get(5).map_or(3, |s| s.parse().expect("reps"));
    if fmt == "all" {
        for (format, n, k) in [
            (Format::Q4_1, 1536, 576),
            (Format::Q5_0, 4864, 896),
            (Format::Q4_K, 8960, 1536),
            (Format::Q6_K, 1536, 8960),
        ] {
            one(format, n, k, m, reps);
        }
    } else {
        one(parse_format(fmt), n, k, m, reps);
    }
}
