//! `lockstep bench --serve`: a load benchmark of the HTTP server. It starts `lockstep
//! serve` in-process on a free local port, then for each client count K runs K concurrent
//! clients, each sending the same number of streaming chat-completion requests one after
//! another, and reports the aggregate generation speed (completion tokens of the run over
//! its wall time) and the time to first token (request sent → first content delta) at the
//! 50th and 99th percentile, with the engine's step counters over the run (steps, rows
//! per step, wall ms per step and the part of it spent in the backend's forward).
//!
//! Every request generates exactly `max_tokens` tokens (`ignore_eos`, temperature 0), and
//! every prompt is distinct (it names the run, client and request), so the prefix cache
//! shares only the chat template's opening between requests, as with real users.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use serde_json::{Value, json};

use crate::load;

/// The `--serve` flags of `lockstep bench`.
#[derive(Debug, Clone, Args)]
pub struct ServeBenchArgs {
    /// Load benchmark of `lockstep serve` instead: aggregate tokens/s and p50/p99 time to
    /// first token of concurrent streaming chat clients, and the engine's steps (rows per
    /// step, ms per step, ms of it in the forward) (first -m is the model, first -n the
    /// tokens per request, first -t the forward threads)
    #[arg(long = "serve", conflicts_with_all = ["spec", "constraint"])]
    pub serve: bool,

    /// With --serve: concurrent clients of each run; comma-separated or repeated
    #[arg(long = "clients", value_name = "K", value_delimiter = ',',
          default_values_t = [1, 4, 16], requires = "serve")]
    pub clients: Vec<usize>,

    /// With --serve: requests each client sends, one after another
    #[arg(long = "requests-per-client", value_name = "N", default_value_t = 4,
          requires = "serve", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub requests_per_client: u32,

    /// With --serve: sequences the server generates at once (default: the largest
    /// --clients)
    #[arg(long = "serve-max-seqs", value_name = "N", requires = "serve",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_seqs: Option<u32>,

    /// With --serve: each request is a raw completion of N prompt tokens (distinct token
    /// ids per request, so no prompt is cached) instead of a short chat, as
    /// `llama-batched-bench -npp N` measures
    #[arg(long = "serve-prompt-tokens", value_name = "N", requires = "serve",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub prompt_tokens: Option<u32>,
}

/// What the run needs besides the `--serve` flags (from the general bench flags).
#[derive(Debug, Clone)]
pub struct ServeBenchSetup {
    /// Model name or path.
    pub model: String,
    /// Forward threads (`None` = one per core).
    pub threads: Option<usize>,
    /// Completion tokens per request.
    pub max_tokens: usize,
    /// Print one JSON array instead of a Markdown table.
    pub json: bool,
    /// Where the server's forward runs (`--device`).
    pub device: crate::device::DeviceArg,
    /// Prompt rows per forward (`--prefill-chunk`; `None` = the backend's).
    pub prefill_chunk: Option<u32>,
}

/// One request's measurements.
#[derive(Debug, Clone, Copy)]
struct RequestSample {
    ttft: Duration,
    tokens: usize,
}

/// One row of the result table.
#[derive(Debug, Clone, Serialize)]
struct RunResult {
    model: String,
    clients: usize,
    requests: usize,
    max_tokens: usize,
    completion_tokens: usize,
    wall_s: f64,
    tokens_per_second: f64,
    per_client_tokens_per_second: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    ttft_max_ms: f64,
    /// The engine's forward steps during the run.
    steps: u64,
    /// Mean rows per step (prefill and decode rows together).
    rows_per_step: f64,
    /// Mean wall time per step, ms.
    step_ms: f64,
    /// Mean time per step inside the backend's forward, ms (the rest is the engine's own
    /// work: scheduling, sampling, grammar, speculation).
    forward_ms: f64,
}

/// The engine's step counters over one run (the difference of two snapshots).
#[derive(Debug, Clone, Copy, Default)]
struct StepStats {
    steps: u64,
    rows: u64,
    step_ms: f64,
    forward_ms: f64,
}

impl StepStats {
    fn between(before: &engine::EngineMetrics, after: &engine::EngineMetrics) -> StepStats {
        StepStats {
            steps: after.steps.saturating_sub(before.steps),
            rows: after.rows_total.saturating_sub(before.rows_total),
            step_ms: after.step_ms_total - before.step_ms_total,
            forward_ms: after.forward_ms_total - before.forward_ms_total,
        }
    }
}

/// Runs the benchmark and writes the table (or JSON) to `out`.
pub fn run(
    args: &ServeBenchArgs,
    setup: &ServeBenchSetup,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    if args.clients.is_empty() || args.clients.contains(&0) {
        bail!("--clients needs counts of at least 1");
    }
    if setup.max_tokens == 0 {
        bail!("the serve bench needs at least one token per request (-n)");
    }
    let largest = args.clients.iter().copied().max().unwrap_or(1);
    let max_seqs = args.max_seqs.map_or(largest, |n| n as usize);
    let path = load::resolve_model_path(&setup.model)?;
    let name = load::display_name(&setup.model, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let n_ctx = runtime::load::context_length(&gguf, None)?;
    let mut opts = runtime::ModelOptions::new(name.clone());
    opts.threads = setup.threads;
    opts.max_seqs = max_seqs;
    opts.queue_capacity = largest.max(64);
    opts.prefill_chunk = setup.prefill_chunk.map(|n| n as usize);
    // A GPU (asked for, or `auto` in a CUDA build) loads through device::backend, which
    // bounds the context by the device's memory; the CPU checks host RAM here.
    let on_gpu_maybe = match setup.device {
        crate::device::DeviceArg::Cpu => false,
        crate::device::DeviceArg::Cuda(_) => true,
        crate::device::DeviceArg::Auto => backend_cuda::cuda_built(),
    };
    let served = if on_gpu_maybe {
        let margs = crate::args::ModelArgs {
            model: setup.model.clone(),
            threads: setup.threads.and_then(|t| u16::try_from(t).ok()),
            ctx_size: None,
            kv_type: crate::args::KvTypeArg::F16,
            device: setup.device,
            prefill_chunk: setup.prefill_chunk,
        };
        let pool = opts.clone();
        let loaded =
            crate::device::backend(&gguf, &margs, &name, None, &|n| pool.kv_pool_tokens(n))?;
        opts.ctx_size = Some(loaded.n_ctx);
        drop(gguf);
        runtime::Runtime::open_with_backend(&path, &opts, loaded.backend, &loaded.device_name)
    } else {
        runtime::load::check_memory(&gguf, n_ctx, model::KvType::default())?;
        drop(gguf);
        opts.ctx_size = Some(n_ctx);
        runtime::Runtime::open(&path, &opts)
    };
    let model = Arc::new(served.with_context(|| format!("loading {}", path.display()))?);
    let n_vocab = model.engine().n_vocab();
    let fingerprint = model.fingerprint().to_string();
    let request = |tag: &str, max_tokens: usize| match args.prompt_tokens {
        Some(n) => Request::Tokens(token_prompt_body(tag, n as usize, n_vocab, max_tokens)),
        None => Request::Chat(request_body(tag, max_tokens)),
    };
    let served_model = Arc::clone(&model);
    let server = server::BackgroundServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        model,
        server::ServerConfig::default(),
    )
    .context("starting the server")?;
    let addr = server.local_addr();
    if !setup.json {
        writeln!(
            out,
            "lockstep serve {name} at {addr} ({}): max-seqs {max_seqs}, {} threads, {}{} tokens \
             per request, {} requests per client; load average before: {}",
            fingerprint,
            setup
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            args.prompt_tokens
                .map_or(String::new(), |n| format!("{n} prompt tokens and ")),
            setup.max_tokens,
            args.requests_per_client,
            load_average()
        )?;
        writeln!(
            out,
            "\n| clients | requests | tokens | wall s | aggregate t/s | per-client t/s | TTFT p50 ms | TTFT p99 ms | steps | rows/step | step ms | forward ms |\n\
             | ------: | -------: | -----: | -----: | ------------: | -------------: | ----------: | ----------: | ----: | --------: | ------: | ---------: |"
        )?;
        out.flush()?;
    }
    // Warm-up (untimed): page in the weights, fill the kernels' caches.
    stream_request(addr, &request("warm-up", setup.max_tokens.min(8)))
        .context("the warm-up request failed")?;
    let mut results = Vec::new();
    for (run_index, &clients) in args.clients.iter().enumerate() {
        let before = served_model.engine().metrics();
        let r = run_clients(
            addr,
            run_index,
            clients,
            args.requests_per_client as usize,
            &|tag| request(tag, setup.max_tokens),
        )?;
        let steps = StepStats::between(&before, &served_model.engine().metrics());
        let result = summarize(&name, clients, setup.max_tokens, &r, steps);
        if !setup.json {
            writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.0} | {:.0} | {} | {:.1} | {:.2} | {:.2} |",
                result.clients,
                result.requests,
                result.completion_tokens,
                result.wall_s,
                result.tokens_per_second,
                result.per_client_tokens_per_second,
                result.ttft_p50_ms,
                result.ttft_p99_ms,
                result.steps,
                result.rows_per_step,
                result.step_ms,
                result.forward_ms
            )?;
            out.flush()?;
        }
        results.push(result);
    }
    if setup.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&results)?)?;
    } else {
        writeln!(out, "\nload average after: {}", load_average())?;
    }
    server.shutdown().context("stopping the server")?;
    Ok(())
}

/// The samples of one run and its wall time.
struct RunSamples {
    samples: Vec<RequestSample>,
    wall: Duration,
}

fn run_clients(
    addr: SocketAddr,
    run_index: usize,
    clients: usize,
    requests: usize,
    request: &(dyn Fn(&str) -> Request + Sync),
) -> anyhow::Result<RunSamples> {
    let barrier = Barrier::new(clients + 1);
    let (samples, wall) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let barrier = &barrier;
                scope.spawn(move || -> anyhow::Result<Vec<RequestSample>> {
                    barrier.wait();
                    (0..requests)
                        .map(|j| {
                            let tag = format!("{run_index}-{c}-{j}");
                            stream_request(addr, &request(&tag))
                                .with_context(|| format!("client {c}, request {j}"))
                        })
                        .collect()
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let samples: Vec<anyhow::Result<Vec<RequestSample>>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect();
        (samples, start.elapsed())
    });
    let mut all = Vec::new();
    for s in samples {
        all.extend(s?);
    }
    Ok(RunSamples { samples: all, wall })
}

fn summarize(
    model: &str,
    clients: usize,
    max_tokens: usize,
    run: &RunSamples,
    steps: StepStats,
) -> RunResult {
    let tokens: usize = run.samples.iter().map(|s| s.tokens).sum();
    let wall = run.wall.as_secs_f64();
    let mut ttft: Vec<f64> = run
        .samples
        .iter()
        .map(|s| s.ttft.as_secs_f64() * 1e3)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let per_step = |x: f64| {
        if steps.steps > 0 {
            x / steps.steps as f64
        } else {
            0.0
        }
    };
    let aggregate = if wall > 0.0 {
        tokens as f64 / wall
    } else {
        0.0
    };
    RunResult {
        model: model.to_string(),
        clients,
        requests: run.samples.len(),
        max_tokens,
        completion_tokens: tokens,
        wall_s: wall,
        tokens_per_second: aggregate,
        per_client_tokens_per_second: aggregate / clients as f64,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_max_ms: ttft.last().copied().unwrap_or(0.0),
        steps: steps.steps,
        rows_per_step: per_step(steps.rows as f64),
        step_ms: per_step(steps.step_ms),
        forward_ms: per_step(steps.forward_ms),
    }
}

/// Nearest-rank percentile of sorted values (0 for none).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.clamp(1, sorted.len()) - 1)
        .copied()
        .unwrap_or(0.0)
}

/// The fixed request of `tag`: a distinct short prompt, greedy, exactly `max_tokens`.
fn request_body(tag: &str, max_tokens: usize) -> Value {
    json!({
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": format!(
                "Request {tag}. Write a long story about a lighthouse keeper and a storm.")}
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// One benchmark request: a short chat, or a raw completion of token ids.
enum Request {
    /// `POST /v1/chat/completions` with this body.
    Chat(Value),
    /// `POST /v1/completions` with this body.
    Tokens(Value),
}

/// The raw completion of `tag`: `n` token ids drawn from a hash of the tag (distinct per
/// request, inside the vocabulary's middle, away from the control tokens at its ends),
/// greedy, exactly `max_tokens`.
fn token_prompt_body(tag: &str, n: usize, n_vocab: usize, max_tokens: usize) -> Value {
    let lo = (n_vocab / 50) as u64;
    let span = ((n_vocab * 9 / 10) as u64).saturating_sub(lo).max(1);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tag.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let ids: Vec<u64> = (0..n as u64)
        .map(|i| {
            // splitmix64 of (tag hash, position)
            let mut z = h.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            lo + (z ^ (z >> 31)) % span
        })
        .collect();
    json!({
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// `/proc/loadavg`'s first three fields, or "unknown".
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// Sends one streaming request over a fresh connection and reads it to `[DONE]`: the time
/// to the first content (a chat delta's `content`, a completion's `text`) and the
/// completion tokens of the usage chunk.
fn stream_request(addr: SocketAddr, request: &Request) -> anyhow::Result<RequestSample> {
    let (path, body) = match request {
        Request::Chat(b) => ("/v1/chat/completions", b.to_string()),
        Request::Tokens(b) => ("/v1/completions", b.to_string()),
    };
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()?;
    let mut reader = BufReader::new(stream);
    let (status, chunked) = read_head(&mut reader)?;
    let mut body = HttpBody::new(reader, chunked);
    if status != 200 {
        let mut text = Vec::new();
        while let Some(piece) = body.next_piece()? {
            text.extend_from_slice(&piece);
        }
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
    }
    let mut sse = SseLines::default();
    let mut ttft = None;
    let mut tokens = None;
    while let Some(piece) = body.next_piece()? {
        for data in sse.push(&piece) {
            if data == "[DONE]" {
                let ttft = ttft.context("the stream had no content")?;
                let tokens = tokens.context("the stream had no usage chunk")?;
                return Ok(RequestSample { ttft, tokens });
            }
            let v: Value =
                serde_json::from_str(&data).with_context(|| format!("bad SSE data: {data}"))?;
            if let Some(e) = v.get("error") {
                bail!("the server reported an error: {e}");
            }
            let choice = &v["choices"][0];
            let has_content = choice["delta"]["content"]
                .as_str()
                .or_else(|| choice["text"].as_str())
                .is_some_and(|t| !t.is_empty());
            if has_content && ttft.is_none() {
                ttft = Some(start.elapsed());
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
            }
        }
    }
    bail!("the stream ended before data: [DONE]")
}

/// Reads the status line and headers; returns the status and whether the body is chunked.
pub(crate) fn read_head(reader: &mut impl BufRead) -> anyhow::Result<(u16, bool)> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad HTTP status line {line:?}"))?;
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("the connection closed inside the response headers");
        }
        let header = line.trim_end();
        if header.is_empty() {
            return Ok((status, chunked));
        }
        if let Some((k, v)) = header.split_once(':')
            && k.trim().eq_ignore_ascii_case("transfer-encoding")
            && v.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
}

/// A response body, chunked (`Transfer-Encoding: chunked`) or delimited by the connection's
/// close, read piece by piece as it arrives.
pub(crate) struct HttpBody<R> {
    reader: R,
    chunked: bool,
    done: bool,
}

impl<R: BufRead> HttpBody<R> {
    pub(crate) fn new(reader: R, chunked: bool) -> Self {
        HttpBody {
            reader,
            chunked,
            done: false,
        }
    }

    /// The next piece of the body, `None` at its end.
    pub(crate) fn next_piece(&mut self) -> anyhow::Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        if !self.chunked {
            let mut buf = vec![0u8; 16 * 1024];
            let n = self.reader.read(&mut buf)?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            buf.truncate(n);
            return Ok(Some(buf));
        }
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("the connection closed inside a chunked body");
        }
        let size_text = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_text, 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        if size == 0 {
            self.done = true;
            return Ok(None);
        }
        let mut buf = vec![0u8; size];
        self.reader.read_exact(&mut buf)?;
        let mut crlf = [0u8; 2];
        self.reader.read_exact(&mut crlf)?;
        Ok(Some(buf))
    }
}

/// Splits a byte stream into the `data:` payloads of server-sent events.
#[derive(Default)]
struct SseLines {
    pending: Vec<u8>,
    data: Vec<String>,
}

impl SseLines {
    /// Adds bytes; returns the data of every event completed by them.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                self.data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0, 7.0], 50.0), 3.0);
        assert_eq!(percentile(&[3.0, 7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn sse_events_split_across_pieces_and_comments_are_skipped() {
        let mut sse = SseLines::default();
        assert!(sse.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            sse.push(b":1}\n\n: keep-alive\n\ndata: [DONE]\r\n"),
            vec!["{\"a\":1}"]
        );
        assert_eq!(sse.push(b"\r\n"), vec!["[DONE]"]);
    }

    #[test]
    fn chunked_bodies_are_decoded_piece_by_piece() {
        let raw = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
        let mut body = HttpBody::new(&raw[..], true);
        assert_eq!(body.next_piece().unwrap().unwrap(), b"hello");
        assert_eq!(body.next_piece().unwrap().unwrap(), b" world");
        assert!(body.next_piece().unwrap().is_none());
        let mut bad = HttpBody::new(&b"zz\r\n"[..], true);
        assert!(bad.next_piece().is_err());
    }

    #[test]
    fn a_response_head_gives_status_and_chunking() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        assert_eq!(read_head(&mut &raw[..]).unwrap(), (200, true));
        let raw = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(read_head(&mut &raw[..]).unwrap(), (429, false));
        assert!(read_head(&mut &b"garbage\r\n"[..]).is_err());
    }
}
