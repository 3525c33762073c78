//! The speculation path of the step loop.
//!
//! Before planning, each speculating sequence in the decode phase asks its drafter for a
//! proposal ([`Loop::propose_drafts`], masked by a fork of its constraint: the speculative
//! mirror); the drafts become the sequence's `extra_rows`, and the loop's `rows_for` puts
//! the verify block `[t, d1..dk]` ([`Loop::verify_drafts`]) into the step's one batched
//! forward. Drafts the scheduler granted no rows for are dropped
//! ([`Loop::drop_ungranted_drafts`]). [`Loop::verify_at`] walks the rows with the verified
//! constraint through the same `choose_at` plain decoding uses (so events, stops and usage
//! are exactly plain decoding's), accepts while the target's choice equals the draft, and
//! rolls the KV back with `ForwardBackend::kv_truncate` to the committed length.

use super::{Exit, Logits, Loop, Seq};
use crate::api::{GenerateRequest, TokenMask};
use crate::scheduler::StepPlan;
use spec::{DraftContext, Drafter, DrafterKind, Mirror, PolicyConfig, SeqPolicy, SpecStats};

/// One sequence's speculation state.
pub(super) struct SeqSpec {
    pub(super) drafter: Box<dyn Drafter>,
    pub(super) policy: SeqPolicy,
    pub(super) cfg: PolicyConfig,
    pub(super) stats: SpecStats,
    /// This step's drafts (verified after the forward, then cleared).
    pub(super) drafts: Vec<u32>,
    /// Of the drafts, how many were grammar-forced.
    pub(super) forced: usize,
    /// The drafter kind of the non-forced drafts.
    pub(super) source: Option<DrafterKind>,
    /// Which drafter proposed which of the drafts (`(kind, run)` in order).
    pub(super) segments: Vec<(DrafterKind, usize)>,
    /// Drafting time of this step's proposal (costly drafters), µs.
    pub(super) cost_us: u64,
    /// The top1 − top2 margin of the logits that chose the last committed token.
    pub(super) margin: Option<f32>,
}

impl SeqSpec {
    /// The speculation state of a new sequence, when it speculates: the request's own
    /// drafter, else one built from the engine's drafter set when speculation is on
    /// (neither with `no_spec`). Takes the request's drafter.
    pub(super) fn for_request(lp: &Loop<'_>, req: &mut GenerateRequest) -> Option<SeqSpec> {
        let spec_cfg = &lp.cfg.spec;
        let drafter: Box<dyn Drafter> = match req.drafter.take() {
            Some(d) if !req.no_spec => d,
            None if !req.no_spec && spec_cfg.is_on() => Box::new(
                spec_cfg
                    .drafters
                    .build_for(Some(&lp.tok_arc), req.spec_partition),
            ),
            _ => return None,
        };
        Some(SeqSpec {
            drafter,
            policy: SeqPolicy::new(),
            cfg: req
                .spec_policy
                .clone()
                .unwrap_or_else(|| spec_cfg.policy.clone()),
            stats: SpecStats::default(),
            drafts: Vec::new(),
            forced: 0,
            source: None,
            segments: Vec::new(),
            cost_us: 0,
            margin: None,
        })
    }
}

impl Loop<'_> {
    /// The sequence's drafts this step when a grant of `rows` is its verify block
    /// `[t, d1..dk]` (the committed token's row plus every draft).
    pub(super) fn verify_drafts<'a>(s: &'a Seq<'_>, rows: usize) -> Option<&'a [u32]> {
        let sp = s.spec.as_ref()?;
        (!sp.drafts.is_empty() && s.computed + 1 == s.tokens.len() && rows == 1 + sp.drafts.len())
            .then_some(&sp.drafts[..])
    }

    /// Asks each speculating sequence in the decode phase for a proposal under its
    /// adaptive policy, masked by a fresh fork of its constraint (the speculative mirror;
    /// dropped afterwards, so the verified constraint never sees a draft).
    pub(super) fn propose_drafts(&mut self) {
        let n_vocab = self.limits.n_vocab;
        let context_len = self.limits.context_len;
        let eos = self.tok.eos_ids();
        for s in self.running.iter_mut() {
            let Some(sp) = s.spec.as_mut() else { continue };
            sp.drafts.clear();
            sp.forced = 0;
            sp.source = None;
            sp.segments.clear();
            sp.cost_us = 0;
            if s.slot.is_none() || s.computed + 1 != s.tokens.len() {
                continue;
            }
            // Room: up to k drafts commit k + 1 tokens; the last row stays in the context.
            let generated = s.tokens.len() - s.prompt_len;
            let by_max = s
                .max_tokens
                .map_or(usize::MAX, |m| m.saturating_sub(generated + 1));
            let by_ctx = context_len.saturating_sub(s.tokens.len() + 1);
            let room = by_max.min(by_ctx).min(sp.cfg.max_draft);
            let plan = sp.policy.plan(&sp.cfg, &self.cost, room, sp.margin);
            if room == 0 || (plan.max_draft == 0 && s.constraint.is_none()) {
                sp.stats.record_no_draft(plan.gate);
                self.metrics.spec.record_no_draft(plan.gate);
                continue;
            }
            let allow_costly = !sp.cfg.cost_model || self.cost.costly_pays(room);
            self.metrics.spec_draft_model_on = allow_costly;
            let mut fork = s.constraint.as_ref().map(|c| c.fork());
            let mut mirror = match fork.as_mut() {
                Some(f) => Mirror::with_scratch(f.as_mut(), &mut self.draft_mask),
                None => Mirror::unconstrained(),
            };
            let ctx = DraftContext {
                tokens: &s.tokens,
                prompt_len: s.prompt_len,
                params: &s.params,
                never: &self.never,
                max_tokens: room,
                max_draft: plan.max_draft.min(room),
                kind_caps: &plan.caps,
                allow_costly,
                bars: &plan.bars,
                eos_ends: !s.ignore_eos,
                eos,
                target: s.slot.and_then(|slot| self.backend.target_rows(slot)),
            };
            let mut prop = sp.drafter.propose(&ctx, &mut mirror);
            // Never more than the room, never a token outside the logits.
            prop.tokens.truncate(room);
            if let Some(bad) = prop.tokens.iter().position(|&t| t as usize >= n_vocab) {
                prop.tokens.truncate(bad);
            }
            if let Some(kind) = prop.source {
                self.cost.observe_draft(
                    kind,
                    prop.tokens.len() - prop.forced.min(prop.tokens.len()),
                    prop.cost_us,
                );
            }
            if prop.tokens.is_empty() {
                sp.stats.record_no_draft(plan.gate);
                self.metrics.spec.record_no_draft(plan.gate);
                continue;
            }
            sp.forced = prop.forced.min(prop.tokens.len());
            sp.source = prop.source;
            sp.segments = prop.segments();
            sp.cost_us = prop.cost_us;
            sp.drafts = prop.tokens;
        }
    }

    /// Verifies sequence `at`'s block `[t, d1..dk]` from its `k + 1` logit rows: walks the
    /// rows with the plain choice ([`Loop::choose_at`], which emits each token exactly as
    /// plain decoding does and checks every stop), accepting while the target's choice
    /// equals the draft; the first mismatch is the target's own (bonus) token. Then the KV
    /// is truncated to the committed length and the drafter told what was committed.
    pub(super) fn verify_at(&mut self, at: usize, logits: Logits<'_>) -> Option<Exit> {
        let n = self.limits.n_vocab;
        let (drafts, forced, source, segments, cost_us) = {
            let s = &mut self.running[at];
            let sp = s.spec.as_mut()?;
            (
                std::mem::take(&mut sp.drafts),
                sp.forced,
                sp.source,
                std::mem::take(&mut sp.segments),
                sp.cost_us,
            )
        };
        let k = drafts.len();
        let start = self.running[at].tokens.len();
        // Row 0 is the committed token `t`: its KV is now written.
        self.running[at].computed = start;
        self.publish_blocks(at);
        let mut accepted = 0usize;
        let mut exit = None;
        for i in 0..=k {
            let row = logits.row(i, n);
            let before = self.running[at].tokens.len();
            let e = self.choose_at(at, row);
            let s = &self.running[at];
            let chose = (s.tokens.len() > before).then(|| s.tokens[before]);
            let matched = chose.is_some() && drafts.get(i).copied() == chose;
            if matched {
                accepted += 1;
            }
            if e.is_some() {
                exit = e;
                break;
            }
            if !matched {
                break;
            }
        }
        // Statistics: the cycle, the policy, the cost model, time saved.
        let free = k - forced.min(k);
        let free_accepted = accepted.saturating_sub(forced.min(k));
        // Against the measured verify-cost curve: the accepted tokens' plain steps minus
        // the extra time of the k draft rows and the drafting.
        let t1 = self.cost.step_ms(1);
        let extra = self.cost.step_ms(1 + k) - t1;
        let saved_ms = accepted as f64 * t1 - extra - cost_us as f64 / 1e3;
        let saved_us = (saved_ms * 1e3).round() as i64;
        if let Some(kind) = source {
            self.cost.observe_cycle(kind, free, free_accepted);
        }
        self.metrics
            .spec
            .record_cycle(k, forced.min(k), accepted, saved_us);
        self.metrics.spec.record_segments(&segments, k, accepted);
        let s = &mut self.running[at];
        if let Some(sp) = s.spec.as_mut() {
            sp.stats.record_cycle(k, forced.min(k), accepted, saved_us);
            sp.stats.record_segments(&segments, k, accepted);
            sp.policy.record(source, free, free_accepted);
        }
        if exit.is_some() {
            return exit;
        }
        // Committed: t, the accepted drafts and the bonus; KV holds t and the accepted.
        let committed = start + accepted;
        s.computed = committed;
        if let Some(slot) = s.slot {
            self.backend.kv_truncate(slot, committed);
        }
        if let Some(sp) = s.spec.as_mut() {
            sp.drafter.observe(&s.tokens);
        }
        self.publish_blocks(at);
        None
    }

    /// Drops the drafts the scheduler did not grant rows for (a scheduler skip).
    pub(super) fn drop_ungranted_drafts(&mut self, plan: &StepPlan) {
        for s in self.running.iter_mut() {
            let Some(sp) = s.spec.as_mut() else { continue };
            if sp.drafts.is_empty() {
                continue;
            }
            let granted = plan
                .grants
                .iter()
                .find(|g| g.id == s.id)
                .map_or(0, |g| g.rows.saturating_sub(1));
            if granted < sp.drafts.len() {
                sp.drafts.truncate(granted);
                sp.forced = sp.forced.min(granted);
                sp.stats.sched_skips += 1;
                self.metrics.spec.sched_skips += 1;
            }
        }
    }
}

/// The top1 − top2 margin of `logits` over the tokens that may be chosen (`allowed`, or
/// all, minus `never`); 0 when fewer than two may be chosen.
pub(super) fn top2_margin(logits: &[f32], allowed: Option<&TokenMask>, never: &TokenMask) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (t, &v) in logits.iter().enumerate() {
        let t = t as u32;
        if never.get(t) || allowed.is_some_and(|m| !m.get(t)) {
            continue;
        }
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    if b.is_finite() { a - b } else { 0.0 }
}
