//! The DSpark block drafter (DeepSeek V4): a support file's stage chain run over the
//! target's captured hidden rows, the block `[anchor, noise…]` anchored at the last
//! committed token, then the sequential Markov head and the confidence projection choosing
//! the drafts one slot at a time — each masked by the grammar mirror, each chosen with the
//! target's sampling rule and its counter-based noise at the slot's absolute position
//! (coupling, as the draft model does), each kept only while the confidence head clears the
//! policy's bar for its position. The confident prefix is the proposal.
//!
//! **Fold.** The block rides in the verify forward of its anchor (DESIGN.md, "Fold"); for
//! DSpark the fold re-arms only after a full accept, as in ds4. Our reading, where the
//! sources say no more: the fold is *armed* at the start and after a cycle that accepted
//! every DSpark draft — the whole confident prefix (up to the block size) is proposed; a
//! cycle that rejected a DSpark draft *disarms* it — the next proposals fold only the
//! block's first slot (a one-token probe), until one is accepted whole, which re-arms the
//! fold. The verifier decides every token either way (G2 does not depend on it).
//!
//! **Context.** A block's anchor at position `a` attends the context rows of `a − W..a`.
//! The drafter keeps them per stage ([`model::DsparkState`]), computed from the target's
//! captured rows ([`crate::TargetRows`]) and cached by the committed tokens they came from
//! (a captured row is a pure function of the tokens up to its position), so each proposal
//! computes only the rows of the tokens committed since the last one.
//!
//! Under the chain, tokens drafted before DSpark in the same round (grammar-forced ones)
//! occupy the block's first slots: DSpark continues the same block after them, with the
//! Markov head conditioned on them; a block is computed once per anchor and reused.

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};
use model::{Dspark, DsparkBlock, DsparkScratch, DsparkState};
use sampling::Sampler;
use std::sync::{Arc, Mutex, MutexGuard};

/// Counters of one DSpark drafter (all sequences that use it), for tests, the CLI and
/// benchmarks. Verified proposals are those whose cycle the engine observed (a cycle that
/// ends the sequence is not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsparkCounters {
    /// Stage-chain forwards (one per anchor; reused by later calls of the same round).
    pub blocks: u64,
    /// Proposals handed to the verifier (calls that proposed at least one token).
    pub proposals: u64,
    /// Tokens proposed.
    pub proposed: u64,
    /// Verified proposals.
    pub verified: u64,
    /// Tokens of the verified proposals.
    pub drafted: u64,
    /// Of those, tokens the target accepted.
    pub accepted: u64,
    /// Verified proposals accepted whole.
    pub full: u64,
    /// Verified proposals accepted in part.
    pub partial: u64,
    /// Verified proposals whose first token was rejected.
    pub miss: u64,
    /// Proposals cut (or withheld) by the confidence bar at some slot.
    pub confidence_stops: u64,
    /// Proposals cut (or withheld) where the grammar mirror allowed nothing or refused the
    /// choice.
    pub mask_stops: u64,
    /// Proposals made with the fold disarmed (one slot).
    pub probes: u64,
    /// Calls that found no captured rows (or not the ones the window needs).
    pub no_context: u64,
}

impl DsparkCounters {
    /// Tokens of verified proposals the target rejected.
    pub fn rejected(&self) -> u64 {
        self.drafted - self.accepted
    }
}

/// A loaded DSpark drafter, shared by the per-sequence [`DsparkDrafter`]s.
pub struct DsparkDraft {
    model: Arc<Dspark>,
    scratch: Mutex<DsparkScratch>,
    counters: Mutex<DsparkCounters>,
    name: String,
}

impl std::fmt::Debug for DsparkDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DsparkDraft")
            .field("name", &self.name)
            .field("config", self.model.config())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DsparkDraft {
    /// Wraps a loaded [`Dspark`] (already checked against its target by
    /// [`Dspark::load`]).
    pub fn new(name: impl Into<String>, model: Arc<Dspark>) -> Arc<DsparkDraft> {
        let scratch = model.new_scratch();
        Arc::new(DsparkDraft {
            model,
            scratch: Mutex::new(scratch),
            counters: Mutex::new(DsparkCounters::default()),
            name: name.into(),
        })
    }

    /// The support file's display name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The drafter model.
    pub fn model(&self) -> &Arc<Dspark> {
        &self.model
    }

    /// The target layers whose rows the backend must capture.
    pub fn capture_layers(&self) -> &[usize] {
        &self.model.config().target_layers
    }

    /// The counters so far.
    pub fn counters(&self) -> DsparkCounters {
        *lock(&self.counters)
    }

    /// A drafter for one sequence.
    pub fn drafter(self: &Arc<Self>) -> DsparkDrafter {
        DsparkDrafter {
            d: Arc::clone(self),
            state: self.model.new_state(),
            ctx_tokens: Vec::new(),
            block: DsparkBlock::default(),
            block_len: None,
            fold_armed: true,
            pending: Vec::new(),
            round: None,
            sampler: Sampler::new(),
            embed: Vec::new(),
            logits: Vec::new(),
        }
    }

    fn count(&self, f: impl FnOnce(&mut DsparkCounters)) {
        f(&mut lock(&self.counters));
    }
}

/// One sequence's DSpark state: its context rows, the current block, the fold.
pub struct DsparkDrafter {
    d: Arc<DsparkDraft>,
    state: DsparkState,
    /// The committed tokens whose context rows `state` was built from (positions
    /// `0..ctx_tokens.len()`).
    ctx_tokens: Vec<u32>,
    block: DsparkBlock,
    /// The committed length `block` was computed for (its anchor is the last of them).
    block_len: Option<usize>,
    fold_armed: bool,
    /// This round's proposals not yet observed: (first position, tokens).
    pending: Vec<(usize, Vec<u32>)>,
    /// The current round (one verify cycle's proposal, possibly in several calls of the
    /// chain): the tokens where this drafter last stopped, and its drafts so far.
    round: Option<Round>,
    sampler: Sampler,
    embed: Vec<f32>,
    logits: Vec<f32>,
}

/// Where a drafter stopped in the current round.
#[derive(Clone, Debug)]
struct Round {
    /// The context it last proposed after, followed by that proposal.
    tokens: Vec<u32>,
    /// Its drafts in the round so far.
    drafted: usize,
}

impl std::fmt::Debug for DsparkDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DsparkDrafter")
            .field("context", &self.state.len())
            .field("fold_armed", &self.fold_armed)
            .finish()
    }
}

impl DsparkDrafter {
    /// Whether the fold is armed (the next proposal may fold the whole block).
    pub fn fold_armed(&self) -> bool {
        self.fold_armed
    }

    /// Brings the context up to the anchor at `anchor_pos` (rows `anchor_pos − W..anchor_pos`
    /// from the target) and computes the block unless it is current. False when the target
    /// rows are missing or a forward fails (nothing is proposed then).
    fn prepare(
        &mut self,
        tokens: &[u32],
        rows: &dyn crate::TargetRows,
        sc: &mut DsparkScratch,
    ) -> bool {
        let model = Arc::clone(&self.d.model);
        let anchor_pos = tokens.len() - 1;
        let common = self
            .ctx_tokens
            .iter()
            .zip(&tokens[..anchor_pos])
            .take_while(|(a, b)| a == b)
            .count()
            .min(self.state.len());
        if common < anchor_pos || self.state.len() != anchor_pos {
            // Rows from `common` on came from other tokens; rows before the window are not
            // needed (the state restarts at the window's start when `common` is below it).
            self.state.truncate(common);
            let lo = anchor_pos.saturating_sub(model.window());
            let from = common.max(lo);
            let ok = match rows.rows(from, anchor_pos) {
                Some(r) => model.extend_context(sc, &mut self.state, from, r).is_ok(),
                None => false,
            };
            self.ctx_tokens.clear();
            self.block_len = None;
            if !ok {
                self.state = model.new_state();
                return false;
            }
            self.ctx_tokens.extend_from_slice(&tokens[..anchor_pos]);
        }
        if self.block_len != Some(tokens.len()) || self.block.anchor != tokens[anchor_pos] {
            if model
                .block(sc, &self.state, tokens[anchor_pos], &mut self.block)
                .is_err()
            {
                self.block_len = None;
                return false;
            }
            self.block_len = Some(tokens.len());
            self.d.count(|c| c.blocks += 1);
        }
        true
    }
}

impl Drafter for DsparkDrafter {
    fn kind(&self) -> DrafterKind {
        DrafterKind::Dspark
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let Some(rows) = ctx.target else {
            return out;
        };
        let d = Arc::clone(&self.d);
        let model = Arc::clone(&d.model);
        let cfg = model.config();
        // The committed tokens: one more than the target has computed (the anchor's forward
        // rides in the verify block). Tokens after them were drafted earlier in this round.
        let committed = rows.len() + 1;
        if rows.width() != model.capture_width() || ctx.tokens.len() < committed {
            d.count(|c| c.no_context += 1);
            return out;
        }
        let first_slot = ctx.tokens.len() - committed;
        // The chain may call again in the same round, after tokens it appended (forced ones):
        // the block continues after them; where nothing was appended, this drafter already
        // chose to stop there.
        let same_round = self.round.as_ref().is_some_and(|r| {
            r.tokens.len() >= committed
                && ctx.tokens.len() >= r.tokens.len()
                && ctx.tokens[..r.tokens.len()] == r.tokens[..]
        });
        if !same_round {
            // Anything pending from an earlier round was never verified.
            self.pending.clear();
            self.round = None;
        }
        let done = self.round.as_ref().map_or(0, |r| r.drafted);
        if self
            .round
            .as_ref()
            .is_some_and(|r| r.tokens.len() == ctx.tokens.len())
        {
            return out;
        }
        let slots = cfg.block_size.saturating_sub(first_slot);
        // Disarmed: one slot per round (the probe).
        let cap = if self.fold_armed {
            slots
        } else {
            slots.min(1usize.saturating_sub(done))
        };
        let k = cap.min(ctx.max_draft).min(ctx.max_tokens);
        self.round = Some(Round {
            tokens: ctx.tokens.to_vec(),
            drafted: done,
        });
        if k == 0 {
            return out;
        }
        let mut sc = lock(&d.scratch);
        if !self.prepare(&ctx.tokens[..committed], rows, &mut sc) {
            d.count(|c| c.no_context += 1);
            return out;
        }
        let (dim, vocab) = (
            model.target().config().n_embd,
            model.target().config().n_vocab,
        );
        let mut generated: Vec<u32> = ctx.tokens[ctx.prompt_len.min(ctx.tokens.len())..].to_vec();
        let mut prev = ctx.tokens[ctx.tokens.len() - 1];
        let (mut conf_stop, mut mask_stop) = (false, false);
        for j in 0..k {
            let slot = first_slot + j;
            if model.markov_embed(prev, &mut self.embed).is_err() {
                break;
            }
            let hidden = &self.block.hidden[slot * dim..(slot + 1) * dim];
            match model.confidence(&mut sc, hidden, &self.embed) {
                // The bar of this draft's position among the round's drafts.
                Ok(c) if c >= ctx.bar(done + j) => {}
                _ => {
                    conf_stop = true;
                    break;
                }
            }
            let Some(allowed) = mirror.allowed() else {
                mask_stop = true;
                break;
            };
            let base = &self.block.logits[slot * vocab..(slot + 1) * vocab];
            if model
                .markov_logits(&mut sc, &self.embed, base, &mut self.logits)
                .is_err()
            {
                break;
            }
            // Slot `slot` sits at `committed − 1 + slot` and predicts the next position.
            let Some(choice) = ctx.coupled_choice(
                &mut self.sampler,
                &self.logits,
                &generated,
                committed + slot,
                allowed,
            ) else {
                break;
            };
            let t = choice.token;
            if !mirror.advance(t) {
                mask_stop = true;
                break;
            }
            out.tokens.push(t);
            generated.push(t);
            prev = t;
            if ctx.ends(t) {
                break;
            }
        }
        drop(sc);
        let probe = !self.fold_armed;
        let n = out.tokens.len() as u64;
        d.count(|c| {
            c.confidence_stops += u64::from(conf_stop);
            c.mask_stops += u64::from(mask_stop);
            if n > 0 {
                c.proposals += 1;
                c.proposed += n;
                c.probes += u64::from(probe);
            }
        });
        if let Some(r) = self.round.as_mut() {
            r.tokens.extend_from_slice(&out.tokens);
            r.drafted += out.tokens.len();
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::Dspark);
            // A proposal supersedes unverified ones at or after its start (drafts the
            // scheduler dropped, or a previous round's).
            let start = ctx.tokens.len();
            self.pending.retain(|(s, _)| *s < start);
            self.pending.push((start, out.tokens.clone()));
        }
        out
    }

    fn observe(&mut self, committed: &[u32]) {
        if self.pending.is_empty() {
            return;
        }
        let mut all_full = true;
        for (start, toks) in std::mem::take(&mut self.pending) {
            // Accepted: the drafts the committed tokens agree with, short of the last
            // committed token (the target's own choice after the accepted ones).
            let room = committed.len().saturating_sub(start + 1);
            let acc = toks
                .iter()
                .zip(committed.get(start..).unwrap_or(&[]))
                .take_while(|(a, b)| a == b)
                .count()
                .min(room);
            let full = acc == toks.len();
            all_full &= full;
            self.d.count(|c| {
                c.verified += 1;
                c.drafted += toks.len() as u64;
                c.accepted += acc as u64;
                if full {
                    c.full += 1;
                } else if acc == 0 {
                    c.miss += 1;
                } else {
                    c.partial += 1;
                }
            });
        }
        self.fold_armed = all_full;
        self.round = None;
    }
}
