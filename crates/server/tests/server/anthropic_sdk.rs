//! Runs tests/anthropic/test_anthropic_sdk.py (the official `anthropic` Python package,
//! pinned, installed into a venv under the target directory) against a live server.

use std::path::PathBuf;
use std::process::Command;

use crate::common::qwen;

const ANTHROPIC_PIN: &str = "2.17.0";

fn venv_python() -> PathBuf {
    crate::common::sdk_python("anthropic", ANTHROPIC_PIN)
}

#[test]
fn the_official_anthropic_python_sdk_passes_its_checks() {
    let python = venv_python();
    let server = qwen();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/anthropic/test_anthropic_sdk.py");
    let out = Command::new(python)
        .arg(&script)
        .env("ANTHROPIC_BASE_URL", server.url(""))
        .env("ANTHROPIC_API_KEY", "unused")
        .env("LOCKSTEP_MODEL", "qwen2.5-coder-0.5b")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "SDK script failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("all anthropic SDK checks passed"),
        "{stdout}"
    );
}
