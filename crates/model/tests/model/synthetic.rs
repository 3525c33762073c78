//! Loading checks, batch validation and the forward on tiny generated GGUF models (no
//! model download needed).
use gguf::{GgmlType, GgufFile, GgufWriter};
use lockstep_model::{
    Arch, BatchRow, KvType, LoadOptions, MemoryEstimate, Model, ModelError, RopeScaling,
    check_memory,
};
use quant::{Format, quantize_row};
use std::sync::Arc;

const E: usize = 64;
const H: usize = 4;
const KV: usize = 2;
const D: usize = 16;
const F: usize = 128;
const V: usize = 40;
const L: usize = 2;
const CTX: u32 = 96;

/// Deterministic values in [-0.5, 0.5).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

struct Spec {
    arch: &'static str,
    skip: Option<String>,
    reshape: Option<(String, Vec<u64>)>,
    extra: Vec<(String, gguf::Value)>,
    tied: bool,
}

impl Spec {
    fn new(arch: &'static str) -> Spec {
        Spec {
            arch,
            skip: None,
            reshape: None,
            extra: Vec::new(),
            tied: false,
        }
    }
}

fn build(spec: &Spec) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    let a = if spec.arch == "unknownarch" {
        "llama"
    } else {
        spec.arch
    };
    w.add("general.architecture", spec.arch).unwrap();
    let k = |s: &str| format!("{a}.{s}");
    w.add(k("block_count"), L as u32).unwrap();
    w.add(k("context_length"), CTX).unwrap();
    w.add(k("embedding_length"), E as u32).unwrap();
    w.add(k("feed_forward_length"), F as u32).unwrap();
    w.add(k("attention.head_count"), H as u32).unwrap();
    w.add(k("attention.head_count_kv"), KV as u32).unwrap();
    w.add(k("attention.layer_norm_rms_epsilon"), 1e-5f32)
        .unwrap();
    w.add(k("rope.freq_base"), 10000.0f32).unwrap();
    for (key, v) in &spec.extra {
        w.add(key.clone(), v.clone()).unwrap();
    }
    let mut seed = 1;
    let mut tensor = |w: &mut GgufWriter, name: String, k: usize, n: usize| {
        if spec.skip.as_deref() == Some(name.as_str()) {
            return;
        }
        seed += 1;
        let vals = values(seed, k * n);
        let mut dims = if n == 1 {
            vec![k as u64]
        } else {
            vec![k as u64, n as u64]
        };
        if let Some((r, d)) = &spec.reshape
            && *r == name
        {
            dims = d.clone();
        }
        let count: u64 = dims.iter().product();
        if n == 1 {
            let bytes: Vec<u8> = vals
                .iter()
                .map(|v| v + 1.0)
                .flat_map(f32::to_le_bytes)
                .collect();
            w.add_tensor(name, &dims, GgmlType::F32, bytes).unwrap();
        } else {
            let vals = values(seed, count as usize);
            let bytes = quantize_row(Format::Q8_0, &vals).unwrap();
            w.add_tensor(name, &dims, GgmlType::Q8_0, bytes).unwrap();
        }
    };
    tensor(&mut w, "token_embd.weight".into(), E, V);
    if !spec.tied {
        tensor(&mut w, "output.weight".into(), E, V);
    }
    tensor(&mut w, "output_norm.weight".into(), E, 1);
    for i in 0..L {
        let p = |t: &str| format!("blk.{i}.{t}");
        tensor(&mut w, p("attn_norm.weight"), E, 1);
        tensor(&mut w, p("attn_q.weight"), E, H * D);
        tensor(&mut w, p("attn_k.weight"), E, KV * D);
        tensor(&mut w, p("attn_v.weight"), E, KV * D);
        tensor(&mut w, p("attn_output.weight"), H * D, E);
        if spec.arch == "qwen2" {
            tensor(&mut w, p("attn_q.bias"), H * D, 1);
            tensor(&mut w, p("attn_k.bias"), KV * D, 1);
            tensor(&mut w, p("attn_v.bias"), KV * D, 1);
        }
        if spec.arch == "gemma3" {
            tensor(&mut w, p("attn_q_norm.weight"), D, 1);
            tensor(&mut w, p("attn_k_norm.weight"), D, 1);
            tensor(&mut w, p("post_attention_norm.weight"), E, 1);
            tensor(&mut w, p("post_ffw_norm.weight"), E, 1);
        }
        tensor(&mut w, p("ffn_norm.weight"), E, 1);
        tensor(&mut w, p("ffn_gate.weight"), E, F);
        tensor(&mut w, p("ffn_up.weight"), E, F);
        tensor(&mut w, p("ffn_down.weight"), F, E);
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap())
}

fn load(spec: &Spec) -> Result<Model, ModelError> {
    Model::load(
        build(spec),
        &LoadOptions {
            threads: Some(2),
            ..LoadOptions::default()
        },
    )
}

fn err(spec: &Spec) -> String {
    load(spec).expect_err("load must fail").to_string()
}

#[test]
fn config_is_read_from_metadata() {
    let m = load(&Spec::new("qwen2")).unwrap();
    let c = m.config();
    assert_eq!(
        (c.arch, c.n_layer, c.n_embd, c.n_ff),
        (Arch::Qwen2, L, E, F)
    );
    assert_eq!((c.n_head, c.n_head_kv, c.head_dim, c.n_rot), (H, KV, D, D));
    assert_eq!(
        (c.n_ctx_train, c.n_vocab, c.tied_embeddings),
        (CTX as usize, V, false)
    );
    assert_eq!(c.rope_scaling, RopeScaling::None);
    assert_eq!(m.n_ctx(), CTX as usize);
    let mut tied = Spec::new("llama");
    tied.tied = true;
    assert!(load(&tied).unwrap().config().tied_embeddings);
}

#[test]
fn unknown_architecture_is_refused_naming_it_and_the_supported_list() {
    let msg = err(&Spec::new("unknownarch"));
    assert!(
        msg.contains("unknownarch") && msg.contains("llama, qwen2"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_error_names_it() {
    let mut s = Spec::new("qwen2");
    s.skip = Some("blk.1.attn_k.bias".into());
    let msg = err(&s);
    assert!(
        msg.contains("blk.1.attn_k.bias") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn wrongly_shaped_tensor_error_names_it_and_both_shapes() {
    let mut s = Spec::new("llama");
    s.reshape = Some(("blk.0.ffn_up.weight".into(), vec![E as u64, 96]));
    let msg = err(&s);
    assert!(
        msg.contains("blk.0.ffn_up.weight") && msg.contains("[64, 96]"),
        "{msg}"
    );
    assert!(msg.contains("[64, 128]"), "{msg}");
}

#[test]
fn yarn_rope_scaling_is_refused_and_linear_is_read() {
    let mut s = Spec::new("llama");
    s.extra
        .push(("llama.rope.scaling.type".into(), "yarn".into()));
    s.extra
        .push(("llama.rope.scaling.factor".into(), 4.0f32.into()));
    let msg = err(&s);
    assert!(
        msg.contains("unsupported rope scaling") && msg.contains("yarn"),
        "{msg}"
    );
    let mut s = Spec::new("llama");
    s.extra
        .push(("llama.rope.scaling.type".into(), "linear".into()));
    s.extra
        .push(("llama.rope.scaling.factor".into(), 2.0f32.into()));
    let m = load(&s).unwrap();
    assert_eq!(m.config().rope_scaling, RopeScaling::Linear { factor: 2.0 });
}

#[test]
fn context_beyond_the_trained_length_is_refused_at_load() {
    let opts = LoadOptions {
        n_ctx: Some(CTX as usize + 1),
        ..LoadOptions::default()
    };
    let msg = Model::load(build(&Spec::new("llama")), &opts)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("97") && msg.contains("96"), "{msg}");
}

fn rows(tokens: &[u32], start: usize) -> Vec<BatchRow> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &token)| BatchRow {
            seq: 0,
            token,
            pos: start + i,
            wants_logits: true,
        })
        .collect()
}

#[test]
fn row_at_or_beyond_the_context_is_a_context_overflow_error() {
    let m = load(&Spec::new("llama")).unwrap();
    let mut kv = m.new_kv_cache(256).unwrap();
    let mut seq = m.new_sequence(&kv);
    let mut s = m.new_scratch();
    let mut logits = Vec::new();
    let toks: Vec<u32> = (0..CTX).map(|i| i % V as u32).collect();
    m.forward(
        &mut s,
        &mut kv,
        &mut [&mut seq],
        &rows(&toks, 0),
        &mut logits,
    )
    .unwrap();
    let e = m
        .forward(
            &mut s,
            &mut kv,
            &mut [&mut seq],
            &rows(&[1], CTX as usize),
            &mut logits,
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ContextOverflow {
                pos: 96,
                n_ctx: 96,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("position 96"), "{e}");
    assert_eq!(seq.len(), CTX as usize, "a refused batch changes nothing");
}

#[test]
fn malformed_batches_are_refused_before_anything_changes() {
    let m = load(&Spec::new("llama")).unwrap();
    let mut kv = m.new_kv_cache(256).unwrap();
    let mut seq = m.new_sequence(&kv);
    let mut s = m.new_scratch();
    let mut logits = Vec::new();
    let mut bad = |r: Vec<BatchRow>, want: &str| {
        let e = m
            .forward(&mut s, &mut kv, &mut [&mut seq], &r, &mut logits)
            .unwrap_err();
        assert!(matches!(e, ModelError::Batch(_)), "{e}");
        assert!(e.to_string().contains(want), "{e}");
    };
    let mut r = rows(&[1, 2], 0);
    r[1].seq = 1;
    bad(r, "sequence 1");
    bad(rows(&[1, V as u32], 0), "outside the vocabulary");
    let mut r = rows(&[1, 2, 3], 0);
    r[2].pos = 5;
    bad(r, "consecutive");
    bad(rows(&[1, 2], 3), "cannot be skipped");
    assert_eq!(seq.len(), 0);
}

#[test]
fn synthetic_qwen2_logits_are_finite_and_batch_invariant() {
    let m = load(&Spec::new("qwen2")).unwrap();
    let toks: Vec<u32> = (0..70).map(|i| (i * 7 + 3) % V as u32).collect();
    let run = |chunks: &[usize]| -> Vec<u32> {
        let mut kv = m.new_kv_cache(128).unwrap();
        let mut seq = m.new_sequence(&kv);
        let mut s = m.new_scratch();
        let mut out = Vec::new();
        let mut logits = Vec::new();
        let mut at = 0;
        for &c in chunks {
            m.forward(
                &mut s,
                &mut kv,
                &mut [&mut seq],
                &rows(&toks[at..at + c], at),
                &mut logits,
            )
            .unwrap();
            assert_eq!(logits.len(), c * V);
            out.extend(logits.iter().map(|x| x.to_bits()));
            at += c;
        }
        assert_eq!(seq.len(), toks.len());
        out
    };
    let whole = run(&[70]);
    assert!(whole.iter().all(|&b| f32::from_bits(b).is_finite()));
    assert!(run(&[1; 70]) == whole, "token by token differs");
    assert!(run(&[31, 2, 30, 7]) == whole, "chunked differs");
}

#[test]
fn memory_estimate_counts_weights_kv_and_scratch() {
    let g = build(&Spec::new("llama"));
    let est = MemoryEstimate::for_model(&g, 100, KvType::F16).unwrap();
    let weights: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    assert_eq!(est.weights_bytes, weights);
    // 2 layers × (K and V) × 2 kv heads × 16 dims × 128 slots (4 blocks of 32) × 2 bytes.
    assert_eq!(est.kv_bytes, 2 * 2 * 32 * 128 * 2);
    assert!(est.scratch_bytes > 0);
    assert_eq!(
        est.total,
        est.weights_bytes + est.kv_bytes + est.scratch_bytes
    );
    assert!(check_memory(&est, est.total).is_ok());
    let e = check_memory(&est, est.total - 1).unwrap_err();
    assert!(matches!(e, ModelError::InsufficientMemory { .. }), "{e}");
}

#[test]
fn gemma3_windows_follow_llama_cpp_pattern_rules() {
    let with = |extra: Vec<(&str, gguf::Value)>| {
        let mut spec = Spec::new("gemma3");
        spec.tied = true;
        spec.extra = extra.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        load(&spec).map(|m| m.config().clone())
    };
    // No sliding_window: every layer global, one RoPE base.
    let c = with(vec![]).unwrap();
    assert_eq!(c.arch, Arch::Gemma3);
    assert_eq!(c.layer_windows, vec![None; L]);
    assert_eq!(c.attn_scale, 0.25, "1/sqrt(key_length 16)");
    // The default period 6: layers 0..5 slide, so both of these.
    let sw = ("gemma3.attention.sliding_window", gguf::Value::U32(8));
    let c = with(vec![sw.clone()]).unwrap();
    assert_eq!(c.layer_windows, vec![Some(8), Some(8)]);
    assert_eq!(c.rope_base_swa, 10_000.0);
    // Period 2: layer 1 (il % 2 == 1) is global.
    let c = with(vec![
        sw.clone(),
        (
            "gemma3.attention.sliding_window_pattern",
            gguf::Value::U32(2),
        ),
        ("gemma3.rope.freq_base_swa", gguf::Value::F32(500.0)),
    ])
    .unwrap();
    assert_eq!(c.layer_windows, vec![Some(8), None]);
    assert_eq!(c.rope_base_swa, 500.0);
    // A per-layer array wins; a wrong length is refused.
    let arr = |v: Vec<bool>| gguf::Value::Array(gguf::Array::Bool(v));
    let c = with(vec![
        sw.clone(),
        (
            "gemma3.attention.sliding_window_pattern",
            arr(vec![false, true]),
        ),
    ])
    .unwrap();
    assert_eq!(c.layer_windows, vec![None, Some(8)]);
    let e = with(vec![
        sw,
        ("gemma3.attention.sliding_window_pattern", arr(vec![true])),
    ])
    .unwrap_err();
    assert!(e.to_string().contains("sliding_window_pattern"), "{e}");
}

#[test]
fn gemma3_synthetic_forward_is_finite_and_needs_its_extra_norms() {
    let mut spec = Spec::new("gemma3");
    spec.extra = vec![(
        "gemma3.attention.sliding_window".into(),
        gguf::Value::U32(8),
    )];
    let m = load(&spec).unwrap();
    let mut kv = m.new_kv_cache(64).unwrap();
    let mut seq = m.new_sequence(&kv);
    let mut s = m.new_scratch();
    let rows: Vec<BatchRow> = (0..20)
        .map(|p| BatchRow {
            seq: 0,
            token: (p * 7 % V) as u32,
            pos: p,
            wants_logits: p == 19,
        })
        .collect();
    let mut logits = Vec::new();
    m.forward(&mut s, &mut kv, &mut [&mut seq], &rows, &mut logits)
        .unwrap();
    assert_eq!(logits.len(), V);
    assert!(logits.iter().all(|x| x.is_finite()));
    kv.release_sequence(seq);
    spec.skip = Some("blk.1.post_ffw_norm.weight".into());
    assert!(matches!(
        load(&spec),
        Err(ModelError::MissingTensor { name }) if name == "blk.1.post_ffw_norm.weight"
    ));
}
