//! CUDA speed and real-shape exactness probe:
//!
//! ```text
//! cargo run --release -p lockstep-backend-cuda --features cuda --example cuda_bench -- MODEL.gguf [--check-cpu] [--unordered] [--profile] [--ab]
//! ```
//!
//! Prints pp512 (and again with the tensor-core matmuls off, where the device has them:
//! time and whether the logits are the same bits; and with the many-row attention kernel
//! off, likewise), pp2048 (with and without that kernel) and tg128 (tokens/s, medians of 3;
//! tg128 chooses greedily on the device,
//! again with the logits read back and the choice made on the host, and again as the
//! engine does on CUDA: row summaries made on the device, the greedy token and its logprob
//! from them on the host, the same tokens checked), with `--ab` both
//! again for each kernel choice of `StepOptions` (older kernels, same bits), the fraction of the HBM bound for
//! decode (weight bytes per token over 4.3 TB/s, the copy bandwidth measured on this
//! workplace's H200), the verify-cost curve t(M)/t(1) for M = 1..16 at a 512-token
//! context, a G1 check at full shape (a 16-row verify block against 16 decode steps, bit
//! for bit), with `--check-cpu` the logits of a short prompt against the CPU model, and with
//! `--unordered` pp512 and tg128 again with the matmuls' block order left free (what the
//! fixed order costs; those logits are not the canonical ones), and with `--profile` the
//! kernels of a 512-row and a 2048-row prefill and of one decode step (graphs off, a wait around each launch) at contexts 64 and
//! 512, summed by kernel. `--steps-only` runs a 64-token prefill and four decode steps
//! without graphs and nothing else (for an external profiler such as `ncu`), and
//! `--block16-only` a 512-token prefill and one 16-row verify block likewise; `--pp-only`
//! stops after the first pp512 (a prefill's kernels for a profiler); `--quick` prints
//! pp512, pp2048 and tg128 (the default kernels only, the choice on the device) and stops,
//! for side-by-side rounds against llama-bench. `--verify-only` prints the verify-cost curve
//! with the default tensor-core threshold and with tensor cores from two rows (the same
//! bits, checked) the time of one decode step at contexts 64 to 4000 and the verify curve
//! with the attention's scores split out over the device and without (the same tokens and
//! logits, checked), and tg128 with the tensor cores from one row on the general kernels,
//! and stops.

use engine::{ForwardBackend, ForwardRow, KvSlot, ModelBackend};
use gguf::GgufFile;
use std::sync::Arc;
use std::time::Instant;

const HBM_BYTES_PER_S: f64 = 4.3e12;

fn rows(slot: KvSlot, start: usize, toks: &[u32], all_logits: bool) -> Vec<ForwardRow> {
    toks.iter()
        .enumerate()
        .map(|(i, &t)| ForwardRow {
            slot,
            token: t,
            pos: start + i,
            wants_logits: all_logits || i + 1 == toks.len(),
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn argmax(l: &[f32]) -> u32 {
    let mut b = 0;
    for i in 1..l.len() {
        if l[i] > l[b] {
            b = i;
        }
    }
    b as u32
}

/// pp512: one forward of 512 rows, logits of the last (median of 3 after a warm-up).
fn pp512(b: &mut lockstep_backend_cuda::CudaBackend, prompt: &[u32]) -> f64 {
    pp512_logits(b, prompt).0
}

/// [`pp512`] with the last row's logits.
fn pp512_logits(b: &mut lockstep_backend_cuda::CudaBackend, prompt: &[u32]) -> (f64, Vec<f32>) {
    prefill_logits(b, &prompt[..512])
}

/// One forward of all of `prompt`'s rows, logits of the last (median of 3 after a warm-up).
fn prefill_logits(b: &mut lockstep_backend_cuda::CudaBackend, prompt: &[u32]) -> (f64, Vec<f32>) {
    let mut logits = Vec::new();
    let mut pp = Vec::new();
    for rep in 0..4 {
        let s = b.kv_new();
        b.kv_prepare(s, 0, prompt.len()).expect("prepare");
        let t = Instant::now();
        b.forward(&rows(s, 0, prompt, false), &mut logits)
            .expect("forward");
        let dt = t.elapsed().as_secs_f64();
        if rep > 0 {
            pp.push(dt);
        }
        b.kv_release(s);
    }
    (median(pp), logits)
}

/// Prints profiled launches (graphs off, a wait around each) summed by kernel.
fn print_profile(what: &str, rec: Vec<(String, f64)>, wall: f64) {
    let mut by: Vec<(String, f64, usize)> = Vec::new();
    for (name, dt) in rec {
        match by.iter_mut().find(|e| e.0 == name) {
            Some(e) => {
                e.1 += dt;
                e.2 += 1;
            }
            None => by.push((name, dt, 1)),
        }
    }
    by.sort_by(|a, c| c.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    let total: f64 = by.iter().map(|e| e.1).sum();
    println!(
        "profile of {what} (graphs off, waits around each launch): {:.3} ms in kernels, \
         {:.3} ms wall",
        total * 1e3,
        wall * 1e3
    );
    for (name, dt, n) in &by {
        println!(
            "  {name:24} {n:4} launches {:8.1} us  ({:.1} us each)",
            dt * 1e6,
            dt * 1e6 / *n as f64
        );
    }
}

/// Where a tg128 step's greedy choice is made.
#[derive(Clone, Copy, PartialEq)]
enum Choice {
    /// On the device; only the id comes back (`forward_greedy`).
    Device,
    /// On the host from the logits read back (`forward`).
    Host,
    /// As the engine does: row summaries from the device, token and logprob from them on
    /// the host (`forward_summaries`; the row is fetched only for a non-finite row).
    Summary,
}

/// tg128: seconds per token over 128 greedy decode steps from an empty context (median
/// of 3 after a warm-up), the choice made as `choice` says; and the tokens chosen.
fn tg128_with(b: &mut lockstep_backend_cuda::CudaBackend, choice: Choice) -> (f64, Vec<u32>) {
    let mut logits = Vec::new();
    let mut sums = Vec::new();
    let mut tg = Vec::new();
    let mut chosen = Vec::new();
    for rep in 0..4 {
        let s = b.kv_new();
        let mut tok = 1u32;
        chosen.clear();
        let t = Instant::now();
        for p in 0..128 {
            b.kv_prepare(s, p, p + 1).expect("prepare");
            tok = match choice {
                Choice::Host => {
                    b.forward(&rows(s, p, &[tok], true), &mut logits)
                        .expect("forward");
                    argmax(&logits)
                }
                Choice::Device => b
                    .forward_greedy(&rows(s, p, &[tok], true))
                    .expect("forward")[0],
                Choice::Summary => {
                    b.forward_summaries(&rows(s, p, &[tok], true), &mut sums)
                        .expect("forward");
                    match sums[0].greedy() {
                        Some((t, _logprob)) => t,
                        None => {
                            b.logit_row(0, &mut logits).expect("logit row");
                            argmax(&logits)
                        }
                    }
                }
            };
            chosen.push(tok);
        }
        let dt = t.elapsed().as_secs_f64();
        if rep > 0 {
            tg.push(dt);
        }
        b.kv_release(s);
    }
    (median(tg) / 128.0, chosen)
}

fn tg128(b: &mut lockstep_backend_cuda::CudaBackend) -> f64 {
    tg128_with(b, Choice::Device).0
}

/// The verify-cost curve at a 512-token context: the median time of an M-row step for M =
/// 1..=16 (rows `draft[..M]` after `prompt`), the slot (holding the prompt) and the
/// 16-row block's logits.
fn verify_curve(
    b: &mut lockstep_backend_cuda::CudaBackend,
    prompt: &[u32],
    draft: &[u32],
) -> (KvSlot, Vec<(usize, f64)>, Vec<f32>) {
    let mut logits = Vec::new();
    let s = b.kv_new();
    b.kv_prepare(s, 0, 512).expect("prepare");
    b.forward(&rows(s, 0, &prompt[..512], false), &mut logits)
        .expect("forward");
    let mut curve = Vec::new();
    let mut block16 = Vec::new();
    for m in 1..=16usize {
        let mut ts = Vec::new();
        for _ in 0..7 {
            b.kv_prepare(s, 512, 512 + m).expect("prepare");
            let t = Instant::now();
            b.forward(&rows(s, 512, &draft[..m], true), &mut logits)
                .expect("forward");
            ts.push(t.elapsed().as_secs_f64());
            b.kv_truncate(s, 512);
        }
        if m == 16 {
            block16 = logits.clone();
        }
        curve.push((m, median(ts)));
    }
    (s, curve, block16)
}

/// The median time of one decode step (the choice on the device) at each context in
/// `ctxs` (a prefill of that many tokens of `long` first, then 9 steps, the first untimed),
/// and the tokens chosen.
fn decode_by_context(
    b: &mut lockstep_backend_cuda::CudaBackend,
    long: &[u32],
    ctxs: &[usize],
) -> (Vec<(usize, f64)>, Vec<u32>) {
    let mut logits = Vec::new();
    let mut out = Vec::new();
    let mut chosen = Vec::new();
    for &ctx in ctxs {
        let s = b.kv_new();
        b.kv_prepare(s, 0, ctx).expect("prepare");
        for (i, chunk) in long[..ctx].chunks(1024).enumerate() {
            b.forward(&rows(s, i * 1024, chunk, false), &mut logits)
                .expect("forward");
        }
        let mut tok = 1u32;
        let mut ts = Vec::new();
        for p in ctx..ctx + 9 {
            b.kv_prepare(s, p, p + 1).expect("prepare");
            let t = Instant::now();
            tok = b
                .forward_greedy(&rows(s, p, &[tok], true))
                .expect("forward")[0];
            if p > ctx {
                ts.push(t.elapsed().as_secs_f64());
            }
            chosen.push(tok);
        }
        b.kv_release(s);
        out.push((ctx, median(ts)));
    }
    (out, chosen)
}

/// `--verify-only`: the verify-cost curve with the default tensor-core threshold and with
/// tensor cores from two rows (same bits, checked), and one decode step by context.
fn verify_only(b: &mut lockstep_backend_cuda::CudaBackend, long: &[u32]) {
    let nv = b.n_vocab();
    let draft: Vec<u32> = (0..16u32).map(|i| (i * 104_729 + 7) % nv as u32).collect();
    let dev = b.model().device();
    let base = dev.mma_min_rows();
    let mut runs = Vec::new();
    for min_rows in [base, 2, base] {
        b.model().device().set_mma_min_rows(min_rows);
        let (s, curve, block) = verify_curve(b, &long[..512], &draft);
        b.kv_release(s);
        runs.push((min_rows, curve, block));
    }
    b.model().device().set_mma_min_rows(base);
    println!(
        "verify cost at context 512, ms by tensor-core threshold (M, then each run's ms and t(M)/t(1)):"
    );
    for m in 0..16 {
        let cells: Vec<String> = runs
            .iter()
            .map(|(mr, c, _)| format!("mma>={mr:2}: {:.3} ms {:.2}", c[m].1 * 1e3, c[m].1 / c[0].1))
            .collect();
        println!("  M={:2}  {}", m + 1, cells.join(" | "));
    }
    let same = runs.iter().all(|(_, _, blk)| {
        blk.iter()
            .map(|v| v.to_bits())
            .eq(runs[0].2.iter().map(|v| v.to_bits()))
    });
    println!("16-row verify logits the same under every threshold: {same}");
    // Attention with the scores split out over the device (the default) and without:
    // decode by context and the verify curve, the same tokens and logits checked.
    let ctxs = [64usize, 512, 1024, 2048, 4000];
    let opts0 = b.step_options();
    let mut split_runs = Vec::new();
    for split in [true, false] {
        let mut o = opts0;
        o.attn_split = split;
        o.attn_split_min_keys = 0;
        b.set_step_options(o);
        let (dec, toks) = decode_by_context(b, long, &ctxs);
        let (s, curve, block) = verify_curve(b, &long[..512], &draft);
        b.kv_release(s);
        split_runs.push((dec, toks, curve, block));
    }
    b.set_step_options(opts0);
    for (i, &ctx) in ctxs.iter().enumerate() {
        let (a, c) = (split_runs[0].0[i].1, split_runs[1].0[i].1);
        println!(
            "decode step at context {ctx:5}: {:.3} ms split scores, {:.3} ms scores per head ({:.2}x)",
            a * 1e3,
            c * 1e3,
            c / a
        );
    }
    for m in [1usize, 2, 4, 8, 16] {
        let (a, c) = (split_runs[0].2[m - 1].1, split_runs[1].2[m - 1].1);
        println!(
            "verify M={m:2} at context 512: {:.3} ms split scores, {:.3} ms scores per head",
            a * 1e3,
            c * 1e3
        );
    }
    let same_tokens = split_runs[0].1 == split_runs[1].1;
    let same_block = split_runs[0]
        .3
        .iter()
        .map(|v| v.to_bits())
        .eq(split_runs[1].3.iter().map(|v| v.to_bits()));
    println!(
        "split scores vs per head: the same decode tokens: {same_tokens}, the same 16-row verify logits: {same_block}"
    );
    // One-row steps on the general kernels with the tensor cores from one row, against
    // the default choice (matvec kernels where the model has them).
    let opts = b.step_options();
    let t_def = tg128(b);
    b.set_step_options(lockstep_backend_cuda::StepOptions::matvec_mode(0));
    let t_gen = tg128(b);
    b.model().device().set_mma_min_rows(1);
    let (t_mma, mma_tokens) = tg128_with(b, Choice::Device);
    b.model().device().set_mma_min_rows(base);
    b.set_step_options(opts);
    let (_, def_tokens) = tg128_with(b, Choice::Device);
    println!(
        "tg128 ms/token: default {:.3}, general kernels {:.3}, general kernels with tensor cores from one row {:.3}; the same tokens: {}",
        t_def * 1e3,
        t_gen * 1e3,
        t_mma * 1e3,
        mma_tokens == def_tokens
    );
}

fn main() {
    const USAGE: &str = "usage: cuda_bench MODEL.gguf [--check-cpu] [--unordered] [--profile] \
                         [--ab] [--steps-only] [--block16-only] [--pp-only] [--quick] [--verify-only]\n(the options are described at the top of \
                         crates/backend-cuda/examples/cuda_bench.rs)";
    const FLAGS: [&str; 9] = [
        "--quick",
        "--check-cpu",
        "--unordered",
        "--profile",
        "--ab",
        "--pp-only",
        "--steps-only",
        "--block16-only",
        "--verify-only",
    ];
    let args: Vec<String> = std::env::args().collect();
    if args.iter().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    if let Some(bad) = args
        .iter()
        .skip(1)
        .find(|a| a.starts_with('-') && !FLAGS.contains(&a.as_str()))
    {
        eprintln!("cuda_bench: unknown option {bad}\n{USAGE}");
        std::process::exit(2);
    }
    let paths: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let [path] = paths[..] else {
        eprintln!(
            "cuda_bench: expected one model file, got {}\n{USAGE}",
            paths.len()
        );
        std::process::exit(2);
    };
    let check_cpu = args.iter().any(|a| a == "--check-cpu");
    let unordered = args.iter().any(|a| a == "--unordered");
    let profile = args.iter().any(|a| a == "--profile");
    let ab = args.iter().any(|a| a == "--ab");
    let g = match GgufFile::open(path) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            eprintln!("cuda_bench: cannot open {path}: {e}");
            std::process::exit(1);
        }
    };
    let t0 = Instant::now();
    let mut b = match lockstep_backend_cuda::load_backend(0, g.clone(), Some(4096)) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cuda_bench: cannot load {path} on CUDA device 0: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "loaded {path} on {} in {:.2} s (kernels from cache: {}); weight bytes {:.1} MB",
        b.model().device().name(),
        t0.elapsed().as_secs_f64(),
        b.model().device().kernels_from_cache(),
        b.model().weight_bytes() as f64 / 1e6
    );
    b.init_kv(8192).expect("kv");
    let nv = b.n_vocab();
    let long: Vec<u32> = (0..2048u32).map(|i| (i * 7919 + 13) % nv as u32).collect();
    let prompt = long[..512].to_vec();
    let mut logits = Vec::new();
    if args.iter().any(|a| a == "--steps-only") {
        // For an external profiler (ncu): a 64-token prefill, then 4 decode steps with
        // graphs off (every kernel launched on its own), nothing else.
        let s = b.kv_new();
        b.kv_prepare(s, 0, 64).expect("prepare");
        b.forward(&rows(s, 0, &prompt[..64], false), &mut logits)
            .expect("forward");
        b.set_graphs(false);
        let mut tok = 1u32;
        for p in 64..68 {
            b.kv_prepare(s, p, p + 1).expect("prepare");
            tok = b
                .forward_greedy(&rows(s, p, &[tok], true))
                .expect("forward")[0];
        }
        println!("steps-only: last token {tok}");
        return;
    }
    if args.iter().any(|a| a == "--block16-only") {
        // For an external profiler: a 512-token prefill, then one 16-row verify block at
        // context 512 with graphs off, nothing else.
        let s = b.kv_new();
        b.kv_prepare(s, 0, 528).expect("prepare");
        b.forward(&rows(s, 0, &prompt, false), &mut logits)
            .expect("forward");
        b.set_graphs(false);
        b.forward(&rows(s, 512, &long[512..528], true), &mut logits)
            .expect("forward");
        println!("block16-only: {} logits", logits.len());
        return;
    }

    if args.iter().any(|a| a == "--verify-only") {
        let long4: Vec<u32> = (0..4096u32).map(|i| (i * 7919 + 13) % nv as u32).collect();
        verify_only(&mut b, &long4);
        return;
    }
    let (pp_s, pp_logits) = pp512_logits(&mut b, &prompt);
    println!("pp512: {:.1} ms, {:.0} tokens/s", pp_s * 1e3, 512.0 / pp_s);
    if args.iter().any(|a| a == "--pp-only") {
        return;
    }
    if args.iter().any(|a| a == "--quick") {
        let (pp2, _) = prefill_logits(&mut b, &long);
        println!("pp2048: {:.1} ms, {:.0} tokens/s", pp2 * 1e3, 2048.0 / pp2);
        let tg_s = tg128(&mut b);
        println!(
            "tg128: {:.3} ms/token, {:.1} tokens/s",
            tg_s * 1e3,
            1.0 / tg_s
        );
        return;
    }
    let dev = b.model().device();
    if dev.mma() {
        // The warp kernels for the same prefill (same bits), then the default again.
        dev.set_mma(false);
        let (pp_w, warp_logits) = pp512_logits(&mut b, &prompt);
        b.model().device().set_mma(true);
        let (pp_t, _) = pp512_logits(&mut b, &prompt);
        let same = pp_logits
            .iter()
            .map(|v| v.to_bits())
            .eq(warp_logits.iter().map(|v| v.to_bits()));
        println!(
            "pp512 tensor cores vs warp kernels (same run, tensor cores measured again after): \
             {:.1} / {:.1} ms ({:.2}x); the same logits: {same}",
            pp_t * 1e3,
            pp_w * 1e3,
            pp_w / pp_t
        );
    }
    let dev = b.model().device();
    if dev.mma() && dev.mmq_wide() {
        // The 32-row tensor-core tiles for the same prefill (same bits), then the wide
        // ones again.
        dev.set_mmq_wide(false);
        let (pp_n, narrow_logits) = pp512_logits(&mut b, &prompt);
        b.model().device().set_mmq_wide(true);
        let (pp_w, _) = pp512_logits(&mut b, &prompt);
        let same = pp_logits
            .iter()
            .map(|v| v.to_bits())
            .eq(narrow_logits.iter().map(|v| v.to_bits()));
        println!(
            "pp512 wide tensor-core tiles vs 32-row tiles (same run, wide measured again after): \
             {:.1} / {:.1} ms ({:.2}x); the same logits: {same}",
            pp_w * 1e3,
            pp_n * 1e3,
            pp_n / pp_w
        );
    }
    // The many-row attention kernel against the per-(row, head) tiled one (same bits).
    let mut o = b.step_options();
    if o.attn_rows {
        o.attn_rows = false;
        b.set_step_options(o);
        let (pp_h, head_logits) = pp512_logits(&mut b, &prompt);
        let (pp2_h, head_logits2) = prefill_logits(&mut b, &long);
        o.attn_rows = true;
        b.set_step_options(o);
        let (pp_r, rows_logits) = pp512_logits(&mut b, &prompt);
        let (pp2_r, rows_logits2) = prefill_logits(&mut b, &long);
        let same = |a: &[f32], b: &[f32]| {
            a.iter()
                .map(|v| v.to_bits())
                .eq(b.iter().map(|v| v.to_bits()))
        };
        println!(
            "pp512 many-row vs per-head attention kernels (same run): {:.1} / {:.1} ms ({:.2}x); \
             the same logits: {}",
            pp_r * 1e3,
            pp_h * 1e3,
            pp_h / pp_r,
            same(&rows_logits, &head_logits) && same(&rows_logits, &pp_logits)
        );
        println!(
            "pp2048: {:.1} ms, {:.0} tokens/s (per-head attention kernel: {:.1} ms, {:.2}x); \
             the same logits: {}",
            pp2_r * 1e3,
            2048.0 / pp2_r,
            pp2_h * 1e3,
            pp2_h / pp2_r,
            same(&rows_logits2, &head_logits2)
        );
    } else {
        let (pp2, _) = prefill_logits(&mut b, &long);
        println!("pp2048: {:.1} ms, {:.0} tokens/s", pp2 * 1e3, 2048.0 / pp2);
    }
    let tg_s = tg128(&mut b);
    let bound = b.model().weight_bytes() as f64 / HBM_BYTES_PER_S;
    println!(
        "tg128: {:.3} ms/token, {:.1} tokens/s; HBM bound {:.3} ms/token -> {:.1}% of the bound",
        tg_s * 1e3,
        1.0 / tg_s,
        bound * 1e3,
        100.0 * bound / tg_s
    );
    let (tg_h, on_host) = tg128_with(&mut b, Choice::Host);
    println!(
        "tg128 with the logits read back and the choice on the host: {:.3} ms/token, {:.1} tokens/s",
        tg_h * 1e3,
        1.0 / tg_h
    );
    let (tg_r, summarized) = tg128_with(&mut b, Choice::Summary);
    let (_, on_device) = tg128_with(&mut b, Choice::Device);
    println!(
        "tg128 with row summaries (the engine's CUDA path): {:.3} ms/token, {:.1} tokens/s; \
         the same tokens as the device and host choices: {}",
        tg_r * 1e3,
        1.0 / tg_r,
        summarized == on_device && summarized == on_host
    );
    if ab {
        // What each kernel choice buys (same process, same bits).
        let base = b.step_options();
        for mode in 0..4u32 {
            b.set_step_options(lockstep_backend_cuda::StepOptions::matvec_mode(mode));
            let t = tg128(&mut b);
            println!(
                "matvec mode {mode} (tiled attention): tg128 {:.3} ms/token ({:.1} t/s)",
                t * 1e3,
                1.0 / t
            );
        }
        let mut span = base;
        span.attn_tiled = false;
        b.set_step_options(span);
        let t = tg128(&mut b);
        let p = pp512(&mut b, &prompt);
        println!(
            "span attention (default matvec): tg128 {:.3} ms/token ({:.1} t/s), pp512 {:.1} ms ({:.0} t/s)",
            t * 1e3,
            1.0 / t,
            p * 1e3,
            512.0 / p
        );
        b.set_step_options(base);
        let pdl = b.model().device().pdl();
        for on in [false, true] {
            b.model().device().set_pdl(on);
            b.set_step_options(base);
            let t = tg128(&mut b);
            println!(
                "programmatic dependent launch {on}: tg128 {:.3} ms/token ({:.1} t/s)",
                t * 1e3,
                1.0 / t
            );
        }
        b.model().device().set_pdl(pdl);
        b.set_step_options(base);
    }
    if unordered {
        // The same runs with the matmuls' block order left free, then back.
        b.model().device().set_unordered_matmul(true);
        let pp_u = pp512(&mut b, &prompt);
        let tg_u = tg128(&mut b);
        b.model().device().set_unordered_matmul(false);
        let pp_o = pp512(&mut b, &prompt);
        let tg_o = tg128(&mut b);
        println!(
            "fixed order vs unordered matmuls (same run, ordered measured again after): \
             pp512 {:.1} / {:.1} ms (ordered costs {:+.1}%), tg128 {:.3} / {:.3} ms/token \
             (ordered costs {:+.1}%)",
            pp_o * 1e3,
            pp_u * 1e3,
            100.0 * (pp_o / pp_u - 1.0),
            tg_o * 1e3,
            tg_u * 1e3,
            100.0 * (tg_o / tg_u - 1.0)
        );
    }

    if profile {
        // One 512-row and one 2048-row prefill, kernel by kernel.
        for n in [512, 2048] {
            let s = b.kv_new();
            b.kv_prepare(s, 0, n).expect("prepare");
            b.model().device().set_profile(true);
            let t = Instant::now();
            b.forward(&rows(s, 0, &long[..n], false), &mut logits)
                .expect("forward");
            let wall = t.elapsed().as_secs_f64();
            let rec = b.model().device().take_profile();
            b.model().device().set_profile(false);
            b.kv_release(s);
            print_profile(&format!("one {n}-row prefill"), rec, wall);
        }
        for ctx in [64usize, 512] {
            let s = b.kv_new();
            b.kv_prepare(s, 0, ctx).expect("prepare");
            b.forward(&rows(s, 0, &prompt[..ctx], false), &mut logits)
                .expect("forward");
            b.set_graphs(false);
            b.kv_prepare(s, ctx, ctx + 1).expect("prepare");
            b.forward(&rows(s, ctx, &[1], true), &mut logits)
                .expect("forward");
            b.kv_truncate(s, ctx);
            b.model().device().set_profile(true);
            b.kv_prepare(s, ctx, ctx + 1).expect("prepare");
            let t = Instant::now();
            b.forward(&rows(s, ctx, &[1], true), &mut logits)
                .expect("forward");
            let wall = t.elapsed().as_secs_f64();
            let rec = b.model().device().take_profile();
            b.model().device().set_profile(false);
            b.set_graphs(true);
            b.kv_release(s);
            print_profile(&format!("one decode step at context {ctx}"), rec, wall);
        }
    }

    // Verify-cost curve at a 512-token context.
    let draft: Vec<u32> = (0..16u32).map(|i| (i * 104_729 + 7) % nv as u32).collect();
    let (s, curve, block16) = verify_curve(&mut b, &prompt, &draft);
    let t1 = curve[0].1;
    println!("verify-cost curve at context 512 (M, ms, t(M)/t(1)):");
    for (m, tm) in &curve {
        println!("  M={m:2}  {:.3} ms  {:.2}", tm * 1e3, tm / t1);
    }
    // G1 at full shape: the 16-row block's rows against 16 decode steps.
    let mut same = true;
    for (i, &tok) in draft.iter().enumerate() {
        b.kv_prepare(s, 512 + i, 513 + i).expect("prepare");
        b.forward(&rows(s, 512 + i, &[tok], true), &mut logits)
            .expect("forward");
        let blk = &block16[i * nv..(i + 1) * nv];
        if logits
            .iter()
            .zip(blk)
            .any(|(a, c)| a.to_bits() != c.to_bits())
        {
            println!("G1 MISMATCH at verify row {i}");
            same = false;
        }
    }
    println!(
        "G1 at full shape (16-row verify block vs 16 decode steps): {}",
        if same { "bit-identical" } else { "DIFFERENT" }
    );

    if check_cpu {
        let t = Instant::now();
        let m = model::Model::load(
            g.clone(),
            &model::LoadOptions {
                n_ctx: Some(4096),
                ..Default::default()
            },
        )
        .expect("cpu load");
        let mut cpu = ModelBackend::new(Arc::new(m));
        cpu.init_kv(256).expect("kv");
        let toks = &prompt[..12];
        let (sc, sg) = (cpu.kv_new(), b.kv_new());
        let mut lc = Vec::new();
        cpu.kv_prepare(sc, 0, 8).expect("prepare");
        cpu.forward(&rows(sc, 0, &toks[..8], true), &mut lc)
            .expect("cpu forward");
        let mut lg = Vec::new();
        b.kv_prepare(sg, 0, 8).expect("prepare");
        b.forward(&rows(sg, 0, &toks[..8], true), &mut lg)
            .expect("forward");
        let mut all_same = lc.len() == lg.len();
        for p in 8..12 {
            let (mut a, mut c) = (Vec::new(), Vec::new());
            cpu.kv_prepare(sc, p, p + 1).expect("prepare");
            cpu.forward(&rows(sc, p, &toks[p..p + 1], true), &mut a)
                .expect("cpu forward");
            b.kv_prepare(sg, p, p + 1).expect("prepare");
            b.forward(&rows(sg, p, &toks[p..p + 1], true), &mut c)
                .expect("forward");
            all_same &= a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits());
        }
        all_same &= lc.iter().zip(&lg).all(|(x, y)| x.to_bits() == y.to_bits());
        let finite = lc.iter().all(|v| v.is_finite());
        println!(
            "CPU vs CUDA at full shape (8-row prefill + 4 decode steps): {} (cpu logits finite: {finite}; {:.1} s)",
            if all_same {
                "bit-identical"
            } else {
                "DIFFERENT"
            },
            t.elapsed().as_secs_f64()
        );
    }
}
