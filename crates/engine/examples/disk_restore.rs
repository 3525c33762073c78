//! The disk tier's restore rate on a real model: one engine computes a long prompt and
//! saves its KV blocks; then, `REPS` times, a fresh engine (a restart: nothing in RAM)
//! with the page cache dropped first when possible reads the blocks back for the same
//! prompt. Prints each restore's blocks, bytes, wall time and rate (from the engine's
//! `restore_*` counters), the time to first token, and whether the files came from the
//! device or from the page cache.
//!
//! `cargo run --profile test -p lockstep-engine --example disk_restore -- [MODEL] [TOKENS]
//! [REPS] [DIR] [--no-drop]` (defaults: qwen2.5-coder-1.5b, 4000, 3, a temporary directory
//! removed at the end; a DIR given is kept, and blocks already saved there make the first
//! run a restore too). Dropping the page cache needs root (`/proc/sys/vm/drop_caches`);
//! `--no-drop` keeps it (the files are then read from RAM).

use lockstep_engine::{
    DiskCacheConfig, Engine, EngineConfig, GenerateRequest, ModelBackend, SamplingParams,
};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use text::{EncodeOptions, Tokenizer};

fn engine(model: &Arc<model::Model>, tok: &Arc<Tokenizer>, dir: &Path, kv: usize) -> Engine {
    let cfg = EngineConfig {
        max_seqs: 1,
        kv_tokens: kv,
        prefix_cache: true,
        disk_cache: Some(DiskCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes: 16 << 30,
            model_id: [0x5a; 32],
        }),
        ..EngineConfig::default()
    };
    Engine::start(Box::new(ModelBackend::new(model.clone())), tok.clone(), cfg)
        .expect("engine starts")
}

/// Time to first token of `prompt`, ms.
fn first_token(e: &Engine, prompt: &[u32]) -> f64 {
    let mut r = GenerateRequest::new(prompt.to_vec(), SamplingParams::greedy());
    r.max_tokens = Some(1);
    let t0 = Instant::now();
    let c = e.submit(r).expect("accepted").collect();
    assert_eq!(c.error, None);
    t0.elapsed().as_secs_f64() * 1e3
}

/// The disk tier's reader threads' time on a CPU and time waiting for one (run queue),
/// ms, summed, from `/proc/self/task/*/schedstat` (zero where unavailable).
fn readers_sched_ms() -> (f64, f64) {
    let mut out = (0.0, 0.0);
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("lockstep-kv-rea") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
        let mut f = stat
            .split_whitespace()
            .map(|x| x.parse::<f64>().unwrap_or(0.0));
        out.0 += f.next().unwrap_or(0.0) / 1e6;
        out.1 += f.next().unwrap_or(0.0) / 1e6;
    }
    out
}

fn drop_page_cache() -> bool {
    let synced = std::process::Command::new("sync")
        .status()
        .is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", b"3\n").is_ok()
}

fn main() {
    let all: Vec<String> = std::env::args().collect();
    let no_drop = all.iter().any(|a| a == "--no-drop");
    let args: Vec<String> = all.into_iter().filter(|a| a != "--no-drop").collect();
    let name = args.get(1).map_or("qwen2.5-coder-1.5b", String::as_str);
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4000);
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let path = hub::ensure_model(name).expect("model in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let kv = n + 256;
    let opts = model::LoadOptions {
        n_ctx: Some(kv),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    let text = "You are a coding agent. Tools: read_file(path), apply_patch(diff), shell(cmd). \
                Always read a file before patching it, keep diffs small, run the tests after \
                every change and report what you ran. ";
    let mut prompt = tok.encode("", EncodeOptions::raw_prompt());
    let mut i = 0;
    while prompt.len() < n {
        prompt.extend(tok.encode(&format!("{i}: {text}"), EncodeOptions::plain_text()));
        i += 1;
    }
    prompt.truncate(n);
    let keep = args.get(4).map(std::path::PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("lockstep-disk-restore-{}", std::process::id()))
    });
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let cold = {
        let e = engine(&model, &tok, &dir, kv);
        let ms = first_token(&e, &prompt);
        let restored = e.metrics().disk.hit_blocks;
        e.shutdown();
        if restored > 0 {
            println!("(the first run restored {restored} blocks saved in DIR before: not cold)");
        }
        ms
    };
    println!("{name}, {n} prompt tokens: first time to first token {cold:.0} ms");
    for rep in 1..=reps {
        let dropped = !no_drop && drop_page_cache();
        let e = engine(&model, &tok, &dir, kv);
        let ms = first_token(&e, &prompt);
        let d = e.metrics().disk;
        let (on_cpu, waiting) = readers_sched_ms();
        e.shutdown();
        let secs = d.restore_micros as f64 / 1e6;
        println!(
            "restart {rep}: restored {} blocks, {:.1} MB in {:.3} s = {:.2} GB/s ({}); readers' \
             summed read+check time {:.3} s, of it {on_cpu:.0} ms on a CPU and {waiting:.0} ms \
             waiting for one; time to first token {ms:.0} ms ({:.2}% of cold)",
            d.hit_blocks,
            d.restored_bytes as f64 / 1e6,
            secs,
            d.restored_bytes as f64 / secs.max(1e-9) / 1e9,
            if dropped {
                "page cache dropped first: read from the device"
            } else {
                "page cache not dropped: read from RAM"
            },
            d.read_micros as f64 / 1e6,
            100.0 * ms / cold
        );
    }
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
