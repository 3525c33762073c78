//! The engine over the real Gemma-3-270M (sliding-window layers): a generation that runs
//! well past the 512-token window keeps the sliding layers' KV bounded by the window while
//! the global layers grow with the sequence, and sharing a cached prefix across a released
//! window gives the same logits as computing it.

use lockstep_engine::{
    BackendError, Completion, Engine, EngineConfig, ForwardBackend, ForwardRow, GenerateRequest,
    KvSlot, ModelBackend, SamplingParams,
};
use std::sync::{Arc, Mutex};
use text::{EncodeOptions, Tokenizer};

const WINDOW: usize = 512;
const BLOCK: usize = 32;

/// Largest pool use seen after any forward: (sliding, global) blocks, and the pools' last
/// capacities.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    sliding_used: usize,
    global_used: usize,
    sliding_capacity: usize,
    global_capacity: usize,
}

/// A [`ModelBackend`] that records how full its pools are after every forward.
struct Watched {
    inner: ModelBackend,
    seen: Arc<Mutex<Seen>>,
}

impl ForwardBackend for Watched {
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.inner.init_kv(max_tokens)
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn total_blocks(&self) -> usize {
        self.inner.total_blocks()
    }
    fn free_blocks(&self) -> usize {
        self.inner.free_blocks()
    }
    fn kv_new(&mut self) -> KvSlot {
        self.inner.kv_new()
    }
    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError> {
        self.inner.kv_fork(src, len)
    }
    fn kv_len(&self, slot: KvSlot) -> usize {
        self.inner.kv_len(slot)
    }
    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        self.inner.kv_prepare(slot, from, to)
    }
    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        self.inner.kv_blocks_needed(slot, from, to)
    }
    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        self.inner.kv_truncate(slot, len)
    }
    fn kv_release(&mut self, slot: KvSlot) {
        self.inner.kv_release(slot)
    }
    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let r = self.inner.forward(rows, logits);
        let mut seen = self.seen.lock().expect("lock");
        for pool in self.inner.kv_pools() {
            match pool.window {
                Some(_) => {
                    seen.sliding_used = seen.sliding_used.max(pool.used());
                    seen.sliding_capacity = pool.capacity;
                }
                None => {
                    seen.global_used = seen.global_used.max(pool.used());
                    seen.global_capacity = pool.capacity;
                }
            }
        }
        r
    }
}

struct Fixture {
    model: Arc<model::Model>,
    tok: Arc<Tokenizer>,
}

fn fixture() -> Fixture {
    let path = hub::ensure_model("gemma3-270m").expect("gemma3-270m in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        n_ctx: Some(2048),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    Fixture { model, tok }
}

fn engine(f: &Fixture, prefix_cache: bool) -> (Engine, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let backend = Watched {
        inner: ModelBackend::new(f.model.clone()),
        seen: seen.clone(),
    };
    let cfg = EngineConfig {
        max_seqs: 2,
        kv_tokens: 4096,
        step_token_budget: 128,
        prefill_chunk: 64,
        prefix_cache,
        ..EngineConfig::default()
    };
    let e = Engine::start(Box::new(backend), f.tok.clone(), cfg).expect("engine starts");
    (e, seen)
}

/// About `n` prompt tokens of plain prose.
fn prompt(tok: &Tokenizer, n: usize) -> Vec<u32> {
    let text = "The river ran through the valley past the old mill, where the miller's \
                children counted boats and wrote their names in a ledger every evening. ";
    let mut out = tok.encode("", EncodeOptions::raw_prompt());
    while out.len() < n {
        out.extend(tok.encode(text, EncodeOptions::plain_text()));
    }
    out.truncate(n);
    out
}

fn request(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, SamplingParams::greedy());
    r.max_tokens = Some(n);
    r.ignore_eos = true;
    r.logit_digests = true;
    r
}

#[test]
fn gemma3_generation_past_the_window_keeps_sliding_kv_bounded() {
    let f = fixture();
    let (e, seen) = engine(&f, false);
    let p = prompt(&f.tok, 560);
    let c: Completion = e.submit(request(p, 200)).expect("accepted").collect();
    assert_eq!(c.tokens.len(), 200, "{:?}", c.finish);
    let s = *seen.lock().expect("lock");
    eprintln!("pools after a 760-position generation: {s:?}");
    // 760 positions: the global layers hold every block, the sliding ones the window
    // (512/32 + 1 blocks once decoding; a 64-row prefill chunk adds at most 2 while
    // writing).
    assert!(
        s.global_used >= 760usize.div_ceil(BLOCK),
        "global blocks {s:?}"
    );
    assert!(
        s.sliding_used <= WINDOW / BLOCK + 1 + 64 / BLOCK,
        "sliding blocks not bounded by the window: {s:?}"
    );
    // The sliding pool's memory follows the window, not the global pool.
    assert!(
        s.sliding_capacity < s.global_capacity / 2,
        "sliding pool grew like the global one: {s:?}"
    );
}

#[test]
fn gemma3_prefix_reuse_across_a_released_window_gives_the_same_logits() {
    let f = fixture();
    let p = prompt(&f.tok, 700);
    let (plain, _) = engine(&f, false);
    let want = plain
        .submit(request(p.clone(), 12))
        .expect("accepted")
        .collect();
    drop(plain);
    let (e, _) = engine(&f, true);
    let first = e
        .submit(request(p.clone(), 12))
        .expect("accepted")
        .collect();
    let again = e.submit(request(p, 12)).expect("accepted").collect();
    assert!(
        again.usage.cached_tokens > WINDOW,
        "the second request reused the prefix ({} tokens)",
        again.usage.cached_tokens
    );
    for (c, what) in [(&first, "first"), (&again, "reused")] {
        assert_eq!(c.tokens, want.tokens, "{what}: tokens");
        assert_eq!(c.logit_sha256, want.logit_sha256, "{what}: logit digests");
    }
}

#[test]
fn gemma3_accounting_is_in_global_blocks_and_forks_into_a_released_window_are_refused() {
    let f = fixture();
    let mut b = ModelBackend::new(f.model.clone());
    b.init_kv(4096).expect("pool");
    assert_eq!(
        b.total_blocks(),
        4096 / BLOCK,
        "the global pool is the one accounted"
    );
    let a = b.kv_new();
    assert_eq!(b.kv_blocks_needed(a, 0, 600), 600usize.div_ceil(BLOCK));
    b.kv_prepare(a, 0, 600).expect("prefill space");
    assert_eq!(b.free_blocks(), 4096 / BLOCK - 19);
    let pools = b.kv_pools();
    let sliding = pools
        .iter()
        .find(|p| p.window == Some(WINDOW))
        .expect("sliding");
    // The sliding pool starts at two windows' worth (2 x 17 blocks) and holds the 19.
    assert_eq!(
        (sliding.capacity, sliding.used()),
        (2 * (WINDOW / BLOCK + 1), 19)
    );
    // Writing position 600 makes 0..600 final: blocks wholly below 600 + 1 - 512 go.
    b.kv_prepare(a, 600, 601).expect("decode space");
    let sliding = b.kv_pools()[0];
    assert_eq!(sliding.window, Some(WINDOW));
    assert_eq!(sliding.used(), 19 - 89 / BLOCK, "blocks 0 and 1 released");
    // A fork whose next query needs released keys is refused (nothing leaks) ...
    let before = b.kv_pools();
    assert!(b.kv_fork(a, 100).is_err());
    assert_eq!(b.kv_pools(), before);
    // ... one at the end keeps only its window.
    let g = b.kv_fork(a, 601).expect("fork at the end");
    assert_eq!(b.kv_len(g), 601);
    b.kv_release(g);
    // Two more long prompts: the sliding pool outgrows its two windows, on demand, and
    // never past the global pool.
    let more: Vec<KvSlot> = (0..2).map(|_| b.kv_new()).collect();
    for &m in &more {
        b.kv_prepare(m, 0, 600).expect("space");
    }
    let sliding = b.kv_pools()[0];
    assert_eq!(sliding.used(), 17 + 2 * 19);
    assert!(sliding.capacity >= 17 + 2 * 19 && sliding.capacity <= b.total_blocks());
    for m in more {
        b.kv_release(m);
    }
    b.kv_release(a);
    assert!(b.kv_pools().iter().all(|p| p.used() == 0));
}
