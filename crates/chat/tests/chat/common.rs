//! Helpers shared by the integration tests: golden files and real model templates.

use std::path::PathBuf;

/// This crate's `tests/data/golden`: conversations and their renders by HF transformers
/// (made by `tools/golden/make.py`).
#[allow(dead_code)] // not every test file uses every helper
pub fn golden_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/golden"))
}

/// The template and the BOS/EOS token strings of a known model, read from its GGUF.
#[allow(dead_code)] // not every test file uses every helper
pub fn model_template(model: &str) -> (String, String, String) {
    let path = hub::ensure_model(model).expect("model in cache");
    let file = gguf::GgufFile::open(&path).expect("GGUF opens");
    let source = file
        .get_str("tokenizer.chat_template")
        .expect("chat template")
        .to_string();
    let tokens = file.get_array("tokenizer.ggml.tokens").expect("token list");
    let token = |key: &str| -> String {
        let id = file.get_u32(key).expect("token id") as usize;
        tokens
            .get(id)
            .and_then(|v| v.as_str().map(str::to_string))
            .expect("token string")
    };
    let bos = token("tokenizer.ggml.bos_token_id");
    let eos = token("tokenizer.ggml.eos_token_id");
    (source, bos, eos)
}
