//! `lockstep serve`: the OpenAI- and Anthropic-compatible HTTP server (crate `server`) for
//! one model.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::args::ModelArgs;
use crate::device::DeviceArg;
use crate::disk_cache_args::{self, DiskCacheArgs};
use crate::load;
use crate::spec_args::{SpecArgs, SpecReport};

/// Arguments of `lockstep serve`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Open http://HOST:PORT/ in a browser for the chat page (embedded in the binary, works
offline): streamed answers, markdown, JSON mode, settings, and per answer the tokens/s,
time to first token and speculation counters, with a replay that checks the answer is
identical.

Endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models (OpenAI) and
/v1/messages, /v1/messages/count_tokens (Anthropic).

With --ngram [N], --draft MODEL or --spec auto every request speculates; the output is
identical to plain decoding. The free drafters include a cross-request suffix index of
earlier requests' prompts and outputs (--spec-suffix-tokens N, 0 = off). Each response's
usage gains a `speculative` object with the request's counters (cycles, drafted,
accepted, accept_rate, ..., suffix). /metrics exposes the totals as lockstep_spec_*. A
chat request's `\"speculation\": false` (extension field) decodes it plainly.

Examples:
  lockstep serve -m qwen2.5-coder-0.5b --port 8080
  lockstep serve -m qwen2.5-coder-1.5b --ngram --max-seqs 16
  lockstep serve -m qwen2.5-coder-1.5b --alias gpt-4o --strict-model-name
  ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=local claude
                                              Claude Code against a running server
  lockstep bench --serve -m smollm2-135m      load benchmark: t/s and TTFT at 1/4/16 clients")]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Address to listen on
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: IpAddr,

    /// Port to listen on (0 = any free port)
    #[arg(long, value_name = "PORT", default_value_t = 8080)]
    pub port: u16,

    /// Sequences generated at once (continuous batching)
    #[arg(long = "max-seqs", value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_seqs: u32,

    /// Requests waiting for a free sequence before new ones get HTTP 429
    #[arg(long = "queue", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub queue: u32,

    /// Require `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/* (also from
    /// LOCKSTEP_API_KEY)
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "LOCKSTEP_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,

    /// Another name for the model in /v1/models and the `model` field (repeatable)
    #[arg(long = "alias", value_name = "NAME")]
    pub alias: Vec<String>,

    /// Answer only requests whose `model` is the served name or an alias (HTTP 404
    /// otherwise). Without it any requested name is answered by the served model, so
    /// clients that send their own model names (Claude Code, Codex) work unchanged
    #[arg(long = "strict-model-name")]
    pub strict_model_name: bool,

    /// Largest request body in MiB (larger bodies get HTTP 413)
    #[arg(long = "body-limit-mib", value_name = "MIB", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub body_limit_mib: u32,

    /// Seconds in-flight requests get to finish after Ctrl-C/SIGTERM before they are cancelled
    #[arg(long = "shutdown-grace", value_name = "SECS", default_value_t = 30)]
    pub shutdown_grace: u64,

    #[command(flatten)]
    pub disk_cache: DiskCacheArgs,

    /// Speculative decoding for every request; each response's `usage.speculative` then
    /// holds the request's counters (--spec-stats: the totals on stderr at shutdown). Last,
    /// so that its help heading covers only its own flags.
    #[command(flatten, next_help_heading = "Speculative decoding")]
    pub spec: SpecArgs,
}

/// Loads the model and serves until Ctrl-C or SIGTERM.
pub fn run(args: &ServeArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let path = load::resolve_model_path(&args.model.model)?;
    let name = load::display_name(&args.model.model, &path);
    let gguf = runtime::load::open_gguf(&path)?;
    let kv_type: model::KvType = args.model.kv_type.into();
    let mut opts = runtime::ModelOptions {
        name: name.clone(),
        aliases: args.alias.clone(),
        threads: args.model.threads(),
        ctx_size: None,
        max_seqs: args.max_seqs as usize,
        queue_capacity: args.queue as usize,
        kv_tokens: None,
        kv_type,
        spec: engine::SpecConfig::default(),
        disk_cache: None,
        prefill_chunk: args.model.prefill_chunk(),
    };
    // The CPU's Runtime::open unless a GPU was asked for or `auto` may find one, or a
    // DSpark support file comes with the model: then device::backend loads it (and says
    // where it runs). Either way the default context is the trained one, bounded by the
    // memory (host RAM, or the GPU's) of the KV pool the engine will allocate for it.
    let on_gpu_maybe = match args.model.device {
        DeviceArg::Cpu => false,
        DeviceArg::Cuda(_) => true,
        DeviceArg::Auto => backend_cuda::cuda_built(),
    };
    let dspark = args.spec.dspark.as_deref();
    // A DeepSeek V4 model loads there too: speculation (on by default) needs its logit
    // width, which only its own loader reads.
    let v4 = runtime::load::is_deepseek4(&gguf);
    let pool = opts.clone();
    let (choice, loaded, spec_draft) = if on_gpu_maybe || dspark.is_some() || v4 {
        let loaded = crate::device::backend(&gguf, &args.model, &name, dspark, &|n| {
            pool.kv_pool_tokens(n)
        })?;
        let draft = loaded.dspark.clone();
        (loaded.context, Some(loaded), draft)
    } else {
        let choice = runtime::load::context_choice(&gguf, args.model.ctx_size, kv_type, |n| {
            pool.kv_pool_tokens(n)
        })?;
        runtime::load::check_memory(&gguf, choice.n_ctx, kv_type)?;
        (choice, None, None)
    };
    let n_ctx = choice.n_ctx;
    opts.ctx_size = Some(n_ctx);
    let unusable = disk_cache_args::unusable(&gguf);
    opts.disk_cache = args.disk_cache.config(&path, unusable, true)?;
    if args.spec.enabled() {
        let tokenizer = runtime::load::load_tokenizer(&gguf)?;
        let n_vocab = match &loaded {
            Some(l) => l.n_vocab,
            None => {
                model::Config::from_gguf(&gguf)
                    .with_context(|| format!("reading {name}'s configuration"))?
                    .n_vocab
            }
        };
        opts.spec = args.spec.engine_spec(
            &tokenizer,
            n_vocab,
            &args.model,
            opts.kv_pool_tokens(n_ctx),
            spec_draft,
        )?;
    }
    drop(gguf);
    let served = match loaded {
        Some(l) => runtime::Runtime::open_with_backend(&path, &opts, l.backend, &l.device_name),
        None => runtime::Runtime::open(&path, &opts),
    };
    let model = Arc::new(served.with_context(|| format!("loading {}", path.display()))?);
    if let Some(line) = disk_cache_args::status_line(model.engine()) {
        eprintln!("{line}");
    }
    let config = server::ServerConfig {
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        body_limit: args.body_limit_mib as usize * 1024 * 1024,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        strict_model_name: args.strict_model_name,
        ..server::ServerConfig::default()
    };
    let addr = SocketAddr::new(args.host, args.port);
    let ctx = choice.describe();
    let speculation = speculation_note(&opts.spec);
    server::serve_blocking(addr, Arc::clone(&model), config, |bound| {
        let _ = writeln!(
            out,
            "lockstep serving {name} ({ctx}{speculation}) at http://{bound}/v1 — \
             Ctrl-C to stop"
        );
        let _ = writeln!(out, "chat page: http://{bound}/");
        let _ = out.flush();
    })
    .with_context(|| format!("serving on {addr}"))?;
    if args.spec.stats && model.speculates() {
        eprintln!(
            "{} (all requests)",
            SpecReport::of(&model.engine().metrics().spec).line()
        );
    }
    Ok(())
}

/// ", speculative: n-gram + fast-forward" for the start-up line (empty when off).
fn speculation_note(spec: &engine::SpecConfig) -> String {
    if !spec.is_on() {
        return String::new();
    }
    let d = &spec.drafters;
    let mut names = Vec::new();
    if let Some(ix) = &d.suffix {
        names.push(format!(
            "cross-request suffix index ({} tokens)",
            ix.config().budget_tokens
        ));
    }
    if let Some(n) = &d.ngram {
        names.push(format!("n-gram (keys up to {})", n.max_n));
    }
    if let Some(m) = &d.draft_model {
        names.push(format!("draft model {}", m.name()));
    }
    if let Some(ds) = &d.dspark {
        names.push(format!("DSpark {}", ds.name()));
    }
    if d.fast_forward {
        names.push("grammar fast-forward".into());
    }
    format!(", speculative: {}", names.join(" + "))
}
