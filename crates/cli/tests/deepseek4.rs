//! `lockstep run` on a DeepSeek V4 file (the committed reference fixture): plain and
//! speculative greedy runs give the same tokens (n-gram, and the DSpark drafter of the
//! synthetic support file), a support file made for another target is refused with a clear
//! error, and CUDA is refused with a clear error.

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
    let plain = tokens(&run(&["--temp", "0", "--ignore-eos", "-o", "json"])?)?;
    assert_eq!(plain.len(), 16);
    assert!(plain.iter().all(|&t| t < 258));
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
    let plain = tokens(&run(&["--temp", "0", "--ignore-eos", "-o", "json"])?)?;
    let sup = support();
    for temp in ["0", "0.8"] {
        let base = ["--temp", temp, "--seed", "7", "--ignore-eos", "-o", "json"];
        let plain_t = tokens(&run(&base)?)?;
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
    use std::io::BufRead;
    let plain: Value = serde_json::from_str(
        String::from_utf8_lossy(&run(&["--temp", "0", "-o", "json"])?.stdout)
            .lines()
            .last()
            .ok_or("no output")?,
    )?;
    let (model, sup) = (fixture(), support());
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "-m", &model, "--port", "0", "--device", "cpu"])
        .args(["--dspark", &sup, "--spec-max-draft", "5"])
        .args(["--spec-confidence-grid", "0"])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let result = (|| -> TestResult {
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .ok_or_else(|| format!("no address in {line:?}"))?
            .to_string();
        let body = serde_json::json!({
            "model": "flash-layout",
            "prompt": "abcabcabcabc abcabc",
            "max_tokens": 16,
            "temperature": 0,
        })
        .to_string();
        let v: Value = serde_json::from_str(&http_post(&addr, "/v1/completions", &body)?)?;
        assert_eq!(v["choices"][0]["text"], plain["text"], "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
        let spec = &v["usage"]["speculative"];
        assert!(spec["drafted"].as_u64().unwrap_or(0) > 0, "{v}");
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}
