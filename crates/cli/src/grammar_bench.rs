//! `lockstep bench --constraint`: what structured output costs. For a typical nested JSON
//! Schema it reports the grammar compile time, the per-token mask time (mean and p99, as
//! the engine calls it), and decode tokens/s constrained against unconstrained, measured
//! side by side (alternating A/B runs of the same length in one process) with their ratio.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, bail};
use engine::{
    ConstraintError, Engine, EngineConfig, Event, GenerateRequest, ModelBackend, SamplingParams,
    TokenConstraint, TokenMask,
};
use grammar::{Constraint, TokenEnv};
use model::{LoadOptions, Model};
use serde::Serialize;
use text::EncodeOptions;

use crate::constraint_args::compile_timed;
use crate::load;

/// What `bench --constraint` needs from the bench flags.
#[derive(Debug, Clone)]
pub struct GrammarBenchArgs {
    /// Model (name or path).
    pub model: String,
    /// Threads (None = one per core).
    pub threads: Option<usize>,
    /// Most tokens per generation (the constrained output normally ends before).
    pub max_tokens: usize,
    /// A/B pairs.
    pub repetitions: u32,
}

/// The benchmark schema: a small team with nested objects, arrays with bounds, enums,
/// formats and integer bounds — what an extraction or tool-call payload looks like.
pub fn bench_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "team": {"type": "string", "maxLength": 40},
            "founded": {"type": "string", "format": "date"},
            "members": {
                "type": "array", "minItems": 1, "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 40},
                        "role": {"enum": ["lead", "engineer", "designer", "analyst"]},
                        "age": {"type": "integer", "minimum": 18, "maximum": 99},
                        "email": {"type": "string", "format": "email"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string", "maxLength": 30},
                                "country": {"type": "string", "maxLength": 30}
                            },
                            "required": ["city", "country"],
                            "additionalProperties": false
                        }
                    },
                    "required": ["name", "role", "age", "email", "address"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["team", "founded", "members"],
        "additionalProperties": false
    })
}

const PROMPT: &str = "<|im_start|>system\nYou are a helpful assistant. You answer in JSON.<|im_end|>\n\
     <|im_start|>user\nDescribe a small software team of four people (name, role, age, e-mail, \
     city and country of each), with the team's name and founding date.<|im_end|>\n\
     <|im_start|>assistant\n";

/// The results.
#[derive(Debug, Clone, Serialize)]
pub struct GrammarBenchReport {
    model: String,
    threads: usize,
    token_env_ms: f64,
    compile_ms_first: f64,
    compile_ms_again: f64,
    masks: usize,
    mask_us_mean: f64,
    mask_us_p50: f64,
    mask_us_p99: f64,
    mask_us_max: f64,
    consume_us_mean: f64,
    tokens: usize,
    pairs: u32,
    constrained_tps: f64,
    unconstrained_tps: f64,
    ratio: f64,
    mask_share_of_step: f64,
}

/// Timings the engine's calls into a constraint leave behind.
#[derive(Default)]
struct CallLog {
    mask_us: Vec<f64>,
    consume_us: Vec<f64>,
}

/// A constraint that times the engine's calls into the wrapped one.
struct TimedConstraint {
    inner: Box<dyn TokenConstraint>,
    log: Arc<Mutex<CallLog>>,
}

impl TokenConstraint for TimedConstraint {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let t = Instant::now();
        let r = self.inner.compute_mask(mask);
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Ok(mut log) = self.log.lock() {
            log.mask_us.push(us);
        }
        r
    }
    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        let t = Instant::now();
        let r = self.inner.consume(token);
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Ok(mut log) = self.log.lock() {
            log.consume_us.push(us);
        }
        r
    }
    fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
    fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
        self.inner.rollback(n)
    }
    fn fork(&self) -> Box<dyn TokenConstraint> {
        self.inner.fork()
    }
    fn forced_tokens(&mut self) -> Vec<u32> {
        self.inner.forced_tokens()
    }
    fn accepts(&mut self, token: u32) -> bool {
        self.inner.accepts(token)
    }
    fn is_free(&self) -> bool {
        self.inner.is_free()
    }
}

/// One generation: (tokens, decode seconds for the tokens after the first).
fn generate(engine: &Engine, req: GenerateRequest) -> anyhow::Result<(Vec<u32>, f64)> {
    let h = engine.submit(req)?;
    let mut tokens = Vec::new();
    for e in &h {
        match e {
            Event::Token { token, .. } => tokens.push(token),
            Event::Finished { timings, .. } => return Ok((tokens, timings.decode_ms / 1e3)),
            Event::Error(e) => bail!("generation failed: {e}"),
        }
    }
    bail!("the engine ended the stream early")
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Runs the grammar cost bench and prints a Markdown summary (or JSON with `json`).
pub fn run(args: &GrammarBenchArgs, json: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    let n_ctx = 2048;
    let path = load::resolve_model_path(&args.model)?;
    let name = load::display_name(&args.model, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let tok = Arc::new(runtime::load::load_tokenizer(&gguf)?);
    let opts = LoadOptions {
        threads: args.threads,
        n_ctx: Some(n_ctx),
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::load(gguf, &opts).with_context(|| format!("loading {name}"))?);
    let n_vocab = model.config().n_vocab;

    let t = Instant::now();
    let env = TokenEnv::with_logit_width(tok.clone(), n_vocab)?;
    let token_env_ms = t.elapsed().as_secs_f64() * 1e3;
    let constraint = Constraint::json_schema(bench_schema());
    let mut compile_ms = Vec::new();
    let mut compiled = None;
    for _ in 0..5 {
        let c = compile_timed(&constraint, &env).context("compiling the bench schema")?;
        compile_ms.push(c.compile_ms);
        compiled = Some(c.compiled);
    }
    let compiled = compiled.context("no compile ran")?;

    let engine = Engine::start(
        Box::new(ModelBackend::new(model.clone())),
        tok.clone(),
        EngineConfig {
            max_seqs: 1,
            kv_tokens: n_ctx + 64,
            context_len: n_ctx,
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )?;
    let prompt = tok.encode(PROMPT, EncodeOptions::raw_prompt());
    let log = Arc::new(Mutex::new(CallLog::default()));
    let constrained_req = |log: &Arc<Mutex<CallLog>>| {
        let mut r = GenerateRequest::new(prompt.clone(), SamplingParams::greedy());
        r.max_tokens = Some(args.max_tokens);
        r.constraint = Some(Box::new(TimedConstraint {
            inner: Box::new(compiled.matcher()),
            log: log.clone(),
        }));
        r
    };
    // Warm-up (untimed): page in the weights, fix the constrained output's length.
    let (first, _) = generate(&engine, constrained_req(&Arc::new(Mutex::default())))?;
    let n = first.len();
    if n < 16 {
        bail!("the constrained output is only {n} tokens; raise -n");
    }
    let plain_req = || {
        // Same number of tokens as the constrained output, unconstrained.
        let mut r = GenerateRequest::new(prompt.clone(), SamplingParams::greedy());
        r.max_tokens = Some(n);
        r.ignore_eos = true;
        r
    };
    generate(&engine, plain_req())?;
    let (mut tps_c, mut tps_u, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.repetitions {
        // Alternate which runs first, so drift in machine load hits both alike.
        let (mut c, mut u) = (0.0, 0.0);
        for leg in 0..2 {
            if (leg == 0) == (i % 2 == 0) {
                let (toks, secs) = generate(&engine, constrained_req(&log))?;
                if toks != first {
                    bail!("the constrained greedy output changed between runs");
                }
                c = (toks.len() - 1) as f64 / secs.max(1e-9);
            } else {
                let (toks, secs) = generate(&engine, plain_req())?;
                u = (toks.len() - 1) as f64 / secs.max(1e-9);
            }
        }
        tps_c.push(c);
        tps_u.push(u);
        ratios.push(c / u.max(1e-9));
    }
    engine.shutdown();

    let log = log
        .lock()
        .map_err(|_| anyhow::anyhow!("timing log poisoned"))?;
    let mut masks = log.mask_us.clone();
    masks.sort_by(f64::total_cmp);
    let unconstrained_tps = median(&tps_u);
    let report = GrammarBenchReport {
        model: name,
        threads: model.n_threads(),
        token_env_ms,
        compile_ms_first: compile_ms.first().copied().unwrap_or(0.0),
        compile_ms_again: mean(compile_ms.get(1..).unwrap_or_default()),
        masks: masks.len(),
        mask_us_mean: mean(&masks),
        mask_us_p50: percentile(&masks, 50.0),
        mask_us_p99: percentile(&masks, 99.0),
        mask_us_max: masks.last().copied().unwrap_or(0.0),
        consume_us_mean: mean(&log.consume_us),
        tokens: n,
        pairs: args.repetitions,
        constrained_tps: median(&tps_c),
        unconstrained_tps,
        ratio: median(&ratios),
        mask_share_of_step: mean(&masks) * 1e-6 * unconstrained_tps,
    };
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(());
    }
    let r = &report;
    writeln!(
        out,
        "constraint cost: {}, {} threads, JSON Schema `team` (nested objects, arrays, enum, \
         formats), greedy, {} tokens per run, {} A/B pairs (medians)\n\n\
         | measure | value |\n| ------- | ----: |\n\
         | token environment (once per model) | {:.1} ms |\n\
         | grammar compile: first / again (mean of 4) | {:.2} / {:.2} ms |\n\
         | mask per token: mean | {:.1} µs |\n\
         | mask per token: p50 / p99 / max | {:.1} / {:.1} / {:.1} µs |\n\
         | consume per token: mean | {:.1} µs |\n\
         | decode unconstrained | {:.2} t/s |\n\
         | decode constrained | {:.2} t/s |\n\
         | constrained / unconstrained | {:.3} |\n\
         | mask time / step time | {:.2}% |",
        r.model,
        r.threads,
        r.tokens,
        r.pairs,
        r.token_env_ms,
        r.compile_ms_first,
        r.compile_ms_again,
        r.mask_us_mean,
        r.mask_us_p50,
        r.mask_us_p99,
        r.mask_us_max,
        r.consume_us_mean,
        r.unconstrained_tps,
        r.constrained_tps,
        r.ratio,
        100.0 * r.mask_share_of_step
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
