//! The model-hub path against a local HTTP server: resumable `.part` downloads.

use crate::common::*;
use lockstep_hub::{Cache, HubError, Source, SourceChoice, SourceKind};

const HUB: SourceChoice = SourceChoice::Only(SourceKind::Hub);
const PATH: &str = "/org/repo/resolve/main/m.gguf";

fn hub_spec(name: &str, data: &[u8]) -> &'static lockstep_hub::ModelSpec {
    spec(
        name,
        data,
        vec![Source::Hub {
            repo: "org/repo",
            file: "m.gguf",
        }],
    )
}

fn hub_options(server: &TestServer) -> lockstep_hub::PullOptions {
    let mut o = options(HUB, None);
    o.hub_endpoint = server.endpoint.clone();
    o
}

#[test]
fn partial_download_is_resumed_with_one_range_request() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(500_000, 11);
    let server = TestServer::start(PATH, data.clone(), Behavior::Normal)?;
    let spec = hub_spec("resume", &data);
    let cache = Cache::new(root.path());
    // A previous run stopped after 200,000 bytes.
    let part = cache.downloads_dir("resume").join("m.gguf.part");
    std::fs::create_dir_all(cache.downloads_dir("resume"))?;
    std::fs::write(&part, &data[..200_000])?;
    let pulled = cache.pull(spec, &hub_options(&server))?;
    assert_eq!(std::fs::read(&pulled.path)?, data);
    assert_eq!(server.ranges(), vec![Some("bytes=200000-".to_string())]);
    assert!(!part.exists(), "the .part file becomes the model");
    Ok(())
}

#[test]
fn dropped_connection_is_resumed_within_the_same_pull() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(400_000, 12);
    let server = TestServer::start(PATH, data.clone(), Behavior::DropFirstAfter(150_000))?;
    let pulled = Cache::new(root.path()).pull(hub_spec("drop", &data), &hub_options(&server))?;
    assert_eq!(std::fs::read(&pulled.path)?, data);
    let ranges = server.ranges();
    assert_eq!(ranges.len(), 2, "{ranges:?}");
    assert_eq!(ranges[0], None);
    assert_eq!(ranges[1], Some("bytes=150000-".to_string()));
    Ok(())
}

#[test]
fn server_ignoring_range_restarts_the_file_correctly() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(100_000, 13);
    let server = TestServer::start(PATH, data.clone(), Behavior::IgnoreRange)?;
    let cache = Cache::new(root.path());
    std::fs::create_dir_all(cache.downloads_dir("norange"))?;
    std::fs::write(
        cache.downloads_dir("norange").join("m.gguf.part"),
        &data[..30_000],
    )?;
    let pulled = cache.pull(hub_spec("norange", &data), &hub_options(&server))?;
    assert_eq!(std::fs::read(&pulled.path)?, data);
    Ok(())
}

#[test]
fn http_error_status_is_reported_with_the_url() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(1000, 14);
    let server = TestServer::start(PATH, data.clone(), Behavior::Status(404))?;
    let err = Cache::new(root.path())
        .pull(hub_spec("missing", &data), &hub_options(&server))
        .err()
        .ok_or("pull succeeded")?;
    assert!(
        matches!(err, HubError::HttpStatus { status: 404, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("{}{PATH}", server.endpoint)) && msg.contains("404"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn unreachable_server_is_a_network_error() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(1000, 15);
    // Bind then drop a listener: nothing listens on that port any more.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut opts = options(HUB, None);
    opts.hub_endpoint = format!("http://127.0.0.1:{port}");
    let err = Cache::new(root.path())
        .pull(hub_spec("offline", &data), &opts)
        .err()
        .ok_or("pull succeeded")?;
    assert!(matches!(err, HubError::Network { .. }), "{err}");
    assert!(err.to_string().contains("resumes"), "{err}");
    Ok(())
}

#[test]
fn wrong_content_fails_the_checksum_and_is_not_kept() -> TestResult {
    let root = tempfile::tempdir()?;
    let data = model_bytes(64_000, 16);
    let mut served = data.clone();
    served[1234] ^= 1;
    let server = TestServer::start(PATH, served, Behavior::Normal)?;
    let cache = Cache::new(root.path());
    let err = cache
        .pull(hub_spec("wrong", &data), &hub_options(&server))
        .err()
        .ok_or("pull of wrong content succeeded")?;
    assert!(matches!(err, HubError::ChecksumMismatch { .. }), "{err}");
    assert!(!cache.model_path("wrong").exists());
    assert!(!cache.downloads_dir("wrong").join("m.gguf.part").exists());
    Ok(())
}
