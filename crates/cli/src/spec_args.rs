//! Speculative decoding flags (`--spec`, `--draft`, `--ngram`, `--spec-*`) and the
//! counters printout of `--spec-stats`. Output is identical with speculation on or off.

use std::sync::Arc;

use anyhow::Context;
use clap::{Args, ValueEnum};
use engine::{SpecConfig, SpecMode, SpecStats};
use serde::Serialize;
use spec::{
    DraftModel, DrafterSet, DsparkCounters, DsparkDraft, NgramConfig, PolicyConfig, SuffixConfig,
    SuffixIndex,
};
use text::Tokenizer;

use crate::args::ModelArgs;
use crate::load;

/// `--spec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpecModeArg {
    /// Plain decoding
    Off,
    /// Draft with the chosen drafters (the free ones — cross-request suffix index, n-gram,
    /// grammar fast-forward — when none is named)
    Auto,
}

/// Speculative decoding flags.
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Speculative decoding: auto (the default: the free drafters — cross-request suffix
    /// index, n-gram, grammar fast-forward — plus --draft/--dspark when given, each turned
    /// off by the cost model where it does not pay) or off (plain decoding).
    /// The output is bit-identical either way
    #[arg(long = "spec", value_enum, value_name = "MODE")]
    pub spec: Option<SpecModeArg>,

    /// Draft model with the same tokenizer (a known name or a .gguf path), e.g.
    /// qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; runs on the target's --device; turned off
    /// by the cost model when it does not pay
    #[arg(long = "draft", value_name = "MODEL")]
    pub draft: Option<String>,

    /// DSpark block drafter for a DeepSeek V4 model: a support GGUF (ds4's
    /// `deepseek4.dspark.*` or the forks' `dspark.*` metadata, `mtp.*` stage tensors); the
    /// target's rows at its layers are captured while it runs (CPU only, as V4 is)
    #[arg(long = "dspark", value_name = "FILE")]
    pub dspark: Option<String>,

    /// n-gram / prompt-lookup drafting with keys of up to N tokens (default 3)
    #[arg(long = "ngram", value_name = "N", num_args = 0..=1, default_missing_value = "3",
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub ngram: Option<u16>,

    /// Most draft tokens per verify cycle
    #[arg(long = "spec-max-draft", value_name = "K", default_value_t = 12,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub max_draft: u16,

    /// Per-position confidence bars for drafters with a confidence (the draft model, DSpark)
    #[arg(
        long = "spec-confidence-grid",
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "0.55,0.6,0.65"
    )]
    pub confidence_grid: Vec<f32>,

    /// Do not draft when the target's top1 - top2 logit margin for the last token is
    /// below X (0 = off)
    #[arg(long = "spec-margin", value_name = "X", default_value_t = 0.0)]
    pub margin: f32,

    /// Tokens the cross-request suffix index keeps (earlier requests' prompts and outputs,
    /// oldest evicted first; 0 = no suffix drafter)
    #[arg(
        long = "spec-suffix-tokens",
        value_name = "N",
        default_value_t = 262_144
    )]
    pub suffix_tokens: usize,

    /// Print the speculation counters (stderr; in --output json as a "spec" object)
    #[arg(long = "spec-stats")]
    pub stats: bool,
}

impl SpecArgs {
    /// Whether speculation is on: always, unless `--spec off`.
    pub fn enabled(&self) -> bool {
        self.spec != Some(SpecModeArg::Off)
    }

    /// The engine's speculation settings for a target with tokenizer `tok` and logit width
    /// `n_vocab`; loads and checks the draft model on the target's device (`model` gives
    /// the device, threads, context, KV type). `dspark` is the block drafter
    /// [`crate::device::backend`] loaded for `--dspark` (required when it was given).
    pub fn engine_spec(
        &self,
        tok: &Tokenizer,
        n_vocab: usize,
        model: &ModelArgs,
        kv_tokens: usize,
        dspark: Option<Arc<DsparkDraft>>,
    ) -> anyhow::Result<SpecConfig> {
        if !self.enabled() {
            return Ok(SpecConfig::default());
        }
        if let (Some(path), None) = (&self.dspark, &dspark) {
            anyhow::bail!("--dspark {path}: the support file was not loaded for this model");
        }
        for &b in &self.confidence_grid {
            anyhow::ensure!(
                (0.0..=1.0).contains(&b),
                "--spec-confidence-grid values must be in 0..=1, got {b}"
            );
        }
        anyhow::ensure!(
            self.margin.is_finite() && self.margin >= 0.0,
            "--spec-margin must be >= 0"
        );
        let draft_model = match &self.draft {
            None => None,
            Some(name) => {
                let path = load::resolve_model_path(name)?;
                let display = load::display_name(name, &path);
                let gguf = runtime::load::open_gguf(&path)?;
                let dtok = runtime::load::load_tokenizer(&gguf)?;
                let dargs = ModelArgs {
                    model: name.clone(),
                    ..model.clone()
                };
                // On the target's device (`--device`), checked against that device's
                // memory like the target: a draft on the CPU beside a GPU target would
                // cost more per token than the target itself.
                let loaded = crate::device::backend(&gguf, &dargs, &display, None, &|_| kv_tokens)
                    .with_context(|| format!("loading the draft model {display}"))?;
                let on = if loaded.device_name.starts_with("cuda") {
                    loaded.device_name.clone()
                } else {
                    format!("the CPU ({} kernels)", loaded.device_name)
                };
                eprintln!("draft model {display} on {on}");
                Some(DraftModel::new(
                    display,
                    loaded.backend,
                    &dtok,
                    tok,
                    n_vocab,
                    kv_tokens,
                )?)
            }
        };
        let ngram = match self.ngram {
            Some(n) => Some(NgramConfig {
                max_n: usize::from(n),
                ..NgramConfig::default()
            }),
            // No drafter named (the default): the free drafters.
            None if draft_model.is_none() && dspark.is_none() => Some(NgramConfig::default()),
            None => None,
        };
        let suffix = (self.suffix_tokens > 0).then(|| {
            Arc::new(SuffixIndex::new(SuffixConfig {
                budget_tokens: self.suffix_tokens,
                ..SuffixConfig::default()
            }))
        });
        Ok(SpecConfig {
            mode: SpecMode::Auto,
            drafters: DrafterSet {
                fast_forward: true,
                ngram,
                draft_model,
                dspark,
                suffix,
                prompt_text: true,
            },
            policy: PolicyConfig {
                max_draft: usize::from(self.max_draft),
                confidence_grid: self.confidence_grid.clone(),
                margin_bar: self.margin,
                ..PolicyConfig::default()
            },
        })
    }
}

/// The free drafters (a fresh cross-request suffix index, n-gram with keys up to 3 tokens,
/// grammar fast-forward) under the default adaptive policy: what `--spec auto` alone gives.
pub fn free_spec() -> SpecConfig {
    SpecConfig::auto(DrafterSet::free_with_suffix(
        NgramConfig::default().max_n,
        SuffixConfig::default(),
    ))
}

/// The `dspark` object of `--output json` with `--dspark --spec-stats`: the DSpark
/// drafter's own counters.
#[derive(Debug, Clone, Serialize)]
pub struct DsparkReport {
    blocks: u64,
    proposals: u64,
    probes: u64,
    proposed: u64,
    verified: u64,
    drafted: u64,
    accepted: u64,
    rejected: u64,
    full: u64,
    partial: u64,
    miss: u64,
    confidence_stops: u64,
    mask_stops: u64,
}

impl DsparkReport {
    /// The report of `c`.
    pub fn of(c: &DsparkCounters) -> DsparkReport {
        DsparkReport {
            blocks: c.blocks,
            proposals: c.proposals,
            probes: c.probes,
            proposed: c.proposed,
            verified: c.verified,
            drafted: c.drafted,
            accepted: c.accepted,
            rejected: c.rejected(),
            full: c.full,
            partial: c.partial,
            miss: c.miss,
            confidence_stops: c.confidence_stops,
            mask_stops: c.mask_stops,
        }
    }

    /// One line for stderr.
    pub fn line(&self) -> String {
        format!(
            "dspark: {} blocks, {} proposals ({} one-slot probes), {} tokens proposed; \
             verified {} tokens: accepted {}, rejected {}; full/partial/miss {}/{}/{}; \
             stopped by confidence {}, by the grammar {}",
            self.blocks,
            self.proposals,
            self.probes,
            self.proposed,
            self.drafted,
            self.accepted,
            self.rejected,
            self.full,
            self.partial,
            self.miss,
            self.confidence_stops,
            self.mask_stops
        )
    }
}

/// The `spec` object of `--output json` (and the fields `--spec-stats` prints).
#[derive(Debug, Clone, Serialize)]
pub struct SpecReport {
    cycles: u64,
    drafted: u64,
    accepted: u64,
    accept_rate: f64,
    mean_accepted: f64,
    full: u64,
    partial: u64,
    miss: u64,
    no_draft: u64,
    /// No-draft steps by reason (room, backoff, margin, cost, nothing).
    no_draft_reasons: std::collections::BTreeMap<&'static str, u64>,
    sched_skips: u64,
    forced: u64,
    time_saved_ms: f64,
    /// Per drafter kind: cycles, drafted and accepted tokens.
    by_drafter: std::collections::BTreeMap<&'static str, KindReport>,
}

/// One drafter kind's counters in [`SpecReport`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct KindReport {
    cycles: u64,
    drafted: u64,
    accepted: u64,
}

impl SpecReport {
    /// The report of `s`.
    pub fn of(s: &SpecStats) -> SpecReport {
        SpecReport {
            cycles: s.cycles,
            drafted: s.drafted,
            accepted: s.accepted,
            accept_rate: s.accept_rate(),
            mean_accepted: s.mean_accepted(),
            full: s.full,
            partial: s.partial,
            miss: s.miss,
            no_draft: s.no_draft,
            no_draft_reasons: [
                ("room", s.no_draft_room),
                ("backoff", s.no_draft_backoff),
                ("margin", s.no_draft_margin),
                ("cost", s.no_draft_cost),
                ("nothing", s.no_draft_nothing),
            ]
            .into_iter()
            .collect(),
            sched_skips: s.sched_skips,
            forced: s.forced,
            time_saved_ms: s.time_saved_us as f64 / 1e3,
            by_drafter: spec::DrafterKind::ALL
                .into_iter()
                .filter(|&k| s.kind(k).cycles > 0)
                .map(|k| {
                    let c = s.kind(k);
                    (
                        k.name(),
                        KindReport {
                            cycles: c.cycles,
                            drafted: c.drafted,
                            accepted: c.accepted,
                        },
                    )
                })
                .collect(),
        }
    }

    /// One line for stderr.
    pub fn line(&self) -> String {
        format!(
            "spec: {} cycles, drafted {}, accepted {} ({:.1}%), mean accepted {:.2}, \
             full/partial/miss {}/{}/{}, no-draft {} ({}), scheduler skips {}, forced {}, \
             time saved {:.1} ms (est.); by drafter (accepted/drafted): {}",
            self.cycles,
            self.drafted,
            self.accepted,
            100.0 * self.accept_rate,
            self.mean_accepted,
            self.full,
            self.partial,
            self.miss,
            self.no_draft,
            self.no_draft_reasons
                .iter()
                .filter(|r| *r.1 > 0)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.sched_skips,
            self.forced,
            self.time_saved_ms,
            self.by_drafter
                .iter()
                .map(|(k, c)| format!("{k} {}/{}", c.accepted, c.drafted))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}
