//! Decode tokens/s with the packed kernels' L2 stream prefetch at several distances (0 =
//! off), alternated in one process so that a shared machine's noise hits every setting
//! alike; prints the median and every measurement.
//!
//! ```text
//! cargo run --release -p lockstep-model --example prefetch_ab -- [model] [rounds] [distances]
//! ```
//! Defaults: `qwen2.5-coder-1.5b`, 6 rounds, distances `0,16384,32768,65536` bytes; each
//! measurement is 48 single-row decode forwards on 2 threads, or with a fourth argument
//! `pp` one 256-row prefill forward.

use lockstep_model::{BatchRow, LoadOptions, Model};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("qwen2.5-coder-1.5b", String::as_str);
    let rounds: usize = args.get(2).map_or(Ok(6), |s| s.parse())?;
    let distances: Vec<usize> = args
        .get(3)
        .map_or("0,16384,32768,65536", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let prefill = args.get(4).is_some_and(|a| a == "pp");
    let path = hub::ensure_model(name)?;
    let gguf = Arc::new(gguf::GgufFile::open(path)?);
    let opts = LoadOptions {
        threads: Some(2),
        n_ctx: Some(1024),
        ..LoadOptions::default()
    };
    let model = Model::load(gguf, &opts)?;
    let n_vocab = model.config().n_vocab as u32;
    let mut kv = model.new_kv_cache(1024)?;
    let mut scratch = model.new_scratch();
    let mut logits = Vec::new();
    let token = |i: usize| (i as u32 * 7919 + 13) % n_vocab.min(30_000);
    let mut speeds: Vec<Vec<f64>> = vec![Vec::new(); distances.len()];
    for _ in 0..rounds {
        for (i, &d) in distances.iter().enumerate() {
            quant::set_stream_prefetch(d);
            let mut seq = model.new_sequence(&kv);
            let t = Instant::now();
            let n = if prefill {
                let rows: Vec<BatchRow> = (0..256)
                    .map(|pos| BatchRow {
                        seq: 0,
                        token: token(pos),
                        pos,
                        wants_logits: pos == 255,
                    })
                    .collect();
                model.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)?;
                256
            } else {
                for pos in 0..48 {
                    let row = [BatchRow {
                        seq: 0,
                        token: token(pos),
                        pos,
                        wants_logits: true,
                    }];
                    model.forward(&mut scratch, &mut kv, &mut [&mut seq], &row, &mut logits)?;
                }
                48
            };
            speeds[i].push(n as f64 / t.elapsed().as_secs_f64());
            kv.release_sequence(seq);
        }
    }
    let test = if prefill { "pp256" } else { "tg48" };
    println!("{name}, 2 threads, {test} t/s per L2 prefetch distance (bytes ahead; 0 = off):");
    for (d, v) in distances.iter().zip(&mut speeds) {
        v.sort_by(f64::total_cmp);
        let all: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "  {d:>6}: median {:6.2}  [{}]",
            v[v.len() / 2],
            all.join(", ")
        );
    }
    Ok(())
}
