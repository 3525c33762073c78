//! Shared test harness: real models served on 127.0.0.1 (port 0) by servers that live for
//! the whole test process, each on its own runtime thread, and small HTTP/SSE helpers.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use lockstep_server::{ModelOptions, Runtime, Server, ServerConfig};
use serde_json::Value;

/// A running test server.
pub struct TestServer {
    pub addr: SocketAddr,
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

fn load(name: &str, max_seqs: usize, queue: usize) -> Arc<Runtime> {
    load_with(name, max_seqs, queue, engine::SpecConfig::default())
}

/// Loads `name` for a test server, with speculation `spec`.
pub fn load_with(
    name: &str,
    max_seqs: usize,
    queue: usize,
    spec: engine::SpecConfig,
) -> Arc<Runtime> {
    let path = runtime::load::ensure_model(name).expect("model available");
    let mut opts = ModelOptions::new(name);
    opts.spec = spec;
    opts.max_seqs = max_seqs;
    opts.queue_capacity = queue;
    opts.ctx_size = Some(2048);
    opts.kv_tokens = Some(16_384);
    // Two engines share the 2-core machine: one forward thread each avoids oversubscription.
    opts.threads = Some(1);
    Arc::new(Runtime::open(&path, &opts).expect("model loads"))
}

/// Serves `model` with `config` on a background runtime for the rest of the process.
pub fn spawn(model: Arc<Runtime>, config: ServerConfig) -> TestServer {
    let (tx, rx) = std::sync::mpsc::channel();
    let m = model;
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let server = Server::bind("127.0.0.1:0".parse().expect("addr"), m, config)
                .await
                .expect("bind");
            tx.send(server.local_addr().expect("addr"))
                .expect("send addr");
            server
                .serve(std::future::pending::<()>())
                .await
                .expect("serve");
        });
    });
    let addr = rx.recv().expect("server started");
    TestServer { addr }
}

static SMOL_MODEL: OnceLock<Arc<Runtime>> = OnceLock::new();
static QWEN_MODEL: OnceLock<Arc<Runtime>> = OnceLock::new();
static SMOL: OnceLock<TestServer> = OnceLock::new();
static QWEN: OnceLock<TestServer> = OnceLock::new();

pub fn smol_model() -> Arc<Runtime> {
    Arc::clone(SMOL_MODEL.get_or_init(|| load("smollm2-135m", 16, 64)))
}

pub fn qwen_model() -> Arc<Runtime> {
    Arc::clone(QWEN_MODEL.get_or_init(|| load("qwen2.5-coder-0.5b", 8, 64)))
}

/// smollm2-135m, default settings.
pub fn smol() -> &'static TestServer {
    SMOL.get_or_init(|| spawn(smol_model(), ServerConfig::default()))
}

/// qwen2.5-coder-0.5b (its template has tools), default settings.
pub fn qwen() -> &'static TestServer {
    QWEN.get_or_init(|| spawn(qwen_model(), ServerConfig::default()))
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(300))
        .build()
        .expect("client")
}

/// POSTs JSON; returns status and body (JSON, or a string for non-JSON bodies).
pub async fn post(server: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let resp = client()
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Sse {
    pub event: Option<String>,
    pub data: String,
}

impl Sse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("bad SSE data {:?}: {e}", self.data))
    }
}

/// Splits an SSE body into events (comments dropped).
pub fn parse_sse(body: &str) -> Vec<Sse> {
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        let mut event = None;
        let mut data: Vec<&str> = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if !data.is_empty() {
            out.push(Sse {
                event,
                data: data.join("\n"),
            });
        }
    }
    out
}

/// POSTs a streaming request and returns the status, content type and events.
pub async fn post_stream(server: &TestServer, path: &str, body: &Value) -> (u16, String, Vec<Sse>) {
    let resp = client()
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = resp.text().await.expect("body");
    (status, ctype, parse_sse(&text))
}

/// Asserts an OpenAI error body with this status and returns `error`.
pub fn assert_error(status: u16, body: &Value, expected: u16) -> Value {
    assert_eq!(status, expected, "body: {body}");
    let err = body
        .get("error")
        .unwrap_or_else(|| panic!("no error object: {body}"));
    assert!(
        err.get("message").and_then(Value::as_str).is_some(),
        "{body}"
    );
    assert!(err.get("type").and_then(Value::as_str).is_some(), "{body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{body}"
    );
    err.clone()
}

/// A Python with the official SDK `package` at version `pin`, in a venv under the target
/// directory (`<package>-venv`), created and installed from PyPI on first use.
pub fn sdk_python(package: &str, pin: &str) -> std::path::PathBuf {
    use std::process::Command;
    let venv =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{package}-venv"));
    let python = venv.join("bin").join("python");
    let ready = python.is_file()
        && Command::new(&python)
            .args([
                "-c",
                &format!("import {package}, sys; sys.exit({package}.__version__ != '{pin}')"),
            ])
            .status()
            .is_ok_and(|s| s.success());
    if !ready {
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 -m venv runs");
        assert!(status.success(), "creating the venv failed");
        let status = Command::new(venv.join("bin").join("pip"))
            .args(["install", "--quiet", &format!("{package}=={pin}")])
            .status()
            .expect("pip runs");
        assert!(status.success(), "pip install {package}=={pin} failed");
    }
    python
}
