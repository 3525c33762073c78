//! The engine over the real SmolLM2-135M: sequences batched together, reusing a cached
//! prefix, or preempted under a tiny KV pool give bit-identical logits and tokens to each
//! sequence run alone.

use lockstep_engine::{
    Completion, Engine, EngineConfig, Event, GenerateRequest, ModelBackend, SamplingParams,
};
use std::sync::Arc;
use text::{EncodeOptions, Tokenizer};

struct Fixture {
    model: Arc<model::Model>,
    tok: Arc<Tokenizer>,
}

fn fixture() -> Fixture {
    let path = hub::ensure_model("smollm2-135m").expect("smollm2-135m in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        n_ctx: Some(512),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    Fixture { model, tok }
}

fn engine(f: &Fixture, cfg: EngineConfig) -> Engine {
    Engine::start(
        Box::new(ModelBackend::new(f.model.clone())),
        f.tok.clone(),
        cfg,
    )
    .expect("engine starts")
}

fn cfg() -> EngineConfig {
    EngineConfig {
        max_seqs: 4,
        kv_tokens: 2048,
        step_token_budget: 64,
        prefill_chunk: 32,
        queue_capacity: 16,
        context_len: 0,
        prefix_cache: true,
        disk_cache: None,
        spec: Default::default(),
    }
}

const SYSTEM: &str = "<|im_start|>system\nYou are a helpful assistant who answers questions \
                      about geography, history and science. Answer briefly and accurately, in \
                      one short sentence, without lists, without markdown and without asking \
                      questions back. If you do not know, say so.<|im_end|>\n";

fn requests(tok: &Tokenizer) -> Vec<GenerateRequest> {
    let chat = |q: &str| {
        let text = format!("{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
        tok.encode(&text, EncodeOptions::raw_prompt())
    };
    let mk = |prompt: Vec<u32>, sampling: SamplingParams, n: usize| {
        let mut r = GenerateRequest::new(prompt, sampling);
        r.max_tokens = Some(n);
        r.logit_digests = true;
        r
    };
    vec![
        mk(
            chat("What is the capital of France?"),
            SamplingParams::greedy(),
            12,
        ),
        mk(
            tok.encode("The three primary colors are", EncodeOptions::raw_prompt()),
            SamplingParams {
                temperature: 0.8,
                seed: 1234,
                ..SamplingParams::default()
            },
            10,
        ),
        mk(
            chat("Name a planet with rings."),
            SamplingParams::greedy(),
            8,
        ),
    ]
}

fn alone(f: &Fixture) -> Vec<Completion> {
    let e = engine(
        f,
        EngineConfig {
            prefix_cache: false,
            ..cfg()
        },
    );
    let out = requests(&f.tok)
        .into_iter()
        .map(|r| e.submit(r).expect("accepted").collect())
        .collect();
    e.shutdown();
    out
}

fn assert_same(a: &Completion, b: &Completion, what: &str) {
    assert_eq!(a.error, None, "{what}");
    assert_eq!(b.error, None, "{what}");
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.text, b.text, "{what}: text");
    assert_eq!(a.logit_sha256, b.logit_sha256, "{what}: logit digests");
    assert_eq!(a.finish, b.finish, "{what}: finish");
    assert_eq!(
        a.usage.completion_tokens, b.usage.completion_tokens,
        "{what}"
    );
}

#[test]
fn smollm2_batched_reused_and_preempted_sequences_equal_each_run_alone() {
    let f = fixture();
    let reference = alone(&f);
    assert!(!reference[0].tokens.is_empty());
    assert!(
        reference[0].text.contains("Paris"),
        "sanity: {:?}",
        reference[0].text
    );

    // Concurrent, started at different times, the third sharing the system prompt.
    let e = engine(&f, cfg());
    let mut reqs = requests(&f.tok).into_iter();
    let h0 = e.submit(reqs.next().unwrap()).unwrap();
    let first = h0.recv();
    let rest: Vec<_> = reqs.map(|r| e.submit(r).unwrap()).collect();
    let mut c0 = h0.collect();
    if let Some(Event::Token {
        token,
        text,
        logit_sha256,
        ..
    }) = first
    {
        c0.tokens.insert(0, token);
        c0.text.insert_str(0, &text);
        c0.logit_sha256.insert(0, logit_sha256.unwrap());
    } else {
        panic!("first event {first:?}");
    }
    let mut got = vec![c0];
    got.extend(rest.into_iter().map(|h| h.collect()));
    for (i, (a, b)) in reference.iter().zip(&got).enumerate() {
        assert_same(a, b, &format!("batched request {i}"));
    }
    assert!(
        got[2].usage.cached_tokens >= 32,
        "the shared system prompt was reused: {:?}",
        got[2].usage
    );
    assert!(e.metrics().mean_rows_per_step > 1.0);
    e.shutdown();

    // A pool of 4 blocks (128 tokens) for three sequences of ~50 tokens: preemption.
    let e = engine(
        &f,
        EngineConfig {
            kv_tokens: 128,
            ..cfg()
        },
    );
    let hs: Vec<_> = requests(&f.tok)
        .into_iter()
        .map(|r| e.submit(r).unwrap())
        .collect();
    for (i, h) in hs.into_iter().enumerate() {
        assert_same(
            &reference[i],
            &h.collect(),
            &format!("tiny pool request {i}"),
        );
    }
    let m = e.metrics();
    assert!(m.preemptions > 0, "{m:?}");
    e.shutdown();
}

#[test]
fn smollm2_grammar_constrained_output_matches_and_is_batch_invariant() {
    use grammar::{Constraint, GrammarLimits, TokenEnv};
    let f = fixture();
    let env = TokenEnv::new(f.tok.clone()).expect("token env");
    let compiled = Constraint::regex("[0-9]{3}-[a-z]{2,4}")
        .compile(&env, &GrammarLimits::default())
        .expect("regex compiles");
    let prompt = f.tok.encode(
        "<|im_start|>user\nGive me a code.<|im_end|>\n<|im_start|>assistant\n",
        EncodeOptions::raw_prompt(),
    );
    let constrained = || {
        let mut r = GenerateRequest::new(
            prompt.clone(),
            SamplingParams {
                temperature: 0.9,
                seed: 77,
                ..SamplingParams::default()
            },
        );
        r.max_tokens = Some(20);
        r.logit_digests = true;
        r.constraint = Some(Box::new(compiled.matcher()));
        r
    };
    let e = engine(&f, cfg());
    let alone = e.submit(constrained()).unwrap().collect();
    // The same request batched with two unconstrained ones.
    let others: Vec<_> = requests(&f.tok)
        .into_iter()
        .take(2)
        .map(|r| e.submit(r).unwrap())
        .collect();
    let batched = e.submit(constrained()).unwrap().collect();
    for h in others {
        assert_eq!(h.collect().error, None);
    }
    e.shutdown();
    assert_same(&alone, &batched, "constrained");
    let re = regex_lite_match(&alone.text);
    assert!(re, "output {:?} violates the grammar", alone.text);
    assert!(matches!(
        alone.finish,
        Some(lockstep_engine::FinishReason::Stop(_))
    ));
}

/// `[0-9]{3}-[a-z]{2,4}` checked by hand (no regex dependency).
fn regex_lite_match(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 6
        && b.len() <= 8
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(u8::is_ascii_lowercase)
}
