//! Shared helpers: a small byte-level tokenizer for the fake model, engine set-up, and a
//! reference decoder that applies the sampling rule to `fake_logits` directly.
#![allow(dead_code)]

use lockstep_engine::{
    Completion, ConstraintError, Engine, EngineConfig, FakeBackend, FakeStats, GenerateRequest,
    SamplingParams, TokenConstraint, TokenMask, fake_logits,
};
use sampling::{ChoiceContext, Sampler};
use std::sync::Arc;
use text::{Tokenizer, VocabSpec};

/// Vocabulary of the test tokenizer (= the fake model's logit width).
pub const N_VOCAB: usize = 64;
/// The end-of-text control token.
pub const EOS: u32 = 0;
/// Byte tokens 0xC3 and 0xA9: together "é".
pub const BYTE_C3: u32 = 28;
pub const BYTE_A9: u32 = 29;
/// Fake KV block size.
pub const BLOCK: usize = 8;

/// 0: `<|endoftext|>` (control, EOS); 1..=26: a..z; 27: space; 28/29: the two bytes of
/// "é"; 30: " the"; 31: "ing"; 32: "ab"; 33: newline; 34..64: "q0".."q29".
pub fn tokenizer() -> Arc<Tokenizer> {
    let mut tokens = vec!["<|endoftext|>".to_string()];
    tokens.extend((b'a'..=b'z').map(|c| (c as char).to_string()));
    for t in ["Ġ", "Ã", "©", "Ġthe", "ing", "ab", "Ċ"] {
        tokens.push(t.to_string());
    }
    while tokens.len() < N_VOCAB {
        tokens.push(format!("q{}", tokens.len() - 34));
    }
    let mut types = vec![1i32; tokens.len()];
    types[0] = 3;
    let spec = VocabSpec {
        model: "gpt2",
        pre: "gpt2",
        tokens: &tokens,
        token_types: &types,
        eos_id: Some(EOS),
        ..VocabSpec::default()
    };
    Arc::new(Tokenizer::from_spec(&spec).expect("test tokenizer builds"))
}

pub fn config() -> EngineConfig {
    EngineConfig {
        max_seqs: 8,
        kv_tokens: 4096,
        step_token_budget: 64,
        prefill_chunk: 24,
        queue_capacity: 64,
        context_len: 0,
        prefix_cache: true,
        disk_cache: None,
        spec: Default::default(),
    }
}

/// An engine over a fresh fake backend (context 1024).
pub fn engine(cfg: EngineConfig) -> (Engine, Arc<FakeStats>) {
    engine_with(FakeBackend::new(N_VOCAB, 1024, BLOCK), cfg)
}

pub fn engine_with(fake: FakeBackend, cfg: EngineConfig) -> (Engine, Arc<FakeStats>) {
    let stats = fake.stats();
    let engine = Engine::start(Box::new(fake), tokenizer(), cfg).expect("engine starts");
    (engine, stats)
}

/// A deterministic prompt of `len` tokens (ids 1..64, no EOS).
pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            1 + (i
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503))
                >> 7)
                % 63
        })
        .collect()
}

/// A request that generates exactly `n` tokens (EOS ignored) with digests.
pub fn request(prompt: Vec<u32>, sampling: SamplingParams, n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, sampling);
    r.max_tokens = Some(n);
    r.ignore_eos = true;
    r.logit_digests = true;
    r.logprobs = Some(3);
    r
}

pub fn seeded(t: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: t,
        seed,
        ..SamplingParams::default()
    }
}

/// The reference: one forward and one choice per token, straight from `fake_logits` and
/// the sampling rule (position = absolute position of the chosen token).
pub fn reference_decode(
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
    mut constraint: Option<&mut dyn TokenConstraint>,
) -> Vec<u32> {
    let tok = tokenizer();
    let mut never = TokenMask::new(N_VOCAB);
    for &t in tok.never_sample_ids() {
        never.set(t, true).unwrap();
    }
    let mut sampler = Sampler::new();
    let mut all = prompt.to_vec();
    let mut mask = TokenMask::new(N_VOCAB);
    for _ in 0..n {
        let logits = fake_logits(N_VOCAB, &all);
        let allowed = match constraint.as_deref_mut() {
            Some(c) => {
                c.compute_mask(&mut mask).unwrap();
                Some(&mask)
            }
            None => None,
        };
        let ctx = ChoiceContext {
            prompt_tokens: &all[..prompt.len()],
            generated_tokens: &all[prompt.len()..],
            position: all.len() as u64,
        };
        let c = sampler
            .choose(&logits, &ctx, params, allowed, &never)
            .unwrap();
        if let Some(con) = constraint.as_deref_mut() {
            con.consume(c.token).unwrap();
        }
        all.push(c.token);
        if constraint.as_deref().is_some_and(|c| c.is_finished()) {
            break;
        }
    }
    all[prompt.len()..].to_vec()
}

/// Runs each request alone on its own fresh engine with the prefix cache off.
pub fn run_alone(reqs: Vec<GenerateRequest>) -> Vec<Completion> {
    reqs.into_iter()
        .map(|r| {
            let (e, _) = engine(EngineConfig {
                prefix_cache: false,
                ..config()
            });
            let out = e.submit(r).expect("accepted").collect();
            e.shutdown();
            out
        })
        .collect()
}

/// Asserts two completions are the same generation (tokens, text, digests, logprobs,
/// finish, token counts).
pub fn assert_same(a: &Completion, b: &Completion, what: &str) {
    assert_eq!(a.error, None, "{what}: error");
    assert_eq!(b.error, None, "{what}: error");
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.text, b.text, "{what}: text");
    assert_eq!(a.logit_sha256, b.logit_sha256, "{what}: logit digests");
    assert_eq!(a.logprobs, b.logprobs, "{what}: logprobs");
    assert_eq!(a.finish, b.finish, "{what}: finish");
    assert_eq!(
        a.usage.prompt_tokens, b.usage.prompt_tokens,
        "{what}: prompt tokens"
    );
    assert_eq!(
        a.usage.completion_tokens, b.usage.completion_tokens,
        "{what}: completion tokens"
    );
}

/// A constraint for tests: allows exactly `script[i]`'s set at step i, finishes after the
/// script; optionally fails at consume number `fail_at`.
pub struct Scripted {
    pub script: Vec<Vec<u32>>,
    pub step: usize,
    pub fail_at: Option<usize>,
}

impl Scripted {
    pub fn new(script: Vec<Vec<u32>>) -> Scripted {
        Scripted {
            script,
            step: 0,
            fail_at: None,
        }
    }
}

impl Scripted {
    fn failed(&self, what: &str) -> ConstraintError {
        ConstraintError::Failed(format!("{what} at step {}", self.step))
    }
}

impl TokenConstraint for Scripted {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let set = self
            .script
            .get(self.step)
            .ok_or_else(|| self.failed("script over"))?;
        *mask = TokenMask::from_tokens(N_VOCAB, set)
            .map_err(|e| ConstraintError::Failed(e.to_string()))?;
        Ok(())
    }
    fn accepts(&mut self, token: u32) -> bool {
        self.script
            .get(self.step)
            .is_some_and(|set| set.contains(&token))
    }
    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if self.fail_at == Some(self.step) {
            return Err(self.failed("scripted failure"));
        }
        let set = self
            .script
            .get(self.step)
            .ok_or_else(|| self.failed("script over"))?;
        if !set.contains(&token) {
            return Err(ConstraintError::TokenRejected {
                token,
                text: String::new(),
                position: self.step,
            });
        }
        self.step += 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.step >= self.script.len()
    }
    fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
        self.step = self.step.checked_sub(n).ok_or(ConstraintError::Rollback {
            requested: n,
            available: self.step,
        })?;
        Ok(())
    }
    fn forced_tokens(&mut self) -> Vec<u32> {
        self.script[self.step.min(self.script.len())..]
            .iter()
            .take_while(|set| set.len() == 1)
            .map(|set| set[0])
            .collect()
    }
    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(Scripted {
            script: self.script.clone(),
            step: self.step,
            fail_at: self.fail_at,
        })
    }
}
