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

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::load;
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
    cycles: u64,
    drafted: u64,
    accepted: u64,
    accept_rate: f64,
    tokens_per_cycle: f64,
    suffix_drafted: u64,
    suffix_accepted: u64,
}

/// One server under test.
struct Target {
    server: server::BackgroundServer,
    addr: SocketAddr,
}

impl Target {
    fn start(
        path: &std::path::Path,
        opts: &runtime::ModelOptions,
        what: &str,
    ) -> anyhow::Result<Target> {
        let model = Arc::new(
            runtime::Runtime::open(path, opts)
                .with_context(|| format!("loading {} ({what})", path.display()))?,
        );
        let server = server::BackgroundServer::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            model,
            server::ServerConfig::default(),
        )
        .with_context(|| format!("starting the {what} server"))?;
        let addr = server.local_addr();
        Ok(Target { server, addr })
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
    let sessions: Vec<Session> =
        serde_json::from_str(SESSIONS).context("the built-in agent sessions do not parse")?;
    let path = load::resolve_model_path(&setup.model)?;
    let name = load::display_name(&setup.model, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let n_ctx = runtime::load::context_length(&gguf, None)?.min(8192);
    runtime::load::check_memory(&gguf, n_ctx, model::KvType::default())?;
    drop(gguf);
    let mut opts = runtime::ModelOptions::new(name.clone());
    opts.threads = setup.threads;
    opts.ctx_size = Some(n_ctx);
    opts.max_seqs = 1;
    let plain = Target::start(&path, &opts, "plain")?;
    opts.spec = crate::spec_args::free_spec();
    let spec = Target::start(&path, &opts, "speculative")?;
    if !setup.json {
        writeln!(
            out,
            "lockstep bench --agent: {name}, {} threads, context {n_ctx}; plain and \
             speculative servers side by side (free drafters: suffix index, n-gram, \
             fast-forward; adaptive policy); load average before: {}",
            setup
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
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
        }
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        r.decode_speedup = ratio(r.plain_decode_s, r.spec_decode_s);
        r.wall_speedup = ratio(r.plain_wall_s, r.spec_wall_s);
        r.accept_rate = ratio(r.accepted as f64, r.drafted as f64);
        r.tokens_per_cycle = ratio((r.accepted + r.cycles) as f64, r.cycles as f64);
        if !setup.json {
            if results.is_empty() {
                writeln!(
                    out,
                    "\n| workload | turns | tokens | plain t/s | spec t/s | decode speed-up | \
                     end-to-end speed-up | accepted/drafted | tokens/cycle | suffix acc/drafted |\n\
                     | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |"
                )?;
            }
            let tps = |s: f64| ratio(r.completion_tokens as f64, s);
            writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.2} | {:.2}x | {:.2}x | {}/{} ({:.0}%) | {:.2} | {}/{} |",
                r.workload,
                r.turns,
                r.completion_tokens,
                tps(r.plain_decode_s),
                tps(r.spec_decode_s),
                r.decode_speedup,
                r.wall_speedup,
                r.accepted,
                r.drafted,
                100.0 * r.accept_rate,
                r.tokens_per_cycle,
                r.suffix_accepted,
                r.suffix_drafted
            )?;
            out.flush()?;
        }
        results.push(r);
    }
    if setup.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?;
    } else {
        writeln!(
            out,
            "\nevery turn's answer was identical with speculation on and off; load average \
             after: {}",
            load_average()
        )?;
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
