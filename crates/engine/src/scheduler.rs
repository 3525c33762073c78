//! The scheduler: pure logic over plain numbers, no tensors, no KV objects.
//!
//! Each step it decides which sequences run and how many rows each contributes, given the
//! step's row budget and the KV blocks available. Decode rows (and, later, verify blocks:
//! a sequence's `extra_rows`) come first, oldest sequence first; prefill chunks share what
//! is left, so a long prompt never stalls the others by more than one chunk; new requests
//! are admitted FIFO while rows, sequence slots and blocks allow. When a running sequence
//! needs blocks the pool does not have, the newest running sequence is preempted (its KV
//! freed, recomputed later) instead of failing anyone.

/// Fixed scheduling limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedLimits {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Rows per step.
    pub step_token_budget: usize,
    /// Largest prefill chunk per sequence per step.
    pub prefill_chunk: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

/// A running sequence as the scheduler sees it. Listed in priority order (oldest
/// admission first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningSeq {
    /// The sequence id.
    pub id: u64,
    /// Positions whose KV is computed (`0..computed`).
    pub computed: usize,
    /// Committed tokens (prompt + generated). `total - computed` rows catch it up; the
    /// last of them yields the logits of the next choice.
    pub total: usize,
    /// Rows wanted beyond the catch-up (a speculative verify block's drafts; 0 in plain
    /// decoding). Granted only to sequences in the decode phase, and cut to the budget.
    pub extra_rows: usize,
    /// Blocks a pending copy-on-write will take at its next write (0 or 1).
    pub cow_blocks: usize,
}

/// A waiting request as the scheduler sees it, in queue order (preempted sequences first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitingSeq {
    /// The sequence id.
    pub id: u64,
    /// Committed tokens (prompt, plus generated ones of a preempted sequence).
    pub total: usize,
    /// Tokens the prefix cache would supply (`< total`).
    pub cached_tokens: usize,
    /// Blocks the prefix match shares (they exist already).
    pub cached_blocks: usize,
    /// Of those, blocks no sequence uses now: they count as evictable until this sequence
    /// takes them.
    pub cached_idle_blocks: usize,
    /// Blocks a copy-on-write of a shared, partly reused block will take (0 or 1).
    pub cow_blocks: usize,
}

/// KV blocks the step may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBudget {
    /// Free blocks.
    pub free_blocks: usize,
    /// Blocks held only by the prefix cache (freed by LRU eviction on demand).
    pub evictable_blocks: usize,
    /// Blocks in the pool.
    pub total_blocks: usize,
}

/// Rows granted to one sequence this step: positions `computed..computed + rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowGrant {
    /// The sequence id.
    pub id: u64,
    /// Rows (at least 1).
    pub rows: usize,
}

/// The decision of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Running sequences to preempt first (free their KV, back to the queue front), in
    /// this order.
    pub preempt: Vec<u64>,
    /// Waiting sequences to admit (from the queue front, in order).
    pub admit: Vec<u64>,
    /// Sequences whose KV can never fit the pool (even alone): they must end with an error.
    pub too_large: Vec<u64>,
    /// Rows per sequence for this step's forward (running ones first, then admitted ones).
    pub grants: Vec<RowGrant>,
}

impl StepPlan {
    /// Rows in the step.
    pub fn rows(&self) -> usize {
        self.grants.iter().map(|g| g.rows).sum()
    }
}

/// Blocks covering positions `0..len`.
fn blocks_for(len: usize, block_size: usize) -> usize {
    len.div_ceil(block_size.max(1))
}

/// New blocks a sequence with `computed` positions takes to hold `computed + rows`.
fn growth(computed: usize, rows: usize, block_size: usize) -> usize {
    blocks_for(computed + rows, block_size) - blocks_for(computed, block_size)
}

/// Plans one step. Pure: the same inputs give the same plan.
pub fn plan_step(
    limits: &SchedLimits,
    running: &[RunningSeq],
    waiting: &[WaitingSeq],
    kv: KvBudget,
) -> StepPlan {
    let bs = limits.block_size.max(1);
    let mut plan = StepPlan::default();
    let mut budget = limits.step_token_budget;
    let mut avail = kv.free_blocks + kv.evictable_blocks;
    // Running sequences still in the step (not preempted), priority order.
    let mut alive: Vec<RunningSeq> = running.to_vec();
    // Blocks each alive sequence holds (freed if it is preempted).
    let held = |s: &RunningSeq| blocks_for(s.computed, bs);

    // Decode phase first (one catch-up row, plus verify rows), then prefill chunks.
    for phase in [Phase::Decode, Phase::Prefill] {
        let mut i = 0;
        while i < alive.len() {
            let s = alive[i];
            let catch_up = s.total.saturating_sub(s.computed);
            let in_phase = match phase {
                Phase::Decode => catch_up <= 1,
                Phase::Prefill => catch_up > 1,
            };
            if !in_phase || catch_up == 0 || budget == 0 {
                i += 1;
                continue;
            }
            let want = match phase {
                Phase::Decode => 1 + s.extra_rows,
                Phase::Prefill => catch_up.min(limits.prefill_chunk.max(1)),
            }
            .min(budget);
            // The most rows that fit the blocks available (at least the one that matters).
            let fit =
                |rows: usize, avail: usize| growth(s.computed, rows, bs) + s.cow_blocks <= avail;
            let mut rows = want;
            while rows > 0 && !fit(rows, avail) {
                rows -= 1;
            }
            if rows > 0 {
                avail -= growth(s.computed, rows, bs) + s.cow_blocks;
                budget -= rows;
                plan.grants.push(RowGrant { id: s.id, rows });
                i += 1;
                continue;
            }
            // Not even one row fits: free blocks by preempting the newest sequence. If that
            // is this one, it waits; if it is alone and still cannot fit, it never will.
            let victim = alive.len() - 1;
            if victim == i {
                // Alone, everything not free is its own or evictable: it can never fit.
                if alive.len() == 1 {
                    plan.too_large.push(s.id);
                } else {
                    plan.preempt.push(s.id);
                }
                alive.remove(i);
                continue;
            }
            let v = alive.remove(victim);
            // Rows already granted to the victim are withdrawn (and their blocks returned).
            if let Some(at) = plan.grants.iter().position(|g| g.id == v.id) {
                let g = plan.grants.remove(at);
                budget += g.rows;
                avail += growth(v.computed, g.rows, bs) + v.cow_blocks;
            }
            avail += held(&v);
            plan.preempt.push(v.id);
            // Retry the same sequence with the freed blocks.
        }
    }

    // Admit waiting sequences, FIFO, while rows, slots and blocks allow. A sequence that
    // cannot start (even its first chunk does not fit) blocks the ones behind it, so a
    // large request is not starved by a stream of small ones.
    let mut n_running = alive.len();
    for w in waiting {
        if n_running >= limits.max_seqs || budget == 0 {
            break;
        }
        let start = w.cached_tokens;
        let catch_up = w.total.saturating_sub(start);
        if catch_up == 0 {
            break;
        }
        // A request that cannot fit the pool even alone (its whole prompt plus one token).
        let whole = blocks_for(w.total + 1, bs);
        if whole > kv.total_blocks {
            plan.too_large.push(w.id);
            continue;
        }
        // The cached idle blocks stop being evictable once shared.
        let avail_here = avail.saturating_sub(w.cached_idle_blocks);
        let rows = catch_up.min(limits.prefill_chunk.max(1)).min(budget);
        let need = |rows: usize| {
            blocks_for(start + rows, bs).saturating_sub(w.cached_blocks) + w.cow_blocks
        };
        let mut r = rows;
        while r > 0 && need(r) > avail_here {
            r -= 1;
        }
        if r == 0 {
            break;
        }
        avail = avail_here - need(r);
        budget -= r;
        plan.admit.push(w.id);
        plan.grants.push(RowGrant { id: w.id, rows: r });
        n_running += 1;
    }
    plan
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Decode,
    Prefill,
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: SchedLimits = SchedLimits {
        max_seqs: 4,
        step_token_budget: 64,
        prefill_chunk: 16,
        block_size: 4,
    };

    fn run(id: u64, computed: usize, total: usize) -> RunningSeq {
        RunningSeq {
            id,
            computed,
            total,
            extra_rows: 0,
            cow_blocks: 0,
        }
    }

    fn wait(id: u64, total: usize) -> WaitingSeq {
        WaitingSeq {
            id,
            total,
            cached_tokens: 0,
            cached_blocks: 0,
            cached_idle_blocks: 0,
            cow_blocks: 0,
        }
    }

    fn plenty() -> KvBudget {
        KvBudget {
            free_blocks: 1000,
            evictable_blocks: 0,
            total_blocks: 1000,
        }
    }

    fn grants(plan: &StepPlan) -> Vec<(u64, usize)> {
        plan.grants.iter().map(|g| (g.id, g.rows)).collect()
    }

    #[test]
    fn decode_rows_of_many_sequences_share_one_step() {
        let running = [run(1, 10, 11), run(2, 3, 4), run(3, 7, 8)];
        let plan = plan_step(&LIMITS, &running, &[], plenty());
        assert_eq!(grants(&plan), vec![(1, 1), (2, 1), (3, 1)]);
        assert!(plan.preempt.is_empty() && plan.admit.is_empty());
    }

    #[test]
    fn long_prompt_is_chunked_and_never_starves_decodes() {
        // seq 1 prefills 100 tokens; seq 2 and 3 decode.
        let running = [run(1, 0, 100), run(2, 5, 6), run(3, 9, 10)];
        let plan = plan_step(&LIMITS, &running, &[], plenty());
        // decodes first, then one chunk of at most prefill_chunk
        assert_eq!(grants(&plan), vec![(2, 1), (3, 1), (1, 16)]);
    }

    #[test]
    fn step_budget_caps_rows_and_prefill_gets_the_rest() {
        let limits = SchedLimits {
            step_token_budget: 10,
            ..LIMITS
        };
        let running = [run(1, 0, 100), run(2, 5, 6), run(3, 0, 50)];
        let plan = plan_step(&limits, &running, &[], plenty());
        assert_eq!(grants(&plan), vec![(2, 1), (1, 9)]);
        assert_eq!(plan.rows(), 10);
    }

    #[test]
    fn extra_rows_for_a_verify_block_are_granted_in_the_decode_phase() {
        let mut s = run(1, 20, 21);
        s.extra_rows = 4;
        let plan = plan_step(&LIMITS, &[s, run(2, 0, 30)], &[], plenty());
        assert_eq!(grants(&plan), vec![(1, 5), (2, 16)]);
    }

    #[test]
    fn waiting_requests_are_admitted_fifo_within_max_seqs_and_budget() {
        let running = [run(1, 4, 5), run(2, 4, 5)];
        let waiting = [wait(10, 8), wait(11, 30), wait(12, 3)];
        let plan = plan_step(&LIMITS, &running, &waiting, plenty());
        // max_seqs 4: two admitted; 11 gets one chunk.
        assert_eq!(plan.admit, vec![10, 11]);
        assert_eq!(grants(&plan), vec![(1, 1), (2, 1), (10, 8), (11, 16)]);
    }

    #[test]
    fn prefix_cached_tokens_are_not_scheduled_again() {
        let mut w = wait(7, 40);
        w.cached_tokens = 32;
        w.cached_blocks = 8;
        let plan = plan_step(&LIMITS, &[], &[w], plenty());
        assert_eq!(grants(&plan), vec![(7, 8)]);
    }

    #[test]
    fn admission_waits_for_blocks_and_keeps_fifo_order() {
        let kv = KvBudget {
            free_blocks: 3,
            evictable_blocks: 0,
            total_blocks: 20,
        };
        // 20 tokens: the first chunk is cut to what 3 blocks hold (12 rows).
        let plan = plan_step(&LIMITS, &[], &[wait(1, 20), wait(2, 2)], kv);
        assert_eq!(grants(&plan), vec![(1, 12)]);
        assert_eq!(plan.admit, vec![1]);
        let none = KvBudget {
            free_blocks: 0,
            ..kv
        };
        let plan = plan_step(&LIMITS, &[], &[wait(1, 20), wait(2, 2)], none);
        assert!(plan.admit.is_empty() && plan.grants.is_empty());
    }

    #[test]
    fn evictable_blocks_count_as_available_but_not_the_ones_being_reused() {
        let kv = KvBudget {
            free_blocks: 0,
            evictable_blocks: 3,
            total_blocks: 20,
        };
        let mut w = wait(1, 12);
        w.cached_tokens = 8;
        w.cached_blocks = 2;
        w.cached_idle_blocks = 2;
        // needs 1 new block; 3 evictable minus the 2 it reuses = 1 available.
        let plan = plan_step(&LIMITS, &[], &[w], kv);
        assert_eq!(grants(&plan), vec![(1, 4)]);
        w.cow_blocks = 1;
        let plan = plan_step(&LIMITS, &[], &[w], kv);
        assert!(plan.grants.is_empty());
    }

    #[test]
    fn pressure_preempts_the_newest_sequence_not_the_oldest() {
        // Block size 4; seqs 1 and 2 both sit at a block boundary and need a new block.
        let kv = KvBudget {
            free_blocks: 1,
            evictable_blocks: 0,
            total_blocks: 5,
        };
        let running = [run(1, 8, 9), run(2, 8, 9)];
        let plan = plan_step(&LIMITS, &running, &[], kv);
        assert_eq!(grants(&plan), vec![(1, 1)]);
        assert_eq!(plan.preempt, vec![2]);
    }

    #[test]
    fn preempting_a_victim_withdraws_its_grant_and_frees_its_blocks() {
        // seq 1 (oldest) prefills and needs blocks; seq 2 decodes inside its block.
        let kv = KvBudget {
            free_blocks: 0,
            evictable_blocks: 0,
            total_blocks: 4,
        };
        let running = [run(1, 4, 10), run(2, 5, 6)];
        let plan = plan_step(&LIMITS, &running, &[], kv);
        assert_eq!(plan.preempt, vec![2]);
        // seq 2 held 2 blocks: enough for seq 1's whole catch-up (to position 10).
        assert_eq!(grants(&plan), vec![(1, 6)]);
    }

    #[test]
    fn a_sequence_alone_that_cannot_grow_is_reported_too_large() {
        let kv = KvBudget {
            free_blocks: 0,
            evictable_blocks: 0,
            total_blocks: 2,
        };
        let plan = plan_step(&LIMITS, &[run(1, 8, 9)], &[], kv);
        assert_eq!(plan.too_large, vec![1]);
        assert!(plan.grants.is_empty());
        // A waiting request bigger than the pool is reported too.
        let empty = KvBudget {
            free_blocks: 2,
            ..kv
        };
        let plan = plan_step(&LIMITS, &[], &[wait(5, 8), wait(6, 2)], empty);
        assert_eq!(plan.too_large, vec![5]);
        assert_eq!(plan.admit, vec![6]);
    }

    #[test]
    fn nothing_runs_without_work() {
        let plan = plan_step(&LIMITS, &[], &[], plenty());
        assert_eq!(plan, StepPlan::default());
    }
}
