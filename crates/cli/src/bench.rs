//! `lockstep bench`: prompt-processing and generation speed of raw model forwards, measured
//! like llama-bench (`pp512`: one prefill of 512 tokens; `tg128`: 128 single-token decode
//! steps), mean ± standard deviation over repetitions.
//!
//! The engine is not involved: this measures the model and its kernels. Token ids are a
//! fixed pseudo-random sequence, so every run feeds the same input.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use model::{BatchRow, KvType, LoadOptions, Model};
use serde::Serialize;

use crate::args::{DEFAULT_MODEL, KvTypeArg};
use crate::load;
use crate::membw;

/// Tokens prefilled (untimed) before the decode steps of a `tg` test.
const TG_PROMPT_TOKENS: usize = 8;

/// Arguments of `lockstep bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model to measure (name or .gguf path); repeatable
    #[arg(short = 'm', long = "model", value_name = "MODEL", default_values_t = [DEFAULT_MODEL.to_string()])]
    pub models: Vec<String>,

    /// Prompt-processing test sizes: one prefill of N tokens, in chunks of the engine's
    /// prefill chunk (--prefill-chunk); comma-separated or repeated, 0 = none
    #[arg(short = 'p', long = "n-prompt", value_name = "N", value_delimiter = ',', default_values_t = [512])]
    pub n_prompt: Vec<usize>,

    /// Generation test sizes: N single-token decode steps after a short prompt;
    /// comma-separated or repeated, 0 = none
    #[arg(short = 'n', long = "n-gen", value_name = "N", value_delimiter = ',', default_values_t = [128])]
    pub n_gen: Vec<usize>,

    /// Thread counts to measure; comma-separated or repeated (default: one per core)
    #[arg(short = 't', long = "threads", value_name = "N", value_delimiter = ',')]
    pub threads: Vec<usize>,

    /// Repetitions of each test (after one untimed warm-up per model and thread count)
    #[arg(short = 'r', long = "repetitions", value_name = "N", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub repetitions: u32,

    /// Element type of the KV cache
    #[arg(long = "kv-type", value_enum, default_value_t = KvTypeArg::F16)]
    pub kv_type: KvTypeArg,

    /// Output format: a Markdown table, CSV, or one JSON array
    #[arg(short = 'o', long = "output", value_enum, default_value_t = BenchOutput::Md)]
    pub output: BenchOutput,

    /// Speculative decoding bench instead: plain vs speculative tokens/s through the engine
    /// on structured (JSON Schema), code and prose workloads and an extraction suite (six
    /// JSON Schema extractions: quoted CSV, log lines, key: value text, an HTML table,
    /// nested records, re-formatted values), per drafter, with the suite's median speed-up
    /// (first -m is the target, first -n the tokens per workload)
    #[arg(long = "spec")]
    pub spec: bool,

    /// Structured-output cost bench instead: grammar compile time, per-token mask time
    /// (mean, p99) and decode tokens/s constrained vs unconstrained, alternating A/B runs,
    /// for a nested JSON Schema (first -m; -r pairs; first -n caps the tokens)
    #[arg(long = "constraint", conflicts_with = "spec")]
    pub constraint: bool,

    /// Verify-cost bench instead: the time of one forward of M rows, as a speculative
    /// verify block runs (every row's logits, after a context of the first -p tokens), for
    /// M = 1 to 16, median of -r repetitions, t(M)/t(1) (what checking a draft of M − 1
    /// tokens costs against one decode step) and the per-token acceptance rate at which
    /// that draft breaks even (first -m, on --device; one -t on the CPU)
    #[arg(long = "verify", conflicts_with_all = ["spec", "constraint", "agent", "serve"])]
    pub verify: bool,

    /// Agent-workload bench instead: replays multi-turn agent sessions (a coding agent, a
    /// JSON tool-calling loop, a chat) through a plain and a speculating server side by
    /// side, checks the answers are identical, and reports speed-up, acceptance and
    /// tokens per cycle (first -m is the model, first -t the forward threads)
    #[arg(long = "agent", conflicts_with_all = ["spec", "constraint", "serve"])]
    pub agent: bool,

    /// With --agent: only these sessions (coding-agent, tool-loop, chat)
    #[arg(
        long = "agent-sessions",
        value_name = "LIST",
        value_delimiter = ',',
        requires = "agent"
    )]
    pub agent_sessions: Vec<String>,

    /// With --agent or --spec: keep the plain runs' logits in FILE, to measure speculation
    /// later with --replay FILE
    #[arg(long = "record", value_name = "FILE", conflicts_with = "replay")]
    pub record: Option<std::path::PathBuf>,

    /// With --agent or --spec: run on the logits --record kept instead of the model, each
    /// forward taking the time of the measured verify-cost curve (qwen2.5-coder-1.5b, 2
    /// threads) scaled to --replay-step-ms per one-row step: the counters of the recorded
    /// model, speed-ups independent of the machine's load
    #[arg(long = "replay", value_name = "FILE")]
    pub replay: Option<std::path::PathBuf>,

    /// With --replay: the time of a one-row step, ms
    #[arg(long = "replay-step-ms", value_name = "MS", default_value_t = 20.0)]
    pub replay_step_ms: f64,

    /// With --replay: write the speculative runs' forwards to FILE, one JSON line per
    /// sequence per forward (rows, their text, the recorded choice after each, drafts
    /// accepted)
    #[arg(long = "replay-trace", value_name = "FILE", requires = "replay")]
    pub replay_trace: Option<std::path::PathBuf>,

    /// With --spec: also bench this draft model (same tokenizer as the target)
    #[arg(long = "draft", value_name = "MODEL", requires = "spec")]
    pub draft: Option<String>,

    /// Skip the memory-bandwidth measurement (by default each model and thread count
    /// measures read bandwidth first, ~1 s, and tg results report the fraction of the
    /// bandwidth bound they reach)
    #[arg(long = "no-bandwidth")]
    pub no_bandwidth: bool,

    /// Rows per prefill forward in the pp tests (default: the engine's, 256 on the CPU,
    /// 1024 on CUDA)
    #[arg(long = "prefill-chunk", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub prefill_chunk: Option<u32>,

    /// With --spec: most draft tokens per verify cycle
    #[arg(
        long = "spec-max-draft",
        value_name = "K",
        default_value_t = 12,
        requires = "spec"
    )]
    pub spec_max_draft: usize,

    /// With --spec: only these workloads (names as in the table: structured, code, prose,
    /// and the extraction suite csv-quoted, log-lines, key-value, html-table, nested,
    /// reformat; `extraction` names the whole suite)
    #[arg(
        long = "spec-workloads",
        value_name = "LIST",
        value_delimiter = ',',
        requires = "spec"
    )]
    pub spec_workloads: Vec<String>,

    /// Where the model runs: cpu (default), cuda, cuda:N or auto. Off the CPU the pp/tg tests
    /// go through the engine's backend on that device (one prefill in the engine's chunks;
    /// decode steps as the engine's steps run them: the row summarized on the device where
    /// the backend does that, else its logits read back) and --threads and the bandwidth
    /// measurement do not apply; --spec (target and --draft), --agent (both servers),
    /// --serve and --verify load the model there too
    #[arg(long = "device", value_name = "DEVICE", default_value_t = crate::device::DeviceArg::Cpu)]
    pub device: crate::device::DeviceArg,

    /// `--serve` (HTTP server load bench) and its flags.
    #[command(flatten)]
    pub serve: crate::serve_bench::ServeBenchArgs,
}

/// `--output` of `lockstep bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchOutput {
    /// Markdown table (as llama-bench prints)
    Md,
    /// Comma-separated values with a header line
    Csv,
    /// One JSON array of result objects
    Json,
}

/// Which test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Test {
    /// One prefill of this many tokens.
    Prompt(usize),
    /// This many single-token decode steps.
    Gen(usize),
}

impl Test {
    fn name(self) -> String {
        match self {
            Test::Prompt(n) => format!("pp{n}"),
            Test::Gen(n) => format!("tg{n}"),
        }
    }

    fn tokens(self) -> usize {
        match self {
            Test::Prompt(n) | Test::Gen(n) => n,
        }
    }

    /// KV slots the test needs.
    fn context(self) -> usize {
        match self {
            Test::Prompt(n) => n,
            Test::Gen(n) => TG_PROMPT_TOKENS + n,
        }
    }
}

/// One result row.
#[derive(Debug, Clone, Serialize)]
struct BenchResult {
    model: String,
    model_size: u64,
    test: String,
    n_prompt: usize,
    n_gen: usize,
    threads: usize,
    repetitions: u32,
    tokens_per_second: f64,
    stddev: f64,
    samples_ts: Vec<f64>,
    kernels: String,
    kv_type: &'static str,
    /// Weight bytes one decode step reads (every matmul weight and the output head; one
    /// row of the embedding table): tg tests only.
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_per_token: Option<u64>,
    /// Memory read bandwidth measured in this run with the same thread count, GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    bandwidth_gbs: Option<f64>,
    /// tg tests: tokens/s × bytes per token ÷ bandwidth — the fraction of the
    /// memory-bandwidth bound reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    bandwidth_fraction: Option<f64>,
    /// Peak resident memory of the process after this test (model, KV, scratch).
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_rss_bytes: Option<u64>,
}

/// Weight bytes a decode step reads from a GGUF: every tensor except the token embedding
/// table (one row of it is read), plus that table when it doubles as the output head.
fn decode_bytes_per_token(gguf: &gguf::GgufFile) -> u64 {
    let tensors = gguf.tensors();
    let tied = !tensors.iter().any(|t| t.name == "output.weight");
    tensors
        .iter()
        .filter(|t| tied || t.name != "token_embd.weight")
        .map(|t| t.n_bytes)
        .sum()
}

/// The kernel set this process selected: quantized dot kernels / row-op ISA.
pub fn kernel_set_name() -> String {
    format!(
        "{}/{}",
        quant::kernels().name(),
        backend_cpu::Isa::selected().name()
    )
}

impl BenchArgs {
    /// The first `-m` model (the single-model benches take only that one).
    fn first_model(&self) -> String {
        self.models
            .first()
            .cloned()
            .unwrap_or_else(|| DEFAULT_MODEL.into())
    }

    /// The first non-zero `-n`, else `default`.
    fn first_gen(&self, default: usize) -> usize {
        self.n_gen
            .first()
            .copied()
            .filter(|&n| n > 0)
            .unwrap_or(default)
    }
}

/// Runs `lockstep bench`, writing results to `out` as they complete (md, csv) or at the end
/// (json).
pub fn run(args: &BenchArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.serve.serve {
        let setup = crate::serve_bench::ServeBenchSetup {
            model: args.first_model(),
            threads: args.threads.first().copied(),
            max_tokens: args.n_gen.first().copied().unwrap_or(128),
            json: args.output == BenchOutput::Json,
            device: args.device,
            prefill_chunk: args.prefill_chunk,
        };
        return crate::serve_bench::run(&args.serve, &setup, out);
    }
    if args.agent {
        let setup = crate::agent_bench::AgentBenchSetup {
            model: args.first_model(),
            threads: args.threads.first().copied(),
            json: args.output == BenchOutput::Json,
            sessions: args.agent_sessions.clone(),
            record: args.record.clone(),
            replay: args.replay.clone(),
            replay_step_ms: args.replay_step_ms,
            replay_trace: args.replay_trace.clone(),
            device: args.device,
        };
        return crate::agent_bench::run(&setup, out);
    }
    if args.constraint {
        let gb = crate::grammar_bench::GrammarBenchArgs {
            model: args.first_model(),
            threads: args.threads.first().copied(),
            max_tokens: args.first_gen(512),
            repetitions: args.repetitions,
        };
        return crate::grammar_bench::run(&gb, args.output == BenchOutput::Json, out);
    }
    if args.verify {
        return run_verify(args, out);
    }
    if args.spec {
        let sb = crate::spec_bench::SpecBenchArgs {
            model: args.first_model(),
            draft: args.draft.clone(),
            threads: args.threads.first().copied(),
            max_tokens: args.first_gen(128),
            repetitions: args.repetitions,
            max_draft: args.spec_max_draft.max(1),
            workloads: args.spec_workloads.clone(),
            record: args.record.clone(),
            replay: args.replay.clone(),
            replay_step_ms: args.replay_step_ms,
            replay_trace: args.replay_trace.clone(),
            device: args.device,
        };
        return crate::spec_bench::run(&sb, args.output == BenchOutput::Json, out);
    }
    let tests: Vec<Test> = args
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Test::Prompt(n))
        .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| Test::Gen(n)))
        .collect();
    if tests.is_empty() {
        bail!("nothing to measure: every -p and -n size is 0");
    }
    if args.device != crate::device::DeviceArg::Cpu {
        return run_device(args, &tests, out);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads.is_empty() {
        vec![cores]
    } else {
        args.threads.clone()
    };
    if threads.contains(&0) {
        bail!("--threads must be at least 1");
    }
    let kv_type: KvType = args.kv_type.into();
    let kernels = kernel_set_name();
    let mut results = Vec::new();
    let mut notes = Vec::new();
    match args.output {
        BenchOutput::Md => {
            writeln!(
                out,
                "| model | size | kernels | threads | test | t/s |\n\
                 | ----- | ---: | ------- | ------: | ---: | --: |"
            )?;
        }
        BenchOutput::Csv => writeln!(
            out,
            "model,model_size,kernels,threads,test,n_prompt,n_gen,repetitions,tokens_per_second,stddev"
        )?,
        BenchOutput::Json => {}
    }
    out.flush()?;
    for spec in &args.models {
        let path = load::resolve_model_path(spec)?;
        let name = load::display_name(spec, &path);
        let gguf = runtime::load::open_gguf(&path)?;
        let needed = tests.iter().map(|t| t.context()).max().unwrap_or(1);
        let n_ctx = runtime::load::context_length(&gguf, Some(needed))
            .with_context(|| format!("{name}: the longest test needs {needed} tokens"))?;
        runtime::load::check_memory(&gguf, n_ctx, kv_type)?;
        let size: u64 = gguf.tensors().iter().map(|t| t.n_bytes).sum();
        let per_token = decode_bytes_per_token(&gguf);
        for &t in &threads {
            let bandwidth = (!args.no_bandwidth).then(|| membw::read_bandwidth(t.min(cores)));
            if t > cores {
                eprintln!(
                    "note: {t} threads requested, this machine has {cores} cores; using {cores}"
                );
            }
            let opts = LoadOptions {
                threads: Some(t),
                kv_type,
                n_ctx: Some(n_ctx),
            };
            let model =
                Model::load(Arc::clone(&gguf), &opts).with_context(|| format!("loading {name}"))?;
            let mut bench = Bencher::new(&model, n_ctx, args.prefill_chunk)?;
            bench.warm_up()?;
            for &test in &tests {
                let mut samples = Vec::with_capacity(args.repetitions as usize);
                for _ in 0..args.repetitions {
                    let secs = bench.measure(test)?;
                    samples.push(test.tokens() as f64 / secs.max(1e-9));
                }
                let (mean, stddev) = mean_stddev(&samples);
                let is_gen = matches!(test, Test::Gen(_));
                let bytes_per_token = is_gen.then_some(per_token);
                let bandwidth_fraction = match (bytes_per_token, bandwidth) {
                    (Some(b), Some(bw)) if bw > 0.0 => Some(mean * b as f64 / (bw * 1e9)),
                    _ => None,
                };
                let result = BenchResult {
                    model: name.clone(),
                    model_size: size,
                    test: test.name(),
                    n_prompt: if let Test::Prompt(n) = test { n } else { 0 },
                    n_gen: if let Test::Gen(n) = test { n } else { 0 },
                    threads: model.n_threads(),
                    repetitions: args.repetitions,
                    tokens_per_second: mean,
                    stddev,
                    samples_ts: samples,
                    kernels: kernels.clone(),
                    kv_type: match kv_type {
                        KvType::F16 => "f16",
                        KvType::F32 => "f32",
                    },
                    bytes_per_token,
                    bandwidth_gbs: bandwidth,
                    bandwidth_fraction,
                    peak_rss_bytes: membw::peak_rss_bytes(),
                };
                if let (Some(b), Some(bw), Some(f)) =
                    (bytes_per_token, bandwidth, bandwidth_fraction)
                {
                    let bound = bw * 1e9 / b as f64;
                    let cache = membw::last_level_cache_bytes();
                    let applies = match cache {
                        Some(c) if b <= c => {
                            "weights fit in the last-level cache: the bound \
                                              does not apply"
                        }
                        Some(_) => "weights exceed the last-level cache: the bound applies",
                        None => "last-level cache size unknown",
                    };
                    notes.push(format!(
                        "{name}, {} threads, {}: reads {} of weights per token; memory read \
                         bandwidth {bw:.1} GB/s -> bound {bound:.1} t/s; reached {:.0}% ({applies})",
                        result.threads,
                        result.test,
                        human_size(b),
                        f * 100.0
                    ));
                }
                print_row(args.output, &result, out)?;
                results.push(result);
            }
            if let Some(rss) = membw::peak_rss_bytes() {
                notes.push(format!(
                    "{name}, {} threads: peak RSS {} (model, KV cache, scratch)",
                    model.n_threads(),
                    human_size(rss)
                ));
            }
        }
    }
    match args.output {
        BenchOutput::Json => writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?,
        BenchOutput::Md => {
            writeln!(out)?;
            for n in &notes {
                writeln!(out, "- {n}")?;
            }
        }
        BenchOutput::Csv => {
            for n in &notes {
                eprintln!("note: {n}");
            }
        }
    }
    Ok(())
}

/// `lockstep bench --device cuda|cuda:N|auto`: the pp/tg tests through the engine's backend
/// on that device (`device::backend`, as `run` loads it).
fn run_device(args: &BenchArgs, tests: &[Test], out: &mut dyn Write) -> anyhow::Result<()> {
    if !args.threads.is_empty() {
        bail!("--threads applies to the CPU only (drop it or use --device cpu)");
    }
    match args.output {
        BenchOutput::Md => writeln!(
            out,
            "| model | size | device | test | t/s |\n| ----- | ---: | ------ | ---: | --: |"
        )?,
        BenchOutput::Csv => writeln!(
            out,
            "model,model_size,device,test,n_prompt,n_gen,repetitions,tokens_per_second,stddev"
        )?,
        BenchOutput::Json => {}
    }
    out.flush()?;
    let mut results = Vec::new();
    let mut notes = Vec::new();
    for spec in &args.models {
        let path = load::resolve_model_path(spec)?;
        let name = load::display_name(spec, &path);
        let gguf = runtime::load::open_gguf(&path)?;
        let needed = tests.iter().map(|t| t.context()).max().unwrap_or(1);
        let n_ctx = runtime::load::context_length(&gguf, Some(needed))
            .with_context(|| format!("{name}: the longest test needs {needed} tokens"))?;
        let (mut b, device_name, tokens) = bench_backend(args, spec, &name, &gguf, n_ctx, None)?;
        let size: u64 = gguf.tensors().iter().map(|t| t.n_bytes).sum();
        let per_token = decode_bytes_per_token(&gguf);
        // Warm-up: a short prefill and a few decode steps (kernels loaded, step graphs
        // captured).
        let chunk = args
            .prefill_chunk
            .map_or_else(|| b.preferred_prefill_chunk(), |n| n as usize);
        device_run(&mut *b, &tokens, Test::Gen(4), chunk)?;
        for &test in tests {
            let mut samples = Vec::with_capacity(args.repetitions as usize);
            for _ in 0..args.repetitions {
                let secs = device_run(&mut *b, &tokens, test, chunk)?;
                samples.push(test.tokens() as f64 / secs.max(1e-9));
            }
            let (mean, stddev) = mean_stddev(&samples);
            let is_gen = matches!(test, Test::Gen(_));
            let result = BenchResult {
                model: name.clone(),
                model_size: size,
                test: test.name(),
                n_prompt: if let Test::Prompt(n) = test { n } else { 0 },
                n_gen: if let Test::Gen(n) = test { n } else { 0 },
                threads: 0,
                repetitions: args.repetitions,
                tokens_per_second: mean,
                stddev,
                samples_ts: samples,
                kernels: device_name.clone(),
                kv_type: match KvType::from(args.kv_type) {
                    KvType::F16 => "f16",
                    KvType::F32 => "f32",
                },
                bytes_per_token: is_gen.then_some(per_token),
                bandwidth_gbs: None,
                bandwidth_fraction: None,
                peak_rss_bytes: None,
            };
            if is_gen {
                notes.push(format!(
                    "{name} on {}, {}: reads {} of weights per token; {:.1} GB/s of weights at \
                     this speed (compare with the device's memory bandwidth)",
                    device_name,
                    result.test,
                    human_size(per_token),
                    mean * per_token as f64 / 1e9
                ));
            }
            match args.output {
                BenchOutput::Md => writeln!(
                    out,
                    "| {} | {} | {} | {} | {:.2} ± {:.2} |",
                    result.model,
                    human_size(result.model_size),
                    result.kernels,
                    result.test,
                    result.tokens_per_second,
                    result.stddev
                )?,
                BenchOutput::Csv => writeln!(
                    out,
                    "{},{},{},{},{},{},{},{:.3},{:.3}",
                    csv_field(&result.model),
                    result.model_size,
                    csv_field(&result.kernels),
                    result.test,
                    result.n_prompt,
                    result.n_gen,
                    result.repetitions,
                    result.tokens_per_second,
                    result.stddev
                )?,
                BenchOutput::Json => {}
            }
            out.flush()?;
            results.push(result);
        }
    }
    match args.output {
        BenchOutput::Json => writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?,
        BenchOutput::Md => {
            writeln!(out)?;
            for n in &notes {
                writeln!(out, "- {n}")?;
            }
        }
        BenchOutput::Csv => {
            for n in &notes {
                eprintln!("note: {n}");
            }
        }
    }
    Ok(())
}

/// Rows of the largest block `bench --verify` times.
const VERIFY_MAX_ROWS: usize = 16;

/// One block size of `bench --verify`.
#[derive(Debug, Clone, Serialize)]
struct VerifyResult {
    model: String,
    device: String,
    /// Positions before the block.
    context: usize,
    /// Rows in the block (M).
    rows: usize,
    repetitions: u32,
    /// Median time of one forward of the block, ms.
    ms: f64,
    /// `ms` over the median one-row time: t(M)/t(1).
    ratio: f64,
    /// The per-token acceptance rate at which a draft of M − 1 tokens breaks even
    /// ([`break_even_acceptance`]); `None` for M = 1 and where no rate does.
    break_even_acceptance: Option<f64>,
    samples_ms: Vec<f64>,
}

/// The per-token acceptance rate a at which a verify block of `m` rows (a draft of m − 1
/// tokens) yields as many tokens per cycle as it costs one-row steps (`ratio` = t(m)/t(1)),
/// each draft token accepted with probability a if the ones before it were: a cycle then
/// yields 1 + a + … + a^(m−1) tokens (the speculation cost model's count,
/// `spec::expected_rate` at one unit of time), which grows from 1 at a = 0 to m at a = 1.
/// `None` for
/// m = 1 and where even a = 1 does not pay (ratio > m); 0 where the block costs no more than
/// one step.
fn break_even_acceptance(m: usize, ratio: f64) -> Option<f64> {
    if m <= 1 || !ratio.is_finite() || ratio > m as f64 {
        return None;
    }
    if ratio <= 1.0 {
        return Some(0.0);
    }
    let tokens = |a: f64| spec::expected_rate(a, m - 1, 1.0, 0.0, 0.0);
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if tokens(mid) < ratio {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(0.5 * (lo + hi))
}

/// `lockstep bench --verify`: the verify-cost curve of the first model on `--device`. A
/// context of the first `-p` tokens (512 by default) is prefilled once; then, `-r` times
/// over M = 1..=16 in turn (so slow moments of a shared machine spread over every M), a
/// block of M rows at the next positions with every row's logits — summarized on the
/// device where the backend does that for M rows, as the engine's verify steps are — is
/// timed and truncated away again. One untimed pass first (kernels loaded, graphs captured).
fn run_verify(args: &BenchArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.threads.len() > 1 {
        bail!("--verify measures one thread count: give at most one -t");
    }
    if args.threads.contains(&0) {
        bail!("--threads must be at least 1");
    }
    let spec = args.first_model();
    let context = args
        .n_prompt
        .iter()
        .copied()
        .find(|&n| n > 0)
        .unwrap_or(512);
    let path = load::resolve_model_path(&spec)?;
    let name = load::display_name(&spec, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let needed = context + VERIFY_MAX_ROWS;
    let n_ctx = runtime::load::context_length(&gguf, Some(needed))
        .with_context(|| format!("{name}: the verify bench needs {needed} tokens"))?;
    let threads = args
        .threads
        .first()
        .map(|&t| u16::try_from(t))
        .transpose()
        .map_err(|_| anyhow::anyhow!("--threads: at most {}", u16::MAX))?;
    let (mut b, device, tokens) = bench_backend(args, &spec, &name, &gguf, n_ctx, threads)?;
    let tok = |p: usize| tokens.get(p).copied().unwrap_or(0);
    let be = |e: engine::BackendError| anyhow::anyhow!("{name}: {e}");
    let chunk = args
        .prefill_chunk
        .map_or_else(|| b.preferred_prefill_chunk(), |n| n as usize)
        .max(1);
    let slot = b.kv_new();
    let mut logits = Vec::new();
    let mut sums = Vec::new();
    prefill_chunks(&mut *b, slot, &tokens, context, chunk)?;
    // Seconds of one block of `m` rows after the context, which is all the sequence keeps.
    let mut block = |b: &mut dyn engine::ForwardBackend, m: usize| -> anyhow::Result<f64> {
        b.kv_prepare(slot, context, context + m).map_err(be)?;
        let rows: Vec<engine::ForwardRow> = (context..context + m)
            .map(|pos| engine::ForwardRow {
                slot,
                token: tok(pos),
                pos,
                wants_logits: true,
            })
            .collect();
        let t = Instant::now();
        let r = if b.summarizes() && b.summary_min_rows() <= m {
            b.forward_summaries(&rows, &mut sums)
        } else {
            b.forward(&rows, &mut logits)
        };
        let secs = t.elapsed().as_secs_f64();
        b.kv_truncate(slot, context);
        r.map_err(be)?;
        Ok(secs)
    };
    for m in 1..=VERIFY_MAX_ROWS {
        block(&mut *b, m)?;
    }
    let mut samples: Vec<Vec<f64>> = (0..VERIFY_MAX_ROWS)
        .map(|_| Vec::with_capacity(args.repetitions as usize))
        .collect();
    for _ in 0..args.repetitions {
        for (i, s) in samples.iter_mut().enumerate() {
            s.push(block(&mut *b, i + 1)? * 1e3);
        }
    }
    b.kv_release(slot);
    let medians: Vec<f64> = samples
        .iter()
        .map(|s| crate::grammar_bench::median(s))
        .collect();
    let t1 = medians[0].max(1e-9);
    let results: Vec<VerifyResult> = samples
        .into_iter()
        .zip(&medians)
        .enumerate()
        .map(|(i, (s, &ms))| VerifyResult {
            model: name.clone(),
            device: device.clone(),
            context,
            rows: i + 1,
            repetitions: args.repetitions,
            ms,
            ratio: ms / t1,
            break_even_acceptance: break_even_acceptance(i + 1, ms / t1),
            samples_ms: s,
        })
        .collect();
    match args.output {
        BenchOutput::Md => {
            writeln!(
                out,
                "verify cost of {name} on {device} after {context} tokens (median of {} \
                 repetitions)\n\n| M | ms | t(M)/t(1) | ms per row | break-even acceptance |\n\
                 | -: | -: | -: | -: | -: |",
                args.repetitions
            )?;
            for r in &results {
                let be = match (r.rows, r.break_even_acceptance) {
                    (1, _) => "-".to_string(),
                    (_, Some(a)) => format!("{:.0}%", a * 100.0),
                    (_, None) => "never".to_string(),
                };
                writeln!(
                    out,
                    "| {} | {:.3} | {:.2} | {:.3} | {be} |",
                    r.rows,
                    r.ms,
                    r.ratio,
                    r.ms / r.rows as f64
                )?;
            }
            writeln!(
                out,
                "\n- t(M)/t(1): what one verify block of M rows (a draft of M − 1 tokens) \
                 costs against one decode step; drafting pays when a cycle's tokens \
                 (accepted drafts + 1) exceed it. Break-even acceptance: the rate at which \
                 each draft token, its predecessors accepted, must be accepted for that \
                 (1 + a + … + a^(M−1) tokens a cycle)."
            )?;
        }
        BenchOutput::Csv => {
            writeln!(
                out,
                "model,device,context,rows,repetitions,ms,ratio,break_even_acceptance"
            )?;
            for r in &results {
                writeln!(
                    out,
                    "{},{},{},{},{},{:.4},{:.4},{}",
                    csv_field(&r.model),
                    csv_field(&r.device),
                    r.context,
                    r.rows,
                    r.repetitions,
                    r.ms,
                    r.ratio,
                    r.break_even_acceptance
                        .map_or(String::new(), |a| format!("{a:.4}"))
                )?;
            }
        }
        BenchOutput::Json => writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?,
    }
    Ok(())
}

/// Model `spec` (`name`, opened as `gguf`) loaded through the engine's backend on
/// `args.device` (`device::backend`, as `run` loads it) for a context of `n_ctx`, its KV
/// cache made: the backend, the device's name and the bench's token sequence.
fn bench_backend(
    args: &BenchArgs,
    spec: &str,
    name: &str,
    gguf: &Arc<gguf::GgufFile>,
    n_ctx: usize,
    threads: Option<u16>,
) -> anyhow::Result<(Box<dyn engine::ForwardBackend>, String, Vec<u32>)> {
    let margs = crate::args::ModelArgs {
        model: spec.to_string(),
        threads,
        ctx_size: Some(n_ctx),
        kv_type: args.kv_type,
        device: args.device,
        prefill_chunk: args.prefill_chunk,
    };
    let loaded = crate::device::backend(gguf, &margs, name, None, &|n| {
        n + backend_cpu::DEFAULT_BLOCK_SIZE
    })?;
    let mut b = loaded.backend;
    b.init_kv(n_ctx + backend_cpu::DEFAULT_BLOCK_SIZE)
        .map_err(|e| anyhow::anyhow!("{name}: KV cache: {e}"))?;
    Ok((b, loaded.device_name, bench_tokens(n_ctx, loaded.n_vocab)))
}

/// Prefills positions 0..n of `slot` with `tokens` (position p takes token p, 0 past the
/// end) in forwards of at most `chunk` rows, the last row's logits asked for.
fn prefill_chunks(
    b: &mut dyn engine::ForwardBackend,
    slot: engine::KvSlot,
    tokens: &[u32],
    n: usize,
    chunk: usize,
) -> anyhow::Result<()> {
    let be = |e: engine::BackendError| anyhow::anyhow!("{e}");
    let chunk = chunk.max(1);
    let mut logits = Vec::new();
    b.kv_prepare(slot, 0, n).map_err(be)?;
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let rows: Vec<engine::ForwardRow> = (start..end)
            .map(|pos| engine::ForwardRow {
                slot,
                token: tokens.get(pos).copied().unwrap_or(0),
                pos,
                wants_logits: pos + 1 == n,
            })
            .collect();
        b.forward(&rows, &mut logits).map_err(be)?;
        start = end;
    }
    Ok(())
}

/// Seconds one repetition of `test` takes through backend `b` (a fresh sequence, released
/// after): a prefill in chunks of `chunk` rows, logits of the last row; or
/// `TG_PROMPT_TOKENS` of prompt, then the timed single-row decode steps.
fn device_run(
    b: &mut dyn engine::ForwardBackend,
    tokens: &[u32],
    test: Test,
    chunk: usize,
) -> anyhow::Result<f64> {
    let be = |e: engine::BackendError| anyhow::anyhow!("{e}");
    let slot = b.kv_new();
    let tok = |p: usize| tokens.get(p).copied().unwrap_or(0);
    let prefill =
        |b: &mut dyn engine::ForwardBackend, n: usize| prefill_chunks(b, slot, tokens, n, chunk);
    let r = match test {
        Test::Prompt(n) => {
            let t = Instant::now();
            prefill(b, n).map(|()| t.elapsed())
        }
        Test::Gen(n) => prefill(b, TG_PROMPT_TOKENS).and_then(|()| {
            let mut logits = Vec::new();
            let mut sums = Vec::new();
            let t = Instant::now();
            for i in 0..n {
                let pos = TG_PROMPT_TOKENS + i;
                b.kv_prepare(slot, pos, pos + 1).map_err(be)?;
                let row = engine::ForwardRow {
                    slot,
                    token: tok(pos),
                    pos,
                    wants_logits: true,
                };
                // As the engine decodes one greedy sequence: row summaries where the
                // backend takes them for one row (it stays on the device), else the
                // logits read back.
                if b.summarizes() && b.summary_min_rows() <= 1 {
                    b.forward_summaries(&[row], &mut sums).map_err(be)?;
                } else {
                    b.forward(&[row], &mut logits).map_err(be)?;
                }
            }
            Ok(t.elapsed())
        }),
    };
    b.kv_release(slot);
    Ok(r?.as_secs_f64())
}

fn print_row(format: BenchOutput, r: &BenchResult, out: &mut dyn Write) -> anyhow::Result<()> {
    match format {
        BenchOutput::Md => writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.2} ± {:.2} |",
            r.model,
            human_size(r.model_size),
            r.kernels,
            r.threads,
            r.test,
            r.tokens_per_second,
            r.stddev
        )?,
        BenchOutput::Csv => writeln!(
            out,
            "{},{},{},{},{},{},{},{},{:.4},{:.4}",
            csv_field(&r.model),
            r.model_size,
            r.kernels,
            r.threads,
            r.test,
            r.n_prompt,
            r.n_gen,
            r.repetitions,
            r.tokens_per_second,
            r.stddev
        )?,
        BenchOutput::Json => return Ok(()),
    }
    out.flush()?;
    Ok(())
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn human_size(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    let mib = bytes as f64 / MIB;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// Mean and sample standard deviation (n − 1; 0 for one sample), as llama-bench reports.
fn mean_stddev(samples: &[f64]) -> (f64, f64) {
    let n = samples.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = samples.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0);
    }
    let var = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

/// A fixed pseudo-random token sequence (xorshift64*), ids below `n_vocab`.
fn bench_tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let n_vocab = n_vocab.max(1) as u64;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            u32::try_from((r >> 32) % n_vocab).unwrap_or(0)
        })
        .collect()
}

/// One model's KV cache, scratch and input tokens for repeated measurements.
struct Bencher<'m> {
    model: &'m Model,
    kv: model::KvCache,
    scratch: model::ForwardScratch,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    /// Rows per prefill forward.
    chunk: usize,
}

impl<'m> Bencher<'m> {
    fn new(model: &'m Model, n_ctx: usize, chunk: Option<u32>) -> anyhow::Result<Bencher<'m>> {
        Ok(Bencher {
            model,
            kv: model.new_kv_cache(n_ctx + backend_cpu::DEFAULT_BLOCK_SIZE)?,
            scratch: model.new_scratch(),
            tokens: bench_tokens(n_ctx, model.config().n_vocab),
            logits: Vec::new(),
            chunk: chunk.map_or(engine::EngineConfig::default().prefill_chunk, |n| {
                n as usize
            }),
        })
    }

    /// Touches every weight page and starts the thread pool: a short prefill and a decode
    /// (all inside the context of `tokens.len()` positions).
    fn warm_up(&mut self) -> anyhow::Result<()> {
        let n = self.tokens.len().saturating_sub(1).min(16);
        let mut seq = self.model.new_sequence(&self.kv);
        let r = self
            .prefill(&mut seq, n)
            .and_then(|()| self.decode(&mut seq, n, n, 1));
        self.kv.release_sequence(seq);
        r
    }

    /// Seconds one repetition of `test` took.
    fn measure(&mut self, test: Test) -> anyhow::Result<f64> {
        let mut seq = self.model.new_sequence(&self.kv);
        let r = match test {
            Test::Prompt(n) => {
                let start = Instant::now();
                self.prefill(&mut seq, n).map(|()| start.elapsed())
            }
            Test::Gen(n) => self.prefill(&mut seq, TG_PROMPT_TOKENS).and_then(|()| {
                let start = Instant::now();
                self.decode(&mut seq, TG_PROMPT_TOKENS, TG_PROMPT_TOKENS, n)
                    .map(|()| start.elapsed())
            }),
        };
        self.kv.release_sequence(seq);
        Ok(r?.as_secs_f64())
    }

    /// Prefills tokens `0..n` in chunks of `self.chunk` rows, logits for the last.
    fn prefill(&mut self, seq: &mut model::SeqKv, n: usize) -> anyhow::Result<()> {
        let chunk = self.chunk.max(1);
        let mut start = 0;
        while start < n {
            let end = (start + chunk).min(n);
            let rows: Vec<BatchRow> = (start..end)
                .map(|pos| BatchRow {
                    seq: 0,
                    token: self.tokens.get(pos).copied().unwrap_or(0),
                    pos,
                    wants_logits: pos + 1 == n,
                })
                .collect();
            self.model.forward(
                &mut self.scratch,
                &mut self.kv,
                &mut [&mut *seq],
                &rows,
                &mut self.logits,
            )?;
            start = end;
        }
        Ok(())
    }

    /// `steps` single-row forwards from position `pos`, feeding tokens from `token_at` on.
    fn decode(
        &mut self,
        seq: &mut model::SeqKv,
        pos: usize,
        token_at: usize,
        steps: usize,
    ) -> anyhow::Result<()> {
        for i in 0..steps {
            let row = BatchRow {
                seq: 0,
                token: self.tokens.get(token_at + i).copied().unwrap_or(0),
                pos: pos + i,
                wants_logits: true,
            };
            self.model.forward(
                &mut self.scratch,
                &mut self.kv,
                &mut [&mut *seq],
                &[row],
                &mut self.logits,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn break_even_acceptance_solves_the_geometric_cycle() {
        // One row: nothing to draft. A block no dearer than a step pays at any rate.
        assert_eq!(break_even_acceptance(1, 1.0), None);
        assert_eq!(break_even_acceptance(4, 0.9), Some(0.0));
        // Two rows at 1.5 steps: 1 + a = 1.5.
        let a = break_even_acceptance(2, 1.5).unwrap();
        assert!((a - 0.5).abs() < 1e-12, "{a}");
        // Three rows at 1.75 steps: 1 + a + a² = 1.75, a = 0.5.
        let a = break_even_acceptance(3, 1.75).unwrap();
        assert!((a - 0.5).abs() < 1e-12, "{a}");
        // Sixteen rows at 4.6 steps (a GPU's measured curve): the rate gives back 4.6 tokens.
        let a = break_even_acceptance(16, 4.6).unwrap();
        let tokens: f64 = (0..16).map(|i| a.powi(i)).sum();
        assert!(
            (tokens - 4.6).abs() < 1e-9 && a > 0.0 && a < 1.0,
            "{a} {tokens}"
        );
        // Dearer than M steps: no acceptance pays; exactly M steps needs every token.
        assert_eq!(break_even_acceptance(4, 4.5), None);
        assert!((break_even_acceptance(4, 4.0).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(break_even_acceptance(4, f64::NAN), None);
    }

    #[test]
    fn mean_and_sample_stddev() {
        let (m, s) = mean_stddev(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!((m - 5.0).abs() < 1e-12);
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_stddev(&[3.0]), (3.0, 0.0));
    }

    #[test]
    fn bench_tokens_are_fixed_and_inside_the_vocabulary() {
        let a = bench_tokens(1000, 49152);
        assert_eq!(a, bench_tokens(1000, 49152));
        assert!(a.iter().all(|&t| t < 49152));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 900);
    }

    #[test]
    fn test_names_follow_llama_bench() {
        assert_eq!(Test::Prompt(512).name(), "pp512");
        assert_eq!(Test::Gen(128).name(), "tg128");
    }
}
