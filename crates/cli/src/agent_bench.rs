//! `lockstep bench --agent`: replays multi-turn agent sessions through the HTTP server
//! with speculation off and on, side by side, and reports per workload the speed-up, the
//! acceptance and the tokens per verify cycle.
//!
//! The sessions are data (`agent/sessions.json`): a coding agent fixing and extending a
//! Python file over 12 turns (read the file, run the tests, edit with exact
//! `old_string`/`new_string`, rerun), an order-support JSON tool-calling loop (14 turns of
//! search / get / update / email calls), and a 5-turn chat. A request is sent wherever the
//! script has an assistant message, with the messages before it as the history (the
//! script's own assistant messages, so both servers see the same prompts). Two servers run
//! in-process: one plain, one speculating with the free drafters (the cross-request suffix
//! index, n-gram, grammar fast-forward) and the default adaptive policy — what `lockstep
//! serve` does by default. Each turn goes to both, alternating which goes first (the
//! machine's load affects both alike), and their answers must be identical (content, tool
//! calls, finish reason, token counts); a difference is an error. Speed is completion
//! tokens over the servers' decode time (`lockstep_decode_seconds_total`, first token to
//! finish) and, end to end, over the request wall time.
//!
//! Beside the speeds it reports the counters that do not depend on the machine: the
//! *coverage* (output tokens that arrived as accepted drafts, over all output tokens),
//! per drafter (suffix index, n-gram, fast-forward) and why the steps without a draft had
//! none (the policy's gates, or no drafter had a proposal).
//!
//! `--record FILE` keeps the plain server's logits ([`crate::replay`]); `--replay FILE`
//! then runs both servers on those logits without the model, each forward taking the
//! measured verify-cost curve's time: counters of the real model, speeds of the curve, the
//! same on a loaded machine as on a quiet one.

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::load;
use crate::replay::{Recording, RecordingBackend, ReplayBackend, StepCurve};
use crate::serve_bench::{HttpBody, read_head};

/// The replayed sessions.
const SESSIONS: &str = include_str!("agent/sessions.json");

/// One scripted session.
#[derive(Debug, Clone, Deserialize)]
struct Session {
    name: String,
    max_tokens: usize,
    #[serde(default)]
    tools: Option<Value>,
    messages: Vec<Value>,
}

/// What the run needs (from the general bench flags).
#[derive(Debug, Clone)]
pub struct AgentBenchSetup {
    /// Model name or path.
    pub model: String,
    /// Forward threads (`None` = one per core).
    pub threads: Option<usize>,
    /// Print one JSON array instead of a Markdown table.
    pub json: bool,
    /// Only these sessions (empty = all).
    pub sessions: Vec<String>,
    /// Keep the plain server's logits in this file ([`crate::replay`]).
    pub record: Option<PathBuf>,
    /// Run both servers on this recording instead of the model.
    pub replay: Option<PathBuf>,
    /// With `replay`: the time of a one-row step, ms.
    pub replay_step_ms: f64,
    /// With `replay`: trace the speculative server's forwards to this file.
    pub replay_trace: Option<PathBuf>,
    /// Where both servers run the model (each its own copy).
    pub device: crate::device::DeviceArg,
}

/// One workload's totals.
#[derive(Debug, Clone, Default, Serialize)]
struct WorkloadResult {
    workload: String,
    turns: usize,
    completion_tokens: u64,
    plain_decode_s: f64,
    spec_decode_s: f64,
    plain_wall_s: f64,
    spec_wall_s: f64,
    decode_speedup: f64,
    wall_speedup: f64,
    /// With a replay: the verify-cost curve's decode time of each server, s.
    plain_curve_s: f64,
    spec_curve_s: f64,
    /// Their ratio: the decode speed-up on the curve, independent of the machine.
    curve_speedup: f64,
    cycles: u64,
    drafted: u64,
    accepted: u64,
    accept_rate: f64,
    tokens_per_cycle: f64,
    suffix_drafted: u64,
    suffix_accepted: u64,
    /// Accepted draft tokens over output tokens.
    coverage: f64,
    /// Per drafter kind: (cycles, drafted, accepted).
    by_drafter: BTreeMap<String, (u64, u64, u64)>,
    /// Decode steps without a draft, by reason.
    no_draft: BTreeMap<String, u64>,
}

/// One server under test.
struct Target {
    server: server::BackgroundServer,
    addr: SocketAddr,
    /// With a replay backend: its curve clock (µs).
    clock: Option<Arc<AtomicU64>>,
}

impl Target {
    fn start(
        path: &std::path::Path,
        opts: &runtime::ModelOptions,
        what: &str,
        backend: Option<(Box<dyn engine::ForwardBackend>, String)>,
    ) -> anyhow::Result<Target> {
        let rt = match backend {
            Some((b, name)) => runtime::Runtime::open_with_backend(path, opts, b, &name),
            None => runtime::Runtime::open(path, opts),
        };
        let model = Arc::new(rt.with_context(|| format!("loading {} ({what})", path.display()))?);
        let server = server::BackgroundServer::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            model,
            server::ServerConfig::default(),
        )
        .with_context(|| format!("starting the {what} server"))?;
        let addr = server.local_addr();
        Ok(Target {
            server,
            addr,
            clock: None,
        })
    }

    /// The curve clock's seconds (0 without a replay backend).
    fn curve_seconds(&self) -> f64 {
        self.clock
            .as_ref()
            .map_or(0.0, |c| c.load(Ordering::Relaxed) as f64 / 1e6)
    }

    /// The server's total decode seconds so far.
    fn decode_seconds(&self) -> anyhow::Result<f64> {
        let (status, body) = http(self.addr, "GET", "/metrics", None)?;
        if status != 200 {
            bail!("GET /metrics: HTTP {status}");
        }
        let text = String::from_utf8_lossy(&body);
        text.lines()
            .find_map(|l| l.strip_prefix("lockstep_decode_seconds_total "))
            .and_then(|v| v.trim().parse().ok())
            .context("/metrics has no lockstep_decode_seconds_total")
    }

    /// Sends one chat completion: the response, its wall time and the decode seconds it
    /// added.
    fn turn(&self, body: &Value) -> anyhow::Result<(Value, f64, f64)> {
        let d0 = self.decode_seconds()?;
        let t0 = Instant::now();
        let (status, resp) = http(
            self.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
        )?;
        let wall = t0.elapsed().as_secs_f64();
        let resp: Value = serde_json::from_slice(&resp).context("the response is not JSON")?;
        if status != 200 {
            bail!("HTTP {status}: {resp}");
        }
        let d1 = self.decode_seconds()?;
        Ok((resp, wall, d1 - d0))
    }
}

/// What must be identical between the plain and the speculative answer: the message (tool
/// call ids aside), the finish reason and the token counts.
fn comparable(resp: &Value) -> Value {
    let choice = &resp["choices"][0];
    let mut message = choice["message"].clone();
    if let Some(calls) = message.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
        for c in calls {
            if let Some(o) = c.as_object_mut() {
                o.remove("id");
            }
        }
    }
    json!({
        "message": message,
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": resp["usage"]["prompt_tokens"],
        "completion_tokens": resp["usage"]["completion_tokens"],
    })
}

/// Runs the benchmark and writes the table (or JSON) to `out`.
pub fn run(setup: &AgentBenchSetup, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut sessions: Vec<Session> =
        serde_json::from_str(SESSIONS).context("the built-in agent sessions do not parse")?;
    if !setup.sessions.is_empty() {
        for n in &setup.sessions {
            if !sessions.iter().any(|s| &s.name == n) {
                let known: Vec<&str> = sessions.iter().map(|s| s.name.as_str()).collect();
                bail!("unknown agent session {n:?} (known: {})", known.join(", "));
            }
        }
        sessions.retain(|s| setup.sessions.contains(&s.name));
    }
    let path = load::resolve_model_path(&setup.model)?;
    let name = load::display_name(&setup.model, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let n_ctx = runtime::load::context_length(&gguf, None)?.min(8192);
    let mut opts = runtime::ModelOptions::new(name.clone());
    opts.threads = setup.threads;
    opts.ctx_size = Some(n_ctx);
    opts.max_seqs = 1;
    let replay = match &setup.replay {
        Some(p) => Some(Arc::new(Recording::load(p)?)),
        None => None,
    };
    let curve = StepCurve {
        t1_ms: setup.replay_step_ms,
    };
    let on_cpu = setup.device == crate::device::DeviceArg::Cpu;
    if !on_cpu && (setup.replay.is_some() || setup.record.is_some()) {
        bail!("--record and --replay run on the CPU (drop --device)");
    }
    if !on_cpu && setup.threads.is_some() {
        bail!("--threads applies to the CPU only (drop it or use --device cpu)");
    }
    // Off the CPU each server gets its own copy of the model on the device, loaded as
    // `serve --device` loads it.
    let on_device =
        |what: &str| -> anyhow::Result<Option<(Box<dyn engine::ForwardBackend>, String)>> {
            if on_cpu {
                return Ok(None);
            }
            let args = crate::args::ModelArgs {
                model: setup.model.clone(),
                threads: None,
                ctx_size: Some(n_ctx),
                kv_type: crate::args::KvTypeArg::F16,
                device: setup.device,
                prefill_chunk: None,
            };
            let loaded = crate::device::backend(&gguf, &args, &name, None, &|n| n + 64)
                .with_context(|| format!("loading {name} on {} ({what})", setup.device))?;
            Ok(Some((loaded.backend, loaded.device_name)))
        };
    let mut plain_misses: Option<Arc<AtomicU64>> = None;
    let mut plain_clock: Option<Arc<AtomicU64>> = None;
    let mut spec_clock: Option<Arc<AtomicU64>> = None;
    let recording = setup
        .record
        .as_ref()
        .map(|_| Arc::new(Mutex::new(Recording::default())));
    let plain_backend: Option<(Box<dyn engine::ForwardBackend>, String)> =
        match (&replay, &recording) {
            (Some(rec), _) => {
                let b = ReplayBackend::new(Arc::clone(rec), curve, n_ctx);
                plain_misses = Some(b.misses());
                plain_clock = Some(b.decode_clock());
                Some((Box::new(b), "replay".to_string()))
            }
            (None, Some(rec)) => {
                let model = runtime::load::load_model(
                    &gguf,
                    setup.threads,
                    Some(n_ctx),
                    model::KvType::default(),
                )?;
                let inner = engine::ModelBackend::new(Arc::new(model));
                rec.lock().unwrap_or_else(|e| e.into_inner()).n_vocab =
                    engine::ForwardBackend::n_vocab(&inner);
                Some((
                    Box::new(RecordingBackend::new(Box::new(inner), Arc::clone(rec))),
                    "recording".to_string(),
                ))
            }
            (None, None) => on_device("plain")?,
        };
    let device_backend = if replay.is_none() {
        on_device("speculative")?
    } else {
        None
    };
    let device_name = device_backend.as_ref().map(|(_, n)| n.clone());
    if replay.is_none() && on_cpu {
        runtime::load::check_memory(&gguf, n_ctx, model::KvType::default())?;
    }
    drop(gguf);
    let mut plain = Target::start(&path, &opts, "plain", plain_backend)?;
    plain.clock = plain_clock;
    opts.spec = crate::spec_args::free_spec();
    let spec_backend: Option<(Box<dyn engine::ForwardBackend>, String)> = match &replay {
        Some(rec) => {
            let mut b = ReplayBackend::new(Arc::clone(rec), curve, n_ctx);
            spec_clock = Some(b.decode_clock());
            if let Some(p) = &setup.replay_trace {
                let f = std::fs::File::create(p)
                    .with_context(|| format!("creating {}", p.display()))?;
                let gguf = runtime::load::open_gguf(&path)?;
                let tok = runtime::load::load_tokenizer(&gguf)?;
                b = b.with_trace(Box::new(std::io::BufWriter::new(f)), Arc::new(tok));
            }
            Some((Box::new(b), "replay".to_string()))
        }
        None => device_backend,
    };
    let mut spec = Target::start(&path, &opts, "speculative", spec_backend)?;
    spec.clock = spec_clock;
    if !setup.json {
        let how = match &setup.replay {
            Some(p) => format!(
                "replaying {} (no model: a one-row step takes {} ms on the measured \
                 verify-cost curve)",
                p.display(),
                setup.replay_step_ms
            ),
            None => match &device_name {
                Some(d) => d.clone(),
                None => format!(
                    "{} threads",
                    setup.threads.unwrap_or_else(|| {
                        std::thread::available_parallelism().map_or(1, |n| n.get())
                    })
                ),
            },
        };
        writeln!(
            out,
            "lockstep bench --agent: {name}, {how}, context {n_ctx}; plain and \
             speculative servers side by side (free drafters: prompt text, suffix index, \
             n-gram, fast-forward; adaptive policy); load average before: {}",
            load_average()
        )?;
        out.flush()?;
    }
    // Warm-up (untimed): page in the weights on both.
    let warm = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                      "temperature": 0});
    plain.turn(&warm).context("the plain warm-up failed")?;
    spec.turn(&warm).context("the speculative warm-up failed")?;
    let mut results = Vec::new();
    let mut order = 0usize;
    for s in &sessions {
        let mut r = WorkloadResult {
            workload: s.name.clone(),
            ..WorkloadResult::default()
        };
        for (i, m) in s.messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let mut body = json!({
                "messages": &s.messages[..i],
                "max_tokens": s.max_tokens,
                "temperature": 0,
            });
            if let Some(tools) = &s.tools {
                body["tools"] = tools.clone();
            }
            order += 1;
            let curve0 = (plain.curve_seconds(), spec.curve_seconds());
            let (p, sp) = if order.is_multiple_of(2) {
                let p = plain.turn(&body)?;
                (p, spec.turn(&body)?)
            } else {
                let sp = spec.turn(&body)?;
                (plain.turn(&body)?, sp)
            };
            let (a, b) = (comparable(&p.0), comparable(&sp.0));
            if a != b {
                bail!(
                    "{} turn {}: the speculative answer differs from plain decoding\n\
                     plain: {a}\nspec:  {b}",
                    s.name,
                    r.turns + 1
                );
            }
            r.turns += 1;
            r.plain_curve_s += plain.curve_seconds() - curve0.0;
            r.spec_curve_s += spec.curve_seconds() - curve0.1;
            let tokens = a["completion_tokens"].as_u64().unwrap_or(0);
            eprintln!(
                "{} turn {}: {tokens} tokens, decode {:.2} s plain, {:.2} s speculative",
                s.name, r.turns, p.2, sp.2
            );
            r.completion_tokens += tokens;
            r.plain_wall_s += p.1;
            r.spec_wall_s += sp.1;
            r.plain_decode_s += p.2;
            r.spec_decode_s += sp.2;
            let c = &sp.0["usage"]["speculative"];
            let n = |v: &Value| v.as_u64().unwrap_or(0);
            r.cycles += n(&c["cycles"]);
            r.drafted += n(&c["drafted"]);
            r.accepted += n(&c["accepted"]);
            r.suffix_drafted += n(&c["suffix"]["drafted"]);
            r.suffix_accepted += n(&c["suffix"]["accepted"]);
            if let Some(kinds) = c["by_drafter"].as_object() {
                for (k, v) in kinds {
                    let e = r.by_drafter.entry(k.clone()).or_default();
                    e.0 += n(&v["cycles"]);
                    e.1 += n(&v["drafted"]);
                    e.2 += n(&v["accepted"]);
                }
            }
            if let Some(reasons) = c["no_draft_reasons"].as_object() {
                for (k, v) in reasons {
                    *r.no_draft.entry(k.clone()).or_default() += n(v);
                }
            }
        }
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        r.decode_speedup = ratio(r.plain_decode_s, r.spec_decode_s);
        r.wall_speedup = ratio(r.plain_wall_s, r.spec_wall_s);
        r.curve_speedup = ratio(r.plain_curve_s, r.spec_curve_s);
        r.accept_rate = ratio(r.accepted as f64, r.drafted as f64);
        r.tokens_per_cycle = ratio((r.accepted + r.cycles) as f64, r.cycles as f64);
        r.coverage = ratio(r.accepted as f64, r.completion_tokens as f64);
        if !setup.json {
            if results.is_empty() {
                writeln!(
                    out,
                    "\n| workload | turns | tokens | plain t/s | spec t/s | decode speed-up | \
                     end-to-end speed-up | curve speed-up | accepted/drafted | coverage | \
                     tokens/cycle |\n\
                     | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"
                )?;
            }
            let tps = |s: f64| ratio(r.completion_tokens as f64, s);
            writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.2} | {:.2}x | {:.2}x | {} | {}/{} ({:.0}%) | {:.1}% | \
                 {:.2} |",
                r.workload,
                r.turns,
                r.completion_tokens,
                tps(r.plain_decode_s),
                tps(r.spec_decode_s),
                r.decode_speedup,
                r.wall_speedup,
                if setup.replay.is_some() {
                    format!("{:.2}x", r.curve_speedup)
                } else {
                    "n/a".into()
                },
                r.accepted,
                r.drafted,
                100.0 * r.accept_rate,
                100.0 * r.coverage,
                r.tokens_per_cycle
            )?;
            out.flush()?;
        }
        results.push(r);
    }
    if setup.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?;
    } else {
        write_counters(&results, out)?;
        writeln!(
            out,
            "\nevery turn's answer was identical with speculation on and off; load average \
             after: {}",
            load_average()
        )?;
    }
    if let Some(m) = plain_misses {
        let m = m.load(Ordering::Relaxed);
        if m > 0 {
            bail!(
                "the plain replay left the recording at {m} rows: the recording is not of \
                 this model, these sessions or this lockstep"
            );
        }
    }
    if let (Some(p), Some(rec)) = (&setup.record, &recording) {
        let rec = rec.lock().unwrap_or_else(|e| e.into_inner());
        rec.save(p)?;
        if !setup.json {
            writeln!(
                out,
                "recorded {} logit rows of the plain server in {}",
                rec.len(),
                p.display()
            )?;
        }
    }
    plain
        .server
        .shutdown()
        .context("stopping the plain server")?;
    spec.server
        .shutdown()
        .context("stopping the speculative server")?;
    Ok(())
}

/// The machine-independent counters per workload: coverage per drafter (accepted draft
/// tokens of that drafter over output tokens, with its accepted/drafted) and the decode
/// steps without a draft by reason.
fn write_counters(results: &[WorkloadResult], out: &mut dyn Write) -> anyhow::Result<()> {
    let kinds = [
        "prompt-text",
        "suffix",
        "ngram",
        "fast-forward",
        "draft-model",
        "dspark",
    ];
    let shown: Vec<&str> = kinds
        .iter()
        .copied()
        .filter(|k| results.iter().any(|r| r.by_drafter.contains_key(*k)))
        .collect();
    let reasons = ["nothing", "cost", "backoff", "margin", "room"];
    write!(out, "\n| workload | tokens | coverage |")?;
    for k in &shown {
        write!(out, " {k}: coverage (acc/drafted) |")?;
    }
    write!(out, " no-draft steps |")?;
    for r in &reasons {
        write!(out, " {r} |")?;
    }
    write!(out, "\n| --- | --: | --: |")?;
    for _ in 0..shown.len() + 1 + reasons.len() {
        write!(out, " --: |")?;
    }
    writeln!(out)?;
    for r in results {
        let pct = |a: u64| 100.0 * a as f64 / (r.completion_tokens as f64).max(1.0);
        write!(
            out,
            "| {} | {} | {:.1}% |",
            r.workload,
            r.completion_tokens,
            100.0 * r.coverage
        )?;
        for k in &shown {
            let (_, d, a) = r.by_drafter.get(*k).copied().unwrap_or_default();
            write!(out, " {:.1}% ({a}/{d}) |", pct(a))?;
        }
        let total: u64 = r.no_draft.values().sum();
        write!(out, " {total} |")?;
        for reason in &reasons {
            write!(out, " {} |", r.no_draft.get(*reason).copied().unwrap_or(0))?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// `/proc/loadavg`'s first three fields, or "unknown".
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// One HTTP/1.1 request over a fresh connection: the status and the whole body.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()?;
    let mut reader = BufReader::new(stream);
    let (status, chunked) = read_head(&mut reader)?;
    let mut body = HttpBody::new(reader, chunked);
    let mut out = Vec::new();
    while let Some(piece) = body.next_piece()? {
        out.extend_from_slice(&piece);
    }
    Ok((status, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_sessions_parse_and_have_the_promised_turns() {
        let sessions: Vec<Session> = serde_json::from_str(SESSIONS).unwrap();
        let turns: Vec<(&str, usize)> = sessions
            .iter()
            .map(|s| {
                let n = s
                    .messages
                    .iter()
                    .filter(|m| m["role"] == "assistant")
                    .count();
                (s.name.as_str(), n)
            })
            .collect();
        assert_eq!(
            turns,
            vec![("coding-agent", 12), ("tool-loop", 14), ("chat", 5)]
        );
        for s in &sessions {
            // Every tool result answers the call before it.
            for w in s.messages.windows(2) {
                if w[1]["role"] == "tool" {
                    assert_eq!(
                        w[0]["tool_calls"][0]["id"], w[1]["tool_call_id"],
                        "{}",
                        s.name
                    );
                }
            }
        }
    }

    #[test]
    fn tool_call_ids_do_not_count_as_a_difference_but_arguments_do() {
        let resp = |id: &str, args: &str| {
            json!({"choices": [{"message": {"role": "assistant", "content": null,
                "tool_calls": [{"id": id, "type": "function",
                    "function": {"name": "f", "arguments": args}}]},
                "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7}})
        };
        assert_eq!(comparable(&resp("a", "{}")), comparable(&resp("b", "{}")));
        assert_ne!(
            comparable(&resp("a", "{}")),
            comparable(&resp("a", "{\"x\":1}"))
        );
    }
}
