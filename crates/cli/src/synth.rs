//! `lockstep synth`: a model file with a real model's shapes, formats and tokenizer
//! metadata and random weights (for measuring speed where the real weights are not at
//! hand), or with `--skeleton` only the metadata and tensor table (a few MB that can be
//! carried where the model cannot, then expanded there with `synth --like SKELETON`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use backend_cuda::synth::{spec_from_gguf, write_model, write_skeleton};
use clap::Args;

use crate::load;

/// Arguments of `lockstep synth`.
#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// The model to imitate: a known name, a .gguf path, or a skeleton written by
    /// `synth --skeleton`
    #[arg(long = "like", value_name = "MODEL")]
    pub like: String,

    /// Where to write the new .gguf file
    #[arg(long = "out", value_name = "FILE")]
    pub out: PathBuf,

    /// Seed of the random weights (same seed, same file)
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Write only the metadata and tensor table (no weights)
    #[arg(long)]
    pub skeleton: bool,
}

/// Runs `lockstep synth`.
pub fn run(args: &SynthArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let path = load::resolve_model_path(&args.like)?;
    let gguf = runtime::load::open_gguf(&path)?;
    let spec = spec_from_gguf(&gguf).with_context(|| format!("reading {}", path.display()))?;
    let t0 = Instant::now();
    if args.skeleton {
        write_skeleton(&spec, &args.out)?;
        writeln!(
            out,
            "wrote skeleton {} ({} tensors, {:.1} MB of weights when expanded)",
            args.out.display(),
            spec.tensors.len(),
            spec.data_bytes() as f64 / 1e6
        )?;
        return Ok(());
    }
    let bytes = write_model(&spec, args.seed, &args.out)?;
    writeln!(
        out,
        "wrote {} ({} tensors, {:.1} MB of random weights, seed {}) in {:.1} s",
        args.out.display(),
        spec.tensors.len(),
        bytes as f64 / 1e6,
        args.seed,
        t0.elapsed().as_secs_f64()
    )?;
    Ok(())
}
