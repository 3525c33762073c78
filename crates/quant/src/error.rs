//! Typed errors of this crate.

use crate::{ActLayout, Format};

/// Everything that can go wrong when the caller hands this crate slices and shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// A row length that is not a whole number of blocks.
    #[error("{format}: row length {k} is not a multiple of the block length {block_len}")]
    RaggedRow {
        /// The format.
        format: Format,
        /// The row length asked for.
        k: usize,
        /// The format's block length.
        block_len: usize,
    },
    /// A slice whose length does not match the shape.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length the shape implies.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// Activations quantized for another layout than the weight format needs.
    #[error("{format} weights need {needed:?} activations, got {got:?}")]
    ActLayout {
        /// The weight format.
        format: Format,
        /// The layout it consumes.
        needed: ActLayout,
        /// The layout of the activations passed.
        got: ActLayout,
    },
    /// An activation row index past the end.
    #[error("activation row {row} out of range (have {rows})")]
    Row {
        /// The index asked for.
        row: usize,
        /// The number of rows.
        rows: usize,
    },
    /// An output-row range that is empty-inverted or past N.
    #[error("n range {start}..{end} is not inside 0..{n}")]
    NRange {
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// Number of weight rows.
        n: usize,
    },
    /// A requested kernel path that this CPU cannot run.
    #[error("kernel path {0} is not available on this CPU")]
    PathUnavailable(&'static str),
    /// A shape whose byte size overflows `usize`.
    #[error("shape too large")]
    TooLarge,
}
