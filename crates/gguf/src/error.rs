//! Errors of the reader and of the typed metadata getters.
//!
//! Every parse error says where: the byte offset in the file and, where there is one, the
//! metadata key or tensor name being read.

use std::path::PathBuf;

use crate::GgmlType;

/// An error reading a GGUF file or looking up its metadata.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, inspected or mapped.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The file does not start with the `GGUF` magic.
    #[error("not a GGUF file: magic bytes {found:02x?} (expected \"GGUF\")")]
    BadMagic {
        /// The first four bytes of the file.
        found: [u8; 4],
    },

    /// The version is not 2 or 3.
    #[error("unsupported GGUF version {version}{hint}; only versions 2 and 3 are supported")]
    UnsupportedVersion {
        /// The version read (little-endian).
        version: u32,
        /// Extra explanation (v1, or a big-endian file).
        hint: &'static str,
    },

    /// The file ended in the middle of something.
    #[error(
        "file truncated at byte {offset} reading {what}: needs {needed} bytes, {available} left"
    )]
    Truncated {
        /// What was being read.
        what: String,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes the read needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },

    /// A count (of metadata entries, tensors or array elements) that the rest of the file
    /// cannot possibly hold: rejected before anything is allocated for it.
    #[error(
        "{what} at byte {offset}: count {count} needs at least {min_bytes} bytes, only {available} left"
    )]
    CountTooLarge {
        /// What is counted.
        what: String,
        /// Byte offset of the count.
        offset: u64,
        /// The count read.
        count: u64,
        /// The fewest bytes that many items take (saturating).
        min_bytes: u64,
        /// Bytes left in the file after the count.
        available: u64,
    },

    /// A string (key, tensor name or string value) is not valid UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
        /// Byte offset of the string's bytes.
        offset: u64,
    },

    /// A metadata value type tag outside 0..=12.
    #[error("key '{key}': unknown value type {type_id} at byte {offset}")]
    UnknownValueType {
        /// The key being read.
        key: String,
        /// The tag read.
        type_id: u32,
        /// Byte offset of the tag.
        offset: u64,
    },

    /// A bool stored as something other than 0 or 1.
    #[error("key '{key}': invalid bool byte {byte} at byte {offset}")]
    InvalidBool {
        /// The key being read.
        key: String,
        /// The byte read.
        byte: u8,
        /// Byte offset of the byte.
        offset: u64,
    },

    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`](crate::MAX_ARRAY_DEPTH).
    #[error("key '{key}': arrays nested deeper than {max} levels at byte {offset}")]
    ArrayTooDeep {
        /// The key being read.
        key: String,
        /// The limit.
        max: usize,
        /// Byte offset of the too-deep array.
        offset: u64,
    },

    /// The same metadata key twice.
    #[error("duplicate metadata key '{key}' at byte {offset}")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Byte offset of the second occurrence.
        offset: u64,
    },

    /// `general.alignment` is not an integer power of two up to
    /// [`MAX_ALIGNMENT`](crate::MAX_ALIGNMENT).
    #[error("general.alignment must be an integer power of two up to 2^31, found {found}")]
    BadAlignment {
        /// The value found, as text.
        found: String,
    },

    /// A tensor with more than 4 dimensions.
    #[error("tensor '{tensor}': {n_dims} dimensions at byte {offset} (at most 4)")]
    TooManyDims {
        /// Tensor name.
        tensor: String,
        /// Dimension count read.
        n_dims: u32,
        /// Byte offset of the count.
        offset: u64,
    },

    /// The element count or byte size of a tensor overflows.
    #[error("tensor '{tensor}': dimensions {dims:?} overflow")]
    DimsOverflow {
        /// Tensor name.
        tensor: String,
        /// The dimensions read.
        dims: Vec<u64>,
    },

    /// A ggml type id that is not in the type table.
    #[error("tensor '{tensor}': unknown ggml type id {type_id} at byte {offset}")]
    UnknownGgmlType {
        /// Tensor name.
        tensor: String,
        /// The id read.
        type_id: u32,
        /// Byte offset of the id.
        offset: u64,
    },

    /// The first dimension is not a whole number of the type's blocks.
    #[error(
        "tensor '{tensor}': first dimension {ne0} is not a multiple of {ggml_type}'s block length {block_len}"
    )]
    PartialBlock {
        /// Tensor name.
        tensor: String,
        /// The type.
        ggml_type: GgmlType,
        /// The first dimension.
        ne0: u64,
        /// The type's block length.
        block_len: u64,
    },

    /// The same tensor name twice.
    #[error("duplicate tensor name '{tensor}' at byte {offset}")]
    DuplicateTensor {
        /// The name.
        tensor: String,
        /// Byte offset of the second occurrence.
        offset: u64,
    },

    /// A tensor's offset is not a multiple of the alignment.
    #[error(
        "tensor '{tensor}': data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        /// Tensor name.
        tensor: String,
        /// Offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },

    /// A tensor's data does not lie inside the file.
    #[error(
        "tensor '{tensor}': data at file bytes {start}..{end} runs past the end of the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        /// Tensor name.
        tensor: String,
        /// Absolute start (saturating).
        start: u64,
        /// Absolute end (saturating).
        end: u64,
        /// File length.
        file_len: u64,
    },

    /// Two tensors' data overlap.
    #[error("tensors '{first}' and '{second}' overlap in the data section")]
    TensorOverlap {
        /// The tensor with the lower offset.
        first: String,
        /// The tensor starting inside it.
        second: String,
    },

    /// A metadata key that is not there.
    #[error("missing metadata key '{key}'")]
    MissingKey {
        /// The key.
        key: String,
    },

    /// A metadata value of another type than asked for.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type found.
        found: String,
        /// The type asked for.
        expected: &'static str,
    },

    /// An integer metadata value that does not fit the requested type.
    #[error("metadata key '{key}' has value {value}, which does not fit in {expected}")]
    OutOfRange {
        /// The key.
        key: String,
        /// The value found, as text.
        value: String,
        /// The type asked for.
        expected: &'static str,
    },
}
