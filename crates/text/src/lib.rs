//! Tokenizers built from GGUF metadata (byte-level BPE, SentencePiece) and streaming
//! detokenization.
//!
//! [`Tokenizer::from_gguf`] reads `tokenizer.ggml.*` and reproduces llama.cpp's
//! tokenization exactly (tested against llama.cpp's output on ~2,000 strings per model):
//!
//! - `gpt2` models: GPT-2 byte-level BPE after the model's pre-tokenizer (`smollm`,
//!   `qwen2`, `llama3`-style, plain GPT-2), merges by rank.
//! - `llama` models (gemma): SentencePiece-style BPE by piece score, `▁` for spaces,
//!   `<0xNN>` byte fallback.
//!
//! Control tokens (`<|im_start|>`, `<start_of_turn>`) are recognised in text only with
//! [`EncodeOptions::parse_special`]; in chat message text they are plain text. Decoding
//! gives bytes ([`Tokenizer::decode`]); [`StreamDecoder`] turns a token stream into UTF-8
//! deltas that never split a character.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use lockstep_text::{DecodeOptions, EncodeOptions, Tokenizer};
//!
//! let file = gguf::GgufFile::open("model.gguf")?;
//! let tok = Tokenizer::from_gguf(&file)?;
//! let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", EncodeOptions::raw_prompt());
//! let mut stream = tok.stream_decoder(DecodeOptions { skip_special: true });
//! let mut text = String::new();
//! for &id in &ids {
//!     text.push_str(&stream.push(id)?);
//! }
//! text.push_str(&stream.finish());
//! assert_eq!(text, "user\nHi");
//! # Ok(()) }
//! ```

mod bpe;
mod error;
mod gguf_load;
mod pretokenize;
mod special;
mod spm;
mod stream;
mod tokenizer;
mod unicode;
mod vocab;

pub use error::TextError;
pub use stream::StreamDecoder;
pub use tokenizer::{DecodeOptions, EncodeOptions, Tokenizer, TokenizerKind};
pub use vocab::{TokenKind, VocabSpec};
