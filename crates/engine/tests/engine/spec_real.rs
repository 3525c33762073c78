//! G2 on real models: with speculation on — n-gram + grammar fast-forward, a draft model,
//! an oracle and an adversary — every golden prompt and a set of JSON Schema / regex /
//! Lark constrained requests, greedy and seeded at T = 0.8, several sequences at once,
//! give the same token events (ids, text deltas, logprobs, top logprobs, per-position
//! logit SHA-256), finish reasons and usage as plain decoding. The counters prove drafts
//! were proposed, accepted and rejected, so no test passes vacuously.

use crate::harness::{Run, assert_spec_equals_plain, run_all};
use lockstep_engine::{
    Engine, EngineConfig, FinishReason, GenerateRequest, ModelBackend, SamplingParams, SpecConfig,
    SpecStats, StopCause,
};
use spec::{Adversary, DraftModel, DrafterSet, Oracle, PolicyConfig};
use std::sync::Arc;
use text::{EncodeOptions, Tokenizer};

struct Target {
    model: Arc<model::Model>,
    tok: Arc<Tokenizer>,
}

fn load(name: &str, n_ctx: usize) -> Target {
    let path = hub::ensure_model(name).expect("model in the cache");
    let file = Arc::new(gguf::GgufFile::open(&path).expect("GGUF opens"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        n_ctx: Some(n_ctx),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Model::load(file, &opts).expect("model loads"));
    Target { model, tok }
}

fn cfg(spec: SpecConfig) -> EngineConfig {
    EngineConfig {
        max_seqs: 8,
        kv_tokens: 8192,
        step_token_budget: 128,
        prefill_chunk: 64,
        queue_capacity: 64,
        context_len: 0,
        prefix_cache: true,
        disk_cache: None,
        spec,
    }
}

fn engine(t: &Target, spec: SpecConfig) -> Engine {
    Engine::start(
        Box::new(ModelBackend::new(t.model.clone())),
        t.tok.clone(),
        cfg(spec),
    )
    .expect("engine starts")
}

fn request(prompt: Vec<u32>, sampling: SamplingParams, n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, sampling);
    r.max_tokens = Some(n);
    r.logit_digests = true;
    r.logprobs = Some(3);
    r
}

fn temps() -> [SamplingParams; 2] {
    [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            seed: 42,
            ..SamplingParams::default()
        },
    ]
}

fn golden_prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct P {
        text: String,
    }
    // The prompts of the model crate's golden references.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../model/tests/data/golden/prompts.json"
    );
    let bytes = std::fs::read(path).expect("prompts.json");
    let ps: Vec<P> = serde_json::from_slice(&bytes).expect("prompts JSON");
    assert!(ps.len() >= 8);
    ps.iter()
        .map(|p| tok.encode(&p.text, EncodeOptions::raw_prompt()))
        .collect()
}

/// Attaches a per-request drafter built from the plain output (prompt ++ output).
fn with(
    reqs: Vec<GenerateRequest>,
    plain: &[Run],
    make: impl Fn(Vec<u32>) -> Box<dyn spec::Drafter>,
) -> Vec<GenerateRequest> {
    reqs.into_iter()
        .zip(plain)
        .map(|(mut r, p)| {
            let mut expected = r.prompt.clone();
            expected.extend(p.ids());
            r.drafter = Some(make(expected));
            r.spec_policy = Some(PolicyConfig::always(4));
            r
        })
        .collect()
}

/// Runs `reqs()` plain and with each drafter; returns the totals per drafter.
fn check_all_drafters(
    t: &Target,
    draft: Option<Arc<DraftModel>>,
    reqs: &dyn Fn() -> Vec<GenerateRequest>,
    what: &str,
) -> Vec<(&'static str, SpecStats)> {
    let t0 = std::time::Instant::now();
    let plain_engine = engine(t, SpecConfig::default());
    let plain = run_all(&plain_engine, reqs());
    plain_engine.shutdown();
    eprintln!("{what} plain: {:?}", t0.elapsed());
    let mut out = Vec::new();

    // n-gram + fast-forward under an always-draft policy, and under the adaptive one.
    for (name, policy) in [
        ("ngram+ff", PolicyConfig::always(4)),
        ("ngram+ff adaptive", PolicyConfig::default()),
    ] {
        let e = engine(
            t,
            SpecConfig {
                policy,
                ..SpecConfig::auto(DrafterSet::free(3))
            },
        );
        let t0 = std::time::Instant::now();
        let s = assert_spec_equals_plain(&plain, &run_all(&e, reqs()), &format!("{what} {name}"));
        eprintln!("{what} {name}: {:?}", t0.elapsed());
        e.shutdown();
        out.push((name, s));
    }
    if let Some(dm) = draft {
        let e = engine(
            t,
            SpecConfig {
                policy: PolicyConfig::always(4),
                ..SpecConfig::auto(DrafterSet {
                    fast_forward: false,
                    ngram: None,
                    draft_model: Some(dm),
                    dspark: None,
                    suffix: None,
                    prompt_text: false,
                })
            },
        );
        // The draft model drafts one sequence at a time: half the requests keep it quick.
        let n = plain.len().div_ceil(2);
        let half: Vec<GenerateRequest> = reqs().into_iter().step_by(2).collect();
        assert_eq!(half.len(), n);
        // Its own plain reference: prefix-cache hits depend on which requests run together.
        let pe = engine(t, SpecConfig::default());
        let plain_half = run_all(&pe, reqs().into_iter().step_by(2).collect());
        pe.shutdown();
        for (a, b) in plain_half.iter().zip(plain.iter().step_by(2)) {
            assert_eq!(
                a.tokens, b.tokens,
                "{what}: batch invariance of the reference"
            );
        }
        let t0 = std::time::Instant::now();
        let s = assert_spec_equals_plain(
            &plain_half,
            &run_all(&e, half),
            &format!("{what} draft model"),
        );
        eprintln!("{what} draft model: {:?}", t0.elapsed());
        e.shutdown();
        out.push(("draft-model", s));
    }
    let e = engine(t, SpecConfig::default());
    let s = assert_spec_equals_plain(
        &plain,
        &run_all(&e, with(reqs(), &plain, |x| Box::new(Oracle::new(x)))),
        &format!("{what} oracle"),
    );
    e.shutdown();
    out.push(("oracle", s));
    let e = engine(t, SpecConfig::default());
    let s = assert_spec_equals_plain(
        &plain,
        &run_all(&e, with(reqs(), &plain, |x| Box::new(Adversary::new(x)))),
        &format!("{what} adversary"),
    );
    out.push(("adversary", s));
    e.shutdown();
    for (name, s) in &out {
        eprintln!(
            "{what} {name}: cycles {} drafted {} accepted {} (rate {:.2}) full {} partial {} miss {} no-draft {} forced {}",
            s.cycles,
            s.drafted,
            s.accepted,
            s.accept_rate(),
            s.full,
            s.partial,
            s.miss,
            s.no_draft,
            s.forced
        );
    }
    out
}

fn get(stats: &[(&str, SpecStats)], name: &str) -> SpecStats {
    stats
        .iter()
        .find(|(n, _)| *n == name)
        .map(|s| s.1)
        .expect("ran")
}

fn smollm2_draft(t: &Target) -> Arc<DraftModel> {
    // SmolLM2 drafting for itself: a valid drafter (same tokenizer, own KV).
    DraftModel::new(
        "smollm2-135m",
        Box::new(ModelBackend::new(t.model.clone())),
        &t.tok,
        &t.tok,
        t.model.config().n_vocab,
        8192,
    )
    .expect("same tokenizer")
}

#[test]
fn smollm2_golden_prompts_with_every_drafter_equal_plain_decoding() {
    let t = load("smollm2-135m", 512);
    let prompts = golden_prompts(&t.tok);
    let reqs = || {
        let mut v = Vec::new();
        for p in temps() {
            for pr in &prompts {
                v.push(request(pr.clone(), p.clone(), 16));
            }
        }
        v
    };
    let stats = check_all_drafters(&t, Some(smollm2_draft(&t)), &reqs, "golden");
    let ng = get(&stats, "ngram+ff");
    assert!(
        ng.drafted > 0 && ng.accepted > 0 && ng.accepted < ng.drafted,
        "{ng:?}"
    );
    let dm = get(&stats, "draft-model");
    assert!(dm.drafted > 30 && dm.accepted > 0, "{dm:?}");
    // The target drafting for itself agrees with itself (same logits, same noise).
    assert!(dm.accept_rate() > 0.9, "{dm:?}");
    let or = get(&stats, "oracle");
    assert!(or.drafted > 50 && or.accepted == or.drafted, "{or:?}");
    let ad = get(&stats, "adversary");
    assert!(ad.drafted > 50 && ad.accepted == 0, "{ad:?}");
}

#[test]
fn smollm2_constrained_requests_with_every_drafter_equal_plain_decoding() {
    use grammar::{Constraint, GrammarLimits, TokenEnv};
    let t = load("smollm2-135m", 512);
    let env = TokenEnv::with_logit_width(t.tok.clone(), t.model.config().n_vocab).expect("env");
    let compile = |c: Constraint| {
        c.compile(&env, &GrammarLimits::default())
            .expect("constraint compiles")
    };
    let schema = compile(Constraint::json_schema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "city": {"type": "string", "maxLength": 12}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    })));
    let regex = compile(Constraint::regex("[0-9]{3}-[a-z]{2,4}"));
    let lark = compile(Constraint::lark(
        "start: \"The answer is \" NUMBER \", because \" WORD \".\"\nNUMBER: /[0-9]{1,3}/\nWORD: /[a-z]{1,8}/",
    ));
    let chat = |q: &str| {
        t.tok.encode(
            &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
            EncodeOptions::raw_prompt(),
        )
    };
    let cases = [
        (
            chat("Return a JSON object with keys name, age and city for Ada, 36, from London."),
            &schema,
        ),
        (chat("Give me a code."), &regex),
        (chat("What is six times seven?"), &lark),
    ];
    let reqs = || {
        let mut v = Vec::new();
        for p in temps() {
            for (prompt, c) in &cases {
                let mut r = request(prompt.clone(), p.clone(), 40);
                r.constraint = Some(Box::new(c.matcher()));
                v.push(r);
            }
        }
        v
    };
    let stats = check_all_drafters(&t, Some(smollm2_draft(&t)), &reqs, "constrained");
    let ng = get(&stats, "ngram+ff");
    assert!(
        ng.forced > 5 && ng.accepted > 0,
        "fast-forward drafted: {ng:?}"
    );
    let or = get(&stats, "oracle");
    assert!(or.drafted > 20 && or.accepted == or.drafted, "{or:?}");
    let ad = get(&stats, "adversary");
    assert!(ad.drafted > 10 && ad.accepted == 0, "{ad:?}");
    let dm = get(&stats, "draft-model");
    assert!(dm.drafted > 5 && dm.accepted > 0, "{dm:?}");
    // The outputs honour their grammars.
    let e = engine(&t, SpecConfig::auto(DrafterSet::free(3)));
    let runs = run_all(&e, reqs());
    for r in &runs {
        if r.finish.as_ref().map(|f| f.0) == Some(FinishReason::Stop(StopCause::GrammarEnd)) {
            let text = r.text();
            if text.starts_with('{') {
                let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
                assert!(v.get("age").is_some_and(|a| a.is_i64()), "{text}");
            }
        }
    }
    e.shutdown();
}

#[test]
fn qwen_coder_half_b_drafting_for_one_and_a_half_b_equals_plain_decoding() {
    let target = load("qwen2.5-coder-1.5b", 256);
    let draft = load("qwen2.5-coder-0.5b", 256);
    // A different tokenizer is refused with a clear error.
    let smol = load("smollm2-135m", 256);
    let err = DraftModel::new(
        "smollm2-135m",
        Box::new(ModelBackend::new(smol.model.clone())),
        &smol.tok,
        &target.tok,
        target.model.config().n_vocab,
        1024,
    )
    .expect_err("a different tokenizer is refused");
    assert!(err.to_string().contains("cannot draft"), "{err}");
    let dm = DraftModel::new(
        "qwen2.5-coder-0.5b",
        Box::new(ModelBackend::new(draft.model.clone())),
        &draft.tok,
        &target.tok,
        target.model.config().n_vocab,
        2048,
    )
    .expect("same tokenizer");
    let prompt = target.tok.encode(
        "<|im_start|>user\nWrite a Python function that returns the square of x.<|im_end|>\n<|im_start|>assistant\n",
        EncodeOptions::raw_prompt(),
    );
    let reqs = || {
        temps()
            .into_iter()
            .map(|p| request(prompt.clone(), p, 10))
            .collect::<Vec<_>>()
    };
    let plain_engine = engine(&target, SpecConfig::default());
    let plain = run_all(&plain_engine, reqs());
    plain_engine.shutdown();
    let e = engine(
        &target,
        SpecConfig {
            policy: PolicyConfig::always(4),
            ..SpecConfig::auto(DrafterSet {
                fast_forward: true,
                ngram: None,
                draft_model: Some(dm),
                dspark: None,
                suffix: None,
                prompt_text: false,
            })
        },
    );
    let s = assert_spec_equals_plain(&plain, &run_all(&e, reqs()), "qwen 0.5b→1.5b");
    e.shutdown();
    eprintln!("qwen draft model: {s:?} rate {:.2}", s.accept_rate());
    assert!(s.drafted > 0 && s.accepted > 0, "{s:?}");
}

#[test]
fn extraction_under_a_schema_copies_values_in_text_space_and_equals_plain_decoding() {
    use grammar::{Constraint, GrammarLimits, TokenEnv};
    let t = load("qwen2.5-coder-0.5b", 512);
    let env = TokenEnv::with_logit_width(t.tok.clone(), t.model.config().n_vocab).expect("env");
    let schema = Constraint::json_schema(serde_json::json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "city": {"type": "string"},
                "email": {"type": "string"}
            },
            "required": ["name", "age", "city", "email"],
            "additionalProperties": false
        }
    }))
    .compile(&env, &GrammarLimits::default())
    .expect("schema compiles");
    // In this prompt `,London` is `,L` `ondon`; inside the JSON string the model writes
    // `London`: only a cursor in text space can propose the values.
    let prompt = t.tok.encode(
        "<|im_start|>system\nYou convert CSV to JSON.<|im_end|>\n<|im_start|>user\n\
         Convert this CSV to a JSON array with one object per row:\nname,age,city,email\n\
         Ada Lovelace,36,London,ada@example.com\nAlan Turing,41,Wilmslow,alan@example.com\n\
         Grace Hopper,85,Arlington,grace@example.com\n<|im_end|>\n<|im_start|>assistant\n",
        EncodeOptions::raw_prompt(),
    );
    let reqs = || {
        temps()
            .into_iter()
            .map(|p| {
                let mut r = request(prompt.clone(), p, 160);
                r.constraint = Some(Box::new(schema.matcher()));
                r
            })
            .collect::<Vec<_>>()
    };
    // Both requests share the prompt: with the prefix cache on, whether the second one
    // hits it depends on when the engine thread sees it. Off, usage is deterministic.
    let engine = |t: &Target, spec: SpecConfig| {
        Engine::start(
            Box::new(ModelBackend::new(t.model.clone())),
            t.tok.clone(),
            EngineConfig {
                prefix_cache: false,
                ..cfg(spec)
            },
        )
        .expect("engine starts")
    };
    let pe = engine(&t, SpecConfig::default());
    let plain = run_all(&pe, reqs());
    pe.shutdown();
    let greedy = plain[0].text();
    let rows: serde_json::Value =
        serde_json::from_str(&greedy).unwrap_or_else(|e| panic!("{e}: {greedy}"));
    assert_eq!(rows[1]["city"], "Wilmslow", "{greedy}");
    let mut stats = Vec::new();
    for text_cursor in [true, false] {
        let drafters = DrafterSet {
            ngram: Some(spec::NgramConfig {
                text_cursor,
                ..spec::NgramConfig::default()
            }),
            ..DrafterSet::free(3)
        };
        let e = engine(
            &t,
            SpecConfig {
                policy: PolicyConfig::always(8),
                ..SpecConfig::auto(drafters)
            },
        );
        let runs = run_all(&e, reqs());
        e.shutdown();
        let s = assert_spec_equals_plain(
            &plain,
            &runs,
            &format!("extraction text_cursor={text_cursor}"),
        );
        // Greedy alone, where the output copies the prompt.
        let greedy_only = assert_spec_equals_plain(&plain[..1], &runs[..1], "greedy");
        eprintln!("extraction text_cursor={text_cursor}: {s:?}; greedy {greedy_only:?}");
        stats.push(greedy_only);
    }
    let (text, token) = (stats[0], stats[1]);
    assert!(text.drafted > 40 && text.accept_rate() > 0.85, "{text:?}");
    assert!(
        text.mean_accepted() > 1.5 * token.mean_accepted(),
        "text space {text:?} against token space {token:?}"
    );
}
