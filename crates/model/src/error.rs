//! The error type of this crate.

use backend_cpu::Error as BackendError;
use gguf::GgufError;
use quant::QuantError;

/// Everything that can go wrong loading a model or running a forward pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// Reading a metadata key failed (missing, wrong type, out of range).
    #[error("GGUF metadata: {0}")]
    Gguf(#[from] GgufError),

    /// `general.architecture` names an architecture this crate does not implement.
    #[error("unsupported architecture {arch:?}; supported: {}", supported.join(", "))]
    UnsupportedArchitecture {
        /// The architecture named by the file.
        arch: String,
        /// The architectures this crate implements.
        supported: &'static [&'static str],
    },

    /// A hyperparameter is missing a sensible value or is inconsistent with another.
    #[error("invalid model configuration: {0}")]
    Config(String),

    /// RoPE scaling metadata of a kind this crate does not implement.
    #[error("unsupported rope scaling {kind:?} (key {key}); supported: none, linear")]
    UnsupportedRopeScaling {
        /// The scaling type named by the file.
        kind: String,
        /// The metadata key it came from.
        key: String,
    },

    /// A tensor the architecture needs is not in the file.
    #[error("tensor {name} is missing from the model file")]
    MissingTensor {
        /// The tensor name.
        name: String,
    },

    /// A tensor has other dimensions than the configuration implies.
    #[error("tensor {name} has shape {got:?}, expected {expected:?} (ne0 first)")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// The dimensions the configuration implies.
        expected: Vec<u64>,
        /// The dimensions in the file.
        got: Vec<u64>,
    },

    /// A tensor is stored in a format this crate cannot compute with.
    #[error("tensor {name} has unsupported type {ggml_type}{why}")]
    TensorType {
        /// The tensor name.
        name: String,
        /// The ggml type name.
        ggml_type: String,
        /// Extra explanation (may be empty).
        why: String,
    },

    /// A DSpark support file is malformed or does not fit its target (metadata, tensor
    /// names, shapes or types).
    #[error("DSpark support file: {0}")]
    Dspark(String),

    /// A batch row's position lies at or beyond the configured context length.
    #[error(
        "context overflow: row {row} is at position {pos}, the context holds {n_ctx} tokens \
         (positions 0..{n_ctx})"
    )]
    ContextOverflow {
        /// Index of the row in the batch.
        row: usize,
        /// The row's absolute position.
        pos: usize,
        /// The configured context length.
        n_ctx: usize,
    },

    /// A batch is malformed (bad sequence index, token id, or positions).
    #[error("invalid batch: {0}")]
    Batch(String),

    /// The machine does not have the memory the model needs.
    #[error(
        "not enough memory: the model needs about {needed_mib} MiB (weights {weights_mib} MiB, \
         KV cache {kv_mib} MiB, scratch {scratch_mib} MiB) but only {available_mib} MiB are \
         available; use a smaller context or model"
    )]
    InsufficientMemory {
        /// Total estimate, MiB.
        needed_mib: u64,
        /// Weights, MiB.
        weights_mib: u64,
        /// KV cache, MiB.
        kv_mib: u64,
        /// Scratch buffers, MiB.
        scratch_mib: u64,
        /// `MemAvailable`, MiB.
        available_mib: u64,
    },

    /// The CPU backend (KV cache bookkeeping, row ops, attention) refused an operation.
    #[error("backend: {0}")]
    Backend(#[from] BackendError),

    /// A quantized kernel refused its arguments.
    #[error("quantized kernel: {0}")]
    Quant(#[from] QuantError),
}
