//! Reading `tokenizer.ggml.*` metadata from a GGUF file.

use std::borrow::Cow;

use gguf::{GgufFile, Value};

use crate::error::TextError;
use crate::tokenizer::Tokenizer;
use crate::vocab::VocabSpec;

fn opt<'f, T>(
    file: &'f GgufFile,
    key: &str,
    expected: &'static str,
    conv: impl Fn(&'f Value) -> Option<T>,
) -> Result<Option<T>, TextError> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => conv(v).map(Some).ok_or_else(|| TextError::WrongType {
            key: key.to_string(),
            expected,
        }),
    }
}

fn opt_strings<'f>(file: &'f GgufFile, key: &str) -> Result<Option<&'f [String]>, TextError> {
    opt(file, key, "array of strings", |v| {
        v.as_array()?.as_strings()
    })
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata.
    ///
    /// Special-token ids outside the vocabulary are ignored, as llama.cpp does (it warns and
    /// falls back); everything else that is malformed is an error.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TextError> {
        let model = file.get_str("tokenizer.ggml.model")?;
        let pre = opt(file, "tokenizer.ggml.pre", "string", Value::as_str)?.unwrap_or("");
        let tokens = file
            .get_array("tokenizer.ggml.tokens")?
            .as_strings()
            .ok_or_else(|| TextError::WrongType {
                key: "tokenizer.ggml.tokens".to_string(),
                expected: "array of strings",
            })?;
        let token_types = opt(file, "tokenizer.ggml.token_type", "array of i32", |v| {
            v.as_array()?.as_i32s()
        })?
        .unwrap_or(&[]);
        let scores: Option<Cow<'_, [f32]>> =
            opt(file, "tokenizer.ggml.scores", "array of f32 or i32", |v| {
                let a = v.as_array()?;
                match a.as_f32s() {
                    Some(s) => Some(Cow::Borrowed(s)),
                    None => Some(Cow::Owned(a.as_i32s()?.iter().map(|&i| i as f32).collect())),
                }
            })?;
        let merges = match opt_strings(file, "tokenizer.ggml.merges")? {
            Some(m) => m,
            // A byte-level BPE without merges encodes byte by byte; that is complete only
            // when every byte has its token (the DeepSeek V4 reference fixtures: 256 byte
            // tokens and two specials). Otherwise the merges are missing, not absent.
            None if model == "gpt2" && !has_every_byte_token(tokens) => {
                file.require("tokenizer.ggml.merges")?;
                &[]
            }
            None => &[],
        };
        let n = tokens.len();
        let id = |key: &str| -> Result<Option<u32>, TextError> {
            Ok(opt(file, key, "unsigned integer", Value::as_u32)?.filter(|&i| (i as usize) < n))
        };
        let flag = |key: &str| opt(file, key, "bool", Value::as_bool);
        let spec = VocabSpec {
            model,
            pre,
            tokens,
            token_types,
            scores: scores.as_deref(),
            merges,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            eot_id: id("tokenizer.ggml.eot_token_id")?,
            eom_id: id("tokenizer.ggml.eom_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
        };
        Tokenizer::from_spec(&spec)
    }
}

/// Whether `tokens` holds the GPT-2 byte-to-unicode form of each of the 256 bytes.
fn has_every_byte_token(tokens: &[String]) -> bool {
    let mut seen = [false; 256];
    for t in tokens {
        let mut chars = t.chars();
        if let (Some(c), None) = (chars.next(), chars.next())
            && let Some(b) = crate::unicode::char_to_byte(c)
        {
            seen[b as usize] = true;
        }
    }
    seen.iter().all(|&s| s)
}
