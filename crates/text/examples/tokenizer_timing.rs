//! Times loading a known model's tokenizer and encoding a text file with it.
//!
//! `cargo run --release -p lockstep-text --example tokenizer_timing -- qwen2.5-coder-0.5b [file]`

use std::time::{Duration, Instant};

use lockstep_text::{EncodeOptions, Tokenizer};

/// CPU time this thread has run (from `/proc/thread-self/schedstat`; zero where absent),
/// so that timings on a busy machine are not inflated by waiting for a core.
fn thread_cpu_time() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let name = args
        .next()
        .unwrap_or_else(|| "qwen2.5-coder-0.5b".to_string());
    let path = hub::ensure_model(&name)?;
    let (w0, c0) = (Instant::now(), thread_cpu_time());
    let file = gguf::GgufFile::open(&path)?;
    let (w1, c1) = (Instant::now(), thread_cpu_time());
    let tok = Tokenizer::from_gguf(&file)?;
    let (w2, c2) = (Instant::now(), thread_cpu_time());
    println!(
        "{name}: {} tokens; GgufFile::open {:.1} ms wall / {:.1} ms cpu; \
         Tokenizer::from_gguf {:.1} ms wall / {:.1} ms cpu",
        tok.vocab_size(),
        ms(w1 - w0),
        ms(c1 - c0),
        ms(w2 - w1),
        ms(c2 - c1),
    );
    if let Some(text_path) = args.next() {
        let text = std::fs::read_to_string(text_path)?;
        let (w0, c0) = (Instant::now(), thread_cpu_time());
        let ids = tok.encode(&text, EncodeOptions::raw_prompt());
        let (w1, c1) = (Instant::now(), thread_cpu_time());
        println!(
            "encoded {} bytes into {} tokens in {:.1} ms wall / {:.1} ms cpu",
            text.len(),
            ids.len(),
            ms(w1 - w0),
            ms(c1 - c0),
        );
    }
    Ok(())
}
