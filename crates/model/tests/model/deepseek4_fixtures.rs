//! The committed DeepSeek V4 reference fixtures (`tests/fixtures/deepseek4`, made by
//! `tools/v4_fixtures/make_fixtures.py`): every file matches the manifest's sha256, the GGUFs
//! parse with llama.cpp's `deepseek4` metadata and the manifest's tensor table, and the
//! reference logits have the stated shapes. They load as [`Deepseek4`] (the forward itself is
//! tested in `deepseek4.rs`); `Model::load` refuses them with a pointer there.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lockstep_model::{Deepseek4, LoadOptions, Model};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek4")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(dir().join("manifest.json")).expect("manifest.json");
    serde_json::from_str(&text).expect("manifest is JSON")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn every_fixture_matches_its_manifest() {
    let m = manifest();
    let fixtures = m["fixtures"].as_array().expect("fixtures list");
    assert!(fixtures.len() >= 2, "expected at least two fixtures");
    for f in fixtures {
        let name = f["name"].as_str().unwrap();
        let path = dir().join(f["gguf"].as_str().unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            bytes.len() as u64,
            f["gguf_bytes"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            sha256_hex(&bytes),
            f["gguf_sha256"].as_str().unwrap(),
            "{name}"
        );

        let gguf = gguf::GgufFile::open(&path).unwrap();
        assert_eq!(
            gguf.get("general.architecture").and_then(|v| v.as_str()),
            Some("deepseek4"),
            "{name}"
        );
        let tensors = f["tensors"].as_array().unwrap();
        assert_eq!(gguf.tensors().len(), tensors.len(), "{name}");
        for t in tensors {
            let tname = t["name"].as_str().unwrap();
            let info = gguf
                .tensor(tname)
                .unwrap_or_else(|| panic!("{name}: tensor {tname} missing"));
            // numpy shapes are outermost-first, GGUF dims innermost-first.
            let mut shape: Vec<u64> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            shape.reverse();
            assert_eq!(info.dims, shape, "{name}: {tname}");
        }
        for (key, want) in f["gguf_metadata"].as_object().unwrap() {
            assert!(
                gguf.get(key).is_some(),
                "{name}: metadata {key} ({want}) missing"
            );
        }

        for s in f["sequences"].as_array().unwrap() {
            let file = s["logits_file"].as_str().unwrap();
            let bytes = std::fs::read(dir().join(file)).unwrap();
            assert_eq!(sha256_hex(&bytes), s["sha256"].as_str().unwrap(), "{file}");
            let shape: Vec<u64> = s["logits_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let tokens = s["tokens"].as_array().unwrap().len() as u64;
            assert_eq!(shape[0], tokens, "{file}: one row of logits per token");
            assert_eq!(shape[1], m["vocab"]["size"].as_u64().unwrap_or(shape[1]));
            // An .npy file: a header, then the f32 payload.
            assert!(bytes.starts_with(b"\x93NUMPY"), "{file}");
            assert!(bytes.len() as u64 >= shape[0] * shape[1] * 4, "{file}");
        }
    }
}

#[test]
fn deepseek4_loads_with_its_own_type_and_model_load_points_there() {
    let m = manifest();
    for f in m["fixtures"].as_array().unwrap() {
        let path = dir().join(f["gguf"].as_str().unwrap());
        let gguf = Arc::new(gguf::GgufFile::open(&path).unwrap());
        let v4 = Deepseek4::load(Arc::clone(&gguf), &LoadOptions::default()).expect("loads");
        let cfg = v4.config();
        let tc = &f["transformers_config"];
        assert_eq!(
            cfg.n_layer as u64,
            tc["num_hidden_layers"].as_u64().unwrap()
        );
        assert_eq!(cfg.n_embd as u64, tc["hidden_size"].as_u64().unwrap());
        assert_eq!(cfg.window as u64, tc["sliding_window"].as_u64().unwrap());
        assert_eq!(cfg.hc_streams as u64, tc["hc_mult"].as_u64().unwrap());
        assert_eq!(cfg.indexer_top_k as u64, tc["index_topk"].as_u64().unwrap());
        let ratios: Vec<u64> = f["coverage"]["compress_ratios"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        let got: Vec<u64> = cfg
            .layers
            .iter()
            .map(|l| l.ratio().unwrap_or(0) as u64)
            .collect();
        assert_eq!(got, ratios);
        let msg = match Model::load(gguf, &LoadOptions::default()) {
            Ok(_) => panic!("Model::load must not take a deepseek4 file"),
            Err(e) => e.to_string(),
        };
        assert!(
            msg.contains("deepseek4") && msg.contains("Deepseek4::load"),
            "{msg}"
        );
    }
}
