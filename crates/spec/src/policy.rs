//! Adaptive drafting: when to propose and how many tokens.
//!
//! Per sequence ([`SeqPolicy`]): per-position confidence bars, back-off after
//! unproductive cycles *per drafter kind* (a kind whose drafts missed pauses, the pauses
//! doubling per consecutive miss of that kind, bounded ×8, while the other kinds keep
//! drafting; the first-position bar rises +0.05 per consecutive miss of any kind, bounded
//! +0.20; an accepted draft resets its kind's pause and the bar), a margin gate (no
//! proposal when the target hesitated over the last committed token), and a draft length
//! per drafter kind chosen by the cost model from that kind's own acceptance
//! ([`Plan::caps`]: the suffix index's near-certain drafts are not held back by the
//! n-gram's misses, nor the reverse). Engine-wide ([`CostModel`]): the verify-cost curve
//! (each row count's step time as a ratio to the current one-row time, so a change of the
//! machine's load scales the whole curve; interpolated between measured counts, a linear
//! fit beyond them), the measured drafting cost per token and acceptance per drafter kind,
//! which decide the draft length (none when the expected accepted tokens do not beat the
//! curve by [`MIN_GAIN`]; a one-token probe follows [`COST_PROBE_EVERY`] withheld steps,
//! and after each rejected probe twice as many, up to [`COST_PROBE_MAX`]), whether a
//! costly drafter (the draft model, DSpark) pays at all, and a new sequence's starting
//! acceptance (the engine's estimate, weighed as a few cycles so the sequence's own
//! cycles soon outweigh it: a chat after an agent loop whose drafts were all accepted
//! does not keep drafting at full length).
//!
//! Grammar-forced tokens are certain and free to propose: the policy never withholds them.

use crate::drafter::DrafterKind;

/// The adaptive policy's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Most draft tokens per cycle (`--spec-max-draft`), forced tokens included.
    pub max_draft: usize,
    /// Per-position confidence bars for drafters with a confidence (position `j` uses
    /// entry `min(j, len - 1)`; empty = none) (`--spec-confidence-grid`).
    pub confidence_grid: Vec<f32>,
    /// No free proposal when the top1 − top2 logit margin of the target logits that chose
    /// the last committed token is below this (0 = gate off).
    pub margin_bar: f32,
    /// Back off after unproductive cycles.
    pub backoff: bool,
    /// Choose draft lengths (and whether the draft model runs) by measured cost.
    pub cost_model: bool,
}

impl Default for PolicyConfig {
    /// Up to 12 drafts, bars 0.55/0.6/0.65, margin gate off, back-off and cost model on.
    fn default() -> Self {
        PolicyConfig {
            max_draft: 12,
            confidence_grid: vec![0.55, 0.6, 0.65],
            margin_bar: 0.0,
            backoff: true,
            cost_model: true,
        }
    }
}

impl PolicyConfig {
    /// Drafting whenever possible, at full length: no bars, no back-off, no margin gate,
    /// no cost model (tests use it to force many verify cycles).
    pub fn always(max_draft: usize) -> PolicyConfig {
        PolicyConfig {
            max_draft,
            confidence_grid: Vec::new(),
            margin_bar: 0.0,
            backoff: false,
            cost_model: false,
        }
    }
}

/// Decayed success/failure counts of per-position acceptance (a geometric model: each
/// draft position is accepted with probability α given the previous ones were).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Acceptance {
    ok: f64,
    fail: f64,
}

impl Default for Acceptance {
    /// A prior of one success and one failure (α = 0.5).
    fn default() -> Self {
        Acceptance { ok: 1.0, fail: 1.0 }
    }
}

const DECAY: f64 = 0.9;
/// Weight (successes plus failures) of the engine's acceptance when a new sequence starts
/// from it: its own first cycles soon outweigh it (a chat after an agent loop whose drafts
/// were all accepted does not draft at full length for long).
const PRIOR_WEIGHT: f64 = 4.0;

impl Acceptance {
    /// The estimated per-position acceptance probability.
    pub fn alpha(&self) -> f64 {
        self.ok / (self.ok + self.fail)
    }

    /// The same estimate with the weight of [`PRIOR_WEIGHT`] observations at most: the
    /// start of a new sequence from the engine's counts.
    pub fn as_prior(&self) -> Acceptance {
        let w = self.ok + self.fail;
        if w <= PRIOR_WEIGHT {
            return *self;
        }
        let f = PRIOR_WEIGHT / w;
        Acceptance {
            ok: self.ok * f,
            fail: self.fail * f,
        }
    }

    /// Records a cycle: `accepted` of `drafted` free drafts were accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.ok = self.ok * DECAY + accepted as f64;
        self.fail = self.fail * DECAY + f64::from(u8::from(accepted < drafted));
    }
}

/// Expected tokens per millisecond of a cycle that drafts `k` tokens with per-position
/// acceptance `alpha`: `(1 + α + … + α^k) / (base + k·(row + draft))`.
pub fn expected_rate(alpha: f64, k: usize, base_ms: f64, row_ms: f64, draft_ms: f64) -> f64 {
    let mut tokens = 1.0;
    let mut p = 1.0;
    for _ in 0..k {
        p *= alpha;
        tokens += p;
    }
    tokens / (base_ms + k as f64 * (row_ms + draft_ms)).max(1e-9)
}

/// The draft length in `0..=max` with the best [`expected_rate`].
pub fn best_k(alpha: f64, max: usize, base_ms: f64, row_ms: f64, draft_ms: f64) -> usize {
    let mut best = (expected_rate(alpha, 0, base_ms, row_ms, draft_ms), 0);
    for k in 1..=max {
        let r = expected_rate(alpha, k, base_ms, row_ms, draft_ms);
        if r > best.0 * (1.0 + 1e-9) {
            best = (r, k);
        }
    }
    best.1
}

/// The draft length in `0..=max` with the best expected tokens per millisecond when a
/// cycle drafting `k` tokens costs `cost_ms(k)` (the measured verify-cost curve plus the
/// drafting time): `(1 + α + … + α^k) / cost_ms(k)`.
pub fn best_k_by(alpha: f64, max: usize, cost_ms: impl Fn(usize) -> f64) -> usize {
    let mut tokens = 1.0;
    let mut p = 1.0;
    let mut best = (tokens / cost_ms(0).max(1e-9), 0);
    for k in 1..=max {
        p *= alpha;
        tokens += p;
        let r = tokens / cost_ms(k).max(1e-9);
        if r > best.0 * (1.0 + 1e-9) {
            best = (r, k);
        }
    }
    best.1
}

/// Most rows per step whose time is kept separately (the verify-cost curve).
pub const CURVE_ROWS: usize = 65;
/// The least expected gain over a plain step for which the policy drafts (5%).
pub const MIN_GAIN: f64 = 0.05;
/// Steps of a row count measured before its own mean replaces the linear fit.
const CURVE_MIN_SAMPLES: u32 = 3;

/// Engine-wide cost measurements: step time against rows (a linear fit, and the mean time
/// of each row count: the verify-cost curve), drafting cost and acceptance per drafter
/// kind.
#[derive(Clone, Debug)]
pub struct CostModel {
    // Decayed sums of the fit t = a + b·rows over decode/verify steps.
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// Decayed mean step time per row count (index = rows) and how many steps it holds.
    curve: Vec<(f64, u32)>,
    /// Decayed mean of each row count's step time over the one-row mean of its time
    /// (index = rows) and how many steps it holds: the curve's shape, which a change of
    /// the machine's load scales far less than the times themselves.
    ratio: Vec<(f64, u32)>,
    draft_ms: [f64; DrafterKind::COUNT],
    draft_seen: [bool; DrafterKind::COUNT],
    acceptance: [Acceptance; DrafterKind::COUNT],
    cycles: [u64; DrafterKind::COUNT],
    /// Plans since a costly drafter was last allowed (for probing).
    since_costly: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            n: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            curve: vec![(0.0, 0); CURVE_ROWS],
            ratio: vec![(0.0, 0); CURVE_ROWS],
            draft_ms: [0.0; DrafterKind::COUNT],
            draft_seen: [false; DrafterKind::COUNT],
            acceptance: [Acceptance::default(); DrafterKind::COUNT],
            cycles: [0; DrafterKind::COUNT],
            since_costly: 0,
        }
    }
}

const FIT_DECAY: f64 = 0.98;
/// Without measurements, one more row is assumed to cost this fraction of a step.
const DEFAULT_ROW_FRACTION: f64 = 0.05;
/// A costly drafter judged a loss is retried once per this many plans.
const PROBE_EVERY: u64 = 64;
/// Cycles of evidence before a costly drafter can be judged a loss.
const MIN_EVIDENCE: u64 = 8;

impl CostModel {
    /// An empty model (defaults until steps are measured).
    pub fn new() -> CostModel {
        CostModel::default()
    }

    /// Records a decode/verify step of `rows` rows that took `ms` (forward and choices).
    pub fn observe_step(&mut self, rows: usize, ms: f64) {
        if !ms.is_finite() || ms <= 0.0 || rows == 0 {
            return;
        }
        let x = rows as f64;
        self.n = self.n * FIT_DECAY + 1.0;
        self.sx = self.sx * FIT_DECAY + x;
        self.sy = self.sy * FIT_DECAY + ms;
        self.sxx = self.sxx * FIT_DECAY + x * x;
        self.sxy = self.sxy * FIT_DECAY + x * ms;
        if rows > 1
            && let Some(t1) = self.single_row_mean()
            && let Some(c) = self.ratio.get_mut(rows)
        {
            let r = ms / t1;
            // One step slowed by something else (a page fault, another process) moves
            // the shape by at most a factor of two.
            c.0 = if c.1 == 0 {
                r
            } else {
                0.8 * c.0 + 0.2 * r.clamp(0.5 * c.0, 2.0 * c.0)
            };
            c.1 = c.1.saturating_add(1);
        }
        if let Some(c) = self.curve.get_mut(rows) {
            c.0 = if c.1 == 0 { ms } else { 0.8 * c.0 + 0.2 * ms };
            c.1 = c.1.saturating_add(1);
        }
    }

    /// The measured mean one-row step time, once it has [`CURVE_MIN_SAMPLES`] steps.
    fn single_row_mean(&self) -> Option<f64> {
        self.curve
            .get(1)
            .filter(|c| c.1 >= CURVE_MIN_SAMPLES && c.0 > 0.0)
            .map(|c| c.0)
    }

    /// Estimated time of a step of `rows` rows, ms: the current one-row mean times that
    /// row count's measured ratio to it (the curve's shape, so a change of load since
    /// the longer steps were measured moves every estimate alike), else the measured
    /// mean of that row count, once either has `CURVE_MIN_SAMPLES` steps; between two
    /// such counts, interpolated; else the linear fit (scaled to the current one-row
    /// time once that is measured) — never less than the estimate of fewer rows (more rows never cost
    /// less).
    pub fn step_ms(&self, rows: usize) -> f64 {
        let (a, b) = self.fit();
        let t1 = self.single_row_mean();
        // The measured estimate of a row count, if it has one.
        let known = |r: usize| -> Option<f64> {
            let shape = self
                .ratio
                .get(r)
                .filter(|c| c.1 >= CURVE_MIN_SAMPLES)
                .and_then(|c| t1.map(|t1| t1 * c.0));
            shape.or_else(|| {
                self.curve
                    .get(r)
                    .filter(|c| c.1 >= CURVE_MIN_SAMPLES)
                    .map(|c| c.0)
            })
        };
        let mut floor = 0.0f64;
        let mut est = a;
        let mut below: Option<(usize, f64)> = None;
        for r in 1..=rows.max(1) {
            est = match known(r) {
                Some(ms) => ms,
                None => {
                    // Between two measured counts: interpolated; else the fit's shape at
                    // the current one-row time.
                    let above = (r + 1..CURVE_ROWS).find_map(|q| known(q).map(|ms| (q, ms)));
                    match (below, above) {
                        (Some((r0, m0)), Some((r1, m1))) => {
                            m0 + (m1 - m0) * (r - r0) as f64 / (r1 - r0) as f64
                        }
                        _ => match t1 {
                            Some(t1) => t1 * (a + b * r as f64) / (a + b).max(1e-9),
                            None => a + b * r as f64,
                        },
                    }
                }
            };
            est = est.max(floor);
            floor = est;
            if let Some(ms) = known(r) {
                below = Some((r, ms));
            }
        }
        est
    }

    /// The best draft length in `0..=max` for a sequence with per-position acceptance
    /// `alpha` drafting with `kind`: the measured step time of `1 + k` rows plus the
    /// drafting time of `k` tokens, against the tokens expected.
    /// A draft is only worth it when it is expected to beat plain decoding by at least
    /// [`MIN_GAIN`] (near the break-even point a draft risks a loss for nothing).
    pub fn best_draft(&self, alpha: f64, max: usize, kind: DrafterKind) -> usize {
        let draft = self.draft_ms(kind);
        let cost = |k: usize| self.step_ms(1 + k) + k as f64 * draft;
        let k = best_k_by(alpha, max, cost);
        if k == 0 {
            return 0;
        }
        let tokens: f64 = (0..=k).map(|i| alpha.powi(i as i32)).sum();
        let plain = 1.0 / cost(0).max(1e-9);
        if tokens / cost(k).max(1e-9) >= plain * (1.0 + MIN_GAIN) {
            k
        } else {
            0
        }
    }

    /// `(a, b)` of the fit `ms = a + b·rows` (b ≥ 0; a ≥ b). Falls back to a mean step
    /// time with `DEFAULT_ROW_FRACTION` per extra row while the rows do not vary.
    pub fn fit(&self) -> (f64, f64) {
        if self.n < 1e-9 {
            return (1.0, DEFAULT_ROW_FRACTION);
        }
        let mx = self.sx / self.n;
        let my = self.sy / self.n;
        let var = self.sxx / self.n - mx * mx;
        if var < 0.05 {
            let per = my / mx.max(1.0);
            let b = per * DEFAULT_ROW_FRACTION;
            return ((my - b * mx).max(b), b);
        }
        let b = ((self.sxy / self.n - mx * my) / var).max(0.0);
        let a = (my - b * mx).max(b);
        (a, b)
    }

    /// Estimated time of a one-row decode step, ms.
    pub fn single_row_ms(&self) -> f64 {
        let (a, b) = self.fit();
        a + b
    }

    /// Estimated marginal time of one more row in a step, ms.
    pub fn row_ms(&self) -> f64 {
        self.fit().1
    }

    /// Records drafting `tokens` tokens with `kind` in `us` microseconds.
    pub fn observe_draft(&mut self, kind: DrafterKind, tokens: usize, us: u64) {
        if tokens == 0 || !kind.is_costly() {
            return;
        }
        let per = us as f64 / 1e3 / tokens as f64;
        let i = kind.index();
        self.draft_ms[i] = if self.draft_seen[i] {
            0.8 * self.draft_ms[i] + 0.2 * per
        } else {
            per
        };
        self.draft_seen[i] = true;
    }

    /// Measured drafting time per token of `kind`, ms (0 for free drafters).
    pub fn draft_ms(&self, kind: DrafterKind) -> f64 {
        self.draft_ms[kind.index()]
    }

    /// Records a verify cycle of `kind`: `accepted` of `drafted` free drafts.
    pub fn observe_cycle(&mut self, kind: DrafterKind, drafted: usize, accepted: usize) {
        let i = kind.index();
        self.acceptance[i].record(drafted, accepted);
        if drafted > 0 {
            self.cycles[i] += 1;
        }
    }

    /// The engine-wide acceptance estimate of `kind`.
    pub fn alpha(&self, kind: DrafterKind) -> f64 {
        self.acceptance[kind.index()].alpha()
    }

    /// The engine-wide acceptance counts of `kind` (a new sequence starts from them).
    pub fn acceptance(&self, kind: DrafterKind) -> Acceptance {
        self.acceptance[kind.index()]
    }

    /// Verify cycles of `kind` recorded engine-wide.
    pub fn cycles(&self, kind: DrafterKind) -> u64 {
        self.cycles[kind.index()]
    }

    /// Whether a costly drafter (the draft model, DSpark) is expected to pay: the best draft
    /// length under the measured verify-cost curve, drafting time and acceptance is at
    /// least 1. A drafter judged a
    /// loss is still probed once every `PROBE_EVERY` calls, so the judgement can change.
    pub fn costly_pays(&mut self, max_draft: usize) -> bool {
        // The costly kinds with enough evidence to judge (the draft model, DSpark).
        let judged: Vec<DrafterKind> = [DrafterKind::DraftModel, DrafterKind::Dspark]
            .into_iter()
            .filter(|k| self.cycles[k.index()] >= MIN_EVIDENCE && self.draft_seen[k.index()])
            .collect();
        if judged.is_empty() {
            self.since_costly = 0;
            return true;
        }
        let pays = judged
            .iter()
            .any(|&kind| self.best_draft(self.alpha(kind), max_draft, kind) > 0);
        if pays {
            self.since_costly = 0;
            return true;
        }
        self.since_costly += 1;
        if self.since_costly >= PROBE_EVERY {
            self.since_costly = 0;
            return true;
        }
        false
    }
}

/// What the policy allows for one decode step of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Most non-forced draft tokens (0 = only forced tokens).
    pub max_draft: usize,
    /// Confidence bars per draft position (with the back-off bump).
    pub bars: Vec<f32>,
    /// Why free drafting is off this step, if it is.
    pub gate: Option<Gate>,
    /// With the cost model: the most non-forced drafts of each drafter kind (index =
    /// [`DrafterKind::index`]), each from that kind's own measured acceptance, so a
    /// drafter that pays is not held back by one that does not (and the reverse);
    /// `max_draft` is their maximum. Empty without the cost model.
    pub caps: Vec<usize>,
}

/// Why the policy withheld free drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Backing off after unproductive cycles.
    BackOff,
    /// The target hesitated (margin below the bar).
    Margin,
    /// The cost model expects no gain.
    Cost,
    /// No room: too close to `max_tokens` or the context end.
    Room,
}

/// One sequence's adaptive state.
#[derive(Clone, Debug, Default)]
pub struct SeqPolicy {
    /// Consecutive unproductive cycles, any kind (raises the first-position bar).
    misses: u32,
    /// Per kind: consecutive unproductive cycles of that kind.
    kind_misses: [u32; DrafterKind::COUNT],
    /// Per kind: steps that kind still pauses (back-off).
    pause_left: [u32; DrafterKind::COUNT],
    acceptance: [Acceptance; DrafterKind::COUNT],
    /// Cycles recorded per kind.
    recorded: [u32; DrafterKind::COUNT],
    /// Per kind: consecutive steps the cost model withheld its drafts (a probe follows
    /// `probe_every` of them, so the measurements can change its mind).
    cost_skips: [u32; DrafterKind::COUNT],
    /// Per kind: withheld steps before the next probe: [`COST_PROBE_EVERY`], doubled after
    /// each probe that is rejected (bounded by [`COST_PROBE_MAX`]), back to the start after
    /// an accepted draft. 0 = not set yet (the start).
    probe_every: [u32; DrafterKind::COUNT],
    /// Per kind: the plan just made was a probe.
    probing: [bool; DrafterKind::COUNT],
}

/// After this many steps withheld by the cost model, one short cycle is drafted anyway.
pub const COST_PROBE_EVERY: u32 = 16;
/// Most withheld steps between probes (after rejected probes the interval doubles up to
/// this, so a workload where drafts never pay loses at most one row per this many steps).
pub const COST_PROBE_MAX: u32 = 128;
/// Draft length of such a probe (one row: its cost is the curve's cheapest extra row).
const COST_PROBE_LEN: usize = 1;

impl SeqPolicy {
    /// A fresh state.
    pub fn new() -> SeqPolicy {
        SeqPolicy::default()
    }

    /// Consecutive unproductive cycles.
    pub fn misses(&self) -> u32 {
        self.misses
    }

    /// Plans a step: `room` = most draft tokens the sequence can still use (before
    /// `max_tokens` and the context end), `margin` = the top1 − top2 margin of the logits
    /// that chose the last committed token.
    pub fn plan(
        &mut self,
        cfg: &PolicyConfig,
        cost: &CostModel,
        room: usize,
        margin: Option<f32>,
    ) -> Plan {
        let bump = if cfg.backoff {
            (0.05 * self.misses as f32).min(0.20)
        } else {
            0.0
        };
        let mut bars = cfg.confidence_grid.clone();
        if let Some(b) = bars.first_mut() {
            *b = (*b + bump).min(1.0);
        } else if bump > 0.0 {
            bars.push(bump);
        }
        let cap = cfg.max_draft.min(room);
        let mut plan = Plan {
            max_draft: cap,
            bars,
            gate: None,
            caps: Vec::new(),
        };
        // Kinds backing off this step (each pauses on its own misses only).
        let mut paused = [false; DrafterKind::COUNT];
        if cfg.backoff {
            for (p, left) in paused.iter_mut().zip(self.pause_left.iter_mut()) {
                if *left > 0 {
                    *left -= 1;
                    *p = true;
                }
            }
        }
        if cap == 0 {
            plan.gate = Some(Gate::Room);
        } else if cfg.margin_bar > 0.0 && margin.is_some_and(|m| m < cfg.margin_bar) {
            plan.gate = Some(Gate::Margin);
        } else if cfg.cost_model {
            // Each kind drafts as far as its own acceptance pays. A sequence without
            // cycles of a kind starts from the engine's experience with it (earlier
            // requests), not from the neutral prior.
            let caps: Vec<usize> = DrafterKind::ALL
                .iter()
                .map(|&kind| {
                    let i = kind.index();
                    // Its own cycles then update that estimate (they do not start
                    // over from the neutral prior).
                    if self.recorded[i] == 0 && cost.cycles(kind) > 0 {
                        self.acceptance[i] = cost.acceptance(kind).as_prior();
                    }
                    let alpha = self.acceptance[i].alpha();
                    let k = cost.best_draft(alpha, cap, kind);
                    self.probing[i] = false;
                    if k > 0 {
                        self.cost_skips[i] = 0;
                        return k;
                    }
                    // Withheld: probed now and then (less often after rejected probes),
                    // so the measurements can change the model's mind.
                    self.cost_skips[i] += 1;
                    if self.probe_every[i] == 0 {
                        self.probe_every[i] = COST_PROBE_EVERY;
                    }
                    if self.cost_skips[i] >= self.probe_every[i] {
                        self.cost_skips[i] = 0;
                        self.probing[i] = true;
                        COST_PROBE_LEN.min(cap)
                    } else {
                        0
                    }
                })
                .collect();
            let priced = caps.iter().any(|&k| k > 0);
            let caps: Vec<usize> = caps
                .into_iter()
                .zip(paused)
                .map(|(k, p)| if p { 0 } else { k })
                .collect();
            plan.max_draft = caps.iter().copied().max().unwrap_or(0);
            plan.caps = caps;
            if plan.max_draft == 0 {
                plan.gate = Some(if priced { Gate::BackOff } else { Gate::Cost });
            }
        } else if paused.iter().any(|&p| p) {
            plan.caps = paused.iter().map(|&p| if p { 0 } else { cap }).collect();
            if paused.iter().all(|&p| p) || self.only_paused_kinds_drafted(&paused) {
                plan.gate = Some(Gate::BackOff);
            }
        }
        if plan.gate.is_some() {
            plan.max_draft = 0;
            plan.caps.iter_mut().for_each(|c| *c = 0);
        }
        plan
    }

    /// Records a verify cycle: `kind` proposed `drafted` free (non-forced) tokens, of which
    /// `accepted` were accepted.
    pub fn record(&mut self, kind: Option<DrafterKind>, drafted: usize, accepted: usize) {
        let Some(kind) = kind else { return };
        if drafted == 0 {
            return;
        }
        let i = kind.index();
        self.acceptance[i].record(drafted, accepted);
        self.recorded[i] = self.recorded[i].saturating_add(1);
        let probe = std::mem::take(&mut self.probing[i]);
        if accepted > 0 {
            self.misses = 0;
            self.kind_misses[i] = 0;
            self.pause_left[i] = 0;
            self.probe_every[i] = COST_PROBE_EVERY;
        } else {
            if probe {
                self.probe_every[i] =
                    (self.probe_every[i].max(COST_PROBE_EVERY) * 2).min(COST_PROBE_MAX);
            }
            self.misses += 1;
            self.kind_misses[i] += 1;
            self.pause_left[i] = 1u32 << (self.kind_misses[i] - 1).min(3);
        }
    }

    /// Whether every kind that has drafted in this sequence is paused (without the cost
    /// model: then nothing would draft, which is a back-off step).
    fn only_paused_kinds_drafted(&self, paused: &[bool; DrafterKind::COUNT]) -> bool {
        self.recorded.iter().zip(paused).all(|(&n, &p)| n == 0 || p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_off_doubles_pauses_up_to_eight_and_one_accept_resets() {
        let cfg = PolicyConfig {
            cost_model: false,
            ..PolicyConfig::default()
        };
        let cost = CostModel::new();
        let mut p = SeqPolicy::new();
        let mut pauses = Vec::new();
        for _ in 0..5 {
            p.record(Some(DrafterKind::Ngram), 3, 0);
            let mut n = 0;
            while p.plan(&cfg, &cost, 8, None).gate == Some(Gate::BackOff) {
                n += 1;
            }
            pauses.push(n);
        }
        assert_eq!(pauses, vec![1, 2, 4, 8, 8]);
        // The first-position bar rose +0.05 per miss, bounded +0.20.
        let plan = p.plan(&cfg, &cost, 8, None);
        assert!((plan.bars[0] - 0.75).abs() < 1e-6, "{:?}", plan.bars);
        assert_eq!(plan.bars[1], 0.6);
        p.record(Some(DrafterKind::Ngram), 3, 1);
        let plan = p.plan(&cfg, &cost, 8, None);
        assert_eq!(plan.gate, None);
        assert_eq!(plan.bars[0], 0.55);
        assert_eq!(plan.max_draft, 8);
    }

    #[test]
    fn a_new_sequence_weighs_the_engines_acceptance_as_a_few_cycles() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        // Earlier sequences' suffix drafts were all accepted.
        for _ in 0..30 {
            c.observe_cycle(DrafterKind::Suffix, 12, 12);
        }
        let cfg = PolicyConfig {
            backoff: false,
            ..PolicyConfig::default()
        };
        let s = DrafterKind::Suffix.index();
        let mut p = SeqPolicy::new();
        assert_eq!(p.plan(&cfg, &c, 12, None).caps[s], 12);
        // This sequence's drafts miss twice: its own cycles outweigh the engine's.
        p.record(Some(DrafterKind::Suffix), 12, 0);
        p.record(Some(DrafterKind::Suffix), 12, 0);
        let k = p.plan(&cfg, &c, 12, None).caps[s];
        assert!(k <= 4, "{k}");
    }

    #[test]
    fn a_kind_that_misses_backs_off_alone_while_the_others_draft() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        let cfg = PolicyConfig::default();
        let mut p = SeqPolicy::new();
        for _ in 0..6 {
            p.record(Some(DrafterKind::Suffix), 4, 4);
        }
        // The n-gram misses twice: it pauses 2 steps, the suffix index drafts on.
        p.record(Some(DrafterKind::Ngram), 2, 0);
        p.record(Some(DrafterKind::Ngram), 2, 0);
        let (ngram, suffix) = (DrafterKind::Ngram.index(), DrafterKind::Suffix.index());
        for _ in 0..2 {
            let plan = p.plan(&cfg, &c, 8, None);
            assert_eq!(plan.gate, None, "{plan:?}");
            assert_eq!(plan.caps[ngram], 0, "{plan:?}");
            assert!(plan.caps[suffix] >= 7, "{plan:?}");
        }
        // Its pause is over; a suffix miss does not pause the n-gram.
        p.record(Some(DrafterKind::Suffix), 4, 0);
        let plan = p.plan(&cfg, &c, 8, None);
        assert_eq!(plan.caps[suffix], 0, "{plan:?}");
        // Without the cost model: the only kind that drafted is paused, a back-off step.
        let cfg = PolicyConfig {
            cost_model: false,
            ..PolicyConfig::default()
        };
        let mut q = SeqPolicy::new();
        q.record(Some(DrafterKind::Ngram), 2, 0);
        assert_eq!(q.plan(&cfg, &c, 8, None).gate, Some(Gate::BackOff));
        assert_eq!(q.plan(&cfg, &c, 8, None).gate, None);
    }

    #[test]
    fn the_margin_gate_and_the_room_cap_withhold_drafts() {
        let cfg = PolicyConfig {
            margin_bar: 1.0,
            cost_model: false,
            ..PolicyConfig::default()
        };
        let cost = CostModel::new();
        let mut p = SeqPolicy::new();
        assert_eq!(p.plan(&cfg, &cost, 8, Some(0.5)).gate, Some(Gate::Margin));
        assert_eq!(p.plan(&cfg, &cost, 8, Some(2.0)).max_draft, 8);
        assert_eq!(p.plan(&cfg, &cost, 3, Some(2.0)).max_draft, 3);
        assert_eq!(p.plan(&cfg, &cost, 0, Some(2.0)).gate, Some(Gate::Room));
    }

    #[test]
    fn the_cost_model_drafts_long_when_acceptance_is_high_and_not_when_drafts_cost() {
        // Cheap rows (2% of a step): α = 0.9 drafts the maximum, α = 0.01 nothing.
        assert_eq!(best_k(0.9, 8, 10.0, 0.2, 0.0), 8);
        assert_eq!(best_k(0.01, 8, 10.0, 0.2, 0.0), 0);
        // A draft model costing 0.6 of a step per token at 60% acceptance is a loss.
        assert_eq!(best_k(0.6, 8, 10.0, 0.2, 6.0), 0);
    }

    #[test]
    fn drafts_withheld_by_the_cost_model_are_probed_now_and_then() {
        let mut c = CostModel::new();
        for i in 0..40 {
            c.observe_step(1 + i % 4, 10.0 + 5.0 * (1 + i % 4) as f64);
        }
        let cfg = PolicyConfig::default();
        let mut p = SeqPolicy::new();
        p.record(Some(DrafterKind::Ngram), 4, 0);
        p.record(Some(DrafterKind::Ngram), 4, 0);
        let mut p = SeqPolicy {
            misses: 0,
            pause_left: [0; DrafterKind::COUNT],
            ..p
        };
        let ngram = DrafterKind::Ngram.index();
        let plans: Vec<usize> = (0..COST_PROBE_EVERY)
            .map(|_| p.plan(&cfg, &c, 8, None).caps[ngram])
            .collect();
        assert_eq!(plans.iter().filter(|&&k| k > 0).count(), 1, "{plans:?}");
        assert_eq!(plans.last(), Some(&COST_PROBE_LEN));
    }

    #[test]
    fn the_step_fit_recovers_base_and_per_row_cost() {
        let mut c = CostModel::new();
        for i in 0..50 {
            let rows = 1 + i % 5;
            c.observe_step(rows, 20.0 + 2.0 * rows as f64);
        }
        let (a, b) = c.fit();
        assert!((a - 20.0).abs() < 1e-6 && (b - 2.0).abs() < 1e-6, "{a} {b}");
        assert!((c.single_row_ms() - 22.0).abs() < 1e-6);
    }

    #[test]
    fn a_costly_drafter_that_loses_is_turned_off_and_probed_later() {
        let mut c = CostModel::new();
        for i in 0..40 {
            c.observe_step(1 + i % 4, 10.0 + 0.5 * (1 + i % 4) as f64);
        }
        assert!(c.costly_pays(4), "no evidence yet");
        for _ in 0..20 {
            c.observe_draft(DrafterKind::DraftModel, 4, 24_000); // 6 ms per token
            c.observe_cycle(DrafterKind::DraftModel, 4, 1);
        }
        let mut allowed = 0;
        for _ in 0..PROBE_EVERY {
            allowed += usize::from(c.costly_pays(4));
        }
        assert_eq!(allowed, 1, "off except one probe");
    }

    /// Feeds `c` steps of a convex verify-cost curve like the one measured for
    /// qwen2.5-coder-1.5b on 2 CPU threads (1 row 57 ms, 2 rows 65, 4 rows 77, 8 rows 132).
    fn convex_curve(c: &mut CostModel) {
        let curve = [
            (1, 57.0),
            (2, 65.0),
            (3, 71.0),
            (4, 77.0),
            (5, 90.0),
            (9, 140.0),
        ];
        for _ in 0..10 {
            for &(rows, ms) in &curve {
                c.observe_step(rows, ms);
            }
        }
    }

    #[test]
    fn the_measured_curve_replaces_the_linear_fit_where_it_is_known() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        assert!((c.step_ms(1) - 57.0).abs() < 1e-6);
        assert!((c.step_ms(9) - 140.0).abs() < 1e-6);
        // Unmeasured counts come from the fit, never below a smaller count's time.
        assert!(c.step_ms(6) >= c.step_ms(5));
        assert!(c.step_ms(8) >= c.step_ms(6));
        // At 60% acceptance the best cycle on this curve verifies 4 rows (k = 3: 2.18
        // tokens in 77 ms); 5 rows cost 90 ms, and 9 rows 140 ms.
        assert_eq!(c.best_draft(0.6, 8, DrafterKind::Ngram), 3);
        // A drafting cost per token moves it down.
        c.observe_draft(DrafterKind::DraftModel, 1, 20_000);
        assert!(c.best_draft(0.6, 8, DrafterKind::DraftModel) < 3);
        // Near break-even (α = 0.16: one draft row costs 8 ms of 57, expected gain 2%)
        // the policy does not draft; just above the margin (α = 0.25, +9%) it does.
        assert_eq!(c.best_draft(0.16, 8, DrafterKind::Ngram), 0);
        assert!(c.best_draft(0.25, 8, DrafterKind::Ngram) > 0);
        // Prose-like acceptance drafts nothing; near-certain drafts go long.
        assert_eq!(c.best_draft(0.1, 8, DrafterKind::Ngram), 0);
        assert!(c.best_draft(0.98, 8, DrafterKind::Ngram) >= 7);
    }

    #[test]
    fn a_change_of_load_scales_the_whole_curve() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        let k = c.best_draft(0.7, 8, DrafterKind::Ngram);
        // The machine gets twice as slow while only one-row steps are taken: the longer
        // steps' estimates follow, so the draft length does not change.
        for _ in 0..30 {
            c.observe_step(1, 114.0);
        }
        assert!((c.step_ms(1) - 114.0).abs() < 0.5, "{}", c.step_ms(1));
        assert!((c.step_ms(9) - 280.0).abs() < 1.5, "{}", c.step_ms(9));
        assert_eq!(c.best_draft(0.7, 8, DrafterKind::Ngram), k);
        // One outlier step moves a row count's shape by at most a factor of two (x 0.2).
        let before = c.step_ms(5);
        c.observe_step(5, 10_000.0);
        assert!(
            c.step_ms(5) <= before * 1.2 + 1e-6,
            "{} {}",
            before,
            c.step_ms(5)
        );
    }

    #[test]
    fn a_new_sequence_starts_from_the_engines_acceptance() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        for _ in 0..30 {
            c.observe_cycle(DrafterKind::Ngram, 3, 0);
        }
        let cfg = PolicyConfig::default();
        // The neutral prior (α = 0.5) would draft; the engine's record says it will miss.
        assert!(c.best_draft(0.5, 8, DrafterKind::Ngram) > 0);
        let ngram = DrafterKind::Ngram.index();
        let mut p = SeqPolicy::new();
        assert_eq!(p.plan(&cfg, &c, 8, None).caps[ngram], 0);
        // Its own cycles take over from the engine's estimate.
        for _ in 0..20 {
            p.record(Some(DrafterKind::Ngram), 2, 2);
        }
        let plan = p.plan(&cfg, &c, 8, None);
        assert_eq!(plan.gate, None);
        assert!(plan.caps[ngram] > 0 && plan.max_draft >= plan.caps[ngram]);
    }

    #[test]
    fn each_kind_drafts_by_its_own_acceptance() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        let cfg = PolicyConfig::default();
        let mut p = SeqPolicy::new();
        for _ in 0..10 {
            p.record(Some(DrafterKind::Ngram), 3, 0);
            p.record(Some(DrafterKind::Suffix), 4, 4);
        }
        let p = &mut SeqPolicy {
            misses: 0,
            pause_left: [0; DrafterKind::COUNT],
            ..p
        };
        let plan = p.plan(&cfg, &c, 8, None);
        // The suffix index's near-certain drafts go long; the n-gram's misses are withheld.
        assert!(plan.caps[DrafterKind::Suffix.index()] >= 7, "{plan:?}");
        assert_eq!(plan.caps[DrafterKind::Ngram.index()], 0, "{plan:?}");
        assert_eq!(plan.max_draft, plan.caps[DrafterKind::Suffix.index()]);
        assert_eq!(plan.gate, None);
    }

    #[test]
    fn rejected_probes_come_less_often_up_to_the_bound() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        for _ in 0..30 {
            c.observe_cycle(DrafterKind::Ngram, 3, 0);
        }
        let cfg = PolicyConfig {
            backoff: false,
            ..PolicyConfig::default()
        };
        let ngram = DrafterKind::Ngram.index();
        let mut p = SeqPolicy::new();
        let mut gaps = Vec::new();
        let mut since = 0;
        for _ in 0..2000 {
            since += 1;
            let k = p.plan(&cfg, &c, 8, None).caps[ngram];
            if k > 0 {
                assert_eq!(k, COST_PROBE_LEN);
                gaps.push(since);
                since = 0;
                p.record(Some(DrafterKind::Ngram), k, 0);
            }
        }
        assert_eq!(&gaps[..5], &[16, 32, 64, 128, 128], "{gaps:?}");
        // An accepted probe brings the interval back to the start.
        for _ in 0..200 {
            if p.plan(&cfg, &c, 8, None).caps[ngram] > 0 {
                break;
            }
        }
        p.record(Some(DrafterKind::Ngram), 1, 1);
        for _ in 0..30 {
            p.record(Some(DrafterKind::Ngram), 3, 0);
        }
        let n = (0..COST_PROBE_EVERY)
            .filter(|_| p.plan(&cfg, &c, 8, None).caps[ngram] > 0)
            .count();
        assert_eq!(n, 1);
    }

    #[test]
    fn a_dspark_drafter_that_loses_is_turned_off_and_probed_later() {
        let mut c = CostModel::new();
        convex_curve(&mut c);
        for _ in 0..20 {
            c.observe_draft(DrafterKind::Dspark, 4, 160_000); // 40 ms per token
            c.observe_cycle(DrafterKind::Dspark, 4, 1);
        }
        let allowed: usize = (0..PROBE_EVERY)
            .map(|_| usize::from(c.costly_pays(4)))
            .sum();
        assert_eq!(allowed, 1, "off except one probe");
        // Cheap and accepted: it pays.
        let mut c = CostModel::new();
        convex_curve(&mut c);
        for _ in 0..20 {
            c.observe_draft(DrafterKind::Dspark, 4, 4_000);
            c.observe_cycle(DrafterKind::Dspark, 4, 4);
        }
        assert!((0..PROBE_EVERY).all(|_| c.costly_pays(4)));
    }
}
