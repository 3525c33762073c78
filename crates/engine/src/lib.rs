//! The engine: continuous-batching scheduler, sequences, prefix reuse, preemption,
//! cancellation and the event stream callers consume.
//!
//! [`Engine::start`] takes a [`ForwardBackend`] (the real [`ModelBackend`], or
//! `FakeBackend` in tests: behind the `testing` feature) and a tokenizer and runs the step loop on its own thread.
//! Callers [`Engine::submit`] a [`GenerateRequest`] and read [`Event`]s from the
//! [`RequestHandle`]. Each step runs **one** batched forward over rows of several
//! sequences — decode rows, prefill chunks (and, with speculation, verify blocks) — and a
//! sequence's output never depends on its neighbours (G1), on prefix reuse or on
//! preemption: the engine's tests check bit-identical logit digests for each.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use lockstep_engine::{Engine, EngineConfig, Event, GenerateRequest, ModelBackend, SamplingParams};
//!
//! let file = Arc::new(gguf::GgufFile::open("model.gguf")?);
//! let tok = Arc::new(text::Tokenizer::from_gguf(&file)?);
//! let model = Arc::new(model::Model::load(file, &model::LoadOptions::default())?);
//! let engine = Engine::start(Box::new(ModelBackend::new(model)), tok.clone(), EngineConfig::default())?;
//! let prompt = tok.encode("Hello", text::EncodeOptions::raw_prompt());
//! let mut req = GenerateRequest::new(prompt, SamplingParams::greedy());
//! req.max_tokens = Some(16);
//! let handle = engine.submit(req)?;
//! for event in &handle {
//!     match event {
//!         Event::Token { text, .. } => print!("{text}"),
//!         Event::Finished { text, reason, .. } => println!("{text} [{reason}]"),
//!         Event::Error(e) => eprintln!("error: {e}"),
//!     }
//! }
//! engine.shutdown();
//! # Ok(()) }
//! ```
//!
//! Layout: [`api`] (every public type: the contract), [`scheduler`] (pure planning over
//! plain numbers), [`prefix`] (the block-hash prefix index), [`disk`] (its disk tier),
//! `submit` (starting the engine, the shared inbox, queueing requests), `step` (the
//! loop; `step::speculate` its speculation path), `fake`
//! and `model_backend` (the paged-KV backends), `deepseek4_backend` (DeepSeek V4's
//! per-sequence state), `slots` (KV slot bookkeeping shared by the first two).

pub mod api;
mod deepseek4_backend;
pub mod disk;
#[cfg(any(test, feature = "testing"))]
mod fake;
mod model_backend;
pub mod prefix;
pub mod scheduler;
mod slots;
mod step;
mod submit;

pub use api::{
    BackendError, Completion, ConstraintError, DrafterKind, Engine, EngineConfig, EngineError,
    EngineMetrics, Event, EventIter, FinishReason, ForwardBackend, ForwardRow, GenerateRequest,
    KindCounts, KvSlot, RequestHandle, SamplingParams, SpecConfig, SpecMode, SpecStats, StopCause,
    SubmitError, Timings, TokenConstraint, TokenMask, Usage,
};
pub use deepseek4_backend::Deepseek4Backend;
pub use disk::{DiskCacheConfig, DiskCacheMetrics, DiskCacheState, KV_NUMERICS_VERSION};
#[cfg(any(test, feature = "testing"))]
pub use fake::{FakeBackend, FakeStats, fake_logits};
pub use model_backend::{KvPoolUsage, ModelBackend};
pub use step::logit_digest;
