//! G2 on DeepSeek V4 (the committed reference fixtures, `crates/model/tests/fixtures/deepseek4`):
//! with the n-gram drafter (plus grammar fast-forward), an oracle that replays the plain
//! output and an adversary that is always wrong, greedy and seeded at T = 0.8, several
//! sequences at once, the token events (ids, text, logprobs, top logprobs, per-position
//! logit SHA-256), finish reasons and usage equal plain decoding. The counters prove drafts
//! were proposed, accepted and rejected (every rejection rolls the compressor and indexer
//! state back), so the test cannot pass vacuously.

use crate::harness::{Run, assert_digested, assert_spec_equals_plain, run_all};
use lockstep_engine::{
    Deepseek4Backend, Engine, EngineConfig, GenerateRequest, SamplingParams, SpecConfig, SpecStats,
};
use spec::{Adversary, DrafterSet, Oracle, PolicyConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use text::Tokenizer;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/deepseek4")
}

struct Target {
    model: Arc<model::Deepseek4>,
    tok: Arc<Tokenizer>,
    sequences: Vec<Vec<u32>>,
}

fn load(name: &str) -> Target {
    let file = Arc::new(
        gguf::GgufFile::open(fixture_dir().join(format!("{name}.gguf"))).expect("fixture"),
    );
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let opts = model::LoadOptions {
        threads: Some(2),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Deepseek4::load(file, &opts).expect("loads"));
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("manifest.json")).unwrap(),
    )
    .unwrap();
    let fx = manifest["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .expect("fixture in the manifest");
    let sequences = fx["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect();
    Target {
        model,
        tok,
        sequences,
    }
}

fn engine(t: &Target, spec: SpecConfig) -> Engine {
    let cfg = EngineConfig {
        max_seqs: 4,
        kv_tokens: 4096,
        step_token_budget: 96,
        prefill_chunk: 40,
        queue_capacity: 64,
        context_len: 0,
        prefix_cache: true,
        disk_cache: None,
        spec,
    };
    Engine::start(
        Box::new(Deepseek4Backend::new(t.model.clone())),
        t.tok.clone(),
        cfg,
    )
    .expect("engine starts")
}

/// Prompts from the fixture sequences: prefixes of the long one, of the repeated-phrase
/// one (the n-gram drafter's case) and the short one; greedy and seeded sampling.
fn requests(t: &Target) -> Vec<GenerateRequest> {
    let prompts: Vec<Vec<u32>> = vec![
        t.sequences[0][..70].to_vec(),
        t.sequences[1][..90].to_vec(),
        t.sequences[1][..47].to_vec(),
        t.sequences[2].clone(),
    ];
    let mut v = Vec::new();
    for sampling in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            seed: 42,
            ..SamplingParams::default()
        },
    ] {
        for p in &prompts {
            let mut r = GenerateRequest::new(p.clone(), sampling.clone());
            r.max_tokens = Some(48);
            r.logit_digests = true;
            r.logprobs = Some(3);
            // Random weights end early on EOS: keep going so the drafts get exercised.
            r.ignore_eos = true;
            v.push(r);
        }
    }
    v
}

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

fn report(what: &str, s: &SpecStats) {
    eprintln!(
        "{what}: cycles {} drafted {} accepted {} (rate {:.2}) full {} partial {} miss {} \
         no-draft {}",
        s.cycles,
        s.drafted,
        s.accepted,
        s.accept_rate(),
        s.full,
        s.partial,
        s.miss,
        s.no_draft
    );
}

fn check(name: &str) {
    let t = load(name);
    let plain_engine = engine(&t, SpecConfig::default());
    let plain = run_all(&plain_engine, requests(&t));
    plain_engine.shutdown();
    assert_digested(&plain, name);
    assert!(
        plain.iter().all(|r| r.ids().len() == 48),
        "{name}: 48 tokens each"
    );

    let e = engine(
        &t,
        SpecConfig {
            policy: PolicyConfig::always(4),
            ..SpecConfig::auto(DrafterSet::free(3))
        },
    );
    let ng = assert_spec_equals_plain(&plain, &run_all(&e, requests(&t)), &format!("{name} ngram"));
    e.shutdown();
    report(&format!("{name} ngram"), &ng);
    assert!(
        ng.drafted > 0,
        "{name}: the n-gram drafter proposed: {ng:?}"
    );
    assert!(ng.accepted > 0, "{name}: drafts were accepted: {ng:?}");
    assert!(
        ng.accepted < ng.drafted,
        "{name}: drafts were rejected: {ng:?}"
    );

    let e = engine(&t, SpecConfig::default());
    let or = assert_spec_equals_plain(
        &plain,
        &run_all(&e, with(requests(&t), &plain, |x| Box::new(Oracle::new(x)))),
        &format!("{name} oracle"),
    );
    e.shutdown();
    report(&format!("{name} oracle"), &or);
    assert!(or.drafted > 50 && or.accepted == or.drafted, "{or:?}");

    let e = engine(&t, SpecConfig::default());
    let ad = assert_spec_equals_plain(
        &plain,
        &run_all(
            &e,
            with(requests(&t), &plain, |x| Box::new(Adversary::new(x))),
        ),
        &format!("{name} adversary"),
    );
    e.shutdown();
    report(&format!("{name} adversary"), &ad);
    assert!(ad.drafted > 50 && ad.accepted == 0, "{ad:?}");
}

#[test]
fn flash_layout_speculation_equals_plain_decoding() {
    check("flash-layout");
}

#[test]
fn small_ratios_speculation_equals_plain_decoding() {
    check("small-ratios");
}
