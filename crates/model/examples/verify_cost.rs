//! The verify-cost curve: time of one forward of `M` rows of one sequence (every row
//! wanting logits, as a speculative verify block does) after a 256-token prompt, for
//! `M = 1..=16`, as `t(M) / t(1)`. It decides how many draft rows a verify can afford.
//!
//! ```text
//! cargo run --release -p lockstep-model --example verify_cost -- [model] [threads] [reps]
//! ```

use lockstep_model::{BatchRow, LoadOptions, Model};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("smollm2-135m", String::as_str);
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let reps: usize = args.get(3).map_or(Ok(7), |s| s.parse())?;
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
    let prompt = 256;
    let mut seq = model.new_sequence(&kv);
    let rows: Vec<BatchRow> = (0..prompt)
        .map(|pos| BatchRow {
            seq: 0,
            token: token(pos),
            pos,
            wants_logits: false,
        })
        .collect();
    model.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)?;
    println!(
        "{name}: {} threads, {reps} reps (median)",
        model.n_threads()
    );
    println!("| M | ms | t(M)/t(1) | ms per row |\n| -: | -: | -: | -: |");
    let mut t1 = 0.0;
    // Rounds over all M, so slow phases of a noisy machine spread over every M.
    let mut times = vec![Vec::new(); 17];
    for _ in 0..reps {
        for (m, slot) in times.iter_mut().enumerate().skip(1) {
            let rows: Vec<BatchRow> = (prompt..prompt + m)
                .map(|pos| BatchRow {
                    seq: 0,
                    token: token(pos),
                    pos,
                    wants_logits: true,
                })
                .collect();
            let t = Instant::now();
            model.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)?;
            slot.push(t.elapsed().as_secs_f64() * 1e3);
            kv.truncate(&mut seq, prompt);
        }
    }
    for (m, slot) in times.iter_mut().enumerate().skip(1) {
        slot.sort_by(f64::total_cmp);
        let ms = slot[slot.len() / 2];
        if m == 1 {
            t1 = ms;
        }
        println!("| {m} | {ms:.2} | {:.2} | {:.2} |", ms / t1, ms / m as f64);
    }
    kv.release_sequence(seq);
    Ok(())
}
