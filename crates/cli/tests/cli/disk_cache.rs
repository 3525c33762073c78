//! `lockstep run --disk-cache DIR`: a second process reads the first one's prompt blocks
//! back from disk (`cached_tokens`) and generates exactly the same tokens and logprobs;
//! without the flag the per-user cache is used; `--no-disk-cache` reads nothing; `lockstep
//! chat` takes the same flags.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A fresh directory under the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p =
            std::env::temp_dir().join(format!("lockstep-cli-disk-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn prompt() -> String {
    "You are a careful coding agent. Read every file before you change it, keep each patch \
     small, run the tests after each change, and report exactly what you ran. "
        .repeat(6)
}

/// `lockstep run` on smollm2-135m with `extra` flags; the JSON report.
fn run(extra: &[&str]) -> Result<Value, Box<dyn std::error::Error>> {
    hub::ensure_model("smollm2-135m")?;
    let p = prompt();
    let mut args = vec![
        "run", "-p", &p, "-n", "8", "--device", "cpu", "--output", "json",
    ];
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(&args)
        .env("LOCKSTEP_HOME", hub::cache_root()?)
        .env_remove("RUST_LOG")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_str(
        stdout.lines().last().ok_or("no output")?,
    )?)
}

fn block_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |r| {
        r.flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
            .count()
    })
}

#[test]
fn a_second_run_reads_the_prompt_back_from_disk_with_identical_output() -> TestResult {
    let dir = TempDir::new("run");
    let d = dir.0.to_str().ok_or("path")?;
    let first = run(&["--disk-cache", d])?;
    let prompt_tokens = first["prompt_tokens"].as_u64().ok_or("prompt_tokens")?;
    assert!(prompt_tokens > 64, "{first}");
    assert_eq!(first["cached_tokens"], 0, "{first}");
    assert!(block_files(&dir.0) as u64 >= prompt_tokens / 32);
    let second = run(&["--disk-cache", d])?;
    assert_eq!(
        second["cached_tokens"].as_u64(),
        Some((prompt_tokens / 32 * 32).min(prompt_tokens - 1)),
        "{second}"
    );
    assert_eq!(second["tokens"], first["tokens"]);
    assert_eq!(second["logprobs"], first["logprobs"]);
    Ok(())
}

#[test]
fn the_default_directory_is_used_unless_no_disk_cache_says_otherwise() -> TestResult {
    // Twice in the default place (the per-user cache): the second run reads back.
    run(&[])?;
    let again = run(&[])?;
    assert!(again["cached_tokens"].as_u64() > Some(32), "{again}");
    // Off: the same prompt is computed in full.
    let off = run(&["--no-disk-cache"])?;
    assert_eq!(off["cached_tokens"], 0, "{off}");
    assert_eq!(off["tokens"], again["tokens"]);
    Ok(())
}

/// `lockstep chat --verbose` on smollm2-135m with one long user turn and `extra` flags:
/// (stdout, the number of cached prompt tokens of the turn).
fn chat(extra: &[&str]) -> Result<(String, usize), Box<dyn std::error::Error>> {
    use std::io::Write;
    hub::ensure_model("smollm2-135m")?;
    let mut args = vec!["chat", "-n", "8", "--device", "cpu", "--verbose"];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(&args)
        .env("LOCKSTEP_HOME", hub::cache_root()?)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or("stdin")?;
    stdin.write_all(format!("{}\n", prompt()).as_bytes())?;
    drop(stdin);
    let out = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("prompt "))
        .ok_or_else(|| format!("no summary line: {stderr}"))?;
    let cached = match line.split_once(" tokens (") {
        Some((_, rest)) => rest.split_whitespace().next().ok_or("count")?.parse()?,
        None => 0,
    };
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), cached))
}

#[test]
fn chat_reads_a_conversation_start_back_from_disk_in_a_later_process() -> TestResult {
    let dir = TempDir::new("chat");
    let d = dir.0.to_str().ok_or("path")?;
    let (first, cached) = chat(&["--disk-cache", d])?;
    assert_eq!(cached, 0, "nothing on disk yet");
    assert!(block_files(&dir.0) >= 2, "the turn's blocks were saved");
    let (second, cached) = chat(&["--disk-cache", d])?;
    assert!(
        cached >= 64,
        "the second process read the start back: {cached}"
    );
    assert_eq!(second, first, "the same reply");
    let (off, cached) = chat(&["--no-disk-cache"])?;
    assert_eq!((off, cached), (first, 0));
    Ok(())
}

#[test]
fn a_bad_size_limit_is_a_clear_error() -> TestResult {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", "-p", "x", "--disk-cache-gib", "0", "--device", "cpu"])
        .env("LOCKSTEP_HOME", hub::cache_root()?)
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--disk-cache-gib must be a positive number"),
        "{err}"
    );
    Ok(())
}
