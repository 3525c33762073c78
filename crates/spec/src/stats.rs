//! Speculation counters, per request and aggregated.

use crate::drafter::DrafterKind;

/// Speculation counters of one request (in `Usage`) or of the whole engine (in its
/// metrics). All plain integers, so they add up exactly.
///
/// Definitions:
/// - a **cycle** is a step in which the sequence verified at least one draft row;
///   **full** / **partial** / **miss** cycles accepted all / some / none of their drafts;
/// - **no-draft** steps are decode steps with speculation on where nothing was proposed
///   (the policy paused or gated drafting, or no drafter had anything);
/// - **scheduler skips** are steps in which proposed drafts were dropped because the
///   step's row budget or the KV pool did not grant their rows;
/// - **drafted** / **accepted** count draft tokens (grammar-forced ones included, also
///   counted in **forced**); a draft token is accepted when the target chose it;
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
    /// Decode steps with speculation on and nothing proposed.
    pub no_draft: u64,
    /// Steps whose drafts were cut by the scheduler (row budget or KV).
    pub sched_skips: u64,
    /// Draft tokens that were grammar-forced (fast-forward).
    pub forced: u64,
    /// Estimated wall time saved against plain decoding, in microseconds (see above).
    pub time_saved_us: i64,
    /// Cycles whose non-forced drafts came from the cross-request suffix drafter.
    pub suffix_cycles: u64,
    /// Non-forced draft tokens of the suffix drafter verified.
    pub suffix_drafted: u64,
    /// Of those, accepted.
    pub suffix_accepted: u64,
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

    /// Adds `other`'s counters to these.
    pub fn add(&mut self, other: &SpecStats) {
        self.cycles += other.cycles;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.full += other.full;
        self.partial += other.partial;
        self.miss += other.miss;
        self.no_draft += other.no_draft;
        self.sched_skips += other.sched_skips;
        self.forced += other.forced;
        self.time_saved_us += other.time_saved_us;
        self.suffix_cycles += other.suffix_cycles;
        self.suffix_drafted += other.suffix_drafted;
        self.suffix_accepted += other.suffix_accepted;
    }

    /// Records the non-forced part of a cycle by `kind`: `accepted` of `drafted` (only the
    /// suffix drafter has counters of its own).
    pub fn record_source(&mut self, kind: Option<DrafterKind>, drafted: usize, accepted: usize) {
        if kind == Some(DrafterKind::Suffix) && drafted > 0 {
            self.suffix_cycles += 1;
            self.suffix_drafted += drafted as u64;
            self.suffix_accepted += accepted as u64;
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
}
