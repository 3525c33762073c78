//! `lockstep run`: one prompt in, the continuation streamed out (text), or one JSON object
//! with the tokens, text, finish reason, seed and timings (`--output json`).

use std::io::Write;

use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::args::{ModelArgs, SamplingArgs, StopArgs};
use crate::constraint_args::ConstraintArgs;
use crate::session::{self, Generation, PromptArgs, Session};
use crate::spec_args::{DsparkReport, SpecArgs, SpecReport};

/// Arguments of `lockstep run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    stop: StopArgs,
    #[command(flatten)]
    spec: SpecArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
    #[command(flatten)]
    disk_cache: crate::disk_cache_args::DiskCacheArgs,

    /// Output: the text as it is generated, or one JSON object (the last line of stdout)
    /// with prompt_tokens, prompt_token_ids (the ids fed, BOS included), cached_tokens,
    /// tokens, logprobs, text, finish_reason ("stop" or "length"), seed, timings {prompt_ms,
    /// prompt_tokens_per_second, gen_ms, tokens_per_second (tokens after the first over
    /// gen_ms), ttft_ms}, with --top-logprobs top_logprobs, and with a structured-output flag
    /// grammar_compile_ms
    #[arg(short = 'o', long = "output", value_enum, default_value_t = RunOutput::Text)]
    output: RunOutput,

    /// Report the K most likely tokens at each step as [[id, logprob], …] best first
    /// (in the JSON output as top_logprobs)
    #[arg(long = "top-logprobs", value_name = "K", value_parser = clap::value_parser!(u16).range(1..=100))]
    top_logprobs: Option<u16>,
}

/// `--output` of `lockstep run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RunOutput {
    /// The generated text, streamed
    Text,
    /// One JSON object
    Json,
}

/// The JSON object `lockstep run --output json` prints. Scripts and tests rely on these
/// field names.
#[derive(Debug, Serialize)]
struct RunReport<'a> {
    model: &'a str,
    prompt_tokens: usize,
    /// The prompt ids the model was fed, BOS included when the model asks for one.
    prompt_token_ids: &'a [u32],
    /// Prompt tokens whose KV came from the prompt cache (RAM or disk).
    cached_tokens: usize,
    tokens: &'a [u32],
    logprobs: &'a [f32],
    text: &'a str,
    finish_reason: &'static str,
    seed: u64,
    timings: RunTimings,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<SpecReport>,
    /// The DSpark drafter's counters (with `--dspark --spec-stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    dspark: Option<DsparkReport>,
    /// Wall time of compiling the structured-output constraint, when one was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    grammar_compile_ms: Option<f64>,
}

#[derive(Debug, Serialize)]
struct RunTimings {
    prompt_ms: f64,
    prompt_tokens_per_second: f64,
    gen_ms: f64,
    tokens_per_second: f64,
    ttft_ms: f64,
}

impl RunTimings {
    fn of(g: &Generation) -> RunTimings {
        RunTimings {
            prompt_ms: g.timings.prefill_ms,
            prompt_tokens_per_second: g.prompt_tokens_per_second(),
            gen_ms: g.timings.decode_ms,
            tokens_per_second: g.tokens_per_second(),
            ttft_ms: g.timings.ttft_ms,
        }
    }
}

/// Runs `lockstep run`.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let requested = args.constraint.prepare()?;
    let session = Session::open_with(
        &args.model,
        args.prompt.chat,
        Some(&args.spec),
        Some(&args.disk_cache),
    )?;
    let prompt = session.prompt_tokens(&args.prompt)?;
    let grammar = match &requested {
        Some(r) => Some(r.compile(&session, args.prompt.chat, &prompt)?),
        None => None,
    };
    let seed = args.sampling.seed_or_random();
    let mut req = session::request(prompt.clone(), &args.sampling, &args.stop, seed)?;
    req.constraint = grammar.as_ref().map(|g| g.request_constraint());
    req.logprobs = args.top_logprobs.map(usize::from);
    let json = args.output == RunOutput::Json;
    let mut steps: Vec<Vec<(u32, f32)>> = Vec::new();
    let generation = session.generate(req, |ev| {
        if let Some(top) = &ev.top_logprobs {
            steps.push(top.clone());
        }
        if !json && !ev.text.is_empty() {
            out.write_all(ev.text.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    })?;
    if json {
        let report = RunReport {
            model: &session.name,
            prompt_tokens: generation.prompt_tokens,
            prompt_token_ids: &prompt,
            cached_tokens: generation.cached_tokens,
            tokens: &generation.tokens,
            logprobs: &generation.logprobs,
            text: &generation.text,
            finish_reason: session::finish_name(generation.reason),
            seed,
            timings: RunTimings::of(&generation),
            top_logprobs: args.top_logprobs.map(|_| steps),
            spec: generation
                .spec
                .as_ref()
                .filter(|_| args.spec.stats)
                .map(SpecReport::of),
            dspark: session
                .dspark
                .as_ref()
                .filter(|_| args.spec.stats)
                .map(|d| DsparkReport::of(&d.counters())),
            grammar_compile_ms: grammar.as_ref().map(|g| g.compile_ms),
        };
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(out, "{}", generation.tail)?;
    }
    out.flush()?;
    eprintln!("{}", generation.summary(seed));
    if args.spec.stats {
        match &generation.spec {
            Some(s) => eprintln!("{}", SpecReport::of(s).line()),
            None => eprintln!("spec: off"),
        }
        if let Some(d) = &session.dspark {
            eprintln!("{}", DsparkReport::of(&d.counters()).line());
        }
    }
    Ok(())
}
