//! The OpenAI- and Anthropic-compatible HTTP server: chat completions, completions,
//! responses, messages, models, health and metrics, and the chat page at `/` ([`page`]).
//!
//! [`Runtime::open`] (crate `runtime`) loads a GGUF and starts the engine; [`Server::bind`]
//! binds an address; [`Server::serve`] runs until a shutdown future completes (graceful: in-flight
//! requests finish within a grace period). Handlers are thin: request bodies are `serde`
//! types ([`api`]) parsed by an extractor that names the field at fault; the work lives in
//! [`request`] (validation, prompt, constraints), [`run`] (engine bridge), and one module
//! per endpoint that encodes OpenAI's response shapes ([`anthropic`]: Anthropic's Messages
//! API, translated onto the same path); every failure is an [`ApiError`] with OpenAI's
//! error body (Anthropic's on the messages routes).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use lockstep_server::{ModelOptions, Runtime, Server, ServerConfig, shutdown_signal};
//!
//! let path = std::path::Path::new("model.gguf");
//! let model = Arc::new(Runtime::open(path, &ModelOptions::new("model"))?);
//! let server = Server::bind("127.0.0.1:8080".parse()?, model, ServerConfig::default()).await?;
//! server.serve(shutdown_signal()).await?;
//! # Ok(()) }
//! ```

pub mod anthropic;
pub mod api;
pub mod chat_completions;
pub mod completions;
pub mod error;
pub mod extract;
pub mod metrics;
pub mod page;
pub mod request;
pub mod responses;
pub mod routes;
pub mod run;
mod server;
pub mod state;
pub mod tools;
pub mod usage;

pub use error::ApiError;
pub use runtime::{LoadError, ModelOptions, Runtime};
pub use server::{BackgroundServer, Server, serve_blocking, shutdown_signal};
pub use state::ServerConfig;
