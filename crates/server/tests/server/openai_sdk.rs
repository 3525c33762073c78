//! Runs tests/openai/test_openai_sdk.py (the official `openai` Python package, pinned,
//! installed into a venv under the target directory) against a live server.

use std::path::PathBuf;
use std::process::Command;

use crate::common::qwen;

const OPENAI_PIN: &str = "3.57.0";

fn venv_python() -> PathBuf {
    crate::common::sdk_python("openai", OPENAI_PIN)
}

#[test]
fn the_official_openai_python_sdk_passes_its_checks() {
    let python = venv_python();
    let server = qwen();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/openai/test_openai_sdk.py");
    let out = Command::new(python)
        .arg(&script)
        .env("OPENAI_BASE_URL", server.url("/v1"))
        .env("OPENAI_API_KEY", "unused")
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
    assert!(stdout.contains("all openai SDK checks passed"), "{stdout}");
}
