//! Errors of tokenizer construction and decoding.

/// An error building a tokenizer or decoding token ids.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// Reading the GGUF metadata failed.
    #[error("GGUF metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// A metadata key has a type the tokenizer cannot use.
    #[error("metadata key '{key}' has the wrong type: expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
    },
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unsupported tokenizer model '{0}' (supported: gpt2, llama)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error("unsupported pre-tokenizer '{0}'")]
    UnsupportedPreTokenizer(String),
    /// The vocabulary has no tokens.
    #[error("the vocabulary is empty")]
    EmptyVocab,
    /// The vocabulary is larger than token ids can address.
    #[error("the vocabulary has {0} tokens, more than u32 ids can address")]
    VocabTooLarge(usize),
    /// A per-token array does not have one entry per token.
    #[error("{what} has {found} entries, the vocabulary has {expected} tokens")]
    LengthMismatch {
        /// Which array.
        what: &'static str,
        /// The vocabulary size.
        expected: usize,
        /// The array length.
        found: usize,
    },
    /// Two tokens have the same text.
    #[error("duplicate token {text:?} at ids {first} and {second}")]
    DuplicateToken {
        /// The text.
        text: String,
        /// The first id.
        first: u32,
        /// The second id.
        second: u32,
    },
    /// A special token id in the metadata is not a token of the vocabulary.
    #[error("{what} id {id} is outside the vocabulary of {vocab_size} tokens")]
    SpecialIdOutOfRange {
        /// Which special token.
        what: &'static str,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The metadata asks for a special token to be added but does not say which.
    #[error("{0} is true but the token id is not set")]
    MissingSpecialToken(&'static str),
    /// A SentencePiece vocabulary has neither a byte-fallback token for a byte nor an
    /// unknown token.
    #[error("SentencePiece vocabulary has no <0x{0:02X}> token and no unknown token")]
    MissingByteFallback(u8),
    /// A token id passed to decoding is not in the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
}
