//! GGUF file reader: mmap, metadata, tensor table, hostile-input safe.
//!
//! [`GgufFile::open`] maps a single-file GGUF (versions 2 and 3; v1 is rejected), parses
//! the header, every metadata value type (nested arrays included) and the tensor table,
//! and validates tensor placement: every tensor's data lies inside the file, at an offset
//! aligned to `general.alignment` (default 32), with no two tensors overlapping.
//!
//! Hostile input is an error, never a panic or a huge allocation: every count read from
//! the file is checked against the bytes that remain before anything is allocated, all
//! arithmetic on file values is checked, and each error says where it happened (byte
//! offset, metadata key or tensor name).
//!
//! Strings (keys, tensor names, string values including tokenizer vocabularies) must be
//! valid UTF-8; an invalid one is [`GgufError::InvalidUtf8`] naming the key and element.
//! llama.cpp's converters write Python `str` values encoded as UTF-8, and the models this
//! project uses all parse, so strictness costs nothing and keeps `&str` access simple.
//!
//! The mapped file must not be modified by another process while a [`GgufFile`] is alive.
//!
//! [`GgufWriter`] builds valid files (tests, synthetic models).
//!
//! ```
//! use lockstep_gguf::{GgmlType, GgufFile, GgufWriter, Value};
//!
//! let mut w = GgufWriter::new();
//! w.add("general.architecture", "llama")?;
//! w.add("tokenizer.ggml.tokens", vec!["a", "b"])?;
//! w.add_tensor("token_embd.weight", &[32, 2], GgmlType::Q8_0, vec![0u8; 68])?;
//! let f = GgufFile::from_bytes(w.to_bytes())?;
//! assert_eq!(f.architecture()?, "llama");
//! let tokens = f.get_array("tokenizer.ggml.tokens")?.as_strings().unwrap_or_default();
//! assert_eq!(tokens.len(), 2);
//! let t = f.tensor("token_embd.weight").ok_or("missing")?;
//! assert_eq!(f.tensor_data(t).len(), 68);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GgufFile, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS,
    TensorInfo,
};
pub use types::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, MAX_WRITER_ALIGNMENT, WriteError};

#[cfg(test)]
mod tests {
    #[test]
    fn parsed_files_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::GgufFile>();
        assert_send_sync::<crate::GgufError>();
    }
}
