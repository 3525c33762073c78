//! The drafter interface: what a drafter sees ([`DraftContext`]), the grammar mirror it
//! masks with ([`Mirror`] over a fork of the request's [`TokenConstraint`]), and what it returns ([`DraftProposal`]).

use sampling::{Choice, ChoiceContext, Sampler, SamplingParams, TokenConstraint, TokenMask};

/// Which drafter produced a token (counters and the cost model are kept per kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DrafterKind {
    /// Grammar fast-forward: tokens the constraint forces.
    FastForward,
    /// n-gram / prompt lookup over prompt + output.
    Ngram,
    /// A smaller model with the same tokenizer.
    DraftModel,
    /// Test drafter replaying a known output.
    Oracle,
    /// Test drafter that is always wrong.
    Adversary,
    /// The DeepSeek V4 DSpark block drafter (a support file's stage chain over the target's
    /// captured rows).
    Dspark,
    /// The cross-request suffix index (earlier requests' sequences and the sequence
    /// itself).
    Suffix,
    /// JSON values from the prompt text by the record layout learned per key.
    PromptText,
}

impl DrafterKind {
    /// Every kind, in a fixed order (index = [`DrafterKind::index`]).
    pub const ALL: [DrafterKind; 8] = [
        DrafterKind::FastForward,
        DrafterKind::Ngram,
        DrafterKind::DraftModel,
        DrafterKind::Oracle,
        DrafterKind::Adversary,
        DrafterKind::Dspark,
        DrafterKind::Suffix,
        DrafterKind::PromptText,
    ];

    /// Number of kinds (the length of per-kind tables).
    pub const COUNT: usize = DrafterKind::ALL.len();

    /// A stable index into per-kind tables.
    pub fn index(self) -> usize {
        match self {
            DrafterKind::FastForward => 0,
            DrafterKind::Ngram => 1,
            DrafterKind::DraftModel => 2,
            DrafterKind::Oracle => 3,
            DrafterKind::Adversary => 4,
            DrafterKind::Dspark => 5,
            DrafterKind::Suffix => 6,
            DrafterKind::PromptText => 7,
        }
    }

    /// A short lowercase name (`fast-forward`, `ngram`, `draft-model`, `oracle`,
    /// `adversary`, `dspark`, `suffix`, `prompt-text`).
    pub fn name(self) -> &'static str {
        match self {
            DrafterKind::FastForward => "fast-forward",
            DrafterKind::Ngram => "ngram",
            DrafterKind::DraftModel => "draft-model",
            DrafterKind::Oracle => "oracle",
            DrafterKind::Adversary => "adversary",
            DrafterKind::Dspark => "dspark",
            DrafterKind::Suffix => "suffix",
            DrafterKind::PromptText => "prompt-text",
        }
    }

    /// Whether drafting with this kind costs real compute (the cost model charges it).
    pub fn is_costly(self) -> bool {
        matches!(self, DrafterKind::DraftModel | DrafterKind::Dspark)
    }
}

pub use model::TargetRows;

/// What a drafter knows when it proposes: the committed tokens of one sequence and how the
/// target chooses.
#[derive(Clone, Copy)]
pub struct DraftContext<'a> {
    /// Committed tokens: the prompt followed by the generated output. The last one is the
    /// token `t` whose forward rides in the verify block as row 0; drafts follow it.
    pub tokens: &'a [u32],
    /// Prompt tokens at the front of `tokens`.
    pub prompt_len: usize,
    /// The request's sampling parameters (the seed keys the coupled noise).
    pub params: &'a SamplingParams,
    /// Tokens that are never sampled (padding, unused entries).
    pub never: &'a TokenMask,
    /// The most tokens to propose in all (forced ones included): the room left before
    /// `max_tokens` and the context end, capped by the configured maximum.
    pub max_tokens: usize,
    /// The most *non-forced* tokens to propose (the adaptive policy's cap, at most
    /// `max_tokens`; 0 = only grammar-forced tokens).
    pub max_draft: usize,
    /// Per-kind caps on non-forced drafts (index = [`DrafterKind::index`]): the policy's
    /// draft length for each drafter's own measured acceptance (0 = that drafter is
    /// withheld this step). Empty = only `max_draft` applies. The chain honours them.
    pub kind_caps: &'a [usize],
    /// Whether drafters that cost real compute (the draft model) may run (the cost model
    /// turns them off when they do not pay).
    pub allow_costly: bool,
    /// Per-position confidence bars: draft position `j` (0-based) needs a confidence of
    /// at least `bars[min(j, len - 1)]`; empty = no bar. Only drafters that have a
    /// confidence (the draft model: its choice's probability; DSpark: its confidence head)
    /// use it.
    pub bars: &'a [f32],
    /// Whether an end-of-generation token ends the output (false with `ignore_eos`).
    pub eos_ends: bool,
    /// End-of-generation ids (drafting stops after proposing one when `eos_ends`).
    pub eos: &'a [u32],
    /// The target's captured rows of this sequence, when the backend captures them (a
    /// DSpark drafter is attached); `None` otherwise.
    pub target: Option<&'a dyn TargetRows>,
}

impl std::fmt::Debug for DraftContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftContext")
            .field("tokens", &self.tokens.len())
            .field("prompt_len", &self.prompt_len)
            .field("max_tokens", &self.max_tokens)
            .field("max_draft", &self.max_draft)
            .field("kind_caps", &self.kind_caps)
            .field("allow_costly", &self.allow_costly)
            .field("bars", &self.bars)
            .field("target_rows", &self.target.map(|t| t.len()))
            .finish()
    }
}

impl DraftContext<'_> {
    /// Absolute position of the first draft token (`tokens.len()`).
    pub fn next_position(&self) -> usize {
        self.tokens.len()
    }

    /// The confidence bar of draft position `j`.
    pub fn bar(&self, j: usize) -> f32 {
        match self.bars.len() {
            0 => 0.0,
            n => self.bars[j.min(n - 1)],
        }
    }

    /// The cap on `kind`'s non-forced drafts ([`DraftContext::kind_caps`]; `max_draft`
    /// when there are no per-kind caps).
    pub fn cap_of(&self, kind: DrafterKind) -> usize {
        if self.kind_caps.is_empty() {
            self.max_draft
        } else {
            self.kind_caps
                .get(kind.index())
                .copied()
                .unwrap_or(0)
                .min(self.max_draft)
        }
    }

    /// Whether `token` ends the output (drafting past it is pointless).
    pub fn ends(&self, token: u32) -> bool {
        self.eos_ends && self.eos.contains(&token)
    }

    /// The coupled draft choice (ARCHITECTURE.md, `crates/spec`: drafts "coupled to the
    /// target through the same sampling noise"): the token the target's sampling rule, with
    /// the request's parameters and seed, picks from a drafter's `logits` for absolute
    /// `position`, after the output `generated` (the committed output and the drafts before
    /// this one), among `allowed` (the grammar mirror's mask there, `None` when free). Where
    /// the drafter's logits equal the target's, the draft is the target's choice. The draft
    /// model and DSpark choose every draft through it; `None` when the sampler refuses.
    pub fn coupled_choice(
        &self,
        sampler: &mut Sampler,
        logits: &[f32],
        generated: &[u32],
        position: usize,
        allowed: Option<&TokenMask>,
    ) -> Option<Choice> {
        let cctx = ChoiceContext {
            prompt_tokens: &self.tokens[..self.prompt_len.min(self.tokens.len())],
            generated_tokens: generated,
            position: position as u64,
        };
        sampler
            .choose(logits, &cctx, self.params, allowed, self.never)
            .ok()
    }
}

/// A drafter's proposal: tokens to verify after the last committed token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftProposal {
    /// Draft tokens `d1..dk` in order.
    pub tokens: Vec<u32>,
    /// How many of the tokens came from grammar fast-forward (forced by the grammar).
    pub forced: usize,
    /// Which drafter proposed the non-forced tokens (`None` when there are none; the
    /// first one when several did).
    pub source: Option<DrafterKind>,
    /// Which drafter proposed each run of `tokens`, in order: `(kind, run length)`,
    /// grammar-forced runs as [`DrafterKind::FastForward`]. Empty = not itemised: see
    /// [`DraftProposal::segments`].
    pub runs: Vec<(DrafterKind, usize)>,
    /// Wall time the proposal took, in microseconds (the cost model charges costly kinds).
    pub cost_us: u64,
}

impl DraftProposal {
    /// Number of draft tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Who proposed which tokens: [`DraftProposal::runs`] when itemised, else the forced
    /// tokens first, then the rest as `source`'s. The runs cover exactly `tokens`.
    pub fn segments(&self) -> Vec<(DrafterKind, usize)> {
        let n = self.tokens.len();
        if self.runs.iter().map(|r| r.1).sum::<usize>() == n && !self.runs.is_empty() {
            return self.runs.clone();
        }
        let forced = self.forced.min(n);
        let mut out = Vec::new();
        if forced > 0 {
            out.push((DrafterKind::FastForward, forced));
        }
        if n > forced {
            out.push((self.source.unwrap_or(DrafterKind::FastForward), n - forced));
        }
        out
    }

    /// Appends `n` tokens' attribution to `kind` to [`DraftProposal::runs`] (merged
    /// with the last run of the same kind).
    pub fn push_run(&mut self, kind: DrafterKind, n: usize) {
        if n == 0 {
            return;
        }
        match self.runs.last_mut() {
            Some(last) if last.0 == kind => last.1 += n,
            _ => self.runs.push((kind, n)),
        }
    }

    /// Whether nothing was proposed.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// The mirror a drafter masks its drafts with: the speculative grammar mirror when the
/// request is constrained, nothing otherwise. Once a position allows nothing, the mirror is
/// finished, or it fails, it is *stopped*: drafting ends there.
pub struct Mirror<'a> {
    inner: Option<&'a mut dyn TokenConstraint>,
    mask: MaskBuf<'a>,
    stopped: bool,
    advanced: usize,
}

/// The mirror's mask: its own, or a caller's buffer reused across proposals.
enum MaskBuf<'a> {
    Owned(TokenMask),
    Borrowed(&'a mut TokenMask),
}

impl MaskBuf<'_> {
    fn get_mut(&mut self) -> &mut TokenMask {
        match self {
            MaskBuf::Owned(m) => m,
            MaskBuf::Borrowed(m) => m,
        }
    }
}

impl std::fmt::Debug for Mirror<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("constrained", &self.inner.is_some())
            .field("stopped", &self.stopped)
            .field("advanced", &self.advanced)
            .finish()
    }
}

impl<'a> Mirror<'a> {
    /// No constraint: every token is allowed.
    pub fn unconstrained() -> Mirror<'a> {
        Mirror {
            inner: None,
            mask: MaskBuf::Owned(TokenMask::new(0)),
            stopped: false,
            advanced: 0,
        }
    }

    /// A mirror over the speculative fork `inner` (logit width `n_vocab`), with a mask of
    /// its own.
    pub fn new(inner: &'a mut dyn TokenConstraint, n_vocab: usize) -> Mirror<'a> {
        Mirror::with_mask(inner, MaskBuf::Owned(TokenMask::new(n_vocab)))
    }

    /// A mirror over the speculative fork `inner` that computes its masks into `mask` (a
    /// buffer the caller keeps between proposals, so drafting allocates no mask).
    pub fn with_scratch(inner: &'a mut dyn TokenConstraint, mask: &'a mut TokenMask) -> Mirror<'a> {
        Mirror::with_mask(inner, MaskBuf::Borrowed(mask))
    }

    fn with_mask(inner: &'a mut dyn TokenConstraint, mask: MaskBuf<'a>) -> Mirror<'a> {
        let stopped = inner.is_finished();
        Mirror {
            inner: Some(inner),
            mask,
            stopped,
            advanced: 0,
        }
    }

    /// Whether a grammar constrains the drafts here: false without a constraint and while
    /// the constraint leaves the output free ([`TokenConstraint::is_free`]: a lazy
    /// tool-call constraint before the envelope opens). Every drafted token is checked
    /// either way.
    pub fn is_constrained(&self) -> bool {
        self.inner.as_ref().is_some_and(|c| !c.is_free())
    }

    /// Whether drafting must stop here (finished, failed or all masked).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens advanced over so far.
    pub fn advanced(&self) -> usize {
        self.advanced
    }

    /// The allowed set at the current draft position: `Some(None)` when unconstrained,
    /// `Some(Some(mask))` under a grammar, `None` when drafting must stop (the mirror is
    /// finished or failed, or the mask allows nothing — never argmax an all-masked row).
    pub fn allowed(&mut self) -> Option<Option<&TokenMask>> {
        if self.stopped {
            return None;
        }
        let Some(inner) = self.inner.as_mut() else {
            return Some(None);
        };
        let mask = self.mask.get_mut();
        if inner.is_finished() || inner.compute_mask(mask).is_err() || mask.count() == 0 {
            self.stopped = true;
            return None;
        }
        Some(Some(&*self.mask.get_mut()))
    }

    /// Whether `token` may be drafted at the current position (false once stopped).
    pub fn accepts(&mut self, token: u32) -> bool {
        if self.stopped {
            return false;
        }
        match self.inner.as_mut() {
            None => true,
            Some(inner) => !inner.is_finished() && inner.accepts(token),
        }
    }

    /// Advances over `token` (which [`Mirror::accepts`] or the mask allowed); false (and
    /// stopped) when the mirror refuses it.
    pub fn advance(&mut self, token: u32) -> bool {
        if self.stopped {
            return false;
        }
        if let Some(inner) = self.inner.as_mut()
            && inner.consume(token).is_err()
        {
            self.stopped = true;
            return false;
        }
        self.advanced += 1;
        true
    }

    /// How many of `tokens`, in order from the current position, the mirror would accept
    /// (checked on a fork of the constraint: the mirror itself does not advance). All of
    /// them when unconstrained; none once stopped.
    pub fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        if self.stopped {
            return 0;
        }
        let Some(inner) = self.inner.as_ref() else {
            return tokens.len();
        };
        let mut fork = inner.fork();
        tokens
            .iter()
            .take_while(|&&t| !fork.is_finished() && fork.accepts(t) && fork.consume(t).is_ok())
            .count()
    }

    /// Checks and advances in one call: false (nothing changed, or stopped) when `token`
    /// is not allowed.
    pub fn try_push(&mut self, token: u32) -> bool {
        if !self.accepts(token) {
            return false;
        }
        self.advance(token)
    }

    /// The tokens the grammar forces from here (empty when unconstrained or stopped).
    pub fn forced(&mut self) -> Vec<u32> {
        if self.stopped {
            return Vec::new();
        }
        match self.inner.as_mut() {
            Some(inner) if !inner.is_finished() => inner.forced_tokens(),
            _ => Vec::new(),
        }
    }

    /// Whether the grammar is complete after the drafts so far.
    pub fn is_finished(&self) -> bool {
        self.inner.as_ref().is_some_and(|m| m.is_finished())
    }
}

/// A drafter: proposes tokens to verify after a sequence's last committed token. One
/// drafter instance serves one sequence (it may keep state such as its own KV).
///
/// The contract that keeps speculation exact: a drafter only *proposes*; the engine's
/// verifier decides every token with the target's own rule, so a wrong draft costs time,
/// never correctness.
pub trait Drafter: Send {
    /// Which drafter this is (for counters and the cost model).
    fn kind(&self) -> DrafterKind;

    /// Proposes at most `ctx.max_draft` tokens after `ctx.tokens`, each allowed by `mirror`
    /// (advance it over every proposed token; stop where it stops).
    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal;

    /// The committed tokens after a verify cycle (prompt + output). Drafters with state
    /// keep it in step and roll back whatever was drafted beyond it.
    fn observe(&mut self, committed: &[u32]) {
        let _ = committed;
    }

    /// The sequence finished with `committed` (prompt + output): drafters that learn
    /// across requests (the suffix index) record it.
    fn finish(&mut self, committed: &[u32]) {
        let _ = committed;
    }
}
