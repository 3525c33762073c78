//! `lockstep run` on a DeepSeek V4 file (the committed reference fixture): plain and
//! speculative greedy runs give the same tokens (n-gram, and the DSpark drafter of the
//! synthetic support file), a support file made for another target is refused with a clear
//! error, and CUDA is refused with a clear error. `run --chat` and `serve` assemble the
//! model through the same runtime: the built-in DeepSeek V4 template (the file has none)
//! gives the same prompt and answer in both, and a JSON schema on a thinking model leaves
//! the think block free in both.

use std::process::Command;

use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fixture() -> String {
    format!(
        "{}/../model/tests/fixtures/deepseek4/flash-layout.gguf",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn support() -> String {
    format!(
        "{}/../model/tests/fixtures/deepseek4/flash-layout.dspark.gguf",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn run(extra: &[&str]) -> Result<std::process::Output, Box<dyn std::error::Error>> {
    run_model(&fixture(), extra)
}

fn run_model(
    model: &str,
    extra: &[&str],
) -> Result<std::process::Output, Box<dyn std::error::Error>> {
    let model = model.to_string();
    let mut args = vec!["run", "-m", &model, "-p", "abcabcabcabc abcabc", "-n", "16"];
    args.extend_from_slice(extra);
    Ok(Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(&args)
        .env_remove("RUST_LOG")
        .output()?)
}

fn tokens(out: &std::process::Output) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().ok_or("no output")?)?;
    Ok(v["tokens"]
        .as_array()
        .ok_or("no tokens")?
        .iter()
        .filter_map(Value::as_u64)
        .collect())
}

#[test]
fn run_generates_with_a_deepseek4_file() -> TestResult {
    let plain = tokens(&run(&[
        "--temp",
        "0",
        "--ignore-eos",
        "-o",
        "json",
        "--spec",
        "off",
    ])?)?;
    assert_eq!(plain.len(), 16);
    assert!(plain.iter().all(|&t| t < 258));
    // Speculation is on by default (the free drafters), and so is `--spec auto`.
    let default = tokens(&run(&["--temp", "0", "--ignore-eos", "-o", "json"])?)?;
    assert_eq!(plain, default, "speculation changes nothing");
    let spec = tokens(&run(&[
        "--temp",
        "0",
        "--ignore-eos",
        "-o",
        "json",
        "--spec",
        "auto",
    ])?)?;
    assert_eq!(plain, spec, "speculation changes nothing");
    let text = run(&[])?;
    assert!(text.status.success());
    Ok(())
}

#[test]
fn run_drafts_with_a_dspark_support_file() -> TestResult {
    let plain = tokens(&run(&[
        "--temp",
        "0",
        "--ignore-eos",
        "-o",
        "json",
        "--spec",
        "off",
    ])?)?;
    let sup = support();
    for temp in ["0", "0.8"] {
        let base = ["--temp", temp, "--seed", "7", "--ignore-eos", "-o", "json"];
        let mut off = base.to_vec();
        off.extend_from_slice(&["--spec", "off"]);
        let plain_t = tokens(&run(&off)?)?;
        let mut args = base.to_vec();
        args.extend_from_slice(&["--dspark", &sup, "--spec-max-draft", "5", "--spec-stats"]);
        args.extend_from_slice(&["--spec-confidence-grid", "0"]);
        let out = run(&args)?;
        assert_eq!(tokens(&out)?, plain_t, "T={temp}: DSpark changes nothing");
        let v: Value = serde_json::from_str(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .ok_or("no output")?,
        )?;
        let d = &v["dspark"];
        assert!(
            d["proposals"].as_u64().ok_or("no dspark counters")? > 0,
            "{v}"
        );
        assert!(d["verified"].as_u64().unwrap_or(0) > 0, "{v}");
        assert!(v["spec"]["drafted"].as_u64().unwrap_or(0) > 0, "{v}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("dspark: ") && err.contains("proposals"),
            "{err}"
        );
        if temp == "0" {
            assert_eq!(plain, plain_t);
        }
    }
    // A support file made for another target.
    let other = format!(
        "{}/../model/tests/fixtures/deepseek4/small-ratios.gguf",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = run_model(&other, &["--dspark", &sup])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not fit") && err.contains("target layer"),
        "{err}"
    );
    let help = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", "--help"])
        .output()?;
    assert!(String::from_utf8_lossy(&help.stdout).contains("--dspark <FILE>"));
    Ok(())
}

#[test]
fn deepseek4_on_cuda_is_a_clear_error() -> TestResult {
    let out = run(&["--device", "cuda"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("deepseek4") && err.contains("CPU"), "{err}");
    Ok(())
}

/// Sends one HTTP/1.1 request with `Connection: close` and returns the response body
/// (a plain or chunked body).
fn http_post(addr: &str, path: &str, body: &str) -> Result<String, Box<dyn std::error::Error>> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8(raw)?;
    let (head, rest) = raw.split_once("\r\n\r\n").ok_or("no header end")?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{rest}");
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(rest.to_string());
    }
    let mut out = String::new();
    let mut rest = rest;
    loop {
        let (size, after) = rest.split_once("\r\n").ok_or("bad chunk")?;
        let n = usize::from_str_radix(size.trim(), 16)?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(after.get(..n).ok_or("short chunk")?);
        rest = after.get(n + 2..).ok_or("short chunk")?;
    }
}

#[test]
fn serve_drafts_with_a_dspark_support_file_and_answers_as_plain_decoding() -> TestResult {
    let plain: Value = serde_json::from_str(
        String::from_utf8_lossy(&run(&["--temp", "0", "-o", "json"])?.stdout)
            .lines()
            .last()
            .ok_or("no output")?,
    )?;
    let sup = support();
    let served = serve(
        &fixture(),
        &[
            "--dspark",
            &sup,
            "--spec-max-draft",
            "5",
            "--spec-confidence-grid",
            "0",
        ],
    )?;
    let body = serde_json::json!({
        "model": "flash-layout",
        "prompt": "abcabcabcabc abcabc",
        "max_tokens": 16,
        "temperature": 0,
    })
    .to_string();
    let v: Value = serde_json::from_str(&http_post(&served.addr, "/v1/completions", &body)?)?;
    assert_eq!(v["choices"][0]["text"], plain["text"], "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
    let spec = &v["usage"]["speculative"];
    assert!(spec["drafted"].as_u64().unwrap_or(0) > 0, "{v}");
    Ok(())
}

/// A running `lockstep serve -m MODEL EXTRA…` and its address; killed on drop.
struct Served {
    child: std::process::Child,
    addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &str, extra: &[&str]) -> Result<Served, Box<dyn std::error::Error>> {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "-m", model, "--port", "0", "--device", "cpu"])
        .args(extra)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut served = Served {
        child,
        addr: String::new(),
    };
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    served.addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .ok_or_else(|| format!("no address in {line:?}"))?
        .to_string();
    Ok(served)
}

/// The JSON object of `lockstep run -m MODEL --chat -p PROMPT -o json EXTRA…`.
fn run_chat(
    model: &str,
    prompt: &str,
    extra: &[&str],
) -> Result<Value, Box<dyn std::error::Error>> {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", "-m", model, "--chat", "-p", prompt, "-o", "json"])
        .args(["--device", "cpu", "-c", "1024"])
        .args(extra)
        .env_remove("RUST_LOG")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    Ok(serde_json::from_str(
        stdout.lines().last().ok_or("no output")?,
    )?)
}

#[test]
fn the_built_in_template_gives_the_same_prompt_and_answer_in_run_and_serve() -> TestResult {
    // The fixture has no tokenizer.chat_template: both front ends fall back to the
    // built-in DeepSeek V4 encoding (before, `run --chat` refused it as a base model).
    let ran = run_chat(&fixture(), "Hi there", &["--temp", "0", "-n", "12"])?;
    let served = serve(&fixture(), &["-c", "1024"])?;
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 12,
        "temperature": 0,
    })
    .to_string();
    let v: Value = serde_json::from_str(&http_post(&served.addr, "/v1/chat/completions", &body)?)?;
    assert_eq!(
        v["usage"]["prompt_tokens"], ran["prompt_tokens"],
        "{v}\n{ran}"
    );
    assert_eq!(
        v["usage"]["completion_tokens"],
        serde_json::json!(ran["tokens"].as_array().ok_or("no tokens")?.len()),
        "{v}\n{ran}"
    );
    assert_eq!(
        v["choices"][0]["message"]["content"], ran["text"],
        "{v}\n{ran}"
    );
    Ok(())
}

/// The fixture with a chat template whose model thinks first (it knows `<think>` and its
/// generation prompt leaves the block to the model), and `<think>` / `</think>` as two
/// control tokens appended to its vocabulary (every vocabulary-sized tensor gets two rows,
/// copies of its last two), written to `dir`.
fn thinking_fixture(dir: &std::path::Path) -> Result<String, Box<dyn std::error::Error>> {
    use gguf::{Array, Value as G};
    let src = gguf::GgufFile::open(fixture())?;
    let mut w = gguf::GgufWriter::new();
    let mut n_vocab = 0u64;
    for (k, v) in src.metadata() {
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", G::Array(Array::String(t))) => {
                n_vocab = t.len() as u64;
                let mut t = t.clone();
                t.extend(["<think>".to_string(), "</think>".to_string()]);
                G::Array(Array::String(t))
            }
            ("tokenizer.ggml.token_type", G::Array(Array::I32(t))) => {
                let mut t = t.clone();
                t.extend([3, 3]);
                G::Array(Array::I32(t))
            }
            _ => v.clone(),
        };
        w.add(k.clone(), v)?;
    }
    assert!(n_vocab > 2, "the fixture has a vocabulary");
    w.add(
        "tokenizer.chat_template".to_string(),
        G::String(
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
             {% if add_generation_prompt %}<|assistant|>{% endif %}\
             {#- the answer starts with <think>…</think> #}"
                .to_string(),
        ),
    )?;
    for t in src.tensors() {
        let data = src.tensor_data(t);
        let mut dims = t.dims.clone();
        let mut bytes = data.to_vec();
        if dims.last() == Some(&n_vocab) && dims.len() > 1 {
            let row = data.len() / n_vocab as usize;
            bytes.extend_from_slice(&data[data.len() - 2 * row..]);
            if let Some(last) = dims.last_mut() {
                *last += 2;
            }
        }
        w.add_tensor(&t.name, &dims, t.ggml_type, bytes)?;
    }
    let path = dir.join("thinking.gguf");
    w.write_file(&path)?;
    Ok(path.to_string_lossy().into_owned())
}

#[test]
fn a_json_schema_on_a_thinking_model_leaves_the_think_block_free_in_run_and_serve() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = thinking_fixture(dir.path())?;
    let schema = r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#;
    let response_format = serde_json::json!({"type": "json_schema",
        "json_schema": {"name": "n", "schema": serde_json::from_str::<Value>(schema)?}});
    // The same sampled request (a fixed seed) through `run --chat` and `serve`.
    let sampling = ["--temp", "1.5", "--seed", "7", "-n", "24"];
    let ran = run_chat(
        &model,
        "Hi",
        &[&sampling[..], &["--json-schema", schema]].concat(),
    )?;
    let served = serve(&model, &["-c", "1024"])?;
    let chat = |extra: Value| -> Result<Value, Box<dyn std::error::Error>> {
        let mut body = serde_json::json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 24,
            "temperature": 1.5,
            "seed": 7,
            "response_format": response_format,
        });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let v: Value = serde_json::from_str(&http_post(
            &served.addr,
            "/v1/chat/completions",
            &body.to_string(),
        )?)?;
        Ok(v)
    };
    let v = chat(serde_json::json!({}))?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .ok_or_else(|| format!("no content: {v}"))?;
    assert_eq!(text, ran["text"], "run and serve differ:\n{v}\n{ran}");
    // The output opens a think block (its markers are control tokens, not in the text) of
    // free text, not the JSON the schema asks for.
    let tok = text::Tokenizer::from_gguf(&gguf::GgufFile::open(&model)?)?;
    let open = tok.token_to_id("<think>").ok_or("no <think> token")?;
    let close = tok.token_to_id("</think>").ok_or("no </think> token")?;
    assert_eq!(ran["tokens"][0], open, "{ran}");
    assert!(!text.is_empty(), "{v}");
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text:?}");
    // With `</think>` made likely the block closes, and after it comes the JSON.
    let v = chat(serde_json::json!({"max_tokens": 200, "logit_bias": {close.to_string(): 5}}))?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .ok_or_else(|| format!("no content: {v}"))?;
    let json = text
        .char_indices()
        .filter(|(_, c)| *c == '{')
        .find_map(|(i, _)| serde_json::from_str::<Value>(text[i..].trim()).ok())
        .ok_or_else(|| format!("no JSON at the end: {text:?}"))?;
    assert!(json["n"].is_i64(), "{json}");
    assert!(
        !text.trim_start().starts_with('{'),
        "the thoughts come first: {text:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    Ok(())
}
