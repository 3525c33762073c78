//! Prefill and decode throughput, llama-bench style: `pp512` (one forward of 512 prompt
//! rows) and `tg128` (128 single-row decode forwards), in tokens per second.
//!
//! ```text
//! cargo run --release -p lockstep-model --example speed -- [model] [threads] [reps]
//! ```
//! `model` is a known model name (default `smollm2-135m`), `threads` defaults to 2.

use lockstep_model::{BatchRow, LoadOptions, Model};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("smollm2-135m", String::as_str);
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let reps: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let path = hub::ensure_model(name)?;
    let gguf = Arc::new(gguf::GgufFile::open(path)?);
    let opts = LoadOptions {
        threads: Some(threads),
        n_ctx: Some(1024),
        ..LoadOptions::default()
    };
    let model = Model::load(gguf, &opts)?;
    let n_vocab = model.config().n_vocab as u32;
    let mut kv = model.new_kv_cache(1024)?;
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let token = |i: usize| (i as u32 * 7919 + 13) % n_vocab.min(30_000);
    println!(
        "{name}: {} threads, kernels {}",
        model.n_threads(),
        quant::kernels().name()
    );
    for _ in 0..reps {
        let mut seq = model.new_sequence(&kv);
        let rows: Vec<BatchRow> = (0..512)
            .map(|pos| BatchRow {
                seq: 0,
                token: token(pos),
                pos,
                wants_logits: pos == 511,
            })
            .collect();
        let t = Instant::now();
        model.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)?;
        let pp = 512.0 / t.elapsed().as_secs_f64();
        kv.release_sequence(seq);

        let mut seq = model.new_sequence(&kv);
        let t = Instant::now();
        for pos in 0..128 {
            let row = [BatchRow {
                seq: 0,
                token: token(pos),
                pos,
                wants_logits: true,
            }];
            model.forward(&mut scratch, &mut kv, &mut [&mut seq], &row, &mut logits)?;
        }
        let tg = 128.0 / t.elapsed().as_secs_f64();
        kv.release_sequence(seq);
        println!("pp512 {pp:8.1} t/s   tg128 {tg:8.1} t/s");
    }
    Ok(())
}
