//! The DSpark support file and the target-row capture it reads, on the committed synthetic
//! support file (`tests/fixtures/deepseek4/flash-layout.dspark.gguf`, from
//! `tools/v4_fixtures/make_dspark.py`): the file matches its manifest entry, both metadata
//! spellings load to the same settings, malformed or mismatched files are typed errors,
//! capturing changes no logit and its rows are independent of the chunking and restored on
//! truncation, and a block's output depends only on the context rows it attends.

use gguf::{GgufFile, GgufWriter, Value};
use lockstep_model::{
    BatchRow, Deepseek4, Deepseek4Scratch, Deepseek4State, Dspark, DsparkBlock, DsparkConfig,
    LoadOptions, ModelError,
};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek4")
}

fn target(name: &str) -> Arc<Deepseek4> {
    let g = Arc::new(GgufFile::open(dir().join(format!("{name}.gguf"))).unwrap());
    let opts = LoadOptions {
        threads: Some(2),
        ..LoadOptions::default()
    };
    Arc::new(Deepseek4::load(g, &opts).unwrap())
}

fn support_bytes() -> Vec<u8> {
    std::fs::read(dir().join("flash-layout.dspark.gguf")).unwrap()
}

fn support() -> Arc<GgufFile> {
    Arc::new(GgufFile::from_bytes(support_bytes()).unwrap())
}

/// A copy of `g` with its metadata replaced by `meta` (tensors unchanged).
fn with_metadata(g: &GgufFile, meta: &[(&str, Value)]) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add(*k, v.clone()).unwrap();
    }
    for t in g.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec())
            .unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

/// A copy of `g` without the tensor `drop` and with `replace` swapped in.
fn with_tensors(g: &GgufFile, drop: &str, replace: Option<(&[u64], Vec<u8>)>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add(k.clone(), v.clone()).unwrap();
    }
    for t in g.tensors() {
        if t.name == drop {
            if let Some((dims, data)) = &replace {
                w.add_tensor(&t.name, dims, gguf::GgmlType::F32, data.clone())
                    .unwrap();
            }
            continue;
        }
        w.add_tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec())
            .unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

fn ds4_meta() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("deepseek4".into())),
        ("deepseek4.dspark.n_mtp_layers", Value::U32(3)),
        ("deepseek4.dspark.block_size", Value::U32(5)),
        ("deepseek4.dspark.noise_token_id", Value::U32(257)),
        ("deepseek4.dspark.markov_rank", Value::U32(16)),
        ("deepseek4.dspark.target_layer_ids.0", Value::U32(3)),
        ("deepseek4.dspark.target_layer_ids.1", Value::U32(4)),
        ("deepseek4.dspark.target_layer_ids.2", Value::U32(5)),
    ]
}

fn dspark_err(e: ModelError) -> String {
    match e {
        ModelError::Dspark(msg) => msg,
        other => panic!("expected a DSpark error, got {other:?}"),
    }
}

#[test]
fn the_support_file_matches_its_manifest_entry() {
    let m: Json =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let entry = &m["dspark"]["supports"][0];
    assert_eq!(entry["gguf"], "flash-layout.dspark.gguf");
    assert_eq!(entry["target"], "flash-layout");
    let bytes = support_bytes();
    assert!(bytes.len() < 1 << 20, "well under 1 MB: {}", bytes.len());
    let hex: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hex, entry["gguf_sha256"].as_str().unwrap());
    let g = support();
    let listed = entry["tensors"].as_array().unwrap();
    assert_eq!(listed.len(), g.tensors().len());
    for (t, e) in g.tensors().iter().zip(listed) {
        assert_eq!(t.name, e["name"].as_str().unwrap());
        let dims: Vec<u64> = e["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(
            t.ggml_type.to_string().to_uppercase(),
            e["type"].as_str().unwrap(),
            "{}",
            t.name
        );
    }
    // ds4's types where the fixture's row lengths allow them.
    let ty = |n: &str| g.tensor(n).unwrap().ggml_type.to_string().to_uppercase();
    assert_eq!(ty("mtp.0.attn_q_a.weight"), "Q8_0");
    assert_eq!(ty("mtp.1.ffn_gate_shexp.weight"), "Q8_0");
    assert_eq!(ty("mtp.0.main_proj.weight"), "Q8_0");
    assert_eq!(ty("mtp.2.markov_head.markov_w1.weight"), "F16");
    assert_eq!(ty("mtp.2.hc_head_fn.weight"), "F16");
    assert_eq!(ty("mtp.2.confidence_head.proj.weight"), "F32");
}

#[test]
fn both_metadata_spellings_give_the_same_settings() {
    let g = support();
    let ds4 = DsparkConfig::from_gguf(&g).unwrap();
    assert_eq!(
        ds4,
        DsparkConfig {
            n_stages: 3,
            block_size: 5,
            noise_token: 257,
            markov_rank: 16,
            target_layers: vec![3, 4, 5],
        }
    );
    // The deepseek4-dspark forks: `dspark.*`, an array of target layers, `stage_count`.
    let fork = with_metadata(
        &g,
        &[
            (
                "general.architecture",
                Value::String("deepseek4-dspark".into()),
            ),
            ("dspark.block_size", Value::U32(5)),
            ("dspark.noise_token_id", Value::U32(257)),
            ("dspark.markov_rank", Value::U32(16)),
            ("dspark.stage_count", Value::U32(3)),
            ("dspark.n_layers", Value::U32(3)),
            (
                "dspark.target_layer_ids",
                Value::Array(gguf::Array::U32(vec![5, 3, 4])),
            ),
        ],
    );
    assert_eq!(DsparkConfig::from_gguf(&fork).unwrap(), ds4);
    // No stage count and no rank: counted from the tensors, taken from markov_w1.
    let bare = with_metadata(
        &g,
        &[
            (
                "general.architecture",
                Value::String("deepseek4-dspark".into()),
            ),
            ("dspark.block_size", Value::U32(5)),
            ("dspark.noise_token_id", Value::U32(257)),
            ("dspark.target_layer_ids.0", Value::U32(3)),
            ("dspark.target_layer_ids.1", Value::U32(4)),
            ("dspark.target_layer_ids.2", Value::U32(5)),
        ],
    );
    assert_eq!(DsparkConfig::from_gguf(&bare).unwrap(), ds4);
    // And the fork spelling loads the drafter.
    let d = Dspark::load(Arc::new(fork), target("flash-layout")).unwrap();
    assert_eq!(d.capture_width(), 3 * 64);
    assert_eq!(d.window(), 32);
}

#[test]
fn malformed_support_files_are_typed_errors() {
    let g = support();
    let edit = |key: &str, v: Option<Value>| {
        let mut meta = ds4_meta();
        meta.retain(|(k, _)| *k != key);
        if let Some(v) = v {
            meta.push((Box::leak(key.to_string().into_boxed_str()), v));
        }
        with_metadata(&g, &meta)
    };
    let cases: Vec<(GgufFile, &str)> = vec![
        (
            edit("general.architecture", Some(Value::String("llama".into()))),
            "architecture",
        ),
        (edit("deepseek4.dspark.block_size", None), "block_size"),
        (
            edit("deepseek4.dspark.block_size", Some(Value::U32(0))),
            "block_size 0",
        ),
        (
            edit("deepseek4.dspark.noise_token_id", None),
            "noise_token_id",
        ),
        (
            edit("deepseek4.dspark.markov_rank", Some(Value::U32(0))),
            "nonseq",
        ),
        (
            with_metadata(
                &g,
                &ds4_meta()
                    .into_iter()
                    .filter(|(k, _)| !k.contains("target_layer_ids"))
                    .collect::<Vec<_>>(),
            ),
            "target_layer_ids",
        ),
        (
            edit("deepseek4.dspark.target_layer_ids.1", Some(Value::U32(3))),
            "repeat",
        ),
        (
            edit("deepseek4.dspark.n_mtp_layers", Some(Value::U32(99))),
            "stages",
        ),
    ];
    for (file, want) in cases {
        let msg = dspark_err(DsparkConfig::from_gguf(&file).unwrap_err());
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // A wrong value type is a metadata error naming the key.
    let wrong = edit(
        "deepseek4.dspark.block_size",
        Some(Value::String("five".into())),
    );
    let e = DsparkConfig::from_gguf(&wrong).unwrap_err();
    assert!(matches!(e, ModelError::Gguf(_)), "{e:?}");
    assert!(e.to_string().contains("block_size"), "{e}");

    let t = target("flash-layout");
    // Metadata that does not fit the target.
    let far = edit("deepseek4.dspark.target_layer_ids.2", Some(Value::U32(6)));
    let msg = dspark_err(Dspark::load(Arc::new(far), t.clone()).unwrap_err());
    assert!(
        msg.contains("target layer 6") && msg.contains("6 layers"),
        "{msg}"
    );
    let noise = edit("deepseek4.dspark.noise_token_id", Some(Value::U32(258)));
    let msg = dspark_err(Dspark::load(Arc::new(noise), t.clone()).unwrap_err());
    assert!(msg.contains("vocabulary of 258"), "{msg}");
    // A missing or misshapen tensor names itself.
    let missing = with_tensors(&g, "mtp.1.attn_kv.weight", None);
    let msg = dspark_err(Dspark::load(Arc::new(missing), t.clone()).unwrap_err());
    assert!(
        msg.contains("mtp.1.attn_kv.weight") && msg.contains("missing"),
        "{msg}"
    );
    let bad = with_tensors(
        &g,
        "mtp.2.confidence_head.proj.weight",
        Some((&[70], vec![0u8; 70 * 4])),
    );
    let msg = dspark_err(Dspark::load(Arc::new(bad), t.clone()).unwrap_err());
    assert!(
        msg.contains("confidence_head") && msg.contains("[70]"),
        "{msg}"
    );
    // The file made for flash-layout does not fit the other fixture.
    let lower = edit("deepseek4.dspark.target_layer_ids.2", Some(Value::U32(2)));
    let lower = with_metadata(
        &lower,
        &lower
            .metadata()
            .iter()
            .map(|(k, v)| {
                let v = if k.ends_with("target_layer_ids.0") {
                    Value::U32(1)
                } else if k.ends_with("target_layer_ids.1") {
                    Value::U32(3)
                } else {
                    v.clone()
                };
                (k.as_str(), v)
            })
            .collect::<Vec<_>>(),
    );
    let msg = dspark_err(Dspark::load(Arc::new(lower), target("small-ratios")).unwrap_err());
    assert!(
        msg.contains("has shape") && msg.contains("hidden size 48"),
        "{msg}"
    );
}

fn rows(tokens: &[u32], from: usize, to: usize) -> Vec<BatchRow> {
    (from..to)
        .map(|p| BatchRow {
            seq: 0,
            token: tokens[p],
            pos: p,
            wants_logits: true,
        })
        .collect()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| (i * 37 % 250 + 3) as u32).collect()
}

/// Runs `tokens` through `st` in chunks of the given sizes; returns every row's logits.
fn run_chunks(
    t: &Deepseek4,
    st: &mut Deepseek4State,
    tokens: &[u32],
    chunks: &[usize],
) -> Vec<f32> {
    let mut s = Deepseek4Scratch::default();
    let mut all = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while at < tokens.len() {
        let n = chunks[i % chunks.len()].min(tokens.len() - at);
        let mut logits = Vec::new();
        t.forward(
            &mut s,
            &mut [&mut *st],
            &rows(tokens, at, at + n),
            &mut logits,
        )
        .unwrap();
        all.extend(logits);
        at += n;
        i += 1;
    }
    all
}

#[test]
fn capture_changes_no_logit_and_follows_the_state() {
    let t = target("flash-layout");
    let toks = prompt(90);
    let mut plain = t.new_state();
    let want = run_chunks(&t, &mut plain, &toks, &[90]);
    assert!(t.new_capturing_state(&[]).is_err());
    assert!(t.new_capturing_state(&[3, 3]).is_err());
    assert!(t.new_capturing_state(&[6]).is_err());
    let mut one = t.new_capturing_state(&[5, 0, 3]).unwrap();
    assert_eq!(one.capture_layers(), &[0, 3, 5]);
    assert_eq!(one.capture_width(), 3 * 64);
    let got = run_chunks(&t, &mut one, &toks, &[90]);
    assert_eq!(got, want, "capturing changes no logit");
    let mut chunked = t.new_capturing_state(&[0, 3, 5]).unwrap();
    let got = run_chunks(&t, &mut chunked, &toks, &[7, 1, 30, 2]);
    assert_eq!(got, want);
    // Rows of the window before the last forward's first position are held, and equal
    // however the prompt was chunked (G1 for the captured rows).
    let (from, to) = (90 - 32, 90);
    let a = one.captured(from, to).unwrap().to_vec();
    assert_eq!(chunked.captured(from, to).unwrap(), &a[..]);
    assert!(one.captured(from, to + 1).is_none());
    assert!(plain.captured(from, to).is_none());
    // Layer 0's input is the embedding in every stream: its mean is the embedding up to the
    // rounding of three f32 additions (|err| ≤ 7·2⁻²⁴·|x| / 4 < 2⁻²³·|x|).
    let mut e = vec![0.0f32; 64];
    let row0 = &a[..64];
    let t_embd = t.gguf().tensor("token_embd.weight").unwrap();
    let bytes = t.gguf().tensor_data(t_embd);
    let rb = bytes.len() / 258;
    let tok = toks[from] as usize;
    quant_f16_row(&bytes[tok * rb..(tok + 1) * rb], &mut e);
    for (c, x) in row0.iter().zip(&e) {
        assert!((c - x).abs() <= x.abs() * 2f32.powi(-23), "{c} vs {x}");
    }
    // Truncation rolls the captured rows back: rows of rejected tokens are dropped, and the
    // real tokens' rows after the rollback are the ones a straight run has.
    let mut st = t.new_capturing_state(&[0, 3, 5]).unwrap();
    run_chunks(&t, &mut st, &toks[..85], &[85]);
    let mut wrong = toks.clone();
    for x in &mut wrong[85..90] {
        *x = (*x + 11) % 258;
    }
    let mut s = Deepseek4Scratch::default();
    let mut l = Vec::new();
    t.forward(&mut s, &mut [&mut st], &rows(&wrong, 85, 90), &mut l)
        .unwrap();
    assert_ne!(st.captured(85, 90).unwrap(), &a[(85 - from) * 192..]);
    st.truncate(85).unwrap();
    assert!(st.captured(84, 86).is_none());
    t.forward(&mut s, &mut [&mut st], &rows(&toks, 85, 90), &mut l)
        .unwrap();
    assert_eq!(st.captured(from, to).unwrap(), &a[..]);
}

/// The fixture's token embedding is F16: one row decoded.
fn quant_f16_row(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = i32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            let v = man as f32 * 2f32.powi(-24);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        e => sign | (((e - 15 + 127) as u32) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[test]
fn a_block_depends_only_on_the_context_rows_it_attends() {
    let t = target("flash-layout");
    let d = Dspark::load(support(), t.clone()).unwrap();
    let w = d.window();
    let toks = prompt(100);
    let mut st = t.new_capturing_state(&d.config().target_layers).unwrap();
    run_chunks(&t, &mut st, &toks, &[100]);
    // The anchor is token 100 at position 99 (context 0..99).
    let ctx_end = 99;
    let mut sc = d.new_scratch();
    let block = |ds: &lockstep_model::DsparkState, sc: &mut lockstep_model::DsparkScratch| {
        let mut out = DsparkBlock::default();
        d.block(sc, ds, toks[99], &mut out).unwrap();
        out
    };
    // Context from the window only, in one go.
    let mut a = d.new_state();
    d.extend_context(
        &mut sc,
        &mut a,
        ctx_end - w,
        st.captured(ctx_end - w, ctx_end).unwrap(),
    )
    .unwrap();
    assert_eq!((a.len(), a.first()), (99, 99 - w));
    let ba = block(&a, &mut sc);
    assert_eq!(ba.pos, 99);
    assert_eq!(ba.hidden.len(), 5 * 64);
    assert_eq!(ba.logits.len(), 5 * 258);
    assert!(ba.logits.iter().all(|x| x.is_finite()));
    let spread = ba.logits.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    assert!(spread > 0.0, "not flat");
    // Built row by row from further back, with a rollback on the way: the same bits.
    let mut b = d.new_state();
    let start = ctx_end - w - 10;
    let cap = |p: usize, q: usize| st.captured(p, q).unwrap().to_vec();
    d.extend_context(&mut sc, &mut b, start, &cap(start, start + 25))
        .unwrap();
    d.extend_context(&mut sc, &mut b, start + 20, &cap(start + 20, ctx_end - 3))
        .unwrap();
    for p in ctx_end - 3..ctx_end {
        d.extend_context(&mut sc, &mut b, p, &cap(p, p + 1))
            .unwrap();
    }
    assert_eq!(b.len(), 99);
    let bb = block(&b, &mut sc);
    assert_eq!(bb.hidden, ba.hidden);
    assert_eq!(bb.logits, ba.logits);
    // A context that lost rows the window reaches is refused, not computed.
    let mut c = d.new_state();
    d.extend_context(&mut sc, &mut c, ctx_end - 5, &cap(ctx_end - 5, ctx_end))
        .unwrap();
    let mut out = DsparkBlock::default();
    assert!(d.block(&mut sc, &c, toks[99], &mut out).is_err());
    // The context matters: a shorter one (anchor one earlier) gives other logits.
    let mut e = d.new_state();
    d.extend_context(&mut sc, &mut e, 0, &cap(0, 1)).unwrap();
    let mut out = DsparkBlock::default();
    d.block(&mut sc, &e, toks[99], &mut out).unwrap();
    assert_ne!(out.logits, ba.logits);
    // Markov head and confidence.
    let mut emb = Vec::new();
    d.markov_embed(toks[99], &mut emb).unwrap();
    assert_eq!(emb.len(), 16);
    let mut lg = Vec::new();
    d.markov_logits(&mut sc, &emb, &ba.logits[..258], &mut lg)
        .unwrap();
    assert_eq!(lg.len(), 258);
    assert!(lg.iter().zip(&ba.logits[..258]).any(|(a, b)| a != b));
    let c0 = d.confidence(&mut sc, &ba.hidden[..64], &emb).unwrap();
    assert!(c0 > 0.0 && c0 < 1.0, "{c0}");
    assert!(d.markov_embed(258, &mut emb).is_err());
}

/// A little-endian f32 C-order `.npy` file: (shape, values).
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).expect("npy file");
    assert!(bytes.starts_with(b"\x93NUMPY"), "{}", path.display());
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + hlen]).unwrap();
    assert!(header.contains("'<f4'") && header.contains("'fortran_order': False"));
    let shape_text = header.split("'shape': (").nth(1).unwrap();
    let shape: Vec<usize> = shape_text[..shape_text.find(')').unwrap()]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<f32> = bytes[start + hlen..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// Max |port − reference|, as for the V4 logits (`tests/deepseek4.rs`): the reference is a
/// float64 numpy forward from the same weights, the port f32; the target's own f32 logits are
/// within ~1e-5 of float64 on these fixtures, and a flipped routing choice (every stage's
/// top-k clears 2e-3 in the reference, see the manifest) would move values by ~1e-2.
const TOLERANCE: f32 = 1e-4;

#[test]
fn the_drafter_matches_the_numpy_reference() {
    let m: Json =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let r = &m["dspark"]["supports"][0]["reference"];
    let (shape, reference) = read_npy(&dir().join(r["file"].as_str().unwrap()));
    let bytes = std::fs::read(dir().join(r["file"].as_str().unwrap())).unwrap();
    let hex: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hex, r["sha256"].as_str().unwrap());
    let tokens: Vec<u32> = m["fixtures"][0]["sequences"][r["sequence"].as_u64().unwrap() as usize]
        ["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let anchors: Vec<usize> = r["anchors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    // The reference computes with the decoded weights: the Q8_0 tensors become F32 here (a
    // Q8_0 matmul would also quantize its activations, which the reference does not model).
    let g = support();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add(k.clone(), v.clone()).unwrap();
    }
    for t in g.tensors() {
        let data = g.tensor_data(t);
        if t.ggml_type == gguf::GgmlType::Q8_0 {
            let k = t.dims[0] as usize;
            let rows = (t.n_elements() as usize) / k;
            let rb = data.len() / rows;
            let mut out = vec![0.0f32; k];
            let mut f = Vec::with_capacity(rows * k * 4);
            for row in data.chunks_exact(rb) {
                quant::dequantize_row(quant::Format::Q8_0, row, &mut out).unwrap();
                f.extend(out.iter().flat_map(|x| x.to_le_bytes()));
            }
            w.add_tensor(&t.name, &t.dims, gguf::GgmlType::F32, f)
                .unwrap();
        } else {
            w.add_tensor(&t.name, &t.dims, t.ggml_type, data.to_vec())
                .unwrap();
        }
    }
    let tgt = target("flash-layout");
    let d = Dspark::load(
        Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap()),
        tgt.clone(),
    )
    .unwrap();
    let (v, dim, b) = (258, 64, d.config().block_size);
    assert_eq!(shape, vec![anchors.len(), b, 2 * v + dim + 1]);
    let mut sc = d.new_scratch();
    let mut worst = [0.0f32; 4];
    for (ai, &a) in anchors.iter().enumerate() {
        let mut st = tgt.new_capturing_state(&d.config().target_layers).unwrap();
        run_chunks(&tgt, &mut st, &tokens[..a], &[33, 1, 50]);
        let lo = a.saturating_sub(d.window());
        let mut ds = d.new_state();
        d.extend_context(&mut sc, &mut ds, lo, st.captured(lo, a).unwrap())
            .unwrap();
        let mut blk = DsparkBlock::default();
        d.block(&mut sc, &ds, tokens[a], &mut blk).unwrap();
        let (mut emb, mut lg) = (Vec::new(), Vec::new());
        for k in 0..b {
            let want = &reference[(ai * b + k) * (2 * v + dim + 1)..][..2 * v + dim + 1];
            let base = &blk.logits[k * v..(k + 1) * v];
            let hidden = &blk.hidden[k * dim..(k + 1) * dim];
            d.markov_embed(tokens[a + k], &mut emb).unwrap();
            d.markov_logits(&mut sc, &emb, base, &mut lg).unwrap();
            let conf = d.confidence(&mut sc, hidden, &emb).unwrap();
            let diff = |x: &[f32], y: &[f32]| {
                x.iter()
                    .zip(y)
                    .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()))
            };
            worst[0] = worst[0].max(diff(base, &want[..v]));
            worst[1] = worst[1].max(diff(&lg, &want[v..2 * v]));
            worst[2] = worst[2].max(diff(hidden, &want[2 * v..2 * v + dim]));
            worst[3] = worst[3].max((conf - want[2 * v + dim]).abs());
        }
    }
    eprintln!(
        "DSpark vs numpy float64: max |diff| base logits {:.2e}, Markov logits {:.2e}, hidden \
         {:.2e}, confidence {:.2e}",
        worst[0], worst[1], worst[2], worst[3]
    );
    assert!(worst.iter().all(|&x| x <= TOLERANCE), "{worst:?}");
}
