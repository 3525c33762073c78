//! The built `lockstep` binary: `models`, `pull`, errors and help.

use std::path::Path;
use std::process::{Command, Output};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn lockstep(home: &Path, args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .env("LOCKSTEP_HOME", home)
        .env_remove("RUST_LOG")
        .output()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn models_lists_every_known_model_with_size_status_and_path() -> TestResult {
    let home = tempfile::tempdir()?;
    // One model "cached" (a sparse file of the right size), the others not.
    let spec = hub::find_model("gemma3-270m").ok_or("gemma3-270m unknown")?;
    std::fs::create_dir_all(home.path().join("models"))?;
    let cached = home.path().join("models").join("gemma3-270m.gguf");
    std::fs::File::create(&cached)?.set_len(spec.size)?;
    let out = lockstep(home.path(), &["models"])?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for m in hub::known_models() {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{} ", m.name)))
            .ok_or_else(|| format!("no line for {} in:\n{stdout}", m.name))?;
        let path = home.path().join("models").join(format!("{}.gguf", m.name));
        assert!(line.contains(&path.display().to_string()), "{line}");
        let status = if m.name == "gemma3-270m" {
            "cached"
        } else {
            "not pulled"
        };
        assert!(line.contains(status), "{line}");
        assert!(line.contains("iB"), "size shown: {line}");
    }
    assert!(
        stdout.contains(&home.path().display().to_string()),
        "{stdout}"
    );
    Ok(())
}

#[test]
fn pull_of_a_cached_model_is_instant_and_prints_its_path() -> TestResult {
    let path = hub::ensure_model("smollm2-135m")?;
    let root = hub::cache_root()?;
    let start = std::time::Instant::now();
    let out = lockstep(&root, &["pull", "smollm2-135m"])?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), format!("{}\n", path.display()));
    assert!(
        text(&out.stderr).contains("smollm2-135m: already present"),
        "{}",
        text(&out.stderr)
    );
    assert!(start.elapsed().as_secs() < 10, "took {:?}", start.elapsed());
    Ok(())
}

#[test]
fn pull_of_an_unknown_name_fails_and_lists_the_known_models() -> TestResult {
    let home = tempfile::tempdir()?;
    let out = lockstep(home.path(), &["pull", "smollm2-135m", "no-such-model"])?;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("no-such-model"), "{stderr}");
    for m in hub::known_models() {
        assert!(stderr.contains(m.name), "{stderr}");
    }
    // Names are checked before anything is fetched.
    assert!(!home.path().join("models").exists());
    Ok(())
}

#[test]
fn inspect_of_a_missing_file_fails_with_a_clear_error() -> TestResult {
    let home = tempfile::tempdir()?;
    let out = lockstep(home.path(), &["inspect", "/no/such/model.gguf"])?;
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("/no/such/model.gguf") && stderr.contains("known models"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn help_names_the_subcommands_and_the_environment() -> TestResult {
    let home = tempfile::tempdir()?;
    let out = lockstep(home.path(), &["--help"])?;
    assert!(out.status.success());
    let help = text(&out.stdout);
    for word in [
        "pull",
        "models",
        "inspect",
        "LOCKSTEP_HOME",
        "RUST_LOG",
        "Examples",
    ] {
        assert!(help.contains(word), "missing {word}:\n{help}");
    }
    Ok(())
}

#[test]
fn serve_help_names_the_model_name_flags_and_both_apis() -> TestResult {
    let home = tempfile::tempdir()?;
    let out = lockstep(home.path(), &["serve", "--help"])?;
    assert!(out.status.success());
    let help = text(&out.stdout);
    for word in [
        "--alias",
        "--strict-model-name",
        "x-api-key",
        "/v1/messages",
        "ANTHROPIC_BASE_URL",
        "trained context",
    ] {
        assert!(help.contains(word), "missing {word}:\n{help}");
    }
    Ok(())
}

// Built with `--features cuda` the same command would measure a GPU that is there.
#[cfg(not(feature = "cuda"))]
#[test]
fn bench_on_cuda_without_a_usable_gpu_is_a_clear_error_and_prints_no_result() -> TestResult {
    let path = hub::ensure_model("smollm2-135m")?;
    let root = hub::cache_root()?;
    let model = path.display().to_string();
    let out = lockstep(
        &root,
        &[
            "bench", "-m", &model, "--device", "cuda", "-p", "16", "-n", "4", "-r", "1",
        ],
    )?;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--device cuda:0"), "{err}");
    assert!(err.contains("built without CUDA support"), "{err}");
    assert!(!text(&out.stdout).contains("tg4"), "{}", text(&out.stdout));
    // --threads is a CPU flag: refused before anything loads.
    let out = lockstep(
        &root,
        &[
            "bench", "-m", &model, "--device", "cuda", "-t", "2", "-r", "1",
        ],
    )?;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--threads applies to the CPU only"));
    // `auto` in this build is the CPU backend driven through the engine's backend trait,
    // the same code path `--device cuda` takes on a GPU.
    let out = lockstep(
        &root,
        &[
            "bench", "-m", &model, "--device", "auto", "-p", "16", "-n", "4", "-r", "1",
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        table.contains("| pp16 |") && table.contains("| tg4 |"),
        "{table}"
    );
    assert!(table.contains("of weights per token"), "{table}");
    Ok(())
}

#[test]
fn verify_bench_prints_the_cost_curve_of_blocks_of_1_to_16_rows() -> TestResult {
    let path = hub::ensure_model("smollm2-135m")?;
    let root = hub::cache_root()?;
    let model = path.display().to_string();
    let out = lockstep(
        &root,
        &[
            "bench", "--verify", "-m", &model, "-p", "24", "-r", "2", "-t", "1", "-o", "json",
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: serde_json::Value = serde_json::from_str(&text(&out.stdout))?;
    let rows = rows.as_array().ok_or("a JSON array")?;
    assert_eq!(rows.len(), 16);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["rows"], i + 1);
        assert_eq!(r["context"], 24);
        assert_eq!(r["samples_ms"].as_array().map(Vec::len), Some(2));
        let (ms, ratio) = (
            r["ms"].as_f64().unwrap_or(0.0),
            r["ratio"].as_f64().unwrap_or(0.0),
        );
        assert!(ms > 0.0 && ratio > 0.0, "{r}");
        let t1 = rows[0]["ms"].as_f64().unwrap_or(0.0);
        assert!((ratio - ms / t1).abs() < 1e-9, "{r}");
    }
    assert_eq!(rows[0]["ratio"], 1.0);
    // One row drafts nothing: no break-even rate; a larger block has one in [0, 1] or none.
    assert!(rows[0]["break_even_acceptance"].is_null());
    for r in &rows[1..] {
        let a = &r["break_even_acceptance"];
        assert!(
            a.is_null() || a.as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)),
            "{r}"
        );
    }
    // The other benches' flags do not combine with it, and several thread counts are refused.
    let out = lockstep(&root, &["bench", "--verify", "--spec", "-m", &model])?;
    assert!(!out.status.success());
    let out = lockstep(&root, &["bench", "--verify", "-m", &model, "-t", "1,2"])?;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("one thread count"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

// Built with `--features cuda` the same commands would measure on a GPU that is there.
#[cfg(not(feature = "cuda"))]
#[test]
fn spec_and_agent_bench_load_the_model_on_the_device_they_are_given() -> TestResult {
    let path = hub::ensure_model("smollm2-135m")?;
    let root = hub::cache_root()?;
    let model = path.display().to_string();
    // `--device cuda` where CUDA is not built in fails for both benches (they used to run
    // on the CPU whatever --device said).
    for mode in ["--spec", "--agent"] {
        let out = lockstep(&root, &["bench", mode, "-m", &model, "--device", "cuda"])?;
        assert!(!out.status.success(), "{mode}");
        let err = text(&out.stderr);
        assert!(err.contains("built without CUDA support"), "{mode}: {err}");
        assert!(!text(&out.stdout).contains("| plain |"), "{mode}");
    }
    // A replay runs no model: --device is refused rather than ignored.
    let out = lockstep(
        &root,
        &[
            "bench",
            "--spec",
            "-m",
            &model,
            "--device",
            "auto",
            "--replay",
            "/nonexistent.rec",
        ],
    )?;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--device does not apply"), "{err}");
    // `auto` in this build: the target loaded through the device path (the CPU backend
    // behind the engine's backend trait), one run each, outputs checked identical.
    let out = lockstep(
        &root,
        &[
            "bench",
            "--spec",
            "-m",
            &model,
            "--device",
            "auto",
            "-n",
            "12",
            "-r",
            "1",
            "--spec-workloads",
            "structured",
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("| structured |"))
        .collect();
    assert!(rows.len() >= 2, "{table}");
    assert!(rows.iter().all(|r| r.contains("| yes |")), "{table}");
    Ok(())
}

// Built with `--features cuda` the same command would serve on a GPU that is there.
#[cfg(not(feature = "cuda"))]
#[test]
fn serve_on_cuda_without_a_usable_gpu_is_a_clear_error_and_serves_nothing() -> TestResult {
    // A build without CUDA: `--device cuda` must fail at load with the reason, not fall
    // back to the CPU or start listening.
    let path = hub::ensure_model("smollm2-135m")?;
    let root = hub::cache_root()?;
    let model = path.display().to_string();
    let out = lockstep(
        &root,
        &["serve", "-m", &model, "--device", "cuda", "--port", "0"],
    )?;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--device cuda:0"), "{err}");
    assert!(err.contains("built without CUDA support"), "{err}");
    assert!(
        !text(&out.stdout).contains("serving"),
        "{}",
        text(&out.stdout)
    );
    Ok(())
}
