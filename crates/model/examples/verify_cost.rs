//! The verify-cost curve: time of one forward of `M` rows of one sequence (every row
//! wanting logits, as a speculative verify block does) after a 256-token prompt, for
//! `M = 1..=16`, as `t(M) / t(1)`. It decides how many draft rows a verify can afford.
//!
//! ```text
//! cargo run --release -p lockstep-model --example verify_cost -- [model] [threads] [reps]
//! ```

mod common;

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("smollm2-135m", String::as_str);
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let reps: usize = args.get(3).map_or(Ok(7), |s| s.parse())?;
    let mut b = common::Bench::load(name, threads)?;
    let prompt = 256;
    let mut seq = b.model.new_sequence(&b.kv);
    let rows = b.rows(0, prompt, true);
    b.forward(&mut seq, &rows)?;
    println!(
        "{name}: {} threads, {reps} reps (median)",
        b.model.n_threads()
    );
    println!("| M | ms | t(M)/t(1) | ms per row |\n| -: | -: | -: | -: |");
    let mut t1 = 0.0;
    // Rounds over all M, so slow phases of a noisy machine spread over every M.
    let mut times = vec![Vec::new(); 17];
    for _ in 0..reps {
        for (m, slot) in times.iter_mut().enumerate().skip(1) {
            let rows = b.rows(prompt, prompt + m, false);
            let t = Instant::now();
            b.forward(&mut seq, &rows)?;
            slot.push(t.elapsed().as_secs_f64() * 1e3);
            b.kv.truncate(&mut seq, prompt);
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
    b.kv.release_sequence(seq);
    Ok(())
}
