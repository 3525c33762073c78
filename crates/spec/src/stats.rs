//! Speculation counters, per request and aggregated.

use crate::drafter::DrafterKind;
use crate::policy::Gate;

/// One drafter kind's share of the verify cycles (see [`SpecStats::by_kind`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KindCounts {
    /// Verify cycles with at least one draft token of this kind.
    pub cycles: u64,
    /// Draft tokens of this kind verified.
    pub drafted: u64,
    /// Of those, accepted.
    pub accepted: u64,
}

/// Speculation counters of one request (in `Usage`) or of the whole engine (in its
/// metrics). All plain integers, so they add up exactly.
///
/// Definitions:
/// - a **cycle** is a step in which the sequence verified at least one draft row;
///   **full** / **partial** / **miss** cycles accepted all / some / none of their drafts;
/// - **no-draft** steps are decode steps with speculation on where nothing was proposed,
///   split by why: the policy's gates (**room**: too close to `max_tokens` or the context
///   end; **back-off** after unproductive cycles; the **margin** gate; the **cost** model
///   expected no gain) or **nothing**: drafting was allowed but no drafter had a
///   proposal (no match, the grammar refused it);
/// - **scheduler skips** are steps in which proposed drafts were dropped because the
///   step's row budget or the KV pool did not grant their rows;
/// - **drafted** / **accepted** count draft tokens (grammar-forced ones included, also
///   counted in **forced**); a draft token is accepted when the target chose it;
/// - **by kind**: the same per drafter kind, each token counted for the drafter that
///   proposed it (forced tokens as fast-forward's); accepted tokens over the output tokens
///   is that drafter's *coverage*;
/// - **time saved** (µs, may be negative) = Σ over cycles of `accepted × t1 − (k × r +
///   draft)`, where `t1` is the measured time of a one-row decode step, `r` the measured
///   marginal time of one more row in a step (both from the engine's linear fit of step
///   time against rows), `k` the draft rows verified and `draft` the measured drafting
///   time: the plain steps the accepted tokens would have taken, minus what verifying and
///   drafting them cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SpecStats {
    /// Verify cycles (steps with at least one draft row).
    pub cycles: u64,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Cycles that accepted every draft.
    pub full: u64,
    /// Cycles that accepted some but not all drafts.
    pub partial: u64,
    /// Cycles that accepted no draft.
    pub miss: u64,
    /// Decode steps with speculation on and nothing proposed (the sum of the `no_draft_*`
    /// reasons).
    pub no_draft: u64,
    /// No-draft steps for lack of room (`max_tokens` or the context end).
    pub no_draft_room: u64,
    /// No-draft steps paused by the back-off after unproductive cycles.
    pub no_draft_backoff: u64,
    /// No-draft steps withheld by the margin gate.
    pub no_draft_margin: u64,
    /// No-draft steps withheld by the cost model (no kind expected to pay).
    pub no_draft_cost: u64,
    /// No-draft steps where drafting was allowed and no drafter proposed anything.
    pub no_draft_nothing: u64,
    /// Steps whose drafts were cut by the scheduler (row budget or KV).
    pub sched_skips: u64,
    /// Draft tokens that were grammar-forced (fast-forward).
    pub forced: u64,
    /// Estimated wall time saved against plain decoding, in microseconds (see above).
    pub time_saved_us: i64,
    /// Per drafter kind (index = [`DrafterKind::index`]): cycles, drafted and accepted
    /// tokens of that kind.
    pub by_kind: [KindCounts; DrafterKind::COUNT],
}

impl SpecStats {
    /// Accepted / drafted (0 when nothing was drafted).
    pub fn accept_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Mean accepted drafts per cycle (0 without cycles).
    pub fn mean_accepted(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.accepted as f64 / self.cycles as f64
        }
    }

    /// The counts of drafter `kind`.
    pub fn kind(&self, kind: DrafterKind) -> KindCounts {
        self.by_kind[kind.index()]
    }

    /// Adds `other`'s counters to these.
    pub fn add(&mut self, other: &SpecStats) {
        self.cycles += other.cycles;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.full += other.full;
        self.partial += other.partial;
        self.miss += other.miss;
        self.no_draft += other.no_draft;
        self.no_draft_room += other.no_draft_room;
        self.no_draft_backoff += other.no_draft_backoff;
        self.no_draft_margin += other.no_draft_margin;
        self.no_draft_cost += other.no_draft_cost;
        self.no_draft_nothing += other.no_draft_nothing;
        self.sched_skips += other.sched_skips;
        self.forced += other.forced;
        self.time_saved_us += other.time_saved_us;
        for (a, b) in self.by_kind.iter_mut().zip(other.by_kind.iter()) {
            a.cycles += b.cycles;
            a.drafted += b.drafted;
            a.accepted += b.accepted;
        }
    }

    /// Records a decode step without a draft: `gate` is the policy's reason when it
    /// withheld drafting, `None` when drafting was allowed and nothing was proposed.
    pub fn record_no_draft(&mut self, gate: Option<Gate>) {
        self.no_draft += 1;
        match gate {
            Some(Gate::Room) => self.no_draft_room += 1,
            Some(Gate::BackOff) => self.no_draft_backoff += 1,
            Some(Gate::Margin) => self.no_draft_margin += 1,
            Some(Gate::Cost) => self.no_draft_cost += 1,
            None => self.no_draft_nothing += 1,
        }
    }

    /// Records who proposed the `drafted` tokens of a cycle (`segments`: `(kind, run)` in
    /// order, as [`crate::DraftProposal::segments`]; runs past `drafted`, cut by the
    /// scheduler, are ignored) of which the first `accepted` were accepted.
    pub fn record_segments(
        &mut self,
        segments: &[(DrafterKind, usize)],
        drafted: usize,
        accepted: usize,
    ) {
        let mut at = 0usize;
        let mut seen = [false; DrafterKind::COUNT];
        for &(kind, run) in segments {
            let run = run.min(drafted.saturating_sub(at));
            if run == 0 {
                continue;
            }
            let c = &mut self.by_kind[kind.index()];
            if !seen[kind.index()] {
                seen[kind.index()] = true;
                c.cycles += 1;
            }
            c.drafted += run as u64;
            c.accepted += accepted.saturating_sub(at).min(run) as u64;
            at += run;
        }
    }

    /// Records one verify cycle of `drafted` rows (`forced` of them grammar-forced) of
    /// which `accepted` were accepted, saving `saved_us`.
    pub fn record_cycle(&mut self, drafted: usize, forced: usize, accepted: usize, saved_us: i64) {
        if drafted == 0 {
            return;
        }
        self.cycles += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.forced += forced as u64;
        if accepted == drafted {
            self.full += 1;
        } else if accepted == 0 {
            self.miss += 1;
        } else {
            self.partial += 1;
        }
        self.time_saved_us += saved_us;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_are_classified_full_partial_or_miss_and_rates_follow() {
        let mut s = SpecStats::default();
        s.record_cycle(4, 1, 4, 100);
        s.record_cycle(4, 0, 2, 10);
        s.record_cycle(3, 0, 0, -30);
        s.record_cycle(0, 0, 0, 5);
        assert_eq!((s.cycles, s.full, s.partial, s.miss), (3, 1, 1, 1));
        assert_eq!((s.drafted, s.accepted, s.forced), (11, 6, 1));
        assert_eq!(s.time_saved_us, 80);
        assert!((s.accept_rate() - 6.0 / 11.0).abs() < 1e-12);
        assert!((s.mean_accepted() - 2.0).abs() < 1e-12);
        let mut t = SpecStats::default();
        t.add(&s);
        t.add(&s);
        assert_eq!(t.drafted, 22);
    }

    #[test]
    fn accepted_tokens_are_credited_to_the_drafter_that_proposed_them() {
        let mut s = SpecStats::default();
        // Forced 2, suffix 3, forced 1, n-gram 2: the first 6 accepted.
        let segs = [
            (DrafterKind::FastForward, 2),
            (DrafterKind::Suffix, 3),
            (DrafterKind::FastForward, 1),
            (DrafterKind::Ngram, 2),
        ];
        s.record_segments(&segs, 8, 6);
        let ff = s.kind(DrafterKind::FastForward);
        assert_eq!((ff.cycles, ff.drafted, ff.accepted), (1, 3, 3));
        let sx = s.kind(DrafterKind::Suffix);
        assert_eq!((sx.cycles, sx.drafted, sx.accepted), (1, 3, 3));
        let ng = s.kind(DrafterKind::Ngram);
        assert_eq!((ng.cycles, ng.drafted, ng.accepted), (1, 2, 0));
        // The scheduler cut the block to 4 rows: the n-gram's run was never verified.
        let mut t = SpecStats::default();
        t.record_segments(&segs, 4, 4);
        assert_eq!(t.kind(DrafterKind::Ngram), KindCounts::default());
        assert_eq!(t.kind(DrafterKind::Suffix).drafted, 2);
    }

    #[test]
    fn no_draft_steps_are_split_by_reason() {
        let mut s = SpecStats::default();
        s.record_no_draft(Some(Gate::Cost));
        s.record_no_draft(Some(Gate::Cost));
        s.record_no_draft(Some(Gate::BackOff));
        s.record_no_draft(Some(Gate::Room));
        s.record_no_draft(Some(Gate::Margin));
        s.record_no_draft(None);
        assert_eq!(s.no_draft, 6);
        assert_eq!(
            (
                s.no_draft_cost,
                s.no_draft_backoff,
                s.no_draft_room,
                s.no_draft_margin,
                s.no_draft_nothing
            ),
            (2, 1, 1, 1, 1)
        );
        let mut t = SpecStats::default();
        t.add(&s);
        assert_eq!(t, s);
    }
}
