//! `lockstep bench --spec`: plain against speculative decoding through the engine, on
//! structured extraction under a JSON Schema (CSV to JSON), code completion, prose, and an
//! extraction suite (quoted CSV, log lines, key: value text, an HTML table, nested records,
//! values to re-format — each under a JSON Schema), per drafter (the default free set:
//! suffix index + n-gram + grammar fast-forward; n-gram + fast-forward; the draft model
//! with `--draft`). Reports decode tokens/s, the speed-up over plain, the speculation
//! counters and the extraction suite's median, and checks that every speculative output is
//! identical to the plain one.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use engine::{
    Engine, EngineConfig, Event, GenerateRequest, ModelBackend, SamplingParams, SpecConfig,
    SpecStats,
};
use grammar::{Constraint, GrammarLimits, TokenEnv};
use model::{LoadOptions, Model};
use serde::Serialize;
use spec::{DraftModel, DrafterSet, PolicyConfig, SuffixIndex};
use text::{EncodeOptions, Tokenizer};

use crate::args::ModelArgs;
use crate::device::DeviceArg;
use crate::load;
use crate::replay::{Recording, RecordingBackend, ReplayBackend, StepCurve};

/// What `bench --spec` needs from the bench flags.
#[derive(Debug, Clone)]
pub struct SpecBenchArgs {
    /// Target model (name or path).
    pub model: String,
    /// Draft model (name or path), if any.
    pub draft: Option<String>,
    /// Threads (None = one per core).
    pub threads: Option<usize>,
    /// Tokens generated per workload.
    pub max_tokens: usize,
    /// Repetitions (the best decode speed of each is kept).
    pub repetitions: u32,
    /// Most drafts per cycle.
    pub max_draft: usize,
    /// Only these workloads (empty = all; `extraction` = the extraction suite).
    pub workloads: Vec<String>,
    /// Keep the plain runs' logits in this file (only the plain runs are made).
    pub record: Option<PathBuf>,
    /// Run every drafter set on this recording instead of the model.
    pub replay: Option<PathBuf>,
    /// With `replay`: the time of a one-row step, ms.
    pub replay_step_ms: f64,
    /// With `replay`: trace the speculative runs' forwards to this file.
    pub replay_trace: Option<PathBuf>,
    /// Where the target (and the draft model) run.
    pub device: DeviceArg,
}

/// Where a run's target forwards come from.
enum Target {
    /// The CPU model, shared by every run's backend.
    Cpu(Arc<Model>),
    /// Another device (`--device`): each run loads its own backend there, as `run` and
    /// `serve` load it (a device backend owns its memory; the load is not timed).
    Device {
        gguf: Arc<gguf::GgufFile>,
        args: ModelArgs,
        name: String,
        /// The backend loaded first (to learn the model's name and width), for the first
        /// run.
        first: Mutex<Option<Box<dyn engine::ForwardBackend>>>,
    },
}

impl Target {
    /// A fresh backend for one run.
    fn backend(&self) -> anyhow::Result<Box<dyn engine::ForwardBackend>> {
        Ok(match self {
            Target::Cpu(m) => Box::new(ModelBackend::new(Arc::clone(m))),
            Target::Device {
                gguf,
                args,
                name,
                first,
            } => match first.lock().unwrap_or_else(|e| e.into_inner()).take() {
                Some(b) => b,
                None => crate::device::backend(gguf, args, name, None, &|n| n + 64)?.backend,
            },
        })
    }
}

/// `name` loaded on `device` (not the CPU).
struct OnDevice {
    tok: Tokenizer,
    /// The display name.
    name: String,
    /// The loaded backend (taken by the first [`Target::backend`]) and what loading it
    /// again needs.
    target: Target,
    n_vocab: usize,
}

/// Loads `name` on `device` (not the CPU).
fn load_on_device(name: &str, device: DeviceArg, n_ctx: usize) -> anyhow::Result<OnDevice> {
    let path = load::resolve_model_path(name)?;
    let display = load::display_name(name, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let tok = runtime::load::load_tokenizer(&gguf)?;
    let args = ModelArgs {
        model: name.to_string(),
        threads: None,
        ctx_size: Some(n_ctx),
        kv_type: crate::args::KvTypeArg::F16,
        device,
        prefill_chunk: None,
    };
    let loaded = crate::device::backend(&gguf, &args, &display, None, &|n| n + 64)
        .with_context(|| format!("loading {display} on {device}"))?;
    eprintln!("{display} on {}", loaded.device_name);
    Ok(OnDevice {
        tok,
        name: display.clone(),
        target: Target::Device {
            gguf,
            args,
            name: display,
            first: Mutex::new(Some(loaded.backend)),
        },
        n_vocab: loaded.n_vocab,
    })
}

/// One generation: its tokens, decode tokens/s and speculation counters.
type RunResult = (Vec<u32>, f64, Option<SpecStats>);

/// One result row.
#[derive(Debug, Clone, Serialize)]
pub struct SpecBenchRow {
    workload: &'static str,
    /// One of the extraction suite.
    extraction: bool,
    drafter: String,
    tokens: usize,
    tokens_per_second: f64,
    speedup: f64,
    identical: bool,
    cycles: u64,
    drafted: u64,
    accepted: u64,
    accept_rate: f64,
    mean_accepted: f64,
    forced: u64,
    no_draft: u64,
    time_saved_ms: f64,
}

struct Workload {
    name: &'static str,
    prompt: String,
    schema: Option<serde_json::Value>,
    /// One of the extraction suite.
    extraction: bool,
}

/// A Qwen chat prompt: `system`, then the user's `task` and `input`.
fn chat_prompt(system: &str, task: &str, input: &str) -> String {
    format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{task}\n{input}<|im_end|>\n\
         <|im_start|>assistant\n"
    )
}

/// An array-of-objects schema: every property required, no others.
fn records(props: serde_json::Value) -> serde_json::Value {
    let required: Vec<String> = props
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    serde_json::json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": false
        }
    })
}

/// The extraction suite: six inputs in different shapes, each under a JSON Schema.
fn extraction_suite() -> Vec<Workload> {
    use serde_json::json;
    let sys = "You extract data into JSON exactly as asked.";
    let csv = "id,name,department,role,salary,start_date\n\
               1001,\"Okafor, Chidi\",Engineering,senior,98500.50,2019-04-15\n\
               1002,\"van der Berg, Anneke\",\"Sales, EMEA\",junior,52000.00,2021-11-01\n\
               1003,\"O'Neil, Patrick\",Support,lead,61250.75,2017-06-30\n\
               1004,\"Garcia Marquez, Lucia\",Engineering,junior,70100.00,2022-01-10\n\
               1005,\"Smith, Jo\",\"Finance, Group\",senior,88000.25,2015-09-21\n";
    let logs = "2024-05-01T12:00:03Z INFO api-gateway GET /v1/users 200 took 12ms\n\
                2024-05-01T12:00:04Z WARN auth-service token refresh slow took 842ms\n\
                2024-05-01T12:00:07Z ERROR billing charge failed for order 5531 took 1503ms\n\
                2024-05-01T12:00:09Z INFO api-gateway POST /v1/orders 201 took 48ms\n\
                2024-05-01T12:00:12Z DEBUG scheduler job sweep-expired done took 3ms\n";
    let kv = "Name: Ada Lovelace\nEmail: ada@example.com\nPhone: +44 20 7946 0018\nPlan: premium\nSeats: 12\n\n\
              Name: Alan Turing\nEmail: alan@example.org\nPhone: +44 161 496 0723\nPlan: team\nSeats: 4\n\n\
              Name: Grace Hopper\nEmail: grace@example.net\nPhone: +1 202 555 0147\nPlan: free\nSeats: 1\n\n\
              Name: Katherine Johnson\nEmail: kj@example.com\nPhone: +1 757 555 0199\nPlan: team\nSeats: 7\n";
    let html = "<table>\n\
                <tr><th>Product</th><th>SKU</th><th>Price</th><th>In stock</th></tr>\n\
                <tr><td>Wireless Mouse</td><td>WM-204</td><td>24.99</td><td>yes</td></tr>\n\
                <tr><td>Mechanical Keyboard</td><td>KB-880</td><td>89.00</td><td>no</td></tr>\n\
                <tr><td>USB-C Hub 7-in-1</td><td>HB-071</td><td>39.50</td><td>yes</td></tr>\n\
                <tr><td>27in Monitor Arm</td><td>MA-027</td><td>54.95</td><td>yes</td></tr>\n\
                <tr><td>Laptop Stand</td><td>LS-110</td><td>29.00</td><td>no</td></tr>\n\
                </table>\n";
    let nested = "Order A-1001 (customer: Maria Rossi, maria@example.com)\n\
                  - 2 x Espresso Beans 1kg @ 18.50\n\
                  - 1 x Milk Frother @ 34.00\n\
                  Order A-1002 (customer: Kenji Sato, kenji@example.com)\n\
                  - 3 x Green Tea 250g @ 7.25\n\
                  - 1 x Glass Teapot @ 22.90\n\
                  - 2 x Bamboo Tray @ 12.00\n\
                  Order A-1003 (customer: Ana Souza, ana@example.com)\n\
                  - 1 x Pour-Over Kettle @ 45.00\n";
    let invoices = "Invoice INV-7731 was issued on 3 March 2024 for a total of $1,234.50, due in 30 days.\n\
                    Invoice INV-7732 was issued on 17 April 2024 for a total of $89.99, due in 14 days.\n\
                    Invoice INV-7733 was issued on 2 May 2024 for a total of $12,000.00, due in 60 days.\n\
                    Invoice INV-7734 was issued on 28 June 2024 for a total of $450.10, due in 30 days.\n";
    let date = json!({"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"});
    vec![
        Workload {
            name: "csv-quoted",
            prompt: chat_prompt(
                sys,
                "Convert this CSV (quoted fields may hold commas) to a JSON array, one object per row:",
                csv,
            ),
            schema: Some(records(json!({
                "id": {"type": "integer"},
                "name": {"type": "string"},
                "department": {"type": "string"},
                "role": {"enum": ["junior", "senior", "lead"]},
                "salary": {"type": "number"},
                "start_date": date.clone()
            }))),
            extraction: true,
        },
        Workload {
            name: "log-lines",
            prompt: chat_prompt(
                sys,
                "Turn each log line into a JSON object (timestamp, level, service, message, duration in ms):",
                logs,
            ),
            schema: Some(records(json!({
                "timestamp": {"type": "string"},
                "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                "service": {"type": "string"},
                "message": {"type": "string"},
                "duration_ms": {"type": "integer"}
            }))),
            extraction: true,
        },
        Workload {
            name: "key-value",
            prompt: chat_prompt(sys, "Extract one JSON object per customer record:", kv),
            schema: Some(records(json!({
                "name": {"type": "string"},
                "email": {"type": "string"},
                "phone": {"type": "string"},
                "plan": {"enum": ["free", "team", "premium"]},
                "seats": {"type": "integer"}
            }))),
            extraction: true,
        },
        Workload {
            name: "html-table",
            prompt: chat_prompt(sys, "Extract the rows of this HTML table as JSON:", html),
            schema: Some(records(json!({
                "product": {"type": "string"},
                "sku": {"type": "string"},
                "price": {"type": "number"},
                "in_stock": {"type": "boolean"}
            }))),
            extraction: true,
        },
        Workload {
            name: "nested",
            prompt: chat_prompt(
                sys,
                "Extract the orders as JSON, each with its customer and its line items:",
                nested,
            ),
            schema: Some(records(json!({
                "order_id": {"type": "string"},
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                    "required": ["name", "email"],
                    "additionalProperties": false
                },
                "items": records(json!({
                    "quantity": {"type": "integer"},
                    "product": {"type": "string"},
                    "unit_price": {"type": "number"}
                }))
            }))),
            extraction: true,
        },
        Workload {
            name: "reformat",
            prompt: chat_prompt(
                sys,
                "Extract the invoices as JSON: dates as YYYY-MM-DD, totals as plain numbers:",
                invoices,
            ),
            schema: Some(records(json!({
                "invoice": {"type": "string"},
                "issued": date,
                "total": {"type": "number"},
                "due_days": {"type": "integer"}
            }))),
            extraction: true,
        },
    ]
}

fn workloads() -> Vec<Workload> {
    let csv = "name,age,city,email\nAda Lovelace,36,London,ada@example.com\n\
               Alan Turing,41,Wilmslow,alan@example.com\nGrace Hopper,85,Arlington,grace@example.com\n\
               Edsger Dijkstra,72,Nuenen,edsger@example.com\nBarbara Liskov,84,Boston,barbara@example.com\n";
    let mut all = vec![
        Workload {
            name: "structured",
            prompt: format!(
                "<|im_start|>system\nYou convert CSV to JSON.<|im_end|>\n<|im_start|>user\n\
                 Convert this CSV to a JSON array with one object per row:\n{csv}<|im_end|>\n\
                 <|im_start|>assistant\n"
            ),
            schema: Some(serde_json::json!({
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "age": {"type": "integer"},
                        "city": {"type": "string"},
                        "email": {"type": "string"}
                    },
                    "required": ["name", "age", "city", "email"],
                    "additionalProperties": false
                }
            })),
            extraction: false,
        },
        Workload {
            name: "code",
            prompt: "<|im_start|>user\nAdd a method `area` to each class, in the same style:\n\
                     ```python\nclass Square:\n    def __init__(self, side):\n        self.side = side\n\n\
                     class Rectangle:\n    def __init__(self, width, height):\n        self.width = width\n        self.height = height\n\n\
                     class Circle:\n    def __init__(self, radius):\n        self.radius = radius\n```<|im_end|>\n\
                     <|im_start|>assistant\n"
                .to_string(),
            schema: None,
            extraction: false,
        },
        Workload {
            name: "prose",
            prompt: "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a \
                     message in a bottle.<|im_end|>\n<|im_start|>assistant\n"
                .to_string(),
            schema: None,
            extraction: false,
        },
    ];
    all.extend(extraction_suite());
    all
}

/// The workloads `names` selects (all when empty; `extraction` = the suite); an unknown
/// name is an error.
fn selected(names: &[String]) -> anyhow::Result<Vec<Workload>> {
    let all = workloads();
    if names.is_empty() {
        return Ok(all);
    }
    for n in names {
        if n != "extraction" && !all.iter().any(|w| w.name == n) {
            let known: Vec<&str> = all.iter().map(|w| w.name).collect();
            bail!(
                "unknown --spec-workloads entry {n:?} (known: {}, extraction)",
                known.join(", ")
            );
        }
    }
    Ok(all
        .into_iter()
        .filter(|w| {
            names
                .iter()
                .any(|n| n == w.name || (n == "extraction" && w.extraction))
        })
        .collect())
}

/// The median of `xs` (the mean of the middle two for an even count); `None` when empty.
fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

fn load_model(
    name: &str,
    threads: Option<usize>,
    n_ctx: usize,
) -> anyhow::Result<(Arc<Model>, Tokenizer, String)> {
    let path = load::resolve_model_path(name)?;
    let display = load::display_name(name, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let tok = runtime::load::load_tokenizer(&gguf)?;
    let opts = LoadOptions {
        threads,
        n_ctx: Some(n_ctx),
        ..LoadOptions::default()
    };
    let model = Model::load(gguf, &opts).with_context(|| format!("loading {display}"))?;
    Ok((Arc::new(model), tok, display))
}

/// Generates once; returns (tokens, decode tokens/s, spec counters).
fn generate(
    engine: &Engine,
    req: GenerateRequest,
) -> anyhow::Result<(Vec<u32>, f64, Option<SpecStats>)> {
    let h = engine.submit(req)?;
    let mut tokens = Vec::new();
    for e in &h {
        match e {
            Event::Token { token, .. } => tokens.push(token),
            Event::Finished { usage, timings, .. } => {
                let n = tokens.len().saturating_sub(1) as f64;
                let tps = n / (timings.decode_ms / 1e3).max(1e-9);
                return Ok((tokens, tps, usage.spec));
            }
            Event::Error(e) => bail!("generation failed: {e}"),
        }
    }
    bail!("the engine ended the stream early")
}

/// Runs the speculative bench and prints a Markdown table (or JSON with `json`).
pub fn run(args: &SpecBenchArgs, json: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    let n_ctx = 2048;
    if args.replay.is_some() && args.device != DeviceArg::Cpu {
        bail!("--replay runs no model, so --device does not apply (drop it)");
    }
    if args.threads.is_some() && args.device != DeviceArg::Cpu {
        bail!("--threads applies to the CPU only (drop it or use --device cpu)");
    }
    let replay = match &args.replay {
        Some(p) => Some(Arc::new(Recording::load(p)?)),
        None => None,
    };
    // A replay needs only the tokenizer; the logits come from the recording.
    let (model, tok, name, n_vocab) = match &replay {
        Some(rec) => {
            let path = load::resolve_model_path(&args.model)?;
            let gguf = runtime::load::open_gguf(&path)?;
            let tok = runtime::load::load_tokenizer(&gguf)?;
            (
                None,
                tok,
                load::display_name(&args.model, &path),
                rec.n_vocab,
            )
        }
        None if args.device == DeviceArg::Cpu => {
            let (m, tok, name) = load_model(&args.model, args.threads, n_ctx)?;
            let n_vocab = m.config().n_vocab;
            (Some(Target::Cpu(m)), tok, name, n_vocab)
        }
        None => {
            // Loaded here to check it fits and to learn its name and width; the first run
            // takes this backend, each later run loads its own.
            let d = load_on_device(&args.model, args.device, n_ctx)?;
            (Some(d.target), d.tok, d.name, d.n_vocab)
        }
    };
    let tok = Arc::new(tok);
    let recording = args.record.as_ref().map(|_| {
        let mut r = Recording::default();
        r.n_vocab = n_vocab;
        Arc::new(Mutex::new(r))
    });
    let trace: Option<Arc<Mutex<std::io::BufWriter<std::fs::File>>>> = match &args.replay_trace {
        Some(p) => Some(Arc::new(Mutex::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )))),
        None => None,
    };
    let curve = StepCurve {
        t1_ms: args.replay_step_ms,
    };
    let repetitions = if replay.is_some() {
        1 // a replay is deterministic
    } else {
        args.repetitions
    };
    if args.draft.is_some() && (replay.is_some() || recording.is_some()) {
        bail!("--draft cannot be combined with --record or --replay");
    }
    let draft = match (&args.draft, &model) {
        (Some(d), Some(_)) if args.device == DeviceArg::Cpu => {
            let (dm, dtok, dname) = load_model(d, args.threads, n_ctx)?;
            Some(DraftModel::new(
                dname,
                Box::new(ModelBackend::new(dm)),
                &dtok,
                &tok,
                n_vocab,
                n_ctx + 64,
            )?)
        }
        (Some(d), Some(_)) => {
            let d = load_on_device(d, args.device, n_ctx)?;
            Some(DraftModel::new(
                d.name,
                d.target.backend()?,
                &d.tok,
                &tok,
                n_vocab,
                n_ctx + 64,
            )?)
        }
        _ => None,
    };
    let env = TokenEnv::with_logit_width(tok.clone(), n_vocab)?;
    let policy = PolicyConfig {
        max_draft: args.max_draft,
        ..PolicyConfig::default()
    };
    let mut configs: Vec<(String, SpecConfig)> = vec![
        ("plain".into(), SpecConfig::default()),
        (
            "ngram+ff".into(),
            SpecConfig {
                policy: policy.clone(),
                ..SpecConfig::auto(DrafterSet::free(3))
            },
        ),
    ];
    // What `run`, `chat` and `serve` do by default: the cross-request suffix index (fresh
    // per engine, so it drafts from the sequence itself here), n-gram, fast-forward.
    configs.insert(
        1,
        (
            "default (prompt-text+suffix+ngram+ff)".into(),
            SpecConfig {
                policy: policy.clone(),
                ..crate::spec_args::free_spec()
            },
        ),
    );
    if recording.is_some() {
        configs.truncate(1); // recording: the plain runs only
    }
    if let Some(dm) = &draft {
        configs.push((
            format!("draft {}+ff", dm.name()),
            SpecConfig {
                policy: policy.clone(),
                ..SpecConfig::auto(DrafterSet {
                    fast_forward: true,
                    ngram: None,
                    draft_model: Some(dm.clone()),
                    dspark: None,
                    suffix: None,
                    prompt_text: false,
                })
            },
        ));
        configs.push((
            format!("ngram+draft {}+ff", dm.name()),
            SpecConfig {
                policy: policy.clone(),
                ..SpecConfig::auto(DrafterSet {
                    fast_forward: true,
                    ngram: Some(spec::NgramConfig::default()),
                    draft_model: Some(dm.clone()),
                    dspark: None,
                    suffix: None,
                    prompt_text: false,
                })
            },
        ));
    }
    if !json {
        let how = match &args.replay {
            Some(p) => format!(
                "replaying {} (no model: a one-row step takes {} ms on the measured \
                 verify-cost curve, speeds are the curve's)",
                p.display(),
                args.replay_step_ms
            ),
            None => format!("best of {repetitions}"),
        };
        writeln!(
            out,
            "target {name}, {} tokens per workload, {how}\n\n\
             | workload | drafter | t/s | speed-up | identical | accept | mean acc. | cycles | forced | saved ms |\n\
             | -------- | ------- | --: | -------: | --------- | -----: | --------: | -----: | -----: | -------: |",
            args.max_tokens
        )?;
    }
    let mut rows = Vec::new();
    for w in selected(&args.workloads)? {
        let prompt = tok.encode(&w.prompt, EncodeOptions::raw_prompt());
        let compiled = match &w.schema {
            Some(s) => Some(
                Constraint::json_schema(s.clone())
                    .compile(&env, &GrammarLimits::default())
                    .context("compiling the bench schema")?,
            ),
            None => None,
        };
        let mut plain: Option<(Vec<u32>, f64)> = None;
        // Repetitions interleave the drafters (plain, then each speculative set, then
        // again), so a change in the machine's load hits every row alike.
        let mut bests: Vec<Option<RunResult>> = vec![None; configs.len()];
        for _ in 0..repetitions {
            for (ci, ((_, spec), best)) in configs.iter().zip(bests.iter_mut()).enumerate() {
                // A fresh engine per run, with a fresh cross-request index: a repetition
                // must not draft from an earlier repetition's (or workload's) output.
                let mut spec = spec.clone();
                if let Some(ix) = &spec.drafters.suffix {
                    spec.drafters.suffix = Some(Arc::new(SuffixIndex::new(*ix.config())));
                }
                let mut clock = None;
                let mut misses = None;
                let backend: Box<dyn engine::ForwardBackend> = match (&replay, &model) {
                    (Some(rec), _) => {
                        let mut b =
                            ReplayBackend::new(Arc::clone(rec), curve, n_ctx + 64).without_sleep();
                        clock = Some(b.decode_clock());
                        if ci == 0 {
                            misses = Some(b.misses());
                        } else if let Some(t) = &trace {
                            b = b.with_trace(Box::new(SharedWriter(Arc::clone(t))), tok.clone());
                        }
                        Box::new(b)
                    }
                    (None, Some(target)) => {
                        let inner = target.backend()?;
                        match &recording {
                            Some(rec) => Box::new(RecordingBackend::new(inner, Arc::clone(rec))),
                            None => inner,
                        }
                    }
                    (None, None) => bail!("no model and no recording"),
                };
                let engine = Engine::start(
                    backend,
                    tok.clone(),
                    EngineConfig {
                        max_seqs: 1,
                        kv_tokens: n_ctx + 64,
                        context_len: n_ctx,
                        prefix_cache: false,
                        spec,
                        ..EngineConfig::default()
                    },
                )?;
                let mut req = GenerateRequest::new(prompt.clone(), SamplingParams::greedy());
                req.max_tokens = Some(args.max_tokens);
                req.constraint = compiled
                    .as_ref()
                    .map(|c| Box::new(c.matcher()) as Box<dyn engine::TokenConstraint>);
                let r = generate(&engine, req);
                engine.shutdown();
                let mut r = r?;
                if let Some(c) = clock {
                    // The curve's decode time, not the wall clock's.
                    let s = c.load(Ordering::Relaxed) as f64 / 1e6;
                    r.1 = r.0.len().saturating_sub(1) as f64 / s.max(1e-9);
                }
                if let Some(m) = misses
                    && m.load(Ordering::Relaxed) > 0
                {
                    bail!(
                        "{}: the plain replay left the recording: it is not of this model, \
                         these workloads or this lockstep",
                        w.name
                    );
                }
                if best.as_ref().is_none_or(|b| r.1 > b.1) {
                    *best = Some(r);
                }
            }
        }
        for ((dname, _), best) in configs.iter().zip(bests) {
            let Some((tokens, tps, stats)) = best else {
                continue;
            };
            let (identical, base) = match &plain {
                None => {
                    plain = Some((tokens.clone(), tps));
                    (true, tps)
                }
                Some((pt, ptps)) => (*pt == tokens, *ptps),
            };
            let s = stats.unwrap_or_default();
            let row = SpecBenchRow {
                workload: w.name,
                extraction: w.extraction,
                drafter: dname.clone(),
                tokens: tokens.len(),
                tokens_per_second: tps,
                speedup: tps / base.max(1e-9),
                identical,
                cycles: s.cycles,
                drafted: s.drafted,
                accepted: s.accepted,
                accept_rate: s.accept_rate(),
                mean_accepted: s.mean_accepted(),
                forced: s.forced,
                no_draft: s.no_draft,
                time_saved_ms: s.time_saved_us as f64 / 1e3,
            };
            if !json {
                writeln!(
                    out,
                    "| {} | {} | {:.2} | {:.2}× | {} | {:.1}% | {:.2} | {} | {} | {:.0} |",
                    row.workload,
                    row.drafter,
                    row.tokens_per_second,
                    row.speedup,
                    if row.identical { "yes" } else { "NO" },
                    100.0 * row.accept_rate,
                    row.mean_accepted,
                    row.cycles,
                    row.forced,
                    row.time_saved_ms
                )?;
                out.flush()?;
            }
            rows.push(row);
        }
    }
    if !json {
        // The extraction suite's speed-ups per drafter and their median.
        let suite: Vec<&SpecBenchRow> = rows
            .iter()
            .filter(|r| r.extraction && r.drafter != "plain")
            .collect();
        let mut drafters: Vec<&str> = Vec::new();
        for r in &suite {
            if !drafters.contains(&r.drafter.as_str()) {
                drafters.push(&r.drafter);
            }
        }
        for d in drafters {
            let xs: Vec<f64> = suite
                .iter()
                .filter(|r| r.drafter == d)
                .map(|r| r.speedup)
                .collect();
            let list: Vec<String> = suite
                .iter()
                .filter(|r| r.drafter == d)
                .map(|r| format!("{} {:.2}×", r.workload, r.speedup))
                .collect();
            if let Some(m) = median(&xs) {
                writeln!(
                    out,
                    "\nextraction suite, {d}: {}; median {m:.2}×",
                    list.join(", ")
                )?;
            }
        }
    }
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
    }
    if let (Some(p), Some(rec)) = (&args.record, &recording) {
        let rec = rec.lock().unwrap_or_else(|e| e.into_inner());
        rec.save(p)?;
        if !json {
            writeln!(
                out,
                "\nrecorded {} logit rows of the plain runs in {}",
                rec.len(),
                p.display()
            )?;
        }
    }
    if rows.iter().any(|r| !r.identical) {
        bail!("a speculative output differed from plain decoding (G2 violated)");
    }
    Ok(())
}

/// A trace file shared by the runs of a replay.
struct SharedWriter(Arc<Mutex<std::io::BufWriter<std::fs::File>>>);

impl Write for SharedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extraction_suite_has_six_varied_workloads_with_valid_schemas() {
        let suite = extraction_suite();
        assert_eq!(suite.len(), 6);
        for w in &suite {
            let s = w.schema.as_ref().expect("every extraction has a schema");
            assert_eq!(s["type"], "array", "{}", w.name);
            let props = s["items"]["properties"].as_object().expect("properties");
            let required = s["items"]["required"].as_array().expect("required");
            assert_eq!(props.len(), required.len(), "{}: all required", w.name);
            assert!(w.prompt.ends_with("<|im_start|>assistant\n"), "{}", w.name);
        }
        let names: Vec<&str> = suite.iter().map(|w| w.name).collect();
        assert_eq!(
            names,
            [
                "csv-quoted",
                "log-lines",
                "key-value",
                "html-table",
                "nested",
                "reformat"
            ]
        );
    }

    #[test]
    fn workloads_are_selected_by_name_or_as_the_suite_and_unknown_names_fail() {
        let pick = |v: &[&str]| -> Vec<&'static str> {
            let names: Vec<String> = v.iter().map(|s| s.to_string()).collect();
            selected(&names).unwrap().iter().map(|w| w.name).collect()
        };
        assert_eq!(pick(&[]).len(), 9);
        assert_eq!(pick(&["prose", "nested"]), ["prose", "nested"]);
        assert_eq!(pick(&["extraction"]).len(), 6);
        assert!(pick(&["extraction", "structured"]).contains(&"structured"));
        let err = selected(&["poetry".to_string()]).err().expect("an error");
        assert!(err.to_string().contains("poetry"), "{err}");
    }

    #[test]
    fn the_median_of_odd_and_even_counts() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }
}
