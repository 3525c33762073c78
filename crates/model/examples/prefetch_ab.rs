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

mod common;

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
    let mut b = common::Bench::load(name, 2)?;
    let mut speeds: Vec<Vec<f64>> = vec![Vec::new(); distances.len()];
    for _ in 0..rounds {
        for (i, &d) in distances.iter().enumerate() {
            quant::set_stream_prefetch(d);
            speeds[i].push(b.measure(prefill)?);
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
