//! Speculative decoding: drafters (draft model, n-gram, grammar fast-forward), the verifier
//! rule and adaptive drafting.
//!
//! A [`Drafter`] proposes tokens after a sequence's last committed token; every proposal
//! is masked by the *speculative mirror* of the request's grammar ([`Mirror`]), so drafts
//! never leave the grammar and drafting stops where the mask allows nothing. The engine
//! verifies a proposal `[t, d1..dk]` in one batched forward: the target's choice at row `i`
//! is the sampling rule on the grammar-masked logits at the row's absolute position (a pure
//! function of logits, prefix, seed and position), drafts are accepted while they equal
//! it, and the first mismatch yields the target's own token. The verifier never changes a
//! token, so output with speculation on is identical to plain decoding (G2).
//!
//! Drafters: [`SuffixDrafter`] (the cross-request [`SuffixIndex`] of earlier requests'
//! sequences, shared by an engine's sequences), [`PromptTextDrafter`] (JSON values from
//! the prompt text by the record layout learned per key), [`NgramDrafter`] (prompt lookup),
//! [`FastForward`] (grammar-forced tokens),
//! [`DraftModelDrafter`] (a smaller model with the same tokenizer, its own KV, coupled
//! noise), [`DsparkDrafter`] (DeepSeek V4's DSpark block drafter over the target's captured
//! rows, [`TargetRows`]), and for tests, behind the `testing` feature, `Oracle` (replays the plain output: 100%
//! acceptance) and `Adversary` (always wrong: 0%). [`Chain`] combines them per sequence;
//! [`DrafterSet`] builds a chain for each new sequence. The adaptive policy
//! ([`SeqPolicy`], [`CostModel`]) decides when and how far to draft; [`SpecStats`] counts.

mod chain;
mod draft_model;
mod drafter;
mod dspark;
mod ngram;
mod policy;
mod prompt_text;
mod stats;
mod suffix;
#[cfg(any(test, feature = "testing"))]
mod testing;
mod text_cursor;

pub use chain::{Chain, FastForward};
pub use draft_model::{DraftModel, DraftModelDrafter, check_same_tokenizer};
pub use drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror, TargetRows};
pub use dspark::{DsparkCounters, DsparkDraft, DsparkDrafter};
pub use ngram::{NgramConfig, NgramDrafter, find_match};
pub use policy::{
    Acceptance, CURVE_ROWS, CostModel, Gate, MIN_GAIN, Plan, PolicyConfig, SeqPolicy, best_k,
    best_k_by, expected_rate,
};
pub use prompt_text::PromptTextDrafter;
pub use stats::{KindCounts, SpecStats};
pub use suffix::{MAX_SCAN, RECENT, SuffixConfig, SuffixCounters, SuffixDrafter, SuffixIndex};
#[cfg(any(test, feature = "testing"))]
pub use testing::{Adversary, Oracle};

use std::sync::Arc;

/// Errors of the speculation setup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The draft model's tokenizer is not the target's.
    #[error("the draft model cannot draft for this target: {0}")]
    TokenizerMismatch(String),
    /// The draft model could not be set up (e.g. its KV pool).
    #[error("draft model: {0}")]
    DraftModel(String),
}

/// Which drafters a new sequence gets (the engine builds one [`Chain`] per sequence).
#[derive(Clone, Debug, Default)]
pub struct DrafterSet {
    /// Grammar fast-forward (forced tokens drafted for free).
    pub fast_forward: bool,
    /// n-gram / prompt lookup, tried before the draft model.
    pub ngram: Option<NgramConfig>,
    /// A draft model.
    pub draft_model: Option<Arc<DraftModel>>,
    /// The DSpark block drafter (DeepSeek V4 targets whose backend captures its rows).
    pub dspark: Option<Arc<DsparkDraft>>,
    /// The cross-request suffix index (one per engine), tried first.
    pub suffix: Option<Arc<SuffixIndex>>,
    /// Under a grammar, JSON values from the prompt text by the record layout
    /// ([`PromptTextDrafter`]; needs the tokenizer), tried before the suffix index.
    pub prompt_text: bool,
}

impl PartialEq for DrafterSet {
    fn eq(&self, other: &Self) -> bool {
        self.fast_forward == other.fast_forward
            && self.ngram == other.ngram
            && self.prompt_text == other.prompt_text
            && match (&self.draft_model, &other.draft_model) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
            && match (&self.dspark, &other.dspark) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
            && match (&self.suffix, &other.suffix) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl DrafterSet {
    /// Whether no drafter is configured.
    pub fn is_empty(&self) -> bool {
        !self.fast_forward
            && self.ngram.is_none()
            && self.draft_model.is_none()
            && self.dspark.is_none()
            && self.suffix.is_none()
            && !self.prompt_text
    }

    /// n-gram (keys up to `max_n`) and fast-forward: the free drafters.
    pub fn free(max_n: usize) -> DrafterSet {
        DrafterSet {
            fast_forward: true,
            ngram: Some(NgramConfig {
                max_n,
                ..NgramConfig::default()
            }),
            draft_model: None,
            dspark: None,
            suffix: None,
            prompt_text: false,
        }
    }

    /// The free drafters with a fresh cross-request index: prompt text, suffix (`cfg`),
    /// n-gram (keys up to `max_n`) and fast-forward.
    pub fn free_with_suffix(max_n: usize, cfg: SuffixConfig) -> DrafterSet {
        DrafterSet {
            suffix: Some(Arc::new(SuffixIndex::new(cfg))),
            prompt_text: true,
            ..DrafterSet::free(max_n)
        }
    }

    /// A chain for one new sequence: fast-forward, then the prompt text (with a
    /// tokenizer), the suffix index, n-gram, DSpark, the draft model.
    pub fn build(&self) -> Chain {
        self.build_with_text(None)
    }

    /// [`DrafterSet::build`] with the target's tokenizer, which lets the n-gram drafter
    /// follow the prompt in text space (values that tokenize differently in the prompt
    /// and in the output, as in extraction under a grammar).
    pub fn build_with_text(&self, text: Option<&Arc<text::Tokenizer>>) -> Chain {
        self.build_for(text, 0)
    }

    /// [`DrafterSet::build_with_text`] for a sequence of suffix-index `partition` (it
    /// reads and feeds only that partition).
    pub fn build_for(&self, text: Option<&Arc<text::Tokenizer>>, partition: u64) -> Chain {
        let mut drafters: Vec<Box<dyn Drafter>> = Vec::new();
        if self.prompt_text
            && let Some(tok) = text
        {
            drafters.push(Box::new(PromptTextDrafter::new(Arc::clone(tok))));
        }
        if let Some(ix) = &self.suffix {
            drafters.push(Box::new(ix.drafter(partition)));
        }
        if let Some(cfg) = self.ngram {
            drafters.push(Box::new(match text {
                Some(tok) => NgramDrafter::with_text(cfg, Arc::clone(tok)),
                None => NgramDrafter::new(cfg),
            }));
        }
        if let Some(ds) = &self.dspark {
            drafters.push(Box::new(ds.drafter()));
        }
        if let Some(dm) = &self.draft_model {
            drafters.push(Box::new(dm.drafter()));
        }
        Chain::new(self.fast_forward, drafters)
    }
}
