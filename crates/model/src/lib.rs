//! Model architectures (llama, qwen2, gemma3) as batched forwards over the CPU backend and a paged
//! KV cache, and DeepSeek V4 ([`Deepseek4`]) over its own per-sequence state.
//!
//! A [`Model`] is loaded from a mapped GGUF file: the [`Config`] comes from the metadata,
//! the matmul weights are repacked once into 16-row tiles (`quant::PackedMatrix`,
//! bit-identical results to the row-major kernels) and the embedding table stays in the
//! mapping (all shape- and type-checked at load). [`Model::forward`]
//! runs one batch of rows — each a (sequence, token, absolute position, wants-logits)
//! [`BatchRow`] — from one or several sequences: a prefill chunk, decode rows and verify
//! blocks alike, in one pass. Every layer writes the rows' K/V into the paged cache and
//! attends by reading them back, so a row's logits are bit-identical however the rows were
//! batched and whatever the thread count (G1, see ARCHITECTURE.md "Numerics").
//!
//! ```no_run
//! use std::sync::Arc;
//! use lockstep_model::{BatchRow, LoadOptions, Model};
//!
//! let gguf = Arc::new(gguf::GgufFile::open("smollm2-135m.gguf")?);
//! let model = Model::load(gguf, &LoadOptions::default())?;
//! let mut kv = model.new_kv_cache(4096)?;
//! let mut seq = model.new_sequence(&kv);
//! let mut scratch = model.new_scratch();
//! let prompt = [504u32, 3575, 282, 4649, 314];
//! let rows: Vec<BatchRow> = prompt
//!     .iter()
//!     .enumerate()
//!     .map(|(pos, &token)| BatchRow { seq: 0, token, pos, wants_logits: pos + 1 == prompt.len() })
//!     .collect();
//! let mut logits = Vec::new();
//! model.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)?;
//! assert_eq!(logits.len(), model.config().n_vocab);
//! kv.release_sequence(seq);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Layout: `config` (hyperparameters), `weights` (packed matrices, views, shape checks), `layers` (the
//! shared attention and feed-forward blocks), one file per architecture (`llama`: llama
//! and qwen2; `gemma3`; `deepseek4`: the forward, its config and its state, and its
//! `dspark` block drafter), `exec`
//! (thread-pool matmuls split over N), `memory` (estimates).

mod backend;
mod config;
mod deepseek4;
mod error;
mod exec;
mod gemma3;
mod layers;
mod llama;
mod memory;
mod model;
mod weights;

pub use backend::{BackendError, Batch, ForwardBackend, ForwardRow, KvSlot, TargetRows};
pub use backend_cpu::{KvCache, KvType, SeqKv, ThreadPool};
pub use config::{Arch, Config, RopeScaling, SUPPORTED_ARCHITECTURES};
pub use deepseek4::{
    Deepseek4, Deepseek4Config, Deepseek4Scratch, Deepseek4State, Deepseek4Trace, Dspark,
    DsparkBlock, DsparkConfig, DsparkScratch, DsparkState, V4Attention, Yarn,
};
pub use error::ModelError;
pub use layers::ForwardScratch;
pub use memory::{
    ESTIMATE_BATCH_ROWS, MemoryEstimate, available_memory, check_memory, parse_mem_available,
};
pub use model::{BatchRow, LoadOptions, Model};
