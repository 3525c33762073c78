//! Shared test fixtures: real tokenizers, a seeded RNG, walks through a matcher.

use std::sync::{Arc, OnceLock};

use lockstep_grammar::{CompiledConstraint, Constraint, GrammarLimits, GrammarMatcher, TokenEnv};
use sampling::TokenMask;
use text::{EncodeOptions, Tokenizer};

/// A model's tokenizer and token environment.
pub struct Model {
    pub tok: Arc<Tokenizer>,
    pub env: Arc<TokenEnv>,
}

fn load(name: &str) -> Model {
    let path = hub::ensure_model(name).expect("model file");
    let file = gguf::GgufFile::open(&path).expect("gguf");
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let env = TokenEnv::new(tok.clone()).expect("token env");
    Model { tok, env }
}

pub fn qwen() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load("qwen2.5-coder-0.5b"))
}

pub fn smollm() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load("smollm2-135m"))
}

/// splitmix64: a small seeded generator, enough for test walks.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

pub fn compile(m: &Model, c: &Constraint) -> CompiledConstraint {
    c.compile(&m.env, &GrammarLimits::default())
        .unwrap_or_else(|e| panic!("compile {c:?}: {e}"))
}

/// Tokenizes `text` as plain text and feeds it token by token; returns the index of the
/// first rejected token, or `None` when all were accepted.
pub fn feed_text(m: &Model, matcher: &mut GrammarMatcher, text: &str) -> Option<usize> {
    let ids = m.tok.encode(text, EncodeOptions::plain_text());
    for (i, &t) in ids.iter().enumerate() {
        if matcher.consume(t).is_err() {
            return Some(i);
        }
    }
    None
}

/// Whether the matcher allows an end-of-generation token now (by mask and by `accepts`).
pub fn eos_allowed(m: &Model, matcher: &mut GrammarMatcher) -> bool {
    let mut mask = TokenMask::new(m.env.n_logits());
    let by_mask =
        matcher.compute_mask(&mut mask).is_ok() && m.env.eos_ids().iter().any(|&e| mask.get(e));
    let by_accepts = m.env.eos_ids().iter().any(|&e| matcher.accepts(e));
    assert_eq!(by_mask, by_accepts, "mask and accepts disagree on EOS");
    by_mask
}

/// The outcome of a random walk.
pub struct Walk {
    pub bytes: Vec<u8>,
    pub tokens: Vec<u32>,
    pub finished: bool,
}

/// Picks random allowed tokens until EOS or `max_tokens`. Every step also checks that
/// `accepts` agrees with the mask on the chosen token, on EOS and on a few random ids.
pub fn random_walk(
    m: &Model,
    matcher: &mut GrammarMatcher,
    rng: &mut Rng,
    max_tokens: usize,
) -> Walk {
    let n = m.env.n_logits();
    let mut mask = TokenMask::new(n);
    let mut walk = Walk {
        bytes: Vec::new(),
        tokens: Vec::new(),
        finished: false,
    };
    let mut allowed: Vec<u32> = Vec::new();
    let mut short: Vec<u32> = Vec::new();
    let mut structural: Vec<u32> = Vec::new();
    for _ in 0..max_tokens {
        matcher.compute_mask(&mut mask).unwrap_or_else(|e| {
            panic!("mask after {:?}: {e}", String::from_utf8_lossy(&walk.bytes))
        });
        for b in m.env.blocked().iter() {
            assert!(!mask.get(b), "blocked token {b} in the mask");
        }
        for _ in 0..4 {
            let t = rng.below(n) as u32;
            assert_eq!(
                matcher.accepts(t),
                mask.get(t),
                "accepts({t}) disagrees with mask"
            );
        }
        let eos = m.env.eos_ids().iter().copied().find(|&e| mask.get(e));
        if let Some(e) = eos
            && (rng.chance(0.3) || mask.iter().all(|t| m.env.is_eos(t)))
        {
            assert!(matcher.accepts(e));
            matcher.consume(e).expect("consume eos");
            walk.tokens.push(e);
            walk.finished = true;
            return walk;
        }
        allowed.clear();
        short.clear();
        structural.clear();
        for t in mask.iter() {
            if m.env.is_eos(t) {
                continue;
            }
            allowed.push(t);
            let b = m.env.grammar_bytes(t);
            if b.len() <= 1 {
                short.push(t);
            }
            if b.len() == 1 && b"\"{}[],:*\n".contains(&b[0]) {
                structural.push(t);
            }
        }
        assert!(
            !allowed.is_empty(),
            "mask with only EOS must have been taken"
        );
        let pick = if !structural.is_empty() && rng.chance(0.35) {
            structural[rng.below(structural.len())]
        } else if !short.is_empty() && rng.chance(0.5) {
            short[rng.below(short.len())]
        } else {
            allowed[rng.below(allowed.len())]
        };
        assert!(
            matcher.accepts(pick),
            "accepts disagrees with mask on {pick}"
        );
        matcher.consume(pick).expect("consume allowed token");
        walk.bytes.extend_from_slice(m.env.grammar_bytes(pick));
        walk.tokens.push(pick);
    }
    walk
}
