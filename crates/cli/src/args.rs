//! Flags shared by the generation commands (`run`, `check`, `chat`): which model and how
//! to load it, how to sample, and when to stop.

use clap::{Args, ValueEnum};
use sampling::SamplingParams;

/// The default model of every generation command.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Which model to load and how.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model: a known name (fetched into the cache on first use; see `lockstep models`)
    /// or a path to a .gguf file
    #[arg(short = 'm', long = "model", value_name = "MODEL", default_value = DEFAULT_MODEL)]
    pub model: String,

    /// Threads for the forward pass (default: one per core; never more than the cores)
    #[arg(short = 't', long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,

    /// Context length in tokens: prompt plus generated output (default: the model's
    /// trained context, bounded by the memory available; the start-up line says which)
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<usize>,

    /// Element type of the KV cache
    #[arg(long = "kv-type", value_enum, default_value_t = KvTypeArg::F16)]
    pub kv_type: KvTypeArg,

    /// Where the forward runs: cpu, cuda, cuda:N, or auto (CUDA when this build has it and
    /// a device opens, else the CPU)
    #[arg(long = "device", value_name = "DEVICE", default_value_t = crate::device::DeviceArg::Auto)]
    pub device: crate::device::DeviceArg,

    /// Most prompt tokens of one request per forward pass (default: 256 on the CPU, 1024
    /// on CUDA). Larger chunks shorten the time to first token of long prompts on a GPU;
    /// smaller ones hold up the requests decoding beside a prefill for less time. The
    /// output is the same either way
    #[arg(long = "prefill-chunk", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub prefill_chunk: Option<u32>,
}

impl ModelArgs {
    /// `--threads` as a count.
    pub fn threads(&self) -> Option<usize> {
        self.threads.map(usize::from)
    }

    /// `--prefill-chunk` as a row count.
    pub fn prefill_chunk(&self) -> Option<usize> {
        self.prefill_chunk.map(|n| n as usize)
    }
}

/// `--kv-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvTypeArg {
    /// IEEE half precision (half the memory)
    F16,
    /// f32 (exact)
    F32,
}

impl From<KvTypeArg> for model::KvType {
    fn from(value: KvTypeArg) -> Self {
        match value {
            KvTypeArg::F16 => model::KvType::F16,
            KvTypeArg::F32 => model::KvType::F32,
        }
    }
}

/// How to choose each token.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy (always the most likely token), which makes output
    /// reproducible without a seed. Try 0.8 for varied text
    #[arg(long = "temp", value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,

    /// Keep only the K most likely tokens (0 = off)
    #[arg(long = "top-k", value_name = "K", default_value_t = 0)]
    pub top_k: usize,

    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability
    /// reaches P (1 = off)
    #[arg(long = "top-p", value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,

    /// Keep tokens at least P times as likely as the best one (0 = off)
    #[arg(long = "min-p", value_name = "P", default_value_t = 0.0)]
    pub min_p: f32,

    /// Repetition penalty over the last --repeat-last-n tokens, as llama.cpp (1 = off)
    #[arg(long = "repeat-penalty", value_name = "X", default_value_t = 1.0)]
    pub repeat_penalty: f32,

    /// Window of the repetition penalty in tokens (0 = off)
    #[arg(long = "repeat-last-n", value_name = "N", default_value_t = 64)]
    pub repeat_last_n: usize,

    /// OpenAI presence penalty: subtracted once from tokens already generated (0 = off)
    #[arg(
        long = "presence-penalty",
        value_name = "X",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,

    /// OpenAI frequency penalty: subtracted per occurrence in the generated text (0 = off)
    #[arg(
        long = "frequency-penalty",
        value_name = "X",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,

    /// Seed of the sampling noise (default: random, printed on stderr). With the same seed,
    /// model and flags, the output is the same on every run and every thread count
    #[arg(short = 's', long, value_name = "N")]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The seed: `--seed`, or a fresh random one.
    pub fn seed_or_random(&self) -> u64 {
        self.seed.unwrap_or_else(random_seed)
    }

    /// The sampling parameters with `seed`, validated.
    pub fn params(&self, seed: u64) -> anyhow::Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            logit_bias: Vec::new(),
        };
        params.validate()?;
        Ok(params)
    }
}

/// When to stop.
#[derive(Debug, Clone, Args)]
pub struct StopArgs {
    /// Most tokens to generate
    #[arg(
        short = 'n',
        long = "max-tokens",
        value_name = "N",
        default_value_t = 256
    )]
    pub max_tokens: usize,

    /// Stop when the output contains this text (not printed); repeatable
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,

    /// Keep generating past the end-of-text token (until -n or a --stop text)
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

/// A random seed from the standard library's per-process random hash keys, mixed with the
/// clock (no extra dependency; this is not for cryptography).
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    // Keep seeds within JSON's exact integer range so scripts can pass them back.
    h.finish() & ((1u64 << 53) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_seeds_differ_and_fit_json_integers() {
        let (a, b) = (random_seed(), random_seed());
        assert_ne!(a, b);
        assert!(a < (1 << 53) && b < (1 << 53));
    }
}
