//! The prefix cache's disk tier over real models: a prompt computed by one engine and read
//! back from disk by a fresh one (a restart) gives bit-identical logits to a cold
//! computation, for every layer kind — llama (SmolLM2), qwen2 (Qwen2.5-Coder-0.5B) and
//! Gemma 3's sliding-window layers, with a prompt past the window — counts the restored
//! tokens as cached, and survives corrupt, truncated and foreign files. DeepSeek V4 and
//! backends that cannot save their KV say why the tier is off.

use lockstep_engine::{
    Completion, Deepseek4Backend, DiskCacheConfig, DiskCacheState, Engine, EngineConfig,
    GenerateRequest, ModelBackend, SamplingParams,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use text::{EncodeOptions, Tokenizer};

const BLOCK: usize = 32;

struct Fixture {
    model: Arc<model::Model>,
    tok: Arc<Tokenizer>,
}

fn fixture(name: &str, n_ctx: usize) -> Fixture {
    let path = hub::ensure_model(name).expect("model in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        n_ctx: Some(n_ctx),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    Fixture { model, tok }
}

/// A fresh directory under the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "lockstep-disk-cache-test-{what}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn engine(f: &Fixture, disk: Option<&Path>, prefix_cache: bool) -> Engine {
    let cfg = EngineConfig {
        max_seqs: 2,
        kv_tokens: 4096,
        step_token_budget: 128,
        prefill_chunk: 64,
        prefix_cache,
        disk_cache: disk.map(|dir| DiskCacheConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
            model_id: [7; 32],
        }),
        ..EngineConfig::default()
    };
    Engine::start(
        Box::new(ModelBackend::new(f.model.clone())),
        f.tok.clone(),
        cfg,
    )
    .expect("engine starts")
}

/// About `n` prompt tokens of an agent-style prompt.
fn prompt(tok: &Tokenizer, n: usize) -> Vec<u32> {
    let text = "You are a coding agent. Tools: read_file(path), apply_patch(diff), \
                shell(cmd). Always read a file before patching it, keep diffs small, run the \
                tests after every change and report what you ran. ";
    let mut out = tok.encode("", EncodeOptions::raw_prompt());
    while out.len() < n {
        out.extend(tok.encode(text, EncodeOptions::plain_text()));
    }
    out.truncate(n);
    out
}

fn request(prompt: Vec<u32>) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, SamplingParams::greedy());
    r.max_tokens = Some(6);
    r.ignore_eos = true;
    r.logit_digests = true;
    r
}

fn run(e: &Engine, p: &[u32]) -> Completion {
    let c = e.submit(request(p.to_vec())).expect("accepted").collect();
    assert_eq!(c.error, None);
    c
}

fn assert_same(got: &Completion, want: &Completion, what: &str) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(got.logit_sha256, want.logit_sha256, "{what}: logit digests");
    assert_eq!(got.logit_sha256.len(), 6, "{what}: one digest per token");
}

fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("cache directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvb"))
        .collect();
    v.sort();
    v
}

/// Cold, then saved by one engine, then restored by a fresh one: identical logits, the
/// restored blocks counted as cached tokens and as disk hits.
fn restore_is_exact(name: &str, n_ctx: usize, n_prompt: usize) {
    let f = fixture(name, n_ctx);
    let p = prompt(&f.tok, n_prompt);
    let full_blocks = p.len() / BLOCK;
    let cold = {
        let e = engine(&f, None, false);
        run(&e, &p)
    };
    let dir = TempDir::new(name);
    let first = {
        let e = engine(&f, Some(&dir.0), true);
        assert!(
            matches!(e.disk_cache_state(), DiskCacheState::On { .. }),
            "{:?}",
            e.disk_cache_state()
        );
        let c = run(&e, &p);
        assert_eq!(c.usage.cached_tokens, 0, "nothing on disk yet");
        let m = e.metrics().disk;
        assert_eq!(m.miss_blocks, full_blocks as u64);
        e.shutdown();
        c
    };
    assert_same(&first, &cold, "computed with the disk tier on");
    // Every full block of prompt and output was saved.
    let saved = block_files(&dir.0).len();
    assert_eq!(
        saved,
        (p.len() + 5) / BLOCK,
        "block files after the first run"
    );
    // A restart: nothing in RAM, everything on disk.
    let e = engine(&f, Some(&dir.0), true);
    let restored = run(&e, &p);
    assert_same(&restored, &cold, "restored from disk");
    assert_eq!(
        restored.usage.cached_tokens,
        (full_blocks * BLOCK).min(p.len() - 1),
        "the restored blocks count as cached tokens"
    );
    let m = e.metrics().disk;
    assert_eq!(m.hit_blocks, full_blocks as u64, "{m:?}");
    assert_eq!((m.miss_blocks, m.rejected_files), (0, 0), "{m:?}");
    assert!(m.bytes_read > 0);
    assert_eq!(m.restores, 1, "one chain restored: {m:?}");
    assert_eq!(
        m.restored_bytes, m.bytes_read,
        "every block read was restored: {m:?}"
    );
    assert!(m.restore_micros > 0, "{m:?}");
    // In RAM now: the same prompt again reads nothing more.
    let again = run(&e, &p);
    assert_same(&again, &cold, "from RAM after the restore");
    assert_eq!(e.metrics().disk.hit_blocks, full_blocks as u64);
    e.shutdown();

    // Damage: one block's payload flipped, a later one truncated, and a foreign file.
    let files = block_files(&dir.0);
    let mut bytes = std::fs::read(&files[1]).expect("read");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&files[1], &bytes).expect("write");
    let bytes = std::fs::read(&files[2]).expect("read");
    std::fs::write(&files[2], &bytes[..bytes.len() - 100]).expect("write");
    let foreign = dir.0.join(format!("{}.kvb", "ab".repeat(32)));
    std::fs::write(&foreign, b"some other program's file").expect("write");
    let e = engine(&f, Some(&dir.0), true);
    let damaged = run(&e, &p);
    assert_same(&damaged, &cold, "with damaged files");
    let m = e.metrics().disk;
    assert!(m.rejected_files >= 1, "{m:?}");
    assert!(
        damaged.usage.cached_tokens < full_blocks * BLOCK,
        "a damaged block is computed, not trusted"
    );
    e.shutdown();
    // Each restart reads up to the first damaged block, removes it, and saves it again
    // once computed; within two more restarts everything is restored again.
    let mut healed = false;
    for _ in 0..2 {
        let e = engine(&f, Some(&dir.0), true);
        let c = run(&e, &p);
        assert_same(&c, &cold, "after damaged blocks were saved again");
        healed = c.usage.cached_tokens == (full_blocks * BLOCK).min(p.len() - 1);
        e.shutdown();
        if healed {
            break;
        }
    }
    assert!(healed, "the damaged blocks were saved again");
    assert!(
        !foreign.exists(),
        "a file under a block's name that is no block file is removed at a start"
    );
}

#[test]
fn llama_blocks_restored_from_disk_give_bit_identical_logits() {
    restore_is_exact("smollm2-135m", 512, 200);
}

#[test]
fn qwen2_blocks_restored_from_disk_give_bit_identical_logits() {
    restore_is_exact("qwen2.5-coder-0.5b", 512, 150);
}

/// Gemma 3: a prompt past the 512-token window. Each block file holds every layer's K/V of
/// its 32 positions, sliding layers included; a restored chain keeps in the sliding layers
/// only the window its next query sees, exactly as the sequence that computed it did.
#[test]
fn gemma3_sliding_window_blocks_restored_from_disk_give_bit_identical_logits() {
    restore_is_exact("gemma3-270m", 2048, 700);
}

#[test]
fn without_the_prefix_cache_the_disk_tier_is_off_and_says_why() {
    let f = fixture("smollm2-135m", 512);
    let dir = TempDir::new("no-prefix");
    let e = engine(&f, Some(&dir.0), false);
    match e.disk_cache_state() {
        DiskCacheState::Unavailable(why) => assert!(why.contains("prefix cache"), "{why}"),
        other => panic!("expected the tier to be unavailable, got {other:?}"),
    }
    let p = prompt(&f.tok, 100);
    run(&e, &p);
    assert!(!e.metrics().disk.enabled);
    assert!(!dir.0.exists(), "nothing was created");
}

#[test]
fn deepseek4_refuses_the_disk_tier_with_a_reason() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/deepseek4");
    let file = Arc::new(gguf::GgufFile::open(fixtures.join("flash-layout.gguf")).expect("fixture"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Deepseek4::load(file, &opts).expect("loads"));
    let dir = TempDir::new("deepseek4");
    let cfg = EngineConfig {
        disk_cache: Some(DiskCacheConfig {
            dir: dir.0.clone(),
            max_bytes: 1 << 30,
            model_id: [1; 32],
        }),
        ..EngineConfig::default()
    };
    let e = Engine::start(Box::new(Deepseek4Backend::new(model)), tok, cfg).expect("starts");
    match e.disk_cache_state() {
        DiskCacheState::Unavailable(why) => assert!(why.contains("DeepSeek V4"), "{why}"),
        other => panic!("expected the tier to be refused, got {other:?}"),
    }
    assert!(!dir.0.exists(), "nothing was created");
}

/// A restore the data is at fault for is [`BackendError::BadKvBlock`] (the disk tier then
/// removes the file); one the caller is at fault for is [`BackendError::Invalid`]; before
/// the pool exists, [`BackendError::NoKvPool`]. None of them changes the sequence.
#[test]
fn restore_errors_say_whose_fault_they_are() {
    use lockstep_engine::{BackendError, ForwardBackend, ForwardRow};
    let f = fixture("smollm2-135m", 512);
    let mut b = ModelBackend::new(f.model.clone());
    assert!(matches!(
        b.kv_restore_block(lockstep_engine::KvSlot(0), &[]),
        Err(BackendError::NoKvPool)
    ));
    b.init_kv(1024).expect("KV pool");
    let bytes = b.kv_block_bytes();
    let s = b.kv_new();
    let p = prompt(&f.tok, 40);
    b.kv_prepare(s, 0, p.len()).expect("prepare");
    let rows: Vec<ForwardRow> = p
        .iter()
        .enumerate()
        .map(|(pos, &token)| ForwardRow {
            slot: s,
            token,
            pos,
            wants_logits: false,
        })
        .collect();
    b.forward(&rows, &mut Vec::new()).expect("forward");
    let mut block = Vec::new();
    b.kv_export_block(s, 0, &mut block).expect("export");
    assert_eq!(block.len(), bytes);
    let t = b.kv_new();
    let free = b.free_blocks();
    let short = b.kv_restore_block(t, &block[..bytes - 2]);
    assert!(
        matches!(short, Err(BackendError::BadKvBlock(_))),
        "{short:?}"
    );
    assert_eq!((b.kv_len(t), b.free_blocks()), (0, free), "nothing changed");
    // `s` holds 40 positions: not a block boundary.
    let off = b.kv_restore_block(s, &block);
    assert!(matches!(off, Err(BackendError::Invalid(_))), "{off:?}");
    b.kv_restore_block(t, &block)
        .expect("a whole block restores");
    assert_eq!(b.kv_len(t), BLOCK);
}
