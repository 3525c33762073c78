//! Runs tests/openai/test_openai_sdk.py (the official `openai` Python package, pinned,
//! installed into a venv under the target directory) against a live server.

use std::path::PathBuf;
use std::process::Command;

use crate::common::qwen;

const OPENAI_PIN: &str = "3.57.0";

fn venv_python() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin").join("python");
    let ready = python.is_file()
        && Command::new(&python)
            .args([
                "-c",
                &format!("import openai, sys; sys.exit(openai.__version__ != '{OPENAI_PIN}')"),
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
            .args(["install", "--quiet", &format!("openai=={OPENAI_PIN}")])
            .status()
            .expect("pip runs");
        assert!(status.success(), "pip install openai=={OPENAI_PIN} failed");
    }
    python
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
