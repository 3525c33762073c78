//! The chat page of `lockstep serve` in a real browser: headless Chromium driven over
//! WebDriver (chromedriver, started here) against the real binary serving the default model
//! smollm2-135m. A missing browser fails the test with the name of the script that installs
//! it (`tools/ci/install-browser.sh`); nothing here is skipped.
//!
//! With `LOCKSTEP_UPDATE_SCREENSHOT=1` the first test also writes the README's screenshot,
//! `docs/chat-page.png`; otherwise it goes to the test's temporary directory.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::Mutex;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const INSTALL: &str = "tools/ci/install-browser.sh";
/// The W3C WebDriver key of element references.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// Generous: CI is a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(180);

/// One browser and one model server at a time: both want the machine's two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `lockstep serve` on a free port.
struct Serve {
    _proc: Proc,
    addr: SocketAddr,
}

impl Serve {
    fn start(extra: &[&str]) -> Result<Serve, Box<dyn std::error::Error>> {
        hub::ensure_model("smollm2-135m")?;
        let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args([
                "serve",
                "-m",
                "smollm2-135m",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .args(["--ctx-size", "2048", "--max-seqs", "2"])
            .args(extra)
            .env_remove("RUST_LOG")
            .env_remove("LOCKSTEP_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let proc = Proc(child);
        // "lockstep serving NAME (context N…) at http://ADDR/v1 — Ctrl-C to stop"
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split(" at http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or_default().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(WAIT)
            .map_err(|_| "lockstep serve did not report its address")?
            .parse()?;
        Ok(Serve { _proc: proc, addr })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// The browser: chromedriver and one headless Chromium session.
struct Browser {
    http: reqwest::Client,
    base: String,
    _driver: Proc,
    _profile: tempfile::TempDir,
}

fn missing_browser() -> Option<String> {
    [CHROMIUM, CHROMEDRIVER]
        .into_iter()
        .find(|p| !Path::new(p).is_file())
        .map(|p| {
            format!(
                "{p} is missing: the chat-page tests drive headless Chromium; install it with \
                 `bash {INSTALL}` (Debian packages chromium and chromium-driver)"
            )
        })
}

impl Browser {
    async fn start() -> Result<Browser, Box<dyn std::error::Error>> {
        if let Some(msg) = missing_browser() {
            return Err(msg.into());
        }
        let port = free_port()?;
        let driver = Proc(
            Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?,
        );
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()?;
        let root = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = match http.get(format!("{root}/status")).send().await {
                Ok(r) => r.json::<Value>().await?["value"]["ready"] == json!(true),
                Err(_) => false,
            };
            if ready {
                break;
            }
            if Instant::now() > deadline {
                return Err("chromedriver did not become ready within 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir()?;
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--hide-scrollbars",
                    "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        }}});
        let r: Value = http
            .post(format!("{root}/session"))
            .json(&caps)
            .send()
            .await?
            .json()
            .await?;
        let id = r["value"]["sessionId"]
            .as_str()
            .ok_or_else(|| format!("no WebDriver session: {r}"))?;
        Ok(Browser {
            http,
            base: format!("{root}/session/{id}"),
            _driver: driver,
            _profile: profile,
        })
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body.unwrap_or_else(|| json!({}))),
        };
        let r: Value = req
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        if let Some(err) = r["value"].get("error") {
            return Err(format!(
                "WebDriver {method} {path}: {err}: {}",
                r["value"]["message"]
            ));
        }
        Ok(r["value"].clone())
    }

    async fn goto(&self, url: &str) -> Result<(), String> {
        self.call("POST", "/url", Some(json!({"url": url}))).await?;
        Ok(())
    }

    async fn refresh(&self) -> Result<(), String> {
        self.call("POST", "/refresh", None).await?;
        Ok(())
    }

    /// Runs `script` (a function body; `arguments` as usual) in the page.
    async fn js(&self, script: &str, args: Value) -> Result<Value, String> {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
        .await
    }

    async fn find(&self, css: &str) -> Result<String, String> {
        let v = self
            .call(
                "POST",
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await?;
        v[ELEMENT]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no element reference for {css}: {v}"))
    }

    async fn click(&self, css: &str) -> Result<(), String> {
        let e = self.find(css).await?;
        self.call("POST", &format!("/element/{e}/click"), None)
            .await?;
        Ok(())
    }

    /// Types `text` into the element (WebDriver key codes included: `\u{E007}` is Enter).
    async fn type_into(&self, css: &str, text: &str) -> Result<(), String> {
        let e = self.find(css).await?;
        self.call(
            "POST",
            &format!("/element/{e}/value"),
            Some(json!({"text": text})),
        )
        .await?;
        Ok(())
    }

    async fn clear(&self, css: &str) -> Result<(), String> {
        let e = self.find(css).await?;
        self.call("POST", &format!("/element/{e}/clear"), None)
            .await?;
        Ok(())
    }

    async fn clear_and_type(&self, css: &str, text: &str) -> Result<(), String> {
        self.clear(css).await?;
        self.type_into(css, text).await
    }

    /// Polls `script` until it returns something other than `null`/`false`.
    async fn wait_for(&self, what: &str, script: &str) -> Result<Value, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let v = self.js(script, json!([])).await?;
            if !v.is_null() && v != json!(false) {
                return Ok(v);
            }
            if Instant::now() > deadline {
                let page = self
                    .js("return document.body.innerText", json!([]))
                    .await
                    .unwrap_or_default();
                return Err(format!(
                    "timed out waiting for {what}; the page reads:\n{page}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn text(&self, css: &str) -> Result<String, String> {
        let v = self
            .js(
                "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                json!([css]),
            )
            .await?;
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no element {css}"))
    }

    async fn screenshot(&self, to: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let v = self.call("GET", "/screenshot", None).await?;
        let png = base64_decode(v.as_str().ok_or("screenshot is not a string")?)?;
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(to, png)?;
        Ok(())
    }

    async fn close(&self) {
        let _ = self.call("DELETE", "", None).await;
    }
}

fn base64_decode(s: &str) -> Result<Vec<u8>, String> {
    let val = |c: u8| -> Result<u32, String> {
        Ok(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(format!("bad base64 byte {c}")),
        } as u32)
    };
    let bytes: Vec<u8> = s
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'=')
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        let b = n.to_be_bytes();
        out.extend_from_slice(&b[1..chunk.len()]);
    }
    Ok(out)
}

/// Opens the page and waits until it has talked to the server.
async fn open(b: &Browser, server: &Serve) -> Result<(), String> {
    b.goto(&server.url("/")).await?;
    b.wait_for(
        "the server status",
        "return document.querySelector('#server-info .dot.up') !== null",
    )
    .await?;
    Ok(())
}

/// Sets the sampling fields in the settings panel (through its inputs) and closes it.
async fn settings(b: &Browser, fields: &[(&str, &str)]) -> Result<(), String> {
    b.click("#open-settings").await?;
    for (id, value) in fields {
        b.clear_and_type(&format!("#{id}"), value).await?;
    }
    b.click("#close-settings").await
}

/// Types a message and presses Enter.
async fn say(b: &Browser, text: &str) -> Result<(), String> {
    b.type_into("#input", &format!("{text}\u{E007}")).await
}

/// Waits for the last answer to finish; returns its speculation/statistics line.
async fn answered(b: &Browser) -> Result<String, String> {
    let v = b
        .wait_for(
            "a finished answer",
            "const m = [...document.querySelectorAll('.msg.assistant')].pop();
             if (!m || document.querySelector('.cursor')) return null;
             const s = m.querySelector('.speculation-line');
             const e = m.querySelector('.error');
             return e ? 'ERROR: ' + e.innerText : (s ? s.innerText : null);",
        )
        .await?;
    Ok(v.as_str().unwrap_or_default().to_string())
}

fn screenshot_path() -> PathBuf {
    if std::env::var_os("LOCKSTEP_UPDATE_SCREENSHOT").is_some_and(|v| v == "1") {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/chat-page.png")
    } else {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png")
    }
}

#[tokio::test]
async fn a_message_streams_in_shows_its_speculation_replays_identically_and_survives_a_reload()
-> TestResult {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Serve::start(&["--ngram"])?;
    // A first request pages the weights in, so that the page's answer and its replay are
    // timed alike (the screenshot shows both rates).
    let warm = reqwest::Client::new()
        .post(server.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}))
        .send()
        .await?;
    assert_eq!(warm.status().as_u16(), 200);
    let b = Browser::start().await?;
    open(&b, &server).await?;
    settings(
        &b,
        &[
            ("set-temperature", "0.7"),
            ("set-seed", "11"),
            ("set-max-tokens", "200"),
            ("set-system", "You are a concise assistant."),
        ],
    )
    .await?;
    // Shift+Enter is a new line, not a send.
    b.type_into("#input", "first line\u{E008}\u{E007}\u{E000}second line")
        .await?;
    let value = b
        .js("return document.querySelector('#input').value", json!([]))
        .await?;
    assert_eq!(value, json!("first line\nsecond line"));
    assert_eq!(
        b.js("return document.querySelectorAll('.msg').length", json!([]))
            .await?,
        json!(0)
    );
    b.clear("#input").await?;
    // Record every partial answer the page shows while the answer streams.
    b.js(
        "window.__partials = [];
         new MutationObserver(() => {
           const t = document.querySelector('.msg.assistant .text.cursor');
           if (t && t.innerText.trim()) window.__partials.push(t.innerText.length);
         }).observe(document.getElementById('messages'), {childList: true, subtree: true});",
        json!([]),
    )
    .await?;
    let question = "Write a Python function that reverses a string, with a one-line explanation.";
    say(&b, question).await?;
    let line = answered(&b).await?;
    let answer = b.text(".msg.assistant .text").await?;
    assert!(!answer.trim().is_empty(), "an answer: {line}");
    let partials = b.js("return window.__partials", json!([])).await?;
    let partials: Vec<u64> = serde_json::from_value(partials)?;
    assert!(
        partials.iter().any(|&n| (n as usize) < answer.len()),
        "text appeared before the answer was complete: {partials:?} (answer {} chars)",
        answer.len()
    );
    for part in ["tok/s", "TTFT", "tokens", "drafted", "accepted", "seed 11"] {
        assert!(
            line.contains(part),
            "the statistics line shows {part:?}: {line}"
        );
    }
    // The time speculation saved, or what it cost when drafting did not pay off.
    assert!(line.contains("saved ") || line.contains("cost "), "{line}");
    assert_eq!(b.text(".msg.user .bubble").await?, question);
    // Replay: the same request and seed, speculation off, the same answer.
    b.click(".msg.assistant .replay-btn").await?;
    let verdict = b
        .wait_for(
            "the replay verdict",
            "const r = document.querySelector('.replay.same, .replay.differs');
             return r ? r.className + ': ' + r.innerText : null;",
        )
        .await?;
    let verdict = verdict.as_str().unwrap_or_default();
    assert!(
        verdict.contains("same")
            && verdict.contains("identical")
            && verdict.contains("without speculation"),
        "{verdict}"
    );
    b.screenshot(&screenshot_path()).await?;
    // Speculation switched off in the settings: the next answer is decoded plainly.
    assert_eq!(b.text("#spec-badge").await?, "speculation on");
    b.click("#open-settings").await?;
    b.click("#set-speculation").await?;
    b.click("#close-settings").await?;
    assert_eq!(b.text("#spec-badge").await?, "speculation off");
    say(&b, "Thanks!").await?;
    let plain = answered(&b).await?;
    assert!(plain.contains("no speculation"), "{plain}");
    assert!(!plain.contains("drafted"), "{plain}");
    // Rename the conversation, then reload: everything is still there.
    b.click(".conv.active .rename").await?;
    // (WebDriver's element clear would blur the field, which ends the rename: select all.)
    b.type_into(
        ".conv.active input",
        "\u{E009}a\u{E000}String reversal\u{E007}",
    )
    .await?;
    assert_eq!(b.text(".conv.active .conv-title").await?, "String reversal");
    b.refresh().await?;
    open(&b, &server).await?;
    assert_eq!(b.text(".msg.user .bubble").await?, question);
    assert_eq!(b.text(".msg.assistant .text").await?, answer);
    assert_eq!(b.text("#chat-title").await?, "String reversal");
    assert!(b.text(".replay.same").await?.contains("identical"));
    // A new conversation, then delete the first (two clicks: arm, confirm).
    b.click("#new-chat").await?;
    assert_eq!(
        b.js(
            "return document.querySelectorAll('.conv').length",
            json!([])
        )
        .await?,
        json!(2)
    );
    b.click(".conv:not(.active) .delete").await?;
    b.click(".conv:not(.active) .delete").await?;
    assert_eq!(
        b.js(
            "return document.querySelectorAll('.conv').length",
            json!([])
        )
        .await?,
        json!(1)
    );
    // The dark theme is kept across a reload.
    b.click("#theme").await?;
    let theme = "return document.documentElement.dataset.theme";
    assert_eq!(b.js(theme, json!([])).await?, json!("dark"));
    b.refresh().await?;
    open(&b, &server).await?;
    assert_eq!(b.js(theme, json!([])).await?, json!("dark"));
    // At phone width nothing overflows sideways and the conversations open from the menu.
    b.call(
        "POST",
        "/window/rect",
        Some(json!({"width": 390, "height": 844})),
    )
    .await?;
    b.wait_for(
        "the phone layout",
        "return innerWidth <= 420
           && document.documentElement.scrollWidth <= innerWidth
           && getComputedStyle(document.querySelector('#menu')).display !== 'none'
           && document.querySelector('#sidebar').getBoundingClientRect().right <= 0",
    )
    .await?;
    b.click("#menu").await?;
    b.wait_for(
        "the conversations drawer",
        "return document.querySelector('#sidebar').getBoundingClientRect().left >= 0",
    )
    .await?;
    b.close().await;
    Ok(())
}

#[tokio::test]
async fn reasoning_and_tool_calls_are_shown_as_their_own_blocks() -> TestResult {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Serve::start(&[])?;
    let b = Browser::start().await?;
    open(&b, &server).await?;
    // A stored conversation holding what the page keeps from a stream with `<think>` text
    // and a tool call (smollm2-135m neither thinks nor calls tools on its own).
    let conversation = json!({"convs": [{"id": "c1", "title": "Weather", "updated": 1, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>The user wants the weather.</think>Let me look it up.",
         "tool_calls": [{"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}],
         "finish_reason": "tool_calls"},
    ]}], "current": "c1"});
    b.js(
        "localStorage.setItem('lockstep.chat.v1', arguments[0])",
        json!([conversation.to_string()]),
    )
    .await?;
    b.refresh().await?;
    open(&b, &server).await?;
    let reasoning = b.text(".msg.assistant details.reasoning").await?;
    assert!(reasoning.starts_with("Reasoning"), "{reasoning}");
    b.click(".msg.assistant details.reasoning summary").await?;
    assert!(
        b.text(".msg.assistant details.reasoning .thought")
            .await?
            .contains("The user wants the weather.")
    );
    let answer = b.text(".msg.assistant .text").await?;
    assert_eq!(
        answer, "Let me look it up.",
        "the think block is not in the answer"
    );
    let call = b.text(".msg.assistant .tool-call").await?;
    assert!(
        call.to_lowercase().contains("tool call") && call.contains("get_weather"),
        "{call}"
    );
    assert!(
        call.contains("\"city\": \"Paris\""),
        "arguments pretty-printed: {call}"
    );
    b.close().await;
    Ok(())
}

/// The number the server's `/metrics` reports for `lockstep_engine_requests_cancelled_total`
/// and its `/health` count of running sequences.
async fn cancelled_and_running(server: &Serve) -> Result<(f64, Value), Box<dyn std::error::Error>> {
    let http = reqwest::Client::new();
    let metrics = http
        .get(server.url("/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let cancelled = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lockstep_engine_requests_cancelled_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or("no lockstep_engine_requests_cancelled_total in /metrics")?;
    let health: Value = http.get(server.url("/health")).send().await?.json().await?;
    Ok((cancelled, health["running"].clone()))
}

#[tokio::test]
async fn stop_and_escape_end_a_long_answer_and_the_server_frees_its_sequence() -> TestResult {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Serve::start(&[])?;
    let b = Browser::start().await?;
    open(&b, &server).await?;
    settings(&b, &[("set-temperature", "0"), ("set-max-tokens", "1500")]).await?;
    let last = "[...document.querySelectorAll('.msg.assistant')].pop()";
    let mut partials = Vec::new();
    for (round, by_key) in [(1.0, true), (2.0, false)] {
        if round > 1.0 {
            b.click("#new-chat").await?;
        }
        // 1500 tokens at temperature 0 (it runs to the limit).
        say(&b, "List the first 300 prime numbers, one per line.").await?;
        b.wait_for(
            "streamed text",
            &format!(
                "const t = {last}.querySelector('.text.cursor');
                 return t !== null && t.innerText.trim().length > 0;"
            ),
        )
        .await?;
        if by_key {
            b.type_into("#input", "\u{E00C}").await?;
        } else {
            b.click("#stop").await?;
        }
        let partial = b
            .wait_for(
                "the stopped answer",
                &format!(
                    "const m = {last};
                     return m.querySelector('.stopped') && !document.querySelector('.cursor')
                       ? m.querySelector('.text').innerText : null;"
                ),
            )
            .await?;
        let partial = partial.as_str().unwrap_or_default().to_string();
        assert!(!partial.trim().is_empty(), "the text so far is kept");
        assert_eq!(
            b.js("return document.querySelector('#stop').hidden", json!([]))
                .await?,
            json!(true)
        );
        // The server noticed the closed stream and cancelled the sequence.
        let deadline = Instant::now() + WAIT;
        loop {
            let (cancelled, running) = cancelled_and_running(&server).await?;
            if cancelled >= round && running == json!(0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: cancelled {cancelled}, running {running}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        partials.push(partial);
    }
    // The partial answers are kept, marked stopped, across a reload.
    b.refresh().await?;
    open(&b, &server).await?;
    let shown = "return [...document.querySelectorAll('.msg.assistant')].map(m =>
                   [m.querySelector('.text').innerText, m.querySelector('.stopped') !== null])";
    assert_eq!(b.js(shown, json!([])).await?, json!([[partials[1], true]]));
    b.click(".conv:not(.active)").await?;
    assert_eq!(b.js(shown, json!([])).await?, json!([[partials[0], true]]));
    b.close().await;
    Ok(())
}

#[tokio::test]
async fn json_mode_answers_pretty_printed_json_that_satisfies_the_schema() -> TestResult {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Serve::start(&[])?;
    let b = Browser::start().await?;
    open(&b, &server).await?;
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "capital"],
        "additionalProperties": false,
    });
    // A schema the server refuses: its error is shown in place of the answer.
    settings(
        &b,
        &[
            ("set-temperature", "0"),
            ("set-max-tokens", "200"),
            (
                "set-schema",
                r#"{"type": "object", "properties": {"a": {"type": "no-such-type"}}}"#,
            ),
        ],
    )
    .await?;
    b.click("#json-mode").await?;
    say(&b, "Describe Paris.").await?;
    let error = answered(&b).await?;
    assert!(
        error.starts_with("ERROR") && error.contains("response_format"),
        "{error}"
    );
    // With a good schema, Retry answers in JSON.
    settings(&b, &[("set-schema", &schema.to_string())]).await?;
    b.click(".msg.assistant .error button").await?;
    let line = answered(&b).await?;
    assert!(!line.starts_with("ERROR"), "{line}");
    let shown = b.text(".msg.assistant .json-result code").await?;
    assert!(shown.contains("\n  \""), "pretty-printed: {shown}");
    let value: Value = serde_json::from_str(&shown)?;
    let validator = jsonschema::validator_for(&schema)?;
    assert!(validator.is_valid(&value), "{value} against {schema}");
    b.close().await;
    Ok(())
}

#[tokio::test]
async fn an_api_key_server_rejects_the_page_until_it_is_given_the_key() -> TestResult {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Serve::start(&["--api-key", "correct horse"])?;
    let b = Browser::start().await?;
    open(&b, &server).await?;
    settings(&b, &[("set-max-tokens", "24")]).await?;
    say(&b, "Say hello.").await?;
    b.wait_for(
        "the key dialog",
        "return document.querySelector('#key-dialog').open",
    )
    .await?;
    let error = b.text(".msg.assistant .error").await?;
    assert!(
        error.contains("API key"),
        "the refusal is shown in place: {error}"
    );
    // A wrong key is refused and asked for again.
    b.type_into("#key-input", "wrong\u{E007}").await?;
    b.wait_for(
        "the refusal of a wrong key",
        "const e = document.querySelector('#key-error');
         return document.querySelector('#key-dialog').open && !e.hidden && e.innerText.includes('refused');",
    )
    .await?;
    b.type_into("#key-input", "correct horse\u{E007}").await?;
    let line = answered(&b).await?;
    assert!(!line.starts_with("ERROR"), "{line}");
    assert!(line.contains("tokens"), "{line}");
    assert_eq!(
        b.js(
            "return document.querySelectorAll('.msg.assistant').length",
            json!([])
        )
        .await?,
        json!(1),
        "the failed answer was replaced by the retried one"
    );
    // The key lives in the tab's session storage, never in local storage.
    let stored = b
        .js(
            "return [sessionStorage.getItem('lockstep.apiKey'), JSON.stringify(localStorage)]",
            json!([]),
        )
        .await?;
    assert_eq!(stored[0], json!("correct horse"));
    assert!(
        !stored[1]
            .as_str()
            .unwrap_or_default()
            .contains("correct horse")
    );
    b.close().await;
    Ok(())
}
