//! A running model: the engine with its tokenizer, chat template, tool-call format and
//! grammar token environment, plus the names clients may use for it.

use std::path::Path;
use std::sync::Arc;

use chat::{ChatTemplate, ToolCallFormat};
use engine::{Deepseek4Backend, Engine, EngineConfig, ForwardBackend, ModelBackend, SpecConfig};
use grammar::{Constraint, TokenEnv};
use sha2::{Digest, Sha256};
use text::Tokenizer;

use crate::LoadError;
use crate::load::{self, DEFAULT_CTX};
use crate::prompt::ChatPrompter;

/// How to load and run a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// The name the model is served under (`smollm2-135m`, or a file stem).
    pub name: String,
    /// Other names listed by `/v1/models` and accepted in the `model` field.
    pub aliases: Vec<String>,
    /// Threads for the forward pass (`None` = one per core).
    pub threads: Option<usize>,
    /// Context length (`None` = [`DEFAULT_CTX`](crate::load::DEFAULT_CTX) capped at the
    /// trained context).
    pub ctx_size: Option<usize>,
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Requests waiting for admission before new ones get HTTP 429.
    pub queue_capacity: usize,
    /// KV pool size in tokens (`None` = enough for the context twice, at least 16,384).
    pub kv_tokens: Option<usize>,
    /// Element type of the KV cache.
    pub kv_type: model::KvType,
    /// Speculative decoding for every request (off by default). The output is identical
    /// either way; with it on, each response's `usage` carries the request's counters.
    pub spec: SpecConfig,
    /// The prefix cache's disk tier (`None` = RAM only); `cached_tokens` in each
    /// response's usage counts the blocks read back from it too.
    pub disk_cache: Option<engine::DiskCacheConfig>,
    /// Most prompt rows of one sequence per forward (`None` = the backend's
    /// [`ForwardBackend::preferred_prefill_chunk`]: 256 on the CPU, more on a GPU). The
    /// step's row budget grows to it. Never changes the output (G1).
    pub prefill_chunk: Option<usize>,
}

impl ModelOptions {
    /// Options for serving `name` with the defaults: 8 sequences, a queue of 64, no
    /// speculation.
    pub fn new(name: impl Into<String>) -> ModelOptions {
        ModelOptions {
            name: name.into(),
            aliases: Vec::new(),
            threads: None,
            ctx_size: None,
            max_seqs: 8,
            queue_capacity: 64,
            kv_tokens: None,
            kv_type: model::KvType::default(),
            spec: SpecConfig::default(),
            disk_cache: None,
            prefill_chunk: None,
        }
    }

    /// The KV pool size in tokens for a context of `n_ctx`: [`ModelOptions::kv_tokens`],
    /// else enough for the context twice and at least 16,384 (a draft model's KV pool is
    /// sized the same way).
    pub fn kv_pool_tokens(&self, n_ctx: usize) -> usize {
        self.kv_tokens.unwrap_or_else(|| (2 * n_ctx).max(16_384))
    }
}

/// A running model and everything derived from it.
pub struct Runtime {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    prompter: Option<ChatPrompter>,
    tool_format: Box<dyn ToolCallFormat>,
    /// Whether the template itself renders `tools` (otherwise they go into a system note).
    template_has_tools: bool,
    token_env: Arc<TokenEnv>,
    name: String,
    aliases: Vec<String>,
    listed_aliases: Vec<String>,
    fingerprint: String,
    created: u64,
    speculates: bool,
    draft_model: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("name", &self.name)
            .field("aliases", &self.aliases)
            .field("fingerprint", &self.fingerprint)
            .field("context_len", &self.engine.context_len())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Loads the GGUF at `path` on the CPU and starts the engine.
    pub fn open(path: &Path, opts: &ModelOptions) -> Result<Runtime, LoadError> {
        Runtime::open_on(path, opts, None)
    }

    /// Like [`Runtime::open`], but the engine runs on `backend` (a model the caller
    /// loaded from the same file, on another device) named `backend_name` in the
    /// fingerprint. Its context must hold the served context.
    pub fn open_with_backend(
        path: &Path,
        opts: &ModelOptions,
        backend: Box<dyn ForwardBackend>,
        backend_name: &str,
    ) -> Result<Runtime, LoadError> {
        Runtime::open_on(path, opts, Some((backend, backend_name)))
    }

    fn open_on(
        path: &Path,
        opts: &ModelOptions,
        given: Option<(Box<dyn ForwardBackend>, &str)>,
    ) -> Result<Runtime, LoadError> {
        if opts.max_seqs == 0 || opts.queue_capacity == 0 {
            return Err(LoadError::Options(
                "--max-seqs and the queue capacity must be at least 1".into(),
            ));
        }
        let file = load::open_gguf(path)?;
        let tokenizer = Arc::new(load::load_tokenizer(&file)?);
        let trained = load::trained_context(&file);
        let n_ctx = match (opts.ctx_size, trained) {
            (Some(0), _) => return Err(LoadError::Options("--ctx-size must be at least 1".into())),
            (Some(n), Some(t)) if n > t => {
                return Err(LoadError::Options(format!(
                    "--ctx-size {n} exceeds the model's trained context of {t} tokens"
                )));
            }
            (Some(n), _) => n,
            (None, Some(t)) => t.min(DEFAULT_CTX),
            (None, None) => DEFAULT_CTX,
        };
        let template = load::chat_template(&file, &tokenizer)?;
        let load_opts = model::LoadOptions {
            threads: opts.threads,
            kv_type: opts.kv_type,
            n_ctx: Some(n_ctx),
        };
        let (backend, backend_name): (Box<dyn ForwardBackend>, String) = match given {
            Some((b, name)) => {
                if b.max_context() < n_ctx {
                    return Err(LoadError::Options(format!(
                        "the {name} backend holds {} positions, the served context is {n_ctx}",
                        b.max_context()
                    )));
                }
                (b, name.to_string())
            }
            None if load::is_deepseek4(&file) => {
                let model = model::Deepseek4::load(Arc::clone(&file), &load_opts)?;
                (
                    Box::new(Deepseek4Backend::new(Arc::new(model))),
                    quant::kernels().name().to_string(),
                )
            }
            None => {
                let model = model::Model::load(Arc::clone(&file), &load_opts)?;
                (
                    Box::new(ModelBackend::new(Arc::new(model))),
                    quant::kernels().name().to_string(),
                )
            }
        };
        if opts.prefill_chunk == Some(0) {
            return Err(LoadError::Options(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        let defaults = EngineConfig::default();
        let prefill_chunk = opts
            .prefill_chunk
            .unwrap_or_else(|| backend.preferred_prefill_chunk());
        let cfg = EngineConfig {
            prefill_chunk,
            step_token_budget: defaults.step_token_budget.max(prefill_chunk),
            max_seqs: opts.max_seqs,
            kv_tokens: opts.kv_pool_tokens(n_ctx),
            queue_capacity: opts.queue_capacity,
            context_len: n_ctx,
            spec: opts.spec.clone(),
            disk_cache: opts.disk_cache.clone(),
            ..defaults
        };
        let engine = Engine::start(backend, Arc::clone(&tokenizer), cfg)?;
        let token_env = TokenEnv::with_logit_width(Arc::clone(&tokenizer), engine.n_vocab())
            .map_err(LoadError::Grammar)?;
        let (tool_format, template_has_tools) = match &template {
            Some(t) => match chat::detect_format(t.source()) {
                Some(f) => (f, t.source().contains("tools")),
                None => (fallback_format(), false),
            },
            None => (fallback_format(), false),
        };
        let prompter = template.map(|t| ChatPrompter::new(t, &tokenizer));
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        let fingerprint = format!(
            "lockstep-{}-{}",
            backend_name,
            model_hash(&opts.name, path, size)
        );
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut aliases = opts.aliases.clone();
        if let Some(stem) = path.file_stem().map(|s| s.to_string_lossy().into_owned())
            && stem != opts.name
            && !aliases.contains(&stem)
        {
            aliases.push(stem);
        }
        Ok(Runtime {
            engine,
            tokenizer,
            prompter,
            tool_format,
            template_has_tools,
            token_env,
            name: opts.name.clone(),
            aliases,
            listed_aliases: opts.aliases.clone(),
            fingerprint,
            created,
            speculates: opts.spec.is_on(),
            draft_model: opts.spec.is_on() && opts.spec.drafters.draft_model.is_some(),
        })
    }

    /// The served name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a client's `model` value names this model (the name or an alias).
    pub fn answers_to(&self, requested: &str) -> bool {
        requested == self.name || self.aliases.iter().any(|a| a == requested)
    }

    /// The aliases given in [`ModelOptions::aliases`] (listed by `/v1/models`; the file
    /// stem, also accepted, is not listed).
    pub fn listed_aliases(&self) -> &[String] {
        &self.listed_aliases
    }

    /// Whether the chat template has a thinking mode (it reads `enable_thinking`, or it is
    /// DeepSeek V4's built-in encoding): such a model can answer with a reasoning segment
    /// `<think>…</think>` first.
    pub fn thinks(&self) -> bool {
        self.prompter.as_ref().is_some_and(|p| {
            let source = p.template().source();
            source.contains("enable_thinking") || source.starts_with("{# built-in: DeepSeek V4")
        })
    }

    /// `system_fingerprint`: the kernel set and a short model hash.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// When the server loaded the model (Unix seconds), the `created` of `/v1/models`.
    pub fn created(&self) -> u64 {
        self.created
    }

    /// The context length in effect.
    pub fn context_len(&self) -> usize {
        self.engine.context_len()
    }

    /// Whether requests speculate (the engine's speculation is on).
    pub fn speculates(&self) -> bool {
        self.speculates
    }

    /// Whether requests speculate with a draft model.
    pub fn drafts_with_a_model(&self) -> bool {
        self.draft_model
    }

    /// The engine (metrics, submission).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The grammar token environment (logit width of the engine).
    pub fn token_env(&self) -> &Arc<TokenEnv> {
        &self.token_env
    }

    /// The chat template, when the model has one (DeepSeek V4's built-in one for a
    /// DeepSeek V4 file without a template).
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.prompter.as_ref().map(ChatPrompter::template)
    }

    /// The chat prompter (control tokens only from the template), when the model has a
    /// chat template.
    pub fn prompter(&self) -> Option<&ChatPrompter> {
        self.prompter.as_ref()
    }

    /// The tool-call format of the template (Hermes when it does not say).
    pub fn tool_format(&self) -> &dyn ToolCallFormat {
        self.tool_format.as_ref()
    }

    /// Whether the template itself renders `tools` (otherwise a front end puts them into
    /// a system note).
    pub fn template_has_tools(&self) -> bool {
        self.template_has_tools
    }

    /// The constraint plan's think-block rule for a chat prompt of this model (see
    /// [`crate::constraint::think_rule`]): `prompt` is the rendered prompt's tokens.
    pub fn constrain(&self, constraint: Constraint, prompt: &[u32]) -> Constraint {
        crate::constraint::think_rule(constraint, self.template(), &self.tokenizer, prompt)
    }
}

fn fallback_format() -> Box<dyn ToolCallFormat> {
    Box::new(chat::HermesFormat)
}

/// First 16 hex digits of the model's sha256 from the hub table when the file is the known
/// model (same size), else of its size and path.
fn model_hash(name: &str, path: &Path, size: u64) -> String {
    if let Ok(spec) = hub::model_spec(name)
        && spec.size == size
        && let Some(h) = spec.sha256.get(..16)
    {
        return h.to_string();
    }
    let mut hasher = Sha256::new();
    hasher.update(size.to_le_bytes());
    hasher.update(path.to_string_lossy().as_bytes());
    hasher
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}
