//! Prefill and decode throughput, llama-bench style: `pp512` (one forward of 512 prompt
//! rows) and `tg128` (128 single-row decode forwards), in tokens per second.
//!
//! ```text
//! cargo run --release -p lockstep-model --example speed -- [model] [threads] [reps]
//! ```
//! `model` is a known model name (default `smollm2-135m`), `threads` defaults to 2.

mod common;

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("smollm2-135m", String::as_str);
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let reps: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let mut b = common::Bench::load(name, threads)?;
    println!(
        "{name}: {} threads, kernels {}",
        b.model.n_threads(),
        quant::kernels().name()
    );
    for _ in 0..reps {
        let mut seq = b.model.new_sequence(&b.kv);
        let rows = b.rows(0, 512, true);
        let t = Instant::now();
        b.forward(&mut seq, &rows)?;
        let pp = 512.0 / t.elapsed().as_secs_f64();
        b.kv.release_sequence(seq);

        let mut seq = b.model.new_sequence(&b.kv);
        let t = Instant::now();
        for pos in 0..128 {
            let row = b.rows(pos, pos + 1, false);
            b.forward(&mut seq, &row)?;
        }
        let tg = 128.0 / t.elapsed().as_secs_f64();
        b.kv.release_sequence(seq);
        println!("pp512 {pp:8.1} t/s   tg128 {tg:8.1} t/s");
    }
    Ok(())
}
