//! G2 with the DSpark block drafter on DeepSeek V4 (the `flash-layout` fixture and its
//! synthetic support file `flash-layout.dspark.gguf`): greedy and seeded T = 0.8, several
//! sequences at once, the token events (ids, text, logprobs, top logprobs, per-position
//! logit SHA-256), finish reasons and usage equal plain decoding (which runs on a backend
//! that captures nothing, so capturing is shown to change nothing either).
//!
//! With the committed random weights the drafter proposes and the target rejects. A support
//! file derived from it with a crafted Markov head — a bigram table built from the plain
//! outputs, strong enough to decide every draft — makes the drafter predict the plain
//! continuation where the table is right, so acceptance, partial accepts, the fold's
//! disarm-on-reject / re-arm-on-full-accept rule and the confidence bars are all exercised.
//! Under a grammar every proposed token is checked against a fresh matcher replaying the
//! committed output (the drafts respect the mirror).

use crate::harness::{Run, assert_digested, assert_spec_equals_plain, run_all};
use gguf::{GgmlType, GgufFile, GgufWriter, Value};
use lockstep_engine::{
    Deepseek4Backend, Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams,
    SpecConfig, StopCause,
};
use spec::{
    Chain, DraftContext, DraftProposal, Drafter, DrafterKind, DrafterSet, DsparkCounters,
    DsparkDraft, DsparkDrafter, Mirror, PolicyConfig,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use text::Tokenizer;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/deepseek4")
}

struct Target {
    model: Arc<model::Deepseek4>,
    tok: Arc<Tokenizer>,
    sequences: Vec<Vec<u32>>,
    support: Arc<GgufFile>,
}

fn load() -> Target {
    let file = Arc::new(GgufFile::open(fixture_dir().join("flash-layout.gguf")).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let opts = model::LoadOptions {
        threads: Some(2),
        ..model::LoadOptions::default()
    };
    let model = Arc::new(model::Deepseek4::load(file, &opts).unwrap());
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("manifest.json")).unwrap(),
    )
    .unwrap();
    let fx = manifest["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "flash-layout")
        .unwrap();
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
    let support = Arc::new(GgufFile::open(fixture_dir().join("flash-layout.dspark.gguf")).unwrap());
    Target {
        model,
        tok,
        sequences,
        support,
    }
}

fn draft(t: &Target, support: Arc<GgufFile>) -> Arc<DsparkDraft> {
    let d = model::Dspark::load(support, t.model.clone()).expect("the support file fits");
    DsparkDraft::new("flash-layout.dspark", Arc::new(d))
}

/// An engine over the target; `capture` = the layers a DSpark drafter reads (none: plain).
fn engine(t: &Target, capture: Option<&[usize]>, spec: SpecConfig) -> Engine {
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
    let mut b = Deepseek4Backend::new(t.model.clone());
    if let Some(layers) = capture {
        b.capture(layers).unwrap();
    }
    Engine::start(Box::new(b), t.tok.clone(), cfg).expect("engine starts")
}

fn samplings() -> [SamplingParams; 2] {
    [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            seed: 42,
            ..SamplingParams::default()
        },
    ]
}

/// Prefixes of the fixture sequences, greedy and seeded sampling, 48 tokens each.
fn requests(t: &Target) -> Vec<GenerateRequest> {
    let prompts: Vec<Vec<u32>> = vec![
        t.sequences[0][..70].to_vec(),
        t.sequences[1][..90].to_vec(),
        t.sequences[1][..47].to_vec(),
        t.sequences[2].clone(),
    ];
    let mut v = Vec::new();
    for sampling in samplings() {
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

/// DSpark alone, drafting whenever it can (no bars, back-off or cost model) unless `policy`.
fn dspark_spec(d: &Arc<DsparkDraft>, policy: PolicyConfig) -> SpecConfig {
    SpecConfig {
        policy,
        ..SpecConfig::auto(DrafterSet {
            dspark: Some(d.clone()),
            ..DrafterSet::default()
        })
    }
}

fn report(what: &str, c: &DsparkCounters) {
    eprintln!(
        "{what}: blocks {} proposals {} (probes {}) proposed {} | verified {} drafted {} \
         accepted {} rejected {} | full {} partial {} miss {} | confidence stops {} mask stops \
         {} no context {}",
        c.blocks,
        c.proposals,
        c.probes,
        c.proposed,
        c.verified,
        c.drafted,
        c.accepted,
        c.rejected(),
        c.full,
        c.partial,
        c.miss,
        c.confidence_stops,
        c.mask_stops,
        c.no_context
    );
}

fn f16_bits(x: f32) -> u16 {
    match x {
        0.0 => 0,
        1.0 => 0x3c00,
        30.0 => 0x4f80,
        _ => panic!("no f16 encoding written for {x}"),
    }
}

/// The committed support file with its Markov head replaced by a bigram table: rank = the
/// vocabulary, `W1` the identity, `W2[y][x] = 30` when `next[x] = y` (so the bias of the
/// predicted successor dominates the random base logits), and the confidence projection
/// reading only the Markov embedding: `conf_logit[x]` for the previous token `x`.
fn crafted(t: &Target, next: &HashMap<u32, u32>, conf_logit: impl Fn(u32) -> f32) -> GgufFile {
    let g = &t.support;
    let v = t.model.config().n_vocab;
    let d = t.model.config().n_embd;
    let mut w = GgufWriter::new();
    for (k, val) in g.metadata() {
        let val = if k == "deepseek4.dspark.markov_rank" {
            Value::U32(v as u32)
        } else {
            val.clone()
        };
        w.add(k.clone(), val).unwrap();
    }
    let f16s = |vals: &[f32]| -> Vec<u8> {
        vals.iter()
            .flat_map(|&x| f16_bits(x).to_le_bytes())
            .collect()
    };
    for ti in g.tensors() {
        let name = ti.name.as_str();
        if name.ends_with("markov_w1.weight") {
            let mut m = vec![0.0f32; v * v];
            for x in 0..v {
                m[x * v + x] = 1.0;
            }
            w.add_tensor(name, &[v as u64, v as u64], GgmlType::F16, f16s(&m))
                .unwrap();
        } else if name.ends_with("markov_w2.weight") {
            let mut m = vec![0.0f32; v * v];
            for (&x, &y) in next {
                m[y as usize * v + x as usize] = 30.0;
            }
            w.add_tensor(name, &[v as u64, v as u64], GgmlType::F16, f16s(&m))
                .unwrap();
        } else if name.ends_with("confidence_head.proj.weight") {
            let mut p = vec![0.0f32; d + v];
            for x in 0..v {
                p[d + x] = conf_logit(x as u32);
            }
            let bytes: Vec<u8> = p.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.add_tensor(name, &[(d + v) as u64, 1], GgmlType::F32, bytes)
                .unwrap();
        } else {
            w.add_tensor(name, &ti.dims, ti.ggml_type, g.tensor_data(ti).to_vec())
                .unwrap();
        }
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

/// The first successor of every token in the plain runs (prompt end included).
fn bigrams(reqs: &[GenerateRequest], plain: &[Run]) -> HashMap<u32, u32> {
    let mut next = HashMap::new();
    for (r, p) in reqs.iter().zip(plain) {
        let mut seq = vec![*r.prompt.last().unwrap()];
        seq.extend(p.ids());
        for w in seq.windows(2) {
            next.entry(w[0]).or_insert(w[1]);
        }
    }
    next
}

#[test]
fn dspark_on_the_random_support_file_equals_plain_decoding() {
    let t = load();
    let pe = engine(&t, None, SpecConfig::default());
    let plain = run_all(&pe, requests(&t));
    pe.shutdown();
    assert!(plain.iter().all(|r| r.ids().len() == 48), "48 tokens each");

    let d = draft(&t, t.support.clone());
    let layers = d.capture_layers().to_vec();
    let e = engine(&t, Some(&layers), dspark_spec(&d, PolicyConfig::always(5)));
    let spec = run_all(&e, requests(&t));
    let m = e.metrics();
    e.shutdown();
    assert_digested(&plain, "random dspark");
    assert_spec_equals_plain(&plain, &spec, "random dspark");
    let c = d.counters();
    report("random dspark", &c);
    eprintln!("engine: {:?}", m.spec);
    assert!(c.proposals > 20 && c.proposed > 50, "proposals made: {c:?}");
    assert_eq!(c.no_context, 0, "the captured rows were there: {c:?}");
    assert!(c.verified > 20 && c.rejected() > 0, "{c:?}");
    // Every verified DSpark token is a draft the engine counted.
    assert!(
        m.spec.drafted >= c.drafted && m.spec.accepted >= c.accepted,
        "{m:?}"
    );
}

/// A drafter wrapper that checks the fold rule at every cycle and records every proposal.
struct Watch {
    inner: DsparkDrafter,
    log: Arc<Mutex<WatchLog>>,
    /// This cycle's proposals (first position, tokens) and the DSpark drafts in it.
    cycle: Vec<(usize, Vec<u32>)>,
    /// Whether the fold was armed when the cycle's first call came.
    armed_at_start: Option<bool>,
}

#[derive(Default, Debug)]
struct WatchLog {
    /// (committed tokens, prompt length, proposal) of every proposal.
    proposals: Vec<(Vec<u32>, usize, Vec<u32>)>,
    /// Proposals made disarmed and longer than one token (must stay 0).
    long_probes: usize,
    /// Cycles after which the fold state was not what the rule says (must stay 0).
    rule_broken: usize,
    /// Times the fold re-armed after having been disarmed.
    rearmed: usize,
    /// Times it disarmed.
    disarmed: usize,
    /// Proposals that continued a block after tokens the chain drafted first (forced).
    continued: usize,
}

impl Drafter for Watch {
    fn kind(&self) -> DrafterKind {
        self.inner.kind()
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let armed = self.inner.fold_armed();
        let committed = ctx.target.map_or(0, |t| t.len() + 1);
        if ctx.tokens.len() == committed {
            // The first call of a cycle (nothing drafted before it in the round).
            self.cycle.clear();
            self.armed_at_start = Some(armed);
        }
        let p = self.inner.propose(ctx, mirror);
        let mut log = self.log.lock().unwrap();
        if !p.tokens.is_empty() {
            log.continued += usize::from(ctx.tokens.len() > committed);
            log.proposals
                .push((ctx.tokens.to_vec(), ctx.prompt_len, p.tokens.clone()));
            self.cycle.push((ctx.tokens.len(), p.tokens.clone()));
        }
        let drafted: usize = self.cycle.iter().map(|c| c.1.len()).sum();
        if self.armed_at_start == Some(false) && drafted > 1 {
            log.long_probes += 1;
        }
        p
    }

    fn observe(&mut self, committed: &[u32]) {
        let before = self.inner.fold_armed();
        self.inner.observe(committed);
        let after = self.inner.fold_armed();
        let mut log = self.log.lock().unwrap();
        if !self.cycle.is_empty() {
            let full = self.cycle.iter().all(|(start, toks)| {
                committed.len() > start + toks.len()
                    && committed[*start..start + toks.len()] == toks[..]
            });
            if after != full {
                log.rule_broken += 1;
            }
            log.rearmed += usize::from(!before && after);
            log.disarmed += usize::from(before && !after);
        }
        self.cycle.clear();
        self.armed_at_start = None;
    }
}

fn watched(
    reqs: Vec<GenerateRequest>,
    d: &Arc<DsparkDraft>,
    log: &Arc<Mutex<WatchLog>>,
    policy: &PolicyConfig,
) -> Vec<GenerateRequest> {
    reqs.into_iter()
        .map(|mut r| {
            let watch = Box::new(Watch {
                inner: d.drafter(),
                log: log.clone(),
                cycle: Vec::new(),
                armed_at_start: None,
            });
            // Under a grammar, as `DrafterSet::build` does: fast-forward, then DSpark.
            r.drafter = Some(if r.constraint.is_some() {
                Box::new(Chain::new(true, vec![watch]))
            } else {
                watch
            });
            r.spec_policy = Some(policy.clone());
            r
        })
        .collect()
}

#[test]
fn a_crafted_markov_head_is_accepted_and_the_fold_follows_full_accepts() {
    let t = load();
    let pe = engine(&t, None, SpecConfig::default());
    let plain = run_all(&pe, requests(&t));
    pe.shutdown();
    let next = bigrams(&requests(&t), &plain);
    let support = Arc::new(crafted(&t, &next, |_| 8.0));
    let d = draft(&t, support);
    let layers = d.capture_layers().to_vec();

    let log = Arc::new(Mutex::new(WatchLog::default()));
    let e = engine(&t, Some(&layers), SpecConfig::default());
    let spec = run_all(
        &e,
        watched(requests(&t), &d, &log, &PolicyConfig::always(5)),
    );
    e.shutdown();
    assert_digested(&plain, "crafted dspark");
    assert_spec_equals_plain(&plain, &spec, "crafted dspark");
    let c = d.counters();
    report("crafted dspark", &c);
    let w = log.lock().unwrap();
    eprintln!(
        "fold: disarmed {} re-armed {} (rule broken {}, long probes {})",
        w.disarmed, w.rearmed, w.rule_broken, w.long_probes
    );
    assert!(
        c.accepted > 50,
        "the bigram table predicts the output: {c:?}"
    );
    assert!(
        c.rejected() > 0,
        "and is wrong where a token has two successors: {c:?}"
    );
    assert!(c.full > 0 && c.partial + c.miss > 0, "{c:?}");
    // Block proposals of several tokens were accepted whole.
    assert!(c.accepted > c.full, "{c:?}");
    assert_eq!(
        w.rule_broken, 0,
        "the fold is armed exactly after full accepts"
    );
    assert_eq!(w.long_probes, 0, "a disarmed fold proposes one slot");
    assert!(
        c.probes > 0 && w.disarmed > 0 && w.rearmed > 0,
        "{c:?} {w:?}"
    );
    drop(w);

    // Confidence bars: tokens after which the head is unsure (logit −8, σ ≈ 0.0003) end a
    // proposal; elsewhere σ(8) ≈ 0.9997 clears the default bars 0.55 / 0.6 / 0.65.
    let unsure = |x: u32| x.is_multiple_of(3);
    let support = Arc::new(crafted(&t, &next, |x| if unsure(x) { -8.0 } else { 8.0 }));
    let d = draft(&t, support);
    let policy = PolicyConfig {
        max_draft: 5,
        backoff: false,
        cost_model: false,
        ..PolicyConfig::default()
    };
    let log = Arc::new(Mutex::new(WatchLog::default()));
    let e = engine(&t, Some(&layers), SpecConfig::default());
    let spec = run_all(&e, watched(requests(&t), &d, &log, &policy));
    e.shutdown();
    assert_digested(&plain, "crafted dspark with bars");
    assert_spec_equals_plain(&plain, &spec, "crafted dspark with bars");
    let c = d.counters();
    report("crafted dspark with bars", &c);
    assert!(c.confidence_stops > 0 && c.accepted > 0, "{c:?}");
    let w = log.lock().unwrap();
    // No proposed token follows an unsure one: the slot after it failed the bar.
    for (tokens, _, prop) in &w.proposals {
        let mut prev = *tokens.last().unwrap();
        for &x in prop {
            assert!(!unsure(prev), "drafted {x} after unsure {prev}");
            prev = x;
        }
    }
    assert!(!w.proposals.is_empty());
}

#[test]
fn constrained_dspark_drafts_stay_inside_the_grammar_and_equal_plain_decoding() {
    use grammar::{Constraint, GrammarLimits, TokenEnv};
    let t = load();
    let env = TokenEnv::with_logit_width(t.tok.clone(), t.model.config().n_vocab).unwrap();
    // Forced stretches (", " and ", and ") that grammar fast-forward drafts before DSpark.
    let re = Constraint::regex("[a-z]{4,8}, [a-z]{4,8}, [a-z]{4,8}, and [a-z]{4,8}\\.")
        .compile(&env, &GrammarLimits::default())
        .unwrap();
    let reqs = || {
        let mut v = Vec::new();
        for sampling in samplings() {
            for p in [&t.sequences[0][..40], &t.sequences[1][..60]] {
                let mut r = GenerateRequest::new(p.to_vec(), sampling.clone());
                r.max_tokens = Some(60);
                r.logit_digests = true;
                r.constraint = Some(Box::new(re.matcher()));
                v.push(r);
            }
        }
        v
    };
    let pe = engine(&t, None, SpecConfig::default());
    let plain = run_all(&pe, reqs());
    pe.shutdown();
    for p in &plain {
        let (reason, text, _) = p.finish.clone().unwrap();
        assert_eq!(reason, FinishReason::Stop(StopCause::GrammarEnd), "{text}");
    }
    // The bigram table of the constrained outputs, but every other letter is followed by a
    // digit, which the grammar never allows: unmasked, the bias would draft it.
    let id = |s: &str| {
        let ids = t.tok.encode(s, text::EncodeOptions::default());
        assert_eq!(ids.len(), 1, "{s}");
        ids[0]
    };
    let seven = id("7");
    let mut next = bigrams(&reqs(), &plain);
    let digit_after = |x: u32| {
        x.is_multiple_of(2)
            && (u32::from(b'a')..=u32::from(b'z'))
                .any(|c| id(&char::from(c as u8).to_string()) == x)
    };
    for x in 'a'..='z' {
        let x = id(&x.to_string());
        if digit_after(x) {
            next.insert(x, seven);
        }
    }
    let d = draft(&t, Arc::new(crafted(&t, &next, |_| 8.0)));
    let layers = d.capture_layers().to_vec();
    let log = Arc::new(Mutex::new(WatchLog::default()));
    let e = engine(&t, Some(&layers), SpecConfig::default());
    let spec = run_all(&e, watched(reqs(), &d, &log, &PolicyConfig::always(5)));
    e.shutdown();
    assert_digested(&plain, "constrained dspark");
    assert_spec_equals_plain(&plain, &spec, "constrained dspark");
    let c = d.counters();
    report("constrained dspark", &c);
    assert!(
        c.proposals > 10 && c.accepted > 0 && c.rejected() > 0,
        "{c:?}"
    );
    // Replay: every proposed token is allowed by the grammar after the committed output
    // and the proposal's earlier tokens.
    let w = log.lock().unwrap();
    let (mut checked, mut steered) = (0, 0);
    for (tokens, prompt_len, prop) in &w.proposals {
        let mut m = re.matcher();
        for &x in &tokens[*prompt_len..] {
            m.consume(x).unwrap();
        }
        let mut prev = *tokens.last().unwrap();
        for &x in prop {
            assert!(
                m.accepts(x),
                "draft {x} outside the grammar after {tokens:?}"
            );
            m.consume(x).unwrap();
            checked += 1;
            // The table's choice here was the digit; the mask made it another token.
            steered += usize::from(digit_after(prev));
            prev = x;
        }
    }
    eprintln!(
        "constrained: {checked} drafted tokens checked against the grammar, {steered} of them \
         where the unmasked choice was a digit"
    );
    assert!(checked > 20 && steered > 0);
    eprintln!(
        "constrained fold: disarmed {} re-armed {}, {} proposals continued a block after \
         forced tokens",
        w.disarmed, w.rearmed, w.continued
    );
    assert_eq!(
        w.rule_broken, 0,
        "the fold is armed exactly after full accepts"
    );
    assert_eq!(
        w.long_probes, 0,
        "a disarmed fold proposes one slot per cycle"
    );
    assert!(
        w.continued > 0,
        "DSpark continued blocks after forced tokens"
    );
}
