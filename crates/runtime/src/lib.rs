//! One place that assembles a running model, between the engine and the front ends
//! (`lockstep run`/`chat`/`serve` and the HTTP server).
//!
//! [`Runtime::open`] turns a model file and [`ModelOptions`] into a running
//! [`engine::Engine`] with everything a front end needs: the tokenizer, the chat template
//! and its [`prompt::ChatPrompter`] (DeepSeek V4's built-in template when the file has
//! none), the tool-call format, the grammar token environment. [`load`] holds the pieces
//! (opening the file, the context length, the memory check, the tokenizer and template)
//! for front ends that assemble something else (benchmarks, a draft model).
//!
//! [`constraint`] owns the constraint plan of a request: [`constraint::plan`] builds it
//! from the response format and the [`tools`] (their envelope grammars live there), and
//! [`Runtime::constrain`] applies the think-block rule (a model that thinks first keeps its `<think>…</think>` block
//! free and the constraint applies after `</think>`), so every front end constrains the
//! same way; [`constraint::GrammarCache`] compiles repeated constraints once.
//!
//! ```no_run
//! # fn demo() -> Result<(), lockstep_runtime::LoadError> {
//! use lockstep_runtime::{ModelOptions, Runtime};
//!
//! let rt = Runtime::open(std::path::Path::new("model.gguf"), &ModelOptions::new("model"))?;
//! println!("{} tokens of context", rt.context_len());
//! # Ok(()) }
//! ```

pub mod constraint;
pub mod load;
pub mod memory;
pub mod prompt;
mod runtime;
pub mod tools;

pub use model::KvType;
pub use runtime::{ModelOptions, Runtime};

/// Why a model could not be loaded or started.
///
/// The messages carry their cause inline (no `source()` chain), so a front end that
/// prints the chain does not repeat it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The GGUF file could not be opened or read.
    #[error("opening {path}: {error}")]
    Gguf {
        /// The file.
        path: String,
        /// The reader's error.
        error: gguf::GgufError,
    },
    /// The tokenizer metadata is unusable.
    #[error("reading the tokenizer from the model file: {0}")]
    Tokenizer(text::TextError),
    /// The model could not be loaded (or does not fit in memory).
    #[error("{0}")]
    Model(model::ModelError),
    /// The engine did not start.
    #[error("starting the engine: {0}")]
    Engine(engine::EngineError),
    /// `tokenizer.chat_template` is not a string.
    #[error("tokenizer.chat_template is not a string")]
    TemplateNotString,
    /// The chat template does not compile.
    #[error("compiling the model's chat template: {0}")]
    Template(chat::ChatError),
    /// The grammar token environment could not be built.
    #[error("building the grammar token environment: {0}")]
    Grammar(grammar::GrammarError),
    /// A known model could not be fetched into the cache.
    #[error("fetching the model: {0}")]
    Hub(hub::HubError),
    /// An option is out of range.
    #[error("{0}")]
    Options(String),
    /// The memory a load needs (host RAM, or a CUDA device's memory) is not there.
    #[error(
        "not enough {memory}: the model needs about {needed_mib} MiB there (weights \
         {weights_mib} MiB, KV cache {kv_mib} MiB, scratch {scratch_mib} MiB) but only \
         {available_mib} MiB are available, {short_mib} MiB short; use a smaller context \
         (-c) or model{}",
        if matches!(memory, memory::MemoryKind::Device(_)) { ", or --device cpu" } else { "" }
    )]
    InsufficientMemory {
        /// The memory that is short.
        memory: memory::MemoryKind,
        /// What the load needs there, MiB.
        needed_mib: u64,
        /// Weights, MiB.
        weights_mib: u64,
        /// KV cache, MiB.
        kv_mib: u64,
        /// Scratch buffers, MiB.
        scratch_mib: u64,
        /// What is available there, MiB.
        available_mib: u64,
        /// `needed_mib` less what is available, MiB (rounded up).
        short_mib: u64,
    },
}

impl From<model::ModelError> for LoadError {
    fn from(e: model::ModelError) -> LoadError {
        LoadError::Model(e)
    }
}

impl From<engine::EngineError> for LoadError {
    fn from(e: engine::EngineError) -> LoadError {
        LoadError::Engine(e)
    }
}
