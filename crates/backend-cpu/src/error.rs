//! The error type of this crate.

/// Errors of the CPU backend: mismatched buffer shapes, bad configurations and KV-cache
/// bookkeeping failures. None of them leaves partial state behind unless stated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A buffer does not have the length the other arguments imply.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// The length implied by the other arguments.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A position is beyond the RoPE table.
    #[error("position {pos} is beyond the RoPE table ({len} positions)")]
    RopePosition {
        /// The position asked for.
        pos: usize,
        /// Positions the table covers.
        len: usize,
    },
    /// A layer index is out of range.
    #[error("layer {layer} out of range ({n_layers} layers)")]
    Layer {
        /// The layer asked for.
        layer: usize,
        /// Layers in the cache.
        n_layers: usize,
    },
    /// The block pool of a layer group has too few free blocks.
    #[error("KV cache full: group {group} needs {needed} more blocks, {free} free")]
    OutOfBlocks {
        /// The layer group.
        group: usize,
        /// Blocks the operation needs.
        needed: usize,
        /// Blocks free in that group.
        free: usize,
    },
    /// A position is not covered by the sequence's reserved length.
    #[error("position {pos} is beyond the sequence's reserved length {len}")]
    NotReserved {
        /// The position.
        pos: usize,
        /// The sequence's reserved length.
        len: usize,
    },
    /// The block holding a position was released (it fell out of a sliding window).
    #[error("position {pos} of layer group {group} was released (outside the window)")]
    Released {
        /// The position.
        pos: usize,
        /// The layer group.
        group: usize,
    },
    /// A write targets a block shared with another sequence; copy it first
    /// (`KvCache::make_writable`).
    #[error("position {pos} of layer group {group} lies in a shared block")]
    SharedBlock {
        /// The position.
        pos: usize,
        /// The layer group.
        group: usize,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks a buffer length.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Shape {
            what,
            expected,
            got,
        })
    }
}
