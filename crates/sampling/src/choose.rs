//! The choice function: penalties and bias, the allowed set, truncation, Gumbel-max.
//!
//! `Sampler` owns reusable scratch so a call allocates nothing once warm. Nothing in it
//! survives a call: the choice is a pure function of the arguments.

use crate::TokenLogprob;
use crate::logprob::{exp_nonpositive, log_normalizer, logprob_with, max_f32};
use crate::mask::{BitIter, TokenMask};
use crate::noise::{GUMBEL_MAX, NoiseKey, gumbel_from_bits, gumbel_upper_bound};
use crate::params::{ParamError, SamplingParams};
use std::cmp::Ordering;
use thiserror::Error;

/// Vocabularies are indexed by `u32` token ids.
pub(crate) const MAX_VOCAB: usize = u32::MAX as usize;

/// Why no token could be chosen.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SampleError {
    /// The sampling parameters are out of their domain.
    #[error(transparent)]
    InvalidParams(#[from] ParamError),
    /// Nothing may be chosen: the allowed set (grammar mask minus never-sample tokens, minus
    /// tokens whose adjusted logit is `-inf`) is empty.
    #[error(
        "no token can be chosen: the allowed set (grammar mask minus never-sample tokens, \
         minus tokens whose adjusted logit is -inf) is empty"
    )]
    EmptyAllowedSet,
    /// A logit is NaN or `+inf` (a model or kernel fault).
    #[error("logit of token {token} is {value}; logits must be finite or -inf")]
    NonFiniteLogit {
        /// Token id.
        token: u32,
        /// The offending value.
        value: f32,
    },
    /// A prefix token or `logit_bias` token is not in the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab} logits")]
    TokenOutOfRange {
        /// Token id.
        token: u32,
        /// Number of logits.
        vocab: usize,
    },
    /// Penalties and bias pushed a logit to `+inf` or NaN.
    #[error("the adjusted logit of token {token} is {value} after penalties and logit_bias")]
    AdjustedLogitOverflow {
        /// Token id.
        token: u32,
        /// The offending value.
        value: f32,
    },
    /// More logits than `u32` token ids.
    #[error("a vocabulary of {0} logits exceeds the u32 token id range")]
    VocabTooLarge(usize),
}

/// The row's own prefix and the position of the token being chosen.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChoiceContext<'a> {
    /// The prompt tokens (read by the repetition penalty window only).
    pub prompt_tokens: &'a [u32],
    /// The tokens this row has generated so far (read by all penalties).
    pub generated_tokens: &'a [u32],
    /// Absolute position of the token being chosen (0-based; normally
    /// `prompt_tokens.len() + generated_tokens.len()`); keys the noise.
    pub position: u64,
}

/// The chosen token.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Token id.
    pub token: u32,
    /// Log-softmax of the raw logits at T = 1 for `token` (for reporting; penalties, bias,
    /// masks and temperature do not enter it).
    pub logprob: f32,
    /// The top-N alternatives, best first; `choose` leaves it `None`, fill it with
    /// [`top_logprobs`](crate::top_logprobs) when the request asks for them.
    pub top: Option<Vec<TokenLogprob>>,
}

/// `a` ranks before `b`: higher value, then lower token id.
#[inline(always)]
fn better(a: (f32, u32), b: (f32, u32)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// Total best-first order on (value, id) pairs with no NaN.
fn best_first(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// Bounded selection of the `k` best (value desc, id asc) pairs: a binary heap whose root is
/// the worst kept pair. `-inf` values are never kept.
#[derive(Debug, Default)]
pub(crate) struct TopK {
    k: usize,
    heap: Vec<(f32, u32)>,
}

impl TopK {
    pub(crate) fn new(k: usize) -> Self {
        TopK {
            k,
            heap: Vec::with_capacity(k.min(1 << 16)),
        }
    }

    fn reset(&mut self, k: usize) {
        self.k = k;
        self.heap.clear();
    }

    /// The worst kept pair once `k` are kept: nothing that does not beat it can enter.
    #[inline]
    fn floor(&self) -> Option<(f32, u32)> {
        if self.heap.len() == self.k {
            self.heap.first().copied()
        } else {
            None
        }
    }

    #[inline]
    pub(crate) fn offer_in_order(&mut self, value: f32, token: u32) {
        if value == f32::NEG_INFINITY || self.k == 0 {
            return;
        }
        let item = (value, token);
        if self.heap.len() < self.k {
            self.heap.push(item);
            let mut i = self.heap.len() - 1;
            while i > 0 {
                let parent = (i - 1) / 2;
                if better(self.heap[parent], self.heap[i]) {
                    self.heap.swap(parent, i);
                    i = parent;
                } else {
                    break;
                }
            }
        } else if better(item, self.heap[0]) {
            self.heap[0] = item;
            let n = self.heap.len();
            let mut i = 0;
            loop {
                let (l, r) = (2 * i + 1, 2 * i + 2);
                let mut worst = i;
                if l < n && better(self.heap[worst], self.heap[l]) {
                    worst = l;
                }
                if r < n && better(self.heap[worst], self.heap[r]) {
                    worst = r;
                }
                if worst == i {
                    break;
                }
                self.heap.swap(i, worst);
                i = worst;
            }
        }
    }

    /// Sort the kept pairs best first into `out`.
    fn drain_sorted_into(&mut self, out: &mut Vec<(f32, u32)>) {
        out.clear();
        out.append(&mut self.heap);
        out.sort_unstable_by(best_first);
    }

    pub(crate) fn into_sorted(mut self) -> Vec<(f32, u32)> {
        let mut out = Vec::new();
        self.drain_sorted_into(&mut out);
        out
    }
}

/// Counter-based Gumbel race: the argmax of `l / T + g(seed, position, token)` (f64), ties
/// to the lowest id, over the tokens offered that pass min-p. Offers may come in any order;
/// a token is skipped only when a bound proves it cannot reach the best value so far, so
/// the winner is that of the exhaustive evaluation.
///
/// Pruning: `g <= bound(bits)` (see `gumbel_upper_bound`), so a token with
/// `l < (cut - bound) * T` cannot win. The thresholds for every bound value are kept in a
/// table indexed by `lz(2^53 - 1 - r)` and refreshed when the best
/// improves, so a pruned token costs one hash, a table lookup and a compare; tokens below
/// the threshold of the largest bound are skipped without hashing.
struct GumbelRace {
    key: NoiseKey,
    t: f64,
    best: f64,
    best_id: u32,
    /// Logit thresholds per bound index; `-inf` until a first value exists.
    thr: [f64; 65],
    /// The threshold of the largest bound (`54 ln 2`): below it nothing can win.
    thr_any: f64,
    /// Min-p as (best allowed logit, ln(min_p)).
    min_p: Option<(f32, f64)>,
}

/// The bound of `gumbel_upper_bound` by table index `lz(2^53 - 1 - r)` (11: `u < 1/2`;
/// `i >= 12`: `(i - 10) ln 2`; other indices are unreachable).
fn bound_of_index(i: usize) -> f64 {
    match i {
        11 => 0.366_6,
        12.. => (i as f64 - 10.0) * std::f64::consts::LN_2,
        _ => GUMBEL_MAX,
    }
}

impl GumbelRace {
    fn new(key: NoiseKey, temperature: f32, min_p: Option<(f32, f64)>) -> Self {
        GumbelRace {
            key,
            t: f64::from(temperature),
            best: f64::NEG_INFINITY,
            best_id: u32::MAX,
            thr: [f64::NEG_INFINITY; 65],
            thr_any: f64::NEG_INFINITY,
            min_p,
        }
    }

    #[inline(always)]
    fn passes_min_p(&self, l: f32) -> bool {
        self.min_p
            .is_none_or(|(lmax, ln_min_p)| (f64::from(l) - f64::from(lmax)) / self.t >= ln_min_p)
    }

    /// Whether a token with logit at most `l` might still win.
    #[inline(always)]
    fn reachable(&self, l: f32) -> bool {
        f64::from(l) >= self.thr_any && self.passes_min_p(l)
    }

    fn set_best(&mut self, v: f64, token: u32) {
        self.best = v;
        self.best_id = token;
        // The slack dwarfs the rounding of `l / T + g` and of the thresholds themselves.
        let cut = v - 1e-9 * (1.0 + v.abs());
        for (i, thr) in self.thr.iter_mut().enumerate() {
            let x = (cut - bound_of_index(i)) * self.t;
            *thr = x - 1e-12 * x.abs();
        }
        let x = (cut - GUMBEL_MAX) * self.t;
        self.thr_any = x - 1e-12 * x.abs();
    }

    #[inline(always)]
    fn offer(&mut self, token: u32, l: f32) {
        let lf = f64::from(l);
        if l == f32::NEG_INFINITY || lf < self.thr_any {
            return;
        }
        let bits = self.key.bits(token);
        // lz(2^53 - 1 - r): 11 exactly when u < 1/2, else 12..=64 (no branch on r).
        let idx = (((1u64 << 53) - 1 - (bits >> 11)).leading_zeros() as usize).min(64);
        if lf < self.thr[idx] || !self.passes_min_p(l) {
            return;
        }
        debug_assert!(gumbel_upper_bound(bits) <= bound_of_index(idx));
        let v = lf / self.t + gumbel_from_bits(bits);
        if v > self.best || (v == self.best && token < self.best_id) {
            self.set_best(v, token);
        }
    }
}

/// Per-token adjustment gathered from the prefix and `logit_bias`.
#[derive(Clone, Copy, Debug)]
struct Adjustment {
    token: u32,
    count: u32,
    in_window: bool,
    bias: f32,
}

const NO_SLOT: u32 = u32::MAX;

/// Above this many adjusted tokens, patch a copy of the logits instead of carving the
/// tokens out of the dense set (which would break many words into the slow bit path).
const PATCH_AT: usize = 64;

/// The index of `t`'s adjustment, created empty on first use.
#[inline]
fn adjustment_slot(slot: &mut [u32], adjust: &mut Vec<Adjustment>, t: u32) -> usize {
    let s = &mut slot[t as usize];
    if *s == NO_SLOT {
        *s = adjust.len() as u32;
        adjust.push(Adjustment {
            token: t,
            count: 0,
            in_window: false,
            bias: 0.0,
        });
    }
    *s as usize
}

/// The sampling rule with reusable scratch buffers. One per worker thread; `choose` takes
/// `&mut self` only for the scratch, the result depends on the arguments alone.
#[derive(Debug, Default)]
pub struct Sampler {
    /// (allowed ∧ ¬never_sample); in sparse mode minus the adjusted tokens (in `extras`).
    eff: TokenMask,
    /// Max value of the `eff` tokens in each 64-token word.
    chunk_max: Vec<f32>,
    /// token -> index into `adjust`, `NO_SLOT` when absent; all `NO_SLOT` between calls.
    slot: Vec<u32>,
    adjust: Vec<Adjustment>,
    /// Sparse mode: allowed tokens whose logit was adjusted, (adjusted logit, token), finite.
    extras: Vec<(f32, u32)>,
    /// Patched mode (many adjusted tokens): a copy of the logits with adjusted values
    /// written in, so the dense passes keep whole 64-token words.
    work: Vec<f32>,
    patched: bool,
    topk: TopK,
    cands: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler with empty scratch (it grows to the vocabulary on first use).
    pub fn new() -> Self {
        Sampler::default()
    }

    /// Choose the next token of a row. See the crate docs for the rule; in short:
    /// penalties and `logit_bias` from `ctx` → allowed set (`allowed` ∧ ¬`never_sample`;
    /// `None` = every token; bits beyond a mask's length count as absent) → at T = 0 plain
    /// argmax (ties to the lowest id); at T > 0 top-k, then top-p and min-p on
    /// softmax(logit/T) of what top-k left, then the argmax of `logit/T + g(seed, position,
    /// token)` (ties to the lowest id).
    pub fn choose(
        &mut self,
        logits: &[f32],
        ctx: &ChoiceContext<'_>,
        params: &SamplingParams,
        allowed: Option<&TokenMask>,
        never_sample: &TokenMask,
    ) -> Result<Choice, SampleError> {
        params.validate()?;
        let n = logits.len();
        if n > MAX_VOCAB {
            return Err(SampleError::VocabTooLarge(n));
        }
        let (raw_max, lse) = log_normalizer(logits)?;
        self.build_allowed(n, allowed, never_sample);
        self.build_adjustments(logits, ctx, params)?;
        let work = std::mem::take(&mut self.work);
        let values: &[f32] = if self.patched { &work } else { logits };
        let token = self.choose_among(values, ctx, params);
        self.work = work;
        let token = token?;
        Ok(Choice {
            token,
            logprob: logprob_with(logits[token as usize], raw_max, lse),
            top: None,
        })
    }

    /// Steps 2–5 over the adjusted `values` (the logits themselves in sparse mode).
    fn choose_among(
        &mut self,
        values: &[f32],
        ctx: &ChoiceContext<'_>,
        params: &SamplingParams,
    ) -> Result<u32, SampleError> {
        let top = self.dense_top(values);
        let top = self
            .extras
            .iter()
            .fold(top, |b, &e| if better(e, b) { e } else { b });
        if top.0 == f32::NEG_INFINITY {
            return Err(SampleError::EmptyAllowedSet);
        }
        Ok(if params.temperature == 0.0 {
            top.1
        } else {
            self.sample(values, ctx, params, top)
        })
    }

    /// The logits after penalties and `logit_bias` (step 1 of the rule), for inspection and
    /// reporting; allocates. Tokens banned by a `-inf` bias read `-inf`.
    pub fn adjusted_logits(
        &mut self,
        logits: &[f32],
        ctx: &ChoiceContext<'_>,
        params: &SamplingParams,
    ) -> Result<Vec<f32>, SampleError> {
        params.validate()?;
        if logits.len() > MAX_VOCAB {
            return Err(SampleError::VocabTooLarge(logits.len()));
        }
        let every = TokenMask::new(0);
        self.build_allowed(logits.len(), None, &every);
        self.build_adjustments(logits, ctx, params)?;
        if self.patched {
            return Ok(self.work.clone());
        }
        let mut out = logits.to_vec();
        for a in &self.adjust {
            out[a.token as usize] = f32::NEG_INFINITY;
        }
        for &(v, t) in &self.extras {
            out[t as usize] = v;
        }
        Ok(out)
    }

    fn build_allowed(&mut self, n: usize, allowed: Option<&TokenMask>, never: &TokenMask) {
        self.eff.reset(n);
        let rem = n % 64;
        let words = self.eff.words_mut();
        let last = words.len().wrapping_sub(1);
        for (i, w) in words.iter_mut().enumerate() {
            let a = allowed.map_or(u64::MAX, |m| m.word_or_zero(i));
            let mut v = a & !never.word_or_zero(i);
            if i == last && rem != 0 {
                v &= (1u64 << rem) - 1;
            }
            *w = v;
        }
        self.chunk_max.clear();
        self.chunk_max.resize(words.len(), f32::NEG_INFINITY);
    }

    /// Gather penalties and bias: up to `PATCH_AT` adjusted tokens go to `extras` and leave
    /// `eff` (sparse mode); more are written into a copy of the logits (patched mode).
    fn build_adjustments(
        &mut self,
        logits: &[f32],
        ctx: &ChoiceContext<'_>,
        p: &SamplingParams,
    ) -> Result<(), SampleError> {
        self.extras.clear();
        self.adjust.clear();
        self.patched = false;
        let n = logits.len();
        let counts = p.counts_generated();
        let repetition = p.repetition_on();
        let total = ctx.prompt_tokens.len() + ctx.generated_tokens.len();
        let window_start = total.saturating_sub(p.repeat_last_n);
        let window = || {
            let skip_prompt = window_start.min(ctx.prompt_tokens.len());
            let skip_gen = window_start - skip_prompt;
            ctx.prompt_tokens[skip_prompt..]
                .iter()
                .chain(&ctx.generated_tokens[skip_gen..])
        };
        // Check every id before touching the slot table, so an error leaves it clean.
        let check = |t: u32| {
            if (t as usize) < n {
                Ok(())
            } else {
                Err(SampleError::TokenOutOfRange { token: t, vocab: n })
            }
        };
        if counts {
            ctx.generated_tokens.iter().try_for_each(|&t| check(t))?;
        }
        if repetition {
            window().try_for_each(|&t| check(t))?;
        }
        p.logit_bias.iter().try_for_each(|&(t, _)| check(t))?;
        if !counts && !repetition && p.logit_bias.is_empty() {
            return Ok(());
        }

        if self.slot.len() != n {
            self.slot.clear();
            self.slot.resize(n, NO_SLOT);
        }
        let (slot, adjust) = (&mut self.slot, &mut self.adjust);
        if counts {
            for &t in ctx.generated_tokens {
                let i = adjustment_slot(slot, adjust, t);
                adjust[i].count = adjust[i].count.saturating_add(1);
            }
        }
        if repetition {
            for &t in window() {
                let i = adjustment_slot(slot, adjust, t);
                adjust[i].in_window = true;
            }
        }
        for &(t, b) in &p.logit_bias {
            let i = adjustment_slot(slot, adjust, t);
            adjust[i].bias += b;
        }

        let mut overflow = None;
        let patch = self.adjust.len() > PATCH_AT;
        if patch {
            self.work.clear();
            self.work.extend_from_slice(logits);
            self.patched = true;
        }
        for a in &self.adjust {
            self.slot[a.token as usize] = NO_SLOT;
            if !self.eff.get(a.token) {
                continue;
            }
            if !patch {
                // The token leaves the dense set; in range, so this cannot fail.
                let _ = self.eff.set(a.token, false);
            }
            let mut v = logits[a.token as usize];
            if a.in_window {
                v = if v <= 0.0 {
                    v * p.repetition_penalty
                } else {
                    v / p.repetition_penalty
                };
            }
            if a.count > 0 {
                v -= a.count as f32 * p.frequency_penalty + p.presence_penalty;
            }
            v += a.bias;
            if v.is_nan() || v == f32::INFINITY {
                overflow.get_or_insert(SampleError::AdjustedLogitOverflow {
                    token: a.token,
                    value: v,
                });
            } else if patch {
                self.work[a.token as usize] = v;
            } else if v > f32::NEG_INFINITY {
                self.extras.push((v, a.token));
            }
        }
        overflow.map_or(Ok(()), Err)
    }

    /// The best (raw logit, id) among `eff`, filling `chunk_max`. `(-inf, MAX)` when none.
    fn dense_top(&mut self, logits: &[f32]) -> (f32, u32) {
        let mut best = (f32::NEG_INFINITY, u32::MAX);
        for (wi, &w) in self.eff.words().iter().enumerate() {
            if w == 0 {
                continue;
            }
            let base = wi * 64;
            let (m, at) = if w == u64::MAX {
                let chunk = &logits[base..base + 64];
                let m = max_f32(chunk);
                // Only a new best needs its (first) position.
                let at = if m > best.0 {
                    chunk.iter().position(|&x| x == m).unwrap_or(0)
                } else {
                    0
                };
                (m, at)
            } else {
                let mut m = (f32::NEG_INFINITY, 0usize);
                for b in BitIter(w) {
                    let l = logits[base + b as usize];
                    if l > m.0 {
                        m = (l, b as usize);
                    }
                }
                m
            };
            self.chunk_max[wi] = m;
            if m > best.0 {
                best = (m, (base + at) as u32);
            }
        }
        best
    }

    /// T > 0: truncation and the Gumbel race. `top` is the best allowed (logit, id).
    fn sample(
        &mut self,
        logits: &[f32],
        ctx: &ChoiceContext<'_>,
        p: &SamplingParams,
        top: (f32, u32),
    ) -> u32 {
        let candidates = self.eff.count() + self.extras.len();
        let use_top_k = p.top_k > 0 && p.top_k < candidates;
        let use_top_p = p.top_p < 1.0;
        let min_p = (p.min_p > 0.0).then(|| (top.0, f64::from(p.min_p).ln()));
        let mut race = GumbelRace::new(NoiseKey::new(p.seed, ctx.position), p.temperature, min_p);

        if !use_top_k && !use_top_p {
            // Dense: the allowed set itself, whole words skipped by their maximum.
            race.offer(top.1, top.0);
            for (wi, &w) in self.eff.words().iter().enumerate() {
                if w == 0 || !race.reachable(self.chunk_max[wi]) {
                    continue;
                }
                let base = wi * 64;
                if w == u64::MAX {
                    for (j, &l) in logits[base..base + 64].iter().enumerate() {
                        race.offer((base + j) as u32, l);
                    }
                } else {
                    for b in BitIter(w) {
                        race.offer((base + b as usize) as u32, logits[base + b as usize]);
                    }
                }
            }
            for &(l, id) in &self.extras {
                race.offer(id, l);
            }
            return race.best_id;
        }

        // List: materialise the candidates, best first.
        if use_top_k {
            self.collect_top_k(logits, p.top_k);
            if use_top_p {
                let w = NucleusWeight::new(top.0, p.temperature);
                let z = self.cands.iter().map(|&(l, _)| w.of(l)).sum::<f64>();
                let target = f64::from(p.top_p) * z;
                let keep = walk_prefix(&mut self.cands, &w, target, true);
                self.cands.truncate(keep.unwrap_or(usize::MAX));
            }
        } else {
            self.nucleus_dense(logits, top.0, p.temperature, p.top_p);
        }
        for &(l, id) in &self.cands {
            race.offer(id, l);
        }
        race.best_id
    }

    /// `cands` = the `k` best allowed (adjusted logit, id), best first.
    fn collect_top_k(&mut self, logits: &[f32], k: usize) {
        self.topk.reset(k);
        for (wi, &w) in self.eff.words().iter().enumerate() {
            if w == 0 {
                continue;
            }
            // Dense tokens come in id order, so a tie with the floor never enters.
            if let Some(floor) = self.topk.floor()
                && self.chunk_max[wi] <= floor.0
            {
                continue;
            }
            let base = wi * 64;
            for b in BitIter(w) {
                let id = base + b as usize;
                self.topk.offer_in_order(logits[id], id as u32);
            }
        }
        for &(l, id) in &self.extras {
            self.topk.offer_in_order(l, id);
        }
        self.topk.drain_sorted_into(&mut self.cands);
    }

    /// Top-p over the whole allowed set: the total mass in one pass (id order, then extras),
    /// then candidates are collected above a falling logit threshold until the best-first
    /// walk reaches `top_p` of it. `cands` = the kept prefix, best first.
    fn nucleus_dense(&mut self, logits: &[f32], lmax: f32, temperature: f32, top_p: f32) {
        let w = NucleusWeight::new(lmax, temperature);
        let mut z = 0.0f64;
        for (wi, &word) in self.eff.words().iter().enumerate() {
            let base = wi * 64;
            if word == u64::MAX {
                z += w.sum(&logits[base..base + 64]);
            } else {
                for b in BitIter(word) {
                    z += w.of(logits[base + b as usize]);
                }
            }
        }
        z += self.extras.iter().map(|&(l, _)| w.of(l)).sum::<f64>();
        let target = f64::from(top_p) * z;
        // Tokens at or above a logit threshold form a best-first prefix; the crossing token
        // lies in the first such prefix whose walk reaches the target.
        for nats in [8.0f32, 16.0, 32.0, 64.0, f32::INFINITY] {
            let floor = lmax - nats * temperature;
            self.cands.clear();
            for (wi, &word) in self.eff.words().iter().enumerate() {
                if word == 0 || self.chunk_max[wi] < floor {
                    continue;
                }
                let base = wi * 64;
                for b in BitIter(word) {
                    let id = base + b as usize;
                    let l = logits[id];
                    if l >= floor && l > f32::NEG_INFINITY {
                        self.cands.push((l, id as u32));
                    }
                }
            }
            self.cands.extend(
                self.extras
                    .iter()
                    .filter(|&&(l, _)| l >= floor && l > f32::NEG_INFINITY),
            );
            if let Some(keep) = walk_prefix(&mut self.cands, &w, target, false) {
                self.cands.truncate(keep);
                return;
            }
        }
    }
}

/// The top-p weight `exp((l - l_max) / T)`, in f32 with the crate's one `exp`.
struct NucleusWeight {
    lmax: f32,
    t: f32,
}

impl NucleusWeight {
    fn new(lmax: f32, t: f32) -> Self {
        NucleusWeight { lmax, t }
    }

    #[inline(always)]
    fn of(&self, l: f32) -> f64 {
        f64::from(exp_nonpositive((l - self.lmax) / self.t))
    }

    /// The sum of the weights of `xs` in fixed lanes (vectorised).
    fn sum(&self, xs: &[f32]) -> f64 {
        let mut lanes = [0f64; 8];
        let chunks = xs.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            let mut e = [0f32; 8];
            for j in 0..8 {
                e[j] = exp_nonpositive((c[j] - self.lmax) / self.t);
            }
            for j in 0..8 {
                lanes[j] += f64::from(e[j]);
            }
        }
        let mut sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for &x in rest {
            sum += self.of(x);
        }
        sum
    }
}

/// Sort `cands` best first (incrementally, in growing blocks, unless already `sorted`) and
/// walk it; the length of the smallest prefix whose weight reaches `target`, or `None`.
fn walk_prefix(
    cands: &mut [(f32, u32)],
    w: &NucleusWeight,
    target: f64,
    sorted: bool,
) -> Option<usize> {
    let mut cum = 0.0;
    let mut start = 0;
    let mut block = 64;
    while start < cands.len() {
        let rest = &mut cands[start..];
        let m = if sorted {
            rest.len()
        } else {
            block.min(rest.len())
        };
        if !sorted {
            if m < rest.len() {
                rest.select_nth_unstable_by(m - 1, best_first);
            }
            rest[..m].sort_unstable_by(best_first);
        }
        for (i, &(l, _)) in rest[..m].iter().enumerate() {
            cum += w.of(l);
            if cum >= target {
                return Some(start + i + 1);
            }
        }
        start += m;
        block *= 2;
    }
    None
}

/// [`Sampler::choose`] with fresh scratch (allocates; use a `Sampler` in loops).
pub fn choose(
    logits: &[f32],
    ctx: &ChoiceContext<'_>,
    params: &SamplingParams,
    allowed: Option<&TokenMask>,
    never_sample: &TokenMask,
) -> Result<Choice, SampleError> {
    Sampler::new().choose(logits, ctx, params, allowed, never_sample)
}
