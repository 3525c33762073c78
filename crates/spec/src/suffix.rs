//! Cross-request drafting in the spirit of SuffixDecoding: a [`SuffixIndex`] over the
//! token sequences (prompt + output) of earlier requests of one engine, and a
//! [`SuffixDrafter`] per sequence that proposes what followed the sequence's current
//! suffix there.
//!
//! Agent loops repeat themselves across requests: the same tool-call envelopes, file
//! paths, JSON keys, and code re-emitted with small edits. The index keeps the sequences of
//! finished requests (only the part not shared with a recent earlier sequence, so a
//! multi-turn session's ever-growing prompt is stored once), anchored on every
//! `min_match`-token window. A proposal:
//! 1. finds the occurrences of the sequence's last `min_match` tokens, extends each match
//!    backwards up to `max_depth` tokens and keeps those with the longest match (the
//!    pattern);
//! 2. grows the draft greedily: the next token is the most frequent continuation among
//!    the remaining candidates (ties: the most recent), its probability that frequency;
//!    drafting stops when the product of the probabilities falls below `min_prob`;
//! 3. drafts at most `spec_factor × match length` tokens: longer matches draft further.
//!
//! Agent loops call the same tools again and again with values that change from call to
//! call (an order id, a file path, a line number), so a long match often sits in front of
//! a *variable slot*. Inside a match of at least `SLOT_MIN_CONTEXT` (8) tokens, a token
//! on which the candidates disagree while agreeing on the token after it is a slot: it is
//! drafted as the token that followed the same two tokens most recently in the sequence
//! (the latest tool result, the call being written), and when that value is new the
//! candidates step over it and the envelope goes on. After the output wrote a value that
//! no candidate had (a correction), the pattern that ends with it is short; a *slot
//! match* (the pattern with its last token substituted) at least `SLOT_MARGIN` (4) tokens
//! longer than the best exact match then proposes what followed the value there, unless
//! the sequence itself continues that token alike every time (at least twice: a tool
//! name, not a value). (A single candidate is never overridden by the most recent value:
//! in code that loses far more than it gains.)
//!
//! The same walk over the sequence itself (its prompt and output so far) competes with the
//! index; the one with the higher score (the expected number of accepted tokens, the sum
//! of the running probabilities) proposes, the sequence itself winning ties. Under a
//! grammar only the index is used, and only for matches of at least
//! `constrained_min_match` tokens: the n-gram drafter's prompt cursor serves the request's
//! own text better there. Every token passes the grammar mirror.
//!
//! The index is bounded: at most `budget_tokens` stored tokens over all partitions, the
//! oldest sequence evicted first (plus the last [`RECENT`] sequences of each partition,
//! kept whole to find what a new sequence shares with them). Partitions separate callers
//! (the server's API keys): a sequence only reads and feeds its own partition.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};

/// Settings of the cross-request index and its drafters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SuffixConfig {
    /// Most tokens stored over all partitions; the oldest sequences are evicted first.
    pub budget_tokens: usize,
    /// Longest pattern matched (tokens compared backwards from the sequence's end).
    pub max_depth: usize,
    /// Shortest pattern that proposes (also the anchor length of the index), at least 1.
    pub min_match: usize,
    /// Draft at most this many tokens per matched pattern token.
    pub spec_factor: f32,
    /// Stop drafting when the draft's estimated probability falls below this.
    pub min_prob: f32,
    /// Under a grammar, the shortest pattern that proposes.
    pub constrained_min_match: usize,
}

impl Default for SuffixConfig {
    /// 262,144 tokens, patterns of 4 to 24 tokens (8 under a grammar), one draft per
    /// pattern token, probability bar 0.1.
    fn default() -> Self {
        SuffixConfig {
            budget_tokens: 262_144,
            max_depth: 24,
            min_match: 4,
            spec_factor: 1.0,
            min_prob: 0.1,
            constrained_min_match: 8,
        }
    }
}

/// Whole sequences kept per partition to find the prefix a new one shares with them.
pub const RECENT: usize = 4;
/// Most occurrences examined per proposal (the most recent first).
pub const MAX_SCAN: usize = 512;
/// Least context a *slot* match needs before its substituted token (see
/// [`SuffixDrafter`]).
const SLOT_MIN_CONTEXT: usize = 8;
/// How many more tokens a slot match must match than the best exact match to be used.
const SLOT_MARGIN: usize = 4;
/// Tokens before a variable slot whose most recent occurrence in the sequence gives the
/// slot's value.
const SLOT_KEY: usize = 2;

/// Counters of a [`SuffixIndex`] (monotonic, except `stored_tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SuffixCounters {
    /// Sequences added.
    pub sequences: u64,
    /// Tokens added (after removing what a recent sequence already held).
    pub learned_tokens: u64,
    /// Tokens evicted to stay within the budget.
    pub evicted_tokens: u64,
    /// Tokens held now.
    pub stored_tokens: u64,
    /// Proposals drawn from the index (earlier requests).
    pub index_proposals: u64,
    /// Proposals drawn from the sequence itself.
    pub local_proposals: u64,
    /// Tokens proposed, both sources.
    pub proposed_tokens: u64,
}

/// One partition's stored sequences and their anchor index.
#[derive(Debug, Default)]
struct Corpus {
    /// Id of `docs[0]`.
    first: u64,
    docs: VecDeque<Vec<u32>>,
    /// Anchor hash → (doc id, continuation start), oldest first.
    anchors: HashMap<u64, Vec<(u64, u32)>>,
    live: usize,
    dead: usize,
    recent: VecDeque<Vec<u32>>,
}

impl Corpus {
    fn doc(&self, id: u64) -> Option<&[u32]> {
        let i = id.checked_sub(self.first)?;
        self.docs.get(usize::try_from(i).ok()?).map(Vec::as_slice)
    }
}

#[derive(Debug, Default)]
struct State {
    parts: HashMap<u64, Corpus>,
    /// (partition, doc id, tokens) in insertion order, for eviction.
    order: VecDeque<(u64, u64, usize)>,
    total: usize,
}

/// The cross-request suffix index of one engine (one model), shared by the drafters of
/// its sequences.
#[derive(Debug)]
pub struct SuffixIndex {
    cfg: SuffixConfig,
    state: Mutex<State>,
    sequences: AtomicU64,
    learned: AtomicU64,
    evicted: AtomicU64,
    index_proposals: AtomicU64,
    local_proposals: AtomicU64,
    proposed: AtomicU64,
}

fn anchor_hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x5851_f42d_4c95_7f2d);
    }
    h
}

/// How many tokens before `a_end` in `a` equal those before `b_end` in `b` (at most `max`).
fn match_back(a: &[u32], a_end: usize, b: &[u32], b_end: usize, max: usize) -> usize {
    let mut m = 0;
    while m < max && m < a_end && m < b_end && a[a_end - 1 - m] == b[b_end - 1 - m] {
        m += 1;
    }
    m
}

/// The token that followed the last [`SLOT_KEY`] tokens of `s` + `drafted` most recently
/// before (in `s` + `drafted` itself).
fn recent_value(s: &[u32], drafted: &[u32]) -> Option<u32> {
    let n = s.len() + drafted.len();
    if n <= SLOT_KEY {
        return None;
    }
    let at = |i: usize| {
        if i < s.len() {
            s[i]
        } else {
            drafted[i - s.len()]
        }
    };
    (SLOT_KEY..n)
        .rev()
        .find(|&p| (1..=SLOT_KEY).all(|d| at(p - d) == at(n - d)))
        .map(at)
}

/// A candidate continuation: `src[pos..]` follows an occurrence of the pattern.
type Cand<'a> = (&'a [u32], usize);

/// A walk's result: the tokens and the score (the sum of the running probabilities).
struct Walk {
    tokens: Vec<u32>,
    score: f64,
}

/// Grows a draft from `cands` (most recent first): at each step the continuations are
/// counted, the most frequent one that `take` accepts is chosen while the running
/// probability stays at or above `min_prob`.
fn walk(
    mut cands: Vec<Cand<'_>>,
    k: usize,
    min_prob: f64,
    ends: impl Fn(u32) -> bool,
    recent: impl Fn(&[u32]) -> Option<u32>,
    mut take: impl FnMut(u32) -> bool,
) -> Walk {
    let mut out = Walk {
        tokens: Vec::new(),
        score: 0.0,
    };
    let mut prob = 1.0f64;
    let mut counts: Vec<(u32, usize)> = Vec::new();
    for j in 0..k {
        counts.clear();
        let mut total = 0usize;
        for &(src, pos) in &cands {
            if let Some(&t) = src.get(pos + j) {
                total += 1;
                match counts.iter_mut().find(|c| c.0 == t) {
                    Some(c) => c.1 += 1,
                    None => counts.push((t, 1)),
                }
            }
        }
        if total == 0 {
            break;
        }
        // Stable: equal counts keep the most recent first.
        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
        // A variable slot: the occurrences disagree on this token (an id, a path, a
        // number that changes from call to call). Its value is the one that followed the
        // same few tokens most recently in the sequence (the latest tool result, the
        // current call), at the confidence of the slot's most frequent value; when that
        // value is new, every candidate steps over the slot (a one-token substitution).
        // What the candidates write after this token: one token for all of them marks
        // a slot in a fixed envelope (in free text the continuations differ too).
        let after_agrees = || {
            let mut next = cands.iter().filter_map(|&(src, pos)| src.get(pos + j + 1));
            next.next()
                .is_some_and(|first| next.clone().count() > 0 && next.all(|t| t == first))
        };
        let slot = if counts.len() > 1 && after_agrees() {
            recent(&out.tokens).map(|r| (r, counts[0].1 as f64 / total as f64))
        } else {
            None
        };
        let mut chosen = None;
        let mut skip = false;
        if let Some((r, p)) = slot
            && prob * p >= min_prob
            && take(r)
        {
            skip = !counts.iter().any(|c| c.0 == r);
            chosen = Some((r, p));
        }
        if chosen.is_none() {
            for &(t, c) in &counts {
                let p = c as f64 / total as f64;
                if prob * p < min_prob {
                    break;
                }
                if take(t) {
                    chosen = Some((t, p));
                    break;
                }
            }
        }
        let Some((t, p)) = chosen else { break };
        prob *= p;
        out.score += prob;
        out.tokens.push(t);
        if skip {
            cands.retain(|&(src, pos)| src.get(pos + j).is_some());
        } else {
            cands.retain(|&(src, pos)| src.get(pos + j) == Some(&t));
        }
        if ends(t) {
            break;
        }
    }
    out
}

impl SuffixIndex {
    /// An empty index with `cfg` (`min_match` at least 1, `max_depth` at least
    /// `min_match`).
    pub fn new(cfg: SuffixConfig) -> SuffixIndex {
        let min_match = cfg.min_match.max(1);
        SuffixIndex {
            cfg: SuffixConfig {
                min_match,
                max_depth: cfg.max_depth.max(min_match),
                constrained_min_match: cfg.constrained_min_match.max(min_match),
                ..cfg
            },
            state: Mutex::new(State::default()),
            sequences: AtomicU64::new(0),
            learned: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            index_proposals: AtomicU64::new(0),
            local_proposals: AtomicU64::new(0),
            proposed: AtomicU64::new(0),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SuffixConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counters so far.
    pub fn counters(&self) -> SuffixCounters {
        let stored = self.lock().total as u64;
        SuffixCounters {
            sequences: self.sequences.load(Ordering::Relaxed),
            learned_tokens: self.learned.load(Ordering::Relaxed),
            evicted_tokens: self.evicted.load(Ordering::Relaxed),
            stored_tokens: stored,
            index_proposals: self.index_proposals.load(Ordering::Relaxed),
            local_proposals: self.local_proposals.load(Ordering::Relaxed),
            proposed_tokens: self.proposed.load(Ordering::Relaxed),
        }
    }

    /// A drafter for one sequence of `partition`.
    pub fn drafter(self: &Arc<Self>, partition: u64) -> SuffixDrafter {
        SuffixDrafter {
            index: Arc::clone(self),
            partition,
        }
    }

    /// Adds a finished sequence (prompt + output) to `partition`: the part after what it
    /// shares with one of the partition's [`RECENT`] sequences (less `max_depth` tokens of
    /// overlap, so patterns across the seam still match), then evicts the oldest
    /// sequences while over the budget.
    pub fn learn(&self, partition: u64, tokens: &[u32]) {
        let a = self.cfg.min_match;
        if tokens.len() <= a || self.cfg.budget_tokens == 0 {
            return;
        }
        let mut st = self.lock();
        let State {
            parts,
            order,
            total,
        } = &mut *st;
        let corpus = parts.entry(partition).or_default();
        let shared = corpus
            .recent
            .iter()
            .map(|r| r.iter().zip(tokens).take_while(|(x, y)| x == y).count())
            .max()
            .unwrap_or(0);
        if shared < tokens.len() {
            let start = shared
                .saturating_sub(self.cfg.max_depth)
                .max(tokens.len().saturating_sub(self.cfg.budget_tokens));
            let doc = tokens[start..].to_vec();
            if doc.len() > a {
                let id = corpus.first + corpus.docs.len() as u64;
                for p in a..doc.len() {
                    corpus
                        .anchors
                        .entry(anchor_hash(&doc[p - a..p]))
                        .or_default()
                        .push((id, p as u32));
                }
                corpus.live += doc.len() - a;
                order.push_back((partition, id, doc.len()));
                *total += doc.len();
                self.learned.fetch_add(doc.len() as u64, Ordering::Relaxed);
                corpus.docs.push_back(doc);
            }
        }
        corpus.recent.push_back(tokens.to_vec());
        if corpus.recent.len() > RECENT {
            corpus.recent.pop_front();
        }
        self.sequences.fetch_add(1, Ordering::Relaxed);
        while *total > self.cfg.budget_tokens {
            let Some((part, _, len)) = order.pop_front() else {
                break;
            };
            *total -= len;
            self.evicted.fetch_add(len as u64, Ordering::Relaxed);
            let Some(c) = parts.get_mut(&part) else {
                continue;
            };
            c.docs.pop_front();
            c.first += 1;
            let entries = len.saturating_sub(a);
            c.live -= entries.min(c.live);
            c.dead += entries;
            if c.docs.is_empty() {
                parts.remove(&part);
            } else if c.dead > c.live {
                let first = c.first;
                c.anchors.retain(|_, v| {
                    v.retain(|e| e.0 >= first);
                    !v.is_empty()
                });
                c.dead = 0;
            }
        }
    }

    /// Tokens of `partition`'s index that would be proposed after `tokens`
    /// (unconstrained; for tests and tools).
    pub fn lookup(&self, partition: u64, tokens: &[u32], k: usize) -> Vec<u32> {
        let st = self.lock();
        let Some(c) = st.parts.get(&partition) else {
            return Vec::new();
        };
        match self.index_cands(c, tokens) {
            Some((cands, m)) => {
                let k = k.min(self.cap(m));
                walk(
                    cands,
                    k,
                    f64::from(self.cfg.min_prob),
                    |_| false,
                    |d| {
                        (m >= SLOT_MIN_CONTEXT)
                            .then(|| recent_value(tokens, d))
                            .flatten()
                    },
                    |_| true,
                )
                .tokens
            }
            None => Vec::new(),
        }
    }

    fn cap(&self, m: usize) -> usize {
        (self.cfg.spec_factor.max(0.0) * m as f32).ceil() as usize
    }

    /// The index's candidates after `s` with the longest pattern, and its length.
    fn index_cands<'c>(&self, c: &'c Corpus, s: &[u32]) -> Option<(Vec<Cand<'c>>, usize)> {
        let a = self.cfg.min_match;
        if s.len() < a {
            return None;
        }
        let list = c.anchors.get(&anchor_hash(&s[s.len() - a..]))?;
        let mut best = 0;
        let mut cands: Vec<(Cand<'c>, usize)> = Vec::new();
        for &(id, pos) in list.iter().rev() {
            if id < c.first {
                continue;
            }
            let Some(doc) = c.doc(id) else { continue };
            let pos = pos as usize;
            if pos >= doc.len() {
                continue;
            }
            let m = match_back(doc, pos, s, s.len(), self.cfg.max_depth);
            if m < a {
                continue; // a hash collision
            }
            best = best.max(m);
            cands.push(((doc, pos), m));
            if cands.len() >= MAX_SCAN {
                break;
            }
        }
        best_of(cands, best, a)
    }

    /// The index's *slot* candidates after `s`: occurrences of the pattern with `s`'s last
    /// token substituted (the continuation after a value that differs from the one
    /// written there), with the longest context before it, and that context's length.
    fn index_slot_cands<'c>(&self, c: &'c Corpus, s: &[u32]) -> Option<(Vec<Cand<'c>>, usize)> {
        let a = self.cfg.min_match;
        let n = s.len();
        if n <= a {
            return None;
        }
        let list = c.anchors.get(&anchor_hash(&s[n - 1 - a..n - 1]))?;
        let mut best = 0;
        let mut cands: Vec<(Cand<'c>, usize)> = Vec::new();
        for &(id, pos) in list.iter().rev() {
            let Some(doc) = c.doc(id) else { continue };
            let pos = pos as usize;
            if pos + 1 >= doc.len() || doc[pos] == s[n - 1] {
                continue;
            }
            let m = match_back(doc, pos, s, n - 1, self.cfg.max_depth);
            if m < a {
                continue;
            }
            best = best.max(m);
            cands.push(((doc, pos + 1), m));
            if cands.len() >= MAX_SCAN {
                break;
            }
        }
        best_of(cands, best, a)
    }

    /// The sequence's own slot candidates (as [`SuffixIndex::index_slot_cands`], in `s`).
    fn local_slot_cands<'s>(&self, s: &'s [u32]) -> Option<(Vec<Cand<'s>>, usize)> {
        let a = self.cfg.min_match;
        let n = s.len();
        if n <= a + 1 {
            return None;
        }
        let key = &s[n - 1 - a..n - 1];
        let mut best = 0;
        let mut cands: Vec<(Cand<'s>, usize)> = Vec::new();
        for p in (a..n - 1).rev() {
            if s[p] == s[n - 1] || s[p - a..p] != *key {
                continue;
            }
            let m = match_back(s, p, s, n - 1, self.cfg.max_depth);
            best = best.max(m);
            cands.push(((s, p + 1), m));
            if cands.len() >= MAX_SCAN {
                break;
            }
        }
        best_of(cands, best, a)
    }

    /// The sequence's own candidates (occurrences in `s` itself, most recent first).
    fn local_cands<'s>(&self, s: &'s [u32]) -> Option<(Vec<Cand<'s>>, usize)> {
        let a = self.cfg.min_match;
        let n = s.len();
        if n <= a {
            return None;
        }
        let key = &s[n - a..];
        let mut best = 0;
        let mut cands: Vec<(Cand<'s>, usize)> = Vec::new();
        for p in (a..n).rev() {
            if s[p - a..p] != *key {
                continue;
            }
            let m = match_back(s, p, s, n, self.cfg.max_depth);
            best = best.max(m);
            cands.push(((s, p), m));
            if cands.len() >= MAX_SCAN {
                break;
            }
        }
        best_of(cands, best, a)
    }
}

/// The candidates of match length `best` (when at least `min`), and `best`.
fn best_of(
    cands: Vec<(Cand<'_>, usize)>,
    best: usize,
    min: usize,
) -> Option<(Vec<Cand<'_>>, usize)> {
    (best >= min).then(|| {
        let v = cands
            .into_iter()
            .filter(|&(_, m)| m == best)
            .map(|(c, _)| c)
            .collect();
        (v, best)
    })
}

/// One sequence's cross-request drafter: reads its partition of the [`SuffixIndex`] and
/// adds the sequence to it when it finishes.
#[derive(Debug)]
pub struct SuffixDrafter {
    index: Arc<SuffixIndex>,
    partition: u64,
}

impl Drafter for SuffixDrafter {
    fn kind(&self) -> DrafterKind {
        DrafterKind::Suffix
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let k = ctx.max_draft.min(ctx.max_tokens);
        let mut out = DraftProposal::default();
        if k == 0 || mirror.is_stopped() {
            return out;
        }
        let ix = &self.index;
        let cfg = ix.cfg;
        let min_prob = f64::from(cfg.min_prob);
        let ends = |t: u32| ctx.ends(t);
        // Variable slots are recognised only inside a long matched context (an envelope
        // repeated call after call), not in free text's short matches.
        let tokens = ctx.tokens;
        let recent = |m: usize| {
            move |d: &[u32]| {
                if m >= SLOT_MIN_CONTEXT {
                    recent_value(tokens, d)
                } else {
                    None
                }
            }
        };
        let st = ix.lock();
        let global = st
            .parts
            .get(&self.partition)
            .and_then(|c| ix.index_cands(c, ctx.tokens));
        let constrained = mirror.is_constrained();
        let (cands, m, from_index) = if constrained {
            match global {
                Some((c, m)) if m >= cfg.constrained_min_match => (c, m, true),
                _ => return out,
            }
        } else {
            let local = ix.local_cands(ctx.tokens);
            // A slot match: the last token was a value that differs from the one at an
            // earlier occurrence of a much longer context (the next call of a tool with a
            // new id): the continuation after that value.
            let exact = |c: &Option<(Vec<Cand<'_>>, usize)>| c.as_ref().map_or(0, |c| c.1);
            let m_exact = exact(&global).max(exact(&local));
            // Exact occurrences in the sequence itself that all continue alike (at least
            // two) say the last token is no slot value but a known word (a tool name
            // whose continuation is settled): no slot match then. (The index is not
            // counted: it holds copies of the same earlier prompts.)
            let settled = {
                let mut next = local
                    .iter()
                    .flat_map(|(c, _)| c.iter())
                    .filter_map(|&(src, pos)| src.get(pos));
                next.next()
                    .is_some_and(|first| next.clone().count() > 0 && next.all(|t| t == first))
            };
            let slot = {
                let g = st
                    .parts
                    .get(&self.partition)
                    .and_then(|c| ix.index_slot_cands(c, ctx.tokens));
                let l = ix.local_slot_cands(ctx.tokens);
                match (g, l) {
                    (Some(g), Some(l)) if g.1 > l.1 => Some((g, true)),
                    (_, Some(l)) => Some((l, false)),
                    (g, None) => g.map(|g| (g, true)),
                }
            };
            match slot {
                Some(((c, m), from_index))
                    if !settled && m >= SLOT_MIN_CONTEXT && m >= m_exact + SLOT_MARGIN =>
                {
                    (c, m, from_index)
                }
                _ => {
                    let score = |c: &Option<(Vec<Cand<'_>>, usize)>| {
                        c.as_ref().map_or(0.0, |(c, m)| {
                            walk(
                                c.clone(),
                                k.min(ix.cap(*m)),
                                min_prob,
                                ends,
                                recent(*m),
                                |_| true,
                            )
                            .score
                        })
                    };
                    let (gs, ls) = (score(&global), score(&local));
                    match (global, local) {
                        (Some((c, m)), _) if gs > ls => (c, m, true),
                        (_, Some((c, m))) if ls > 0.0 => (c, m, false),
                        _ => return out,
                    }
                }
            }
        };
        let w = walk(cands, k.min(ix.cap(m)), min_prob, ends, recent(m), |t| {
            mirror.try_push(t)
        });
        drop(st);
        if w.tokens.is_empty() {
            return out;
        }
        let counter = if from_index {
            &ix.index_proposals
        } else {
            &ix.local_proposals
        };
        counter.fetch_add(1, Ordering::Relaxed);
        ix.proposed
            .fetch_add(w.tokens.len() as u64, Ordering::Relaxed);
        out.tokens = w.tokens;
        out.source = Some(DrafterKind::Suffix);
        out
    }

    fn finish(&mut self, committed: &[u32]) {
        self.index.learn(self.partition, committed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sampling::{SamplingParams, TokenMask};

    fn ctx<'a>(
        tokens: &'a [u32],
        params: &'a SamplingParams,
        never: &'a TokenMask,
        k: usize,
    ) -> DraftContext<'a> {
        DraftContext {
            tokens,
            prompt_len: tokens.len(),
            params,
            never,
            max_tokens: k,
            max_draft: k,
            kind_caps: &[],
            allow_costly: false,
            bars: &[],
            eos_ends: true,
            eos: &[],
            target: None,
        }
    }

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn an_earlier_request_drafts_its_continuation_up_to_the_match_length() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        ix.learn(0, &seq(100..160));
        // A new request ends with 6 tokens of the earlier one: 6 drafts (factor 1).
        let mut now = seq(1..20);
        now.extend(110..116);
        assert_eq!(ix.lookup(0, &now, 16), seq(116..122));
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let mut d = ix.drafter(0);
        let p = d.propose(&ctx(&now, &params, &never, 3), &mut Mirror::unconstrained());
        assert_eq!(p.tokens, vec![116, 117, 118]);
        assert_eq!(p.source, Some(DrafterKind::Suffix));
        assert_eq!(ix.counters().index_proposals, 1);
    }

    #[test]
    fn partitions_never_see_each_others_sequences() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        ix.learn(1, &seq(100..160));
        let mut now = seq(1..20);
        now.extend(110..130);
        assert!(ix.lookup(2, &now, 8).is_empty());
        assert_eq!(ix.lookup(1, &now, 8), seq(130..138));
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let p = ix
            .drafter(2)
            .propose(&ctx(&now, &params, &never, 8), &mut Mirror::unconstrained());
        assert!(p.tokens.is_empty(), "{p:?}");
    }

    #[test]
    fn the_most_frequent_continuation_wins_and_rare_ones_stop_the_draft() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        let pattern = [7u32, 8, 9, 10, 11, 12];
        for (i, tail) in [[50u32, 51], [50, 51], [50, 52], [60, 61]]
            .iter()
            .enumerate()
        {
            let mut s = vec![1000 + i as u32];
            s.extend(pattern);
            s.extend(tail);
            ix.learn(0, &s);
        }
        let mut now = vec![5u32];
        now.extend(pattern);
        // 50 follows 3 of 4 (p = 0.75); then 51 follows 2 of those 3: 0.75 × 2/3 = 0.5.
        assert_eq!(ix.lookup(0, &now, 8), vec![50, 51]);
        let strict = SuffixIndex::new(SuffixConfig {
            min_prob: 0.6,
            ..SuffixConfig::default()
        });
        for (i, tail) in [[50u32, 51], [50, 51], [50, 52], [60, 61]]
            .iter()
            .enumerate()
        {
            let mut s = vec![2000 + i as u32];
            s.extend(pattern);
            s.extend(tail);
            strict.learn(0, &s);
        }
        assert_eq!(strict.lookup(0, &now, 8), vec![50]);
    }

    #[test]
    fn the_budget_evicts_the_oldest_sequences_first() {
        let ix = SuffixIndex::new(SuffixConfig {
            budget_tokens: 100,
            ..SuffixConfig::default()
        });
        ix.learn(0, &seq(1000..1060));
        ix.learn(1, &seq(2000..2060));
        let c = ix.counters();
        assert_eq!(
            (c.learned_tokens, c.evicted_tokens, c.stored_tokens),
            (120, 60, 60)
        );
        assert!(ix.lookup(0, &seq(1010..1020), 4).is_empty(), "evicted");
        assert_eq!(ix.lookup(1, &seq(2010..2020), 4), seq(2020..2024));
        for i in 0..20u32 {
            ix.learn(3, &seq(3000 + 100 * i..3040 + 100 * i));
        }
        assert!(ix.counters().stored_tokens <= 100);
        assert_eq!(ix.lookup(3, &seq(4910..4920), 4), seq(4920..4924));
    }

    #[test]
    fn a_growing_session_stores_only_what_is_new() {
        let ix = SuffixIndex::new(SuffixConfig::default());
        let first = seq(0..200);
        ix.learn(0, &first);
        // A repeat adds nothing.
        ix.learn(0, &first);
        assert_eq!(ix.counters().learned_tokens, 200);
        let mut second = first.clone();
        second.extend(500..550);
        ix.learn(0, &second);
        // 200, then 50 new tokens and 24 of overlap.
        assert_eq!(ix.counters().learned_tokens, 200 + 50 + 24);
    }

    #[test]
    fn the_sequence_itself_drafts_when_the_index_is_empty_and_the_mirror_is_free() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        let mut now = seq(10..40);
        now.extend(10..16);
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let p = ix
            .drafter(0)
            .propose(&ctx(&now, &params, &never, 4), &mut Mirror::unconstrained());
        assert_eq!(p.tokens, seq(16..20));
        assert_eq!(ix.counters().local_proposals, 1);
    }

    /// A tool call's envelope: 12 fixed tokens, the id token, then 6 fixed tokens.
    fn call(id: u32) -> Vec<u32> {
        let mut v = seq(200..212);
        v.push(id);
        v.extend(300..306);
        v
    }

    #[test]
    fn a_variable_slot_takes_its_most_recent_value_and_the_envelope_goes_on() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        // Two earlier calls with ids 40 and 41.
        let mut a = seq(1..10);
        a.extend(call(40));
        ix.learn(0, &a);
        let mut b = seq(500..510);
        b.extend(call(41));
        ix.learn(0, &b);
        // The latest tool result names id 42 after the id's two context tokens.
        let mut now = seq(600..610);
        now.extend([210, 211, 42, 700]);
        now.extend(200..212);
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let p = ix
            .drafter(0)
            .propose(&ctx(&now, &params, &never, 7), &mut Mirror::unconstrained());
        let mut want = vec![42];
        want.extend(300..306);
        assert_eq!(p.tokens, want);
        // Without a recent value (no earlier `210 211`), the most frequent (the most
        // recent of equals) is drafted.
        let mut plain = seq(600..610);
        plain.extend(200..212);
        assert_eq!(ix.lookup(0, &plain, 3), vec![41, 300, 301]);
    }

    #[test]
    fn after_a_new_value_the_longer_context_before_it_drafts_the_rest_of_the_envelope() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        let mut a = seq(1..10);
        a.extend(call(40));
        ix.learn(0, &a);
        // The id just written (43) is new; elsewhere `43` is followed by 900.
        let mut now = vec![43, 900, 901, 902, 903];
        now.extend(seq(600..610));
        now.extend(200..212);
        now.push(43);
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let p = ix
            .drafter(0)
            .propose(&ctx(&now, &params, &never, 6), &mut Mirror::unconstrained());
        assert_eq!(p.tokens, seq(300..306));
        // A short context before a new token is no slot: nothing from the index.
        // (`200..204` matches with the 3 tokens before it: 7 in all.)
        let short = vec![7u32, 8, 9, 200, 201, 202, 203, 43];
        let p = ix.drafter(0).propose(
            &ctx(&short, &params, &never, 6),
            &mut Mirror::unconstrained(),
        );
        assert!(p.tokens.is_empty(), "{p:?}");
    }

    #[test]
    fn a_word_the_sequence_always_continues_alike_is_no_slot() {
        let ix = Arc::new(SuffixIndex::new(SuffixConfig::default()));
        let mut a = seq(1..10);
        a.extend(call(40));
        ix.learn(0, &a);
        // `45` follows the id's context twice in the sequence, each time with 46 47 48.
        let mut now = vec![1, 2, 209, 210, 211, 45, 46, 47, 48, 3, 4, 209, 210, 211, 45];
        now.extend([46, 47, 48]);
        now.extend(600..610);
        now.extend(200..212);
        now.push(45);
        let params = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let p = ix
            .drafter(0)
            .propose(&ctx(&now, &params, &never, 3), &mut Mirror::unconstrained());
        assert_eq!(p.tokens, vec![46, 47, 48]);
    }
}
