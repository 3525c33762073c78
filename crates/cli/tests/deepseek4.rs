//! `lockstep run` on a DeepSeek V4 file (the committed reference fixture): plain and
//! speculative greedy runs give the same tokens, and CUDA is refused with a clear error.

use std::process::Command;

use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fixture() -> String {
    format!(
        "{}/../model/tests/fixtures/deepseek4/flash-layout.gguf",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn run(extra: &[&str]) -> Result<std::process::Output, Box<dyn std::error::Error>> {
    let model = fixture();
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
fn deepseek4_on_cuda_is_a_clear_error() -> TestResult {
    let out = run(&["--device", "cuda"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("deepseek4") && err.contains("CPU"), "{err}");
    Ok(())
}
