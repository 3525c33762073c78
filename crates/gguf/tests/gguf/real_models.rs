//! The four project models parse, with the expected tables and metadata.

use lockstep_gguf::{GgufFile, TensorInfo};

fn open(name: &str) -> GgufFile {
    let path = hub::ensure_model(name).unwrap_or_else(|e| panic!("model {name}: {e}"));
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every tensor's byte size is its type's row size times the other dimensions, and its
/// data slice has exactly that length.
fn assert_sizes_match_types(f: &GgufFile) {
    for t in f.tensors() {
        let TensorInfo {
            dims, ggml_type, ..
        } = t;
        let ne0 = dims[0];
        assert_eq!(ne0 % ggml_type.block_len(), 0, "{}", t.name);
        let expected =
            ne0 / ggml_type.block_len() * ggml_type.type_size() * dims[1..].iter().product::<u64>();
        assert_eq!(t.n_bytes, expected, "{}", t.name);
        assert_eq!(f.tensor_data(t).len() as u64, expected, "{}", t.name);
        assert_eq!(t.offset % f.alignment(), 0, "{}", t.name);
    }
    let weights: u64 = f.tensors().iter().map(|t| t.n_bytes).sum();
    assert!(f.data_offset() + weights <= f.file_len());
}

#[test]
fn smollm2_135m_parses_with_expected_tables() {
    let f = open("smollm2-135m");
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    let tokens = f.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.as_strings().map(<[String]>::len), Some(49152));
    assert_eq!(tokens.as_strings().unwrap()[0], "<|endoftext|>");
    let types = f.get_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.as_i32s().map(<[i32]>::len), Some(49152));
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, vec![576, 49152]);
    assert_sizes_match_types(&f);
}

#[test]
fn qwen2_5_coder_0_5b_parses_with_expected_tables() {
    let f = open("qwen2.5-coder-0.5b");
    assert_eq!(f.tensors().len(), 291);
    assert_eq!(f.architecture().unwrap(), "qwen2");
    assert_eq!(f.metadata().len(), 26);
    assert_eq!(f.get_u32("qwen2.block_count").unwrap(), 24);
    assert_eq!(f.get_u32("qwen2.attention.head_count_kv").unwrap(), 2);
    let tokens = f.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.as_strings().map(<[String]>::len), Some(151936));
    assert!(
        f.get_str("tokenizer.chat_template")
            .unwrap()
            .contains("<|im_start|>")
    );
    assert_sizes_match_types(&f);
}

#[test]
fn qwen2_5_coder_1_5b_parses_with_expected_tables() {
    let f = open("qwen2.5-coder-1.5b");
    assert_eq!(f.tensors().len(), 339);
    assert_eq!(f.architecture().unwrap(), "qwen2");
    assert_eq!(f.get_u32("qwen2.block_count").unwrap(), 28);
    assert_sizes_match_types(&f);
}

#[test]
fn gemma3_270m_parses_with_expected_tables() {
    let f = open("gemma3-270m");
    assert_eq!(f.tensors().len(), 236);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.architecture().unwrap(), "gemma3");
    assert_eq!(f.get_u32("gemma3.block_count").unwrap(), 18);
    assert_eq!(f.get_u32("gemma3.attention.key_length").unwrap(), 256);
    assert!(f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    let scores = f.get_array("tokenizer.ggml.scores").unwrap();
    assert_eq!(scores.as_f32s().map(<[f32]>::len), Some(262144));
    let tokens = f.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.as_strings().map(<[String]>::len), Some(262144));
    assert_sizes_match_types(&f);
}
