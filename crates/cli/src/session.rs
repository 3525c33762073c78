//! A loaded model behind a running engine, shared by `run`, `check` and `chat`: they all
//! generate through [`engine::Engine`], the same path the server takes.

use std::io::{IsTerminal, Read};
use std::sync::Arc;

use anyhow::{Context, bail};
use chat::ChatTemplate;
use clap::Args;
use engine::{Engine, EngineConfig, Event, FinishReason, GenerateRequest, Timings};
use runtime::Runtime;
use text::Tokenizer;

use crate::args::{ModelArgs, SamplingArgs, StopArgs};
use crate::{load, prompt};

/// The prompt flags of `run` and `check`.
#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// The prompt (default: read all of stdin). Without --chat it is a raw prompt: control
    /// texts such as <|im_start|> in it become the control tokens, as in llama.cpp
    #[arg(short = 'p', long = "prompt", value_name = "TEXT")]
    pub prompt: Option<String>,

    /// Render the prompt as one user message through the model's chat template (with the
    /// assistant's generation prompt); the message text stays plain text
    #[arg(long)]
    pub chat: bool,

    /// A system message before the user message (with --chat)
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
}

impl PromptArgs {
    /// The prompt text: `-p`, else stdin (refused when stdin is a terminal, where reading
    /// would silently wait for Ctrl-D).
    pub fn text(&self) -> anyhow::Result<String> {
        if let Some(p) = &self.prompt {
            return Ok(p.clone());
        }
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            bail!("no prompt: give one with -p TEXT or pipe it on stdin");
        }
        let mut text = String::new();
        stdin
            .lock()
            .read_to_string(&mut text)
            .context("reading the prompt from stdin")?;
        Ok(text)
    }
}

/// A model, its tokenizer and chat template, and the engine running it: a
/// [`Runtime`] for one conversation at a time.
pub struct Session {
    /// Display name of the model.
    pub name: String,
    /// The running model (engine, tokenizer, chat template, grammar environment).
    pub runtime: Runtime,
    /// The DSpark block drafter, when `--dspark` gave one (its counters).
    pub dspark: Option<Arc<spec::DsparkDraft>>,
}

impl Session {
    /// Resolves and loads the model of `args` and starts an engine for one conversation at
    /// a time. With `need_template`, a model without a chat template is refused before the
    /// weights are loaded.
    pub fn open(args: &ModelArgs, need_template: bool) -> anyhow::Result<Session> {
        Session::open_with_spec(args, need_template, None)
    }

    /// [`Session::open`] with speculative decoding set up from `spec` (loading and
    /// checking a draft model when one is named).
    pub fn open_with_spec(
        args: &ModelArgs,
        need_template: bool,
        spec: Option<&crate::spec_args::SpecArgs>,
    ) -> anyhow::Result<Session> {
        Session::open_with(args, need_template, spec, None)
    }

    /// [`Session::open_with_spec`] with the prefix cache's disk tier of `disk` (off when
    /// `None`).
    pub fn open_with(
        args: &ModelArgs,
        need_template: bool,
        spec: Option<&crate::spec_args::SpecArgs>,
        disk: Option<&crate::disk_cache_args::DiskCacheArgs>,
    ) -> anyhow::Result<Session> {
        let path = load::resolve_model_path(&args.model)?;
        let name = load::display_name(&args.model, &path);
        let gguf = runtime::load::open_gguf(&path)?;
        if need_template && !runtime::load::has_chat_template(&gguf) {
            return Err(load::no_template_error(&name));
        }
        let dspark_path = spec.and_then(|s| s.dspark.as_deref());
        // One sequence: the KV cache holds the context (plus a spare block); the default
        // context is bounded by the memory of the device the model runs on.
        let crate::device::Loaded {
            backend,
            n_ctx,
            context,
            n_vocab,
            dspark,
            device_name,
        } = crate::device::backend(&gguf, args, &name, dspark_path, &|n| {
            n + backend_cpu::DEFAULT_BLOCK_SIZE
        })?;
        if args.ctx_size.is_none() {
            eprintln!("{name}: {}", context.describe());
        }
        let block = backend_cpu::DEFAULT_BLOCK_SIZE;
        let mut opts = runtime::ModelOptions {
            threads: args.threads(),
            ctx_size: Some(n_ctx),
            max_seqs: 1,
            queue_capacity: EngineConfig::default().queue_capacity,
            // Room for the whole context plus one spare block, so a new turn of a chat can
            // be admitted while the previous turn's blocks are still in the prefix cache.
            kv_tokens: Some(n_ctx + block),
            kv_type: args.kv_type.into(),
            prefill_chunk: args.prefill_chunk(),
            ..runtime::ModelOptions::new(name.clone())
        };
        opts.disk_cache = match disk {
            Some(d) => {
                let unusable = crate::disk_cache_args::unusable(&gguf);
                d.config(&path, unusable, false)?
            }
            None => None,
        };
        if let Some(s) = spec {
            let tokenizer = runtime::load::load_tokenizer(&gguf)?;
            let kv_tokens = opts.kv_pool_tokens(n_ctx);
            opts.spec = s.engine_spec(&tokenizer, n_vocab, args, kv_tokens, dspark.clone())?;
        }
        drop(gguf);
        let runtime = Runtime::open_with_backend(&path, &opts, backend, &device_name)?;
        let engine = runtime.engine();
        if let Some(d) = disk
            && d.dir.is_some()
            && let engine::DiskCacheState::Unavailable(_) = engine.disk_cache_state()
            && let Some(line) = crate::disk_cache_args::status_line(engine)
        {
            eprintln!("{line}");
        }
        Ok(Session {
            name,
            runtime,
            dspark,
        })
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        self.runtime.tokenizer()
    }

    /// The chat template, when the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.runtime.template()
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        self.runtime.engine()
    }

    /// The prompt tokens for `args`: a raw prompt, or one user message (after an optional
    /// system message) through the chat template.
    pub fn prompt_tokens(&self, args: &PromptArgs) -> anyhow::Result<Vec<u32>> {
        let text = args.text()?;
        if !args.chat {
            return Ok(prompt::raw_prompt_tokens(self.tokenizer(), &text));
        }
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(chat::Message::new("system", system.as_str()));
        }
        messages.push(chat::Message::new("user", text));
        self.chat_tokens(&messages)
    }

    /// The prompt tokens of a conversation, with the generation prompt.
    pub fn chat_tokens(&self, messages: &[chat::Message]) -> anyhow::Result<Vec<u32>> {
        let Some(template) = self.template() else {
            return Err(load::no_template_error(&self.name));
        };
        prompt::chat_prompt_tokens(template, self.tokenizer(), messages)
    }

    /// Runs one request, calling `on_token` for every generated token as it arrives.
    pub fn generate(
        &self,
        request: GenerateRequest,
        mut on_token: impl FnMut(&TokenEvent) -> anyhow::Result<()>,
    ) -> anyhow::Result<Generation> {
        let prompt_tokens = request.prompt.len();
        let handle = self.engine().submit(request)?;
        let mut tokens = Vec::new();
        let mut logprobs = Vec::new();
        let mut text = String::new();
        for event in &handle {
            match event {
                Event::Token {
                    position,
                    token,
                    text: delta,
                    logprob,
                    top_logprobs,
                    logit_sha256,
                } => {
                    let ev = TokenEvent {
                        position,
                        token,
                        text: delta,
                        logprob,
                        top_logprobs,
                        logit_sha256,
                    };
                    on_token(&ev)?;
                    tokens.push(ev.token);
                    logprobs.push(ev.logprob);
                    text.push_str(&ev.text);
                }
                Event::Finished {
                    reason,
                    text: tail,
                    usage,
                    timings,
                } => {
                    text.push_str(&tail);
                    return Ok(Generation {
                        prompt_tokens,
                        cached_tokens: usage.cached_tokens,
                        tokens,
                        logprobs,
                        tail,
                        text,
                        reason,
                        timings,
                        spec: usage.spec,
                    });
                }
                Event::Error(e) => bail!("generation failed: {e}"),
            }
        }
        bail!("the engine ended the request without finishing it")
    }
}

/// One generated token, as [`Session::generate`] hands it to its caller.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    /// Absolute position of the token.
    pub position: usize,
    /// Token id.
    pub token: u32,
    /// Output text that became final with this token (may be empty).
    pub text: String,
    /// Log-probability of the token (raw logits, T = 1).
    pub logprob: f32,
    /// The best alternatives, best first, when asked for.
    pub top_logprobs: Option<Vec<(u32, f32)>>,
    /// SHA-256 of the position's full-vocabulary logits, when asked for.
    pub logit_sha256: Option<[u8; 32]>,
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token (raw logits, T = 1).
    pub logprobs: Vec<f32>,
    /// Text released at the end (after the last token's text).
    pub tail: String,
    /// The whole output text.
    pub text: String,
    /// Why it ended.
    pub reason: FinishReason,
    /// Phase timings.
    pub timings: Timings,
    /// Speculation counters (when the request speculated).
    pub spec: Option<engine::SpecStats>,
}

impl Generation {
    /// Prompt tokens actually computed per second of prefill.
    pub fn prompt_tokens_per_second(&self) -> f64 {
        per_second(
            self.prompt_tokens.saturating_sub(self.cached_tokens),
            self.timings.prefill_ms,
        )
    }

    /// Tokens per second of decoding: the tokens after the first over the time after the
    /// first (the first token's time belongs to the prefill).
    pub fn tokens_per_second(&self) -> f64 {
        per_second(self.tokens.len().saturating_sub(1), self.timings.decode_ms)
    }

    /// One line for stderr: token counts, speeds, finish reason.
    pub fn summary(&self, seed: u64) -> String {
        let cached = if self.cached_tokens > 0 {
            format!(" ({} cached)", self.cached_tokens)
        } else {
            String::new()
        };
        format!(
            "prompt {} tokens{cached} in {:.1} ms ({:.1} t/s), generated {} tokens in {:.1} ms \
             ({:.1} t/s), first token after {:.1} ms, finish: {}, seed: {seed}",
            self.prompt_tokens,
            self.timings.prefill_ms,
            self.prompt_tokens_per_second(),
            self.tokens.len(),
            self.timings.decode_ms,
            self.tokens_per_second(),
            self.timings.ttft_ms,
            self.reason,
        )
    }
}

fn per_second(n: usize, ms: f64) -> f64 {
    if n == 0 || ms <= 0.0 {
        0.0
    } else {
        n as f64 * 1000.0 / ms
    }
}

/// A request from the shared flags.
pub fn request(
    prompt: Vec<u32>,
    sampling: &SamplingArgs,
    stop: &StopArgs,
    seed: u64,
) -> anyhow::Result<GenerateRequest> {
    let mut req = GenerateRequest::new(prompt, sampling.params(seed)?);
    req.max_tokens = Some(stop.max_tokens);
    req.stop_strings = stop.stop.clone();
    req.ignore_eos = stop.ignore_eos;
    Ok(req)
}

/// Whether generation stopped naturally (`"stop"`) or ran out (`"length"`).
pub fn finish_name(reason: FinishReason) -> &'static str {
    reason.as_openai_str()
}
