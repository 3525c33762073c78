//! The state every handler shares: the served model, counters, the grammar cache, the
//! Responses store and the server's settings.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::responses::ResponseStore;
use runtime::Runtime;
use runtime::constraint::GrammarCache;

/// Server settings that are not about the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Required key for `/v1/*`, as `Authorization: Bearer KEY` or `x-api-key: KEY`
    /// (`None` = open).
    pub api_key: Option<String>,
    /// Largest request body in bytes (larger: 413).
    pub body_limit: usize,
    /// Interval of SSE keep-alive comments while nothing else is sent (long prefills).
    pub keep_alive: Duration,
    /// Responses kept for `previous_response_id`.
    pub response_store_capacity: usize,
    /// How long shutdown waits for in-flight requests before cancelling them.
    pub shutdown_grace: Duration,
    /// Refuse (HTTP 404) a `model` that is neither the served name nor an alias. Off by
    /// default: the one served model answers whatever name a client asks for (clients
    /// such as Claude Code and Codex send their own model names).
    pub strict_model_name: bool,
}

impl Default for ServerConfig {
    /// Open, 8 MiB bodies, keep-alive every 10 s, 256 stored responses, 30 s grace, any
    /// model name answered.
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            body_limit: 8 * 1024 * 1024,
            keep_alive: Duration::from_secs(10),
            response_store_capacity: 256,
            shutdown_grace: Duration::from_secs(30),
            strict_model_name: false,
        }
    }
}

/// What handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The served model.
    pub model: Arc<Runtime>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Compiled grammars.
    pub grammars: GrammarCache,
    /// Stored responses.
    pub responses: ResponseStore,
    /// Settings.
    pub config: ServerConfig,
    ids: AtomicU64,
    id_salt: u64,
}

impl AppState {
    /// State for `model` with `config`.
    pub fn new(model: Arc<Runtime>, config: ServerConfig) -> AppState {
        let grammars = GrammarCache::new(Arc::clone(model.token_env()), 64);
        AppState {
            responses: ResponseStore::new(config.response_store_capacity),
            model,
            metrics: Arc::new(Metrics::default()),
            grammars,
            config,
            ids: AtomicU64::new(0),
            id_salt: crate::request::random_seed(),
        }
    }

    /// A fresh id with `prefix` (`chatcmpl-…`): unique in this process, not guessable
    /// across restarts.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let mixed = (self.id_salt ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(17);
        format!("{prefix}{mixed:016x}{n:08x}")
    }

    /// Checks the `model` field: any name is answered by the served model, unless
    /// [`ServerConfig::strict_model_name`] (then: absent, the served name or an alias).
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            None => Ok(()),
            Some(_) if !self.config.strict_model_name => Ok(()),
            Some(m) if self.model.answers_to(m) => Ok(()),
            Some(m) => Err(ApiError::ModelNotFound {
                requested: m.to_string(),
                served: self.model.name().to_string(),
            }),
        }
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
