//! Decode (or prefill) tokens/s under several thread-pool settings, alternated in one
//! process so that a shared machine's noise hits every setting alike; prints the median and
//! every measurement. A setting is `static` (each thread runs exactly its share, every
//! worker takes part) or `steal` (chunks shared out dynamically, workers that are not
//! running skip a matmul), with the spin time in microseconds: `static:100`, `steal:20`.
//!
//! ```text
//! cargo run --release -p lockstep-model --example pool_ab -- [model] [rounds] [settings] [pp|tg] [threads]
//! ```
//! Defaults: `qwen2.5-coder-1.5b`, 6 rounds, `static:100,steal:100,steal:20,steal:5`, `tg`
//! (48 single-row decode forwards per measurement; `pp`: one 256-row prefill), 2 threads.
//! The kernels follow `LOCKSTEP_KERNELS` / `LOCKSTEP_CPU_ISA` as everywhere.

mod common;

use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("qwen2.5-coder-1.5b", String::as_str);
    let rounds: usize = args.get(2).map_or(Ok(6), |s| s.parse())?;
    let settings: Vec<(bool, u64, String)> = args
        .get(3)
        .map_or("static:100,steal:100,steal:20,steal:5", String::as_str)
        .split(',')
        .map(|s| {
            let (mode, us) = s.split_once(':').ok_or("a setting is MODE:SPIN_US")?;
            let steal = match mode {
                "static" => false,
                "steal" => true,
                _ => return Err(format!("unknown mode '{mode}' (static or steal)")),
            };
            let us: u64 = us.parse().map_err(|e| format!("spin '{us}': {e}"))?;
            Ok((steal, us, s.to_string()))
        })
        .collect::<Result<_, String>>()?;
    let prefill = args.get(4).is_some_and(|a| a == "pp");
    let threads: usize = args.get(5).map_or(Ok(2), |s| s.parse())?;
    let mut b = common::Bench::load(name, threads)?;
    let mut speeds: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    for round in 0..rounds {
        // ABBA: reverse the order every other round.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..settings.len()).collect()
        } else {
            (0..settings.len()).rev().collect()
        };
        for i in order {
            let (steal, us, _) = &settings[i];
            b.model.pool().set_stealing(*steal);
            b.model.pool().set_spin(Duration::from_micros(*us));
            speeds[i].push(b.measure(prefill)?);
        }
    }
    let test = if prefill { "pp256" } else { "tg48" };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{name}, {threads} threads, {test} t/s per pool setting (load after: {})",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    for ((_, _, label), v) in settings.iter().zip(&mut speeds) {
        v.sort_by(f64::total_cmp);
        let all: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "  {label:>12}: median {:6.2}  [{}]",
            v[v.len() / 2],
            all.join(", ")
        );
    }
    Ok(())
}
