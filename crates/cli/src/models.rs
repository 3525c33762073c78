//! `lockstep models`: the known models, their size, and whether and where they are cached.

use std::io::Write;

use hub::{Cache, Source};
use indicatif::HumanBytes;

/// Arguments of `lockstep models`.
#[derive(Debug, clap::Args)]
pub struct ModelsArgs {
    /// Also show each model's description, sha256 and sources
    #[arg(short, long)]
    long: bool,
}

/// Runs `models`.
pub fn run(args: &ModelsArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let cache = Cache::from_env()?;
    writeln!(out, "{:<20} {:>10}  {:<10} PATH", "NAME", "SIZE", "STATUS")?;
    for spec in hub::known_models() {
        let status = if cache.cached(spec).is_some() {
            "cached"
        } else {
            "not pulled"
        };
        writeln!(
            out,
            "{:<20} {:>10}  {:<10} {}",
            spec.name,
            HumanBytes(spec.size).to_string(),
            status,
            cache.model_path(spec.name).display()
        )?;
        if args.long {
            writeln!(out, "    {}", spec.display_name)?;
            writeln!(out, "    sha256 {}", spec.sha256)?;
            for source in spec.sources {
                match source {
                    Source::PyPi { wheels } => {
                        let reqs: Vec<String> = wheels.iter().map(|w| w.requirement()).collect();
                        writeln!(out, "    pypi   {}", reqs.join(" "))?;
                    }
                    Source::Hub { repo, file } => writeln!(out, "    hub    {repo} {file}")?,
                }
            }
        }
    }
    writeln!(
        out,
        "\ncache: {} (set LOCKSTEP_HOME to use another directory)",
        cache.root().display()
    )?;
    Ok(())
}
