//! n-gram / prompt lookup: find the most recent earlier occurrence of the last `n` tokens
//! (n from `max_n` down to 1) in prompt + output and propose what followed it. Free to
//! run and strong on structured payloads, code edits and anything that repeats the prompt.
//!
//! Beside the lookup it keeps a **prompt cursor**: the prompt position just after the last
//! accepted span that was copied from the prompt. Extraction under a grammar (CSV to JSON,
//! filling a schema from a document) copies the prompt's values in order while the grammar
//! supplies the syntax between them; the syntax never occurs in the prompt, so a lookup
//! keyed on it finds the previous record's value, while the cursor points at the next one.
//! Under a constraint the cursor is tried first, skipping up to [`CURSOR_SKIP`] prompt
//! tokens the grammar rejects there or that proved to be delimiters (a cursor copy whose
//! first token the target skipped for the next prompt token: `,` inside a JSON string);
//! without a constraint it is the fallback when the lookup finds nothing. The cursor
//! re-aligns after tokens the target wrote itself by anchoring on the most recent of them
//! found just ahead of it in the prompt.

use std::sync::Arc;

use text::Tokenizer;

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};
use crate::text_cursor::{TextCursor, TextProposal, has_value_byte};

/// Settings of the n-gram drafter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Longest key tried (the last `max_n` tokens), at least 1.
    pub max_n: usize,
    /// Shortest key accepted (1 = a single-token match proposes a continuation).
    pub min_n: usize,
    /// Under a constraint, follow the prompt in text space first (see
    /// the `text_cursor` module); needs the tokenizer ([`NgramDrafter::with_text`]).
    pub text_cursor: bool,
}

impl Default for NgramConfig {
    /// Keys of 3, 2 and 1 tokens; the text cursor on.
    fn default() -> Self {
        NgramConfig {
            max_n: 3,
            min_n: 1,
            text_cursor: true,
        }
    }
}

/// Prompt tokens the cursor may skip to reach one the grammar accepts.
pub const CURSOR_SKIP: usize = 4;
/// How far ahead of the cursor committed tokens are looked for, to re-align the cursor
/// after tokens the target produced itself.
pub const CURSOR_SYNC: usize = 16;
/// How many of the last committed tokens may anchor that re-alignment.
pub const CURSOR_ANCHOR: usize = 8;
/// Most delimiter tokens learned per sequence.
const MAX_DELIMITERS: usize = 8;

/// A copy proposed this cycle: drafts at `base..` were copied from `src..` (`len` tokens)
/// while the prompt was `prompt_len` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Copy {
    src: usize,
    base: usize,
    len: usize,
    prompt_len: usize,
    /// Proposed from the prompt cursor (not by the lookup).
    cursor: bool,
}

/// The n-gram / prompt-lookup drafter.
#[derive(Clone, Debug, Default)]
pub struct NgramDrafter {
    cfg: NgramConfig,
    /// Prompt position after the last accepted span copied from the prompt.
    cursor: Option<usize>,
    /// Copies proposed since the last `observe`.
    pending: Vec<Copy>,
    /// Prompt tokens learned to be delimiters: a cursor copy starting with one was
    /// rejected and the target took the prompt token after it instead (`,` between CSV
    /// fields, a newline between rows). The cursor skips them.
    delimiters: Vec<u32>,
    /// The text-space prompt cursor (with a tokenizer and `cfg.text_cursor`).
    text: Option<TextCursor>,
}

impl NgramDrafter {
    /// A drafter with `cfg` (`max_n` at least 1, `min_n` clamped to `1..=max_n`).
    pub fn new(cfg: NgramConfig) -> NgramDrafter {
        let max_n = cfg.max_n.max(1);
        NgramDrafter {
            cfg: NgramConfig {
                max_n,
                min_n: cfg.min_n.clamp(1, max_n),
                text_cursor: cfg.text_cursor,
            },
            cursor: None,
            pending: Vec::new(),
            delimiters: Vec::new(),
            text: None,
        }
    }

    /// A drafter that can also follow the prompt in text space (when `cfg.text_cursor`):
    /// `tok` decodes the prompt and re-encodes the text after the cursor.
    pub fn with_text(cfg: NgramConfig, tok: Arc<Tokenizer>) -> NgramDrafter {
        let mut d = NgramDrafter::new(cfg);
        if cfg.text_cursor {
            d.text = Some(TextCursor::new(tok));
        }
        d
    }

    /// The prompt cursor, if a span copied from the prompt has been accepted.
    pub fn cursor(&self) -> Option<usize> {
        self.cursor
    }

    /// Copies `tokens[src..limit]` (running into the drafts for periodic text) while the
    /// mirror accepts, at most `k` tokens; records the copy for `observe`.
    fn copy_from(
        &mut self,
        ctx: &DraftContext<'_>,
        mirror: &mut Mirror<'_>,
        src: usize,
        k: usize,
        limit: usize,
    ) -> DraftProposal {
        let mut out = DraftProposal::default();
        let at = |i: usize, drafts: &[u32]| -> Option<u32> {
            if i < ctx.tokens.len() {
                Some(ctx.tokens[i])
            } else {
                drafts.get(i - ctx.tokens.len()).copied()
            }
        };
        let mut i = src;
        while out.tokens.len() < k && i < limit {
            let Some(t) = at(i, &out.tokens) else { break };
            if !mirror.try_push(t) {
                break;
            }
            out.tokens.push(t);
            i += 1;
            if ctx.ends(t) {
                break;
            }
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::Ngram);
            self.pending.push(Copy {
                src,
                base: ctx.tokens.len(),
                len: out.tokens.len(),
                prompt_len: ctx.prompt_len,
                cursor: limit != usize::MAX,
            });
        }
        out
    }

    /// A proposal from the prompt cursor: the first of the next [`CURSOR_SKIP`] + 1 prompt
    /// tokens the mirror accepts, and what follows it.
    fn propose_from_cursor(
        &mut self,
        ctx: &DraftContext<'_>,
        mirror: &mut Mirror<'_>,
        k: usize,
    ) -> DraftProposal {
        let Some(mut c) = self.cursor else {
            return DraftProposal::default();
        };
        let end = ctx.prompt_len.min(ctx.tokens.len());
        // Tokens the target chose itself may already have copied past the cursor (bonus
        // tokens, plain steps), possibly followed by syntax of its own: the most recent of
        // the last CURSOR_ANCHOR tokens that occurs within the next CURSOR_SYNC prompt
        // tokens anchors the cursor just after its nearest occurrence.
        let window = c..(c + CURSOR_SYNC).min(end);
        let n = ctx.tokens.len();
        for back in 0..CURSOR_ANCHOR.min(n.saturating_sub(end)) {
            let t = ctx.tokens[n - 1 - back];
            if let Some(p) = window.clone().find(|&p| ctx.tokens[p] == t) {
                c = p + 1;
                break;
            }
        }
        for start in c..(c + CURSOR_SKIP + 1).min(end) {
            let t = ctx.tokens[start];
            if !self.delimiters.contains(&t) && mirror.accepts(t) {
                return self.copy_from(ctx, mirror, start, k, end);
            }
        }
        DraftProposal::default()
    }
}

impl NgramDrafter {
    /// Under a constraint with the text cursor: values from the prompt text, the syntax
    /// between them from the lookup one token at a time (so a copied record's syntax never
    /// runs on into that record's values), until the cursor says the value ends, nothing
    /// fits, or `k` tokens are drafted.
    fn propose_in_text(
        &mut self,
        ctx: &DraftContext<'_>,
        mirror: &mut Mirror<'_>,
        k: usize,
    ) -> DraftProposal {
        let mut ext = ctx.tokens.to_vec();
        let mut out = DraftProposal::default();
        let Some(text) = self.text.as_mut() else {
            return out;
        };
        while out.tokens.len() < k {
            match text.propose(&ext, ctx.prompt_len, k - out.tokens.len(), mirror) {
                TextProposal::Copy(ts) => {
                    ext.extend_from_slice(&ts);
                    out.tokens.extend(ts);
                }
                TextProposal::ValueEnds { value_start } => {
                    // The syntax that closed the previous value after the same key.
                    let close =
                        closing_syntax(text, &ext, ctx.prompt_len, value_start, self.cfg.max_n);
                    let before = out.tokens.len();
                    for t in close {
                        if out.tokens.len() >= k || !mirror.try_push(t) {
                            break;
                        }
                        ext.push(t);
                        out.tokens.push(t);
                    }
                    if out.tokens.len() == before {
                        break;
                    }
                }
                TextProposal::Nothing => {
                    let next = find_match(&ext, self.cfg.max_n, self.cfg.min_n)
                        .map(|(_, start)| ext[start]);
                    match next {
                        Some(t) if mirror.try_push(t) => {
                            ext.push(t);
                            out.tokens.push(t);
                        }
                        _ => break,
                    }
                }
            }
            if out.tokens.last().is_some_and(|&t| ctx.ends(t)) || mirror.is_stopped() {
                break;
            }
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::Ngram);
        }
        out
    }
}

/// The syntax tokens that followed the previous value written after the same key: the
/// value starting at `value_start` is preceded by up to `max_n` key tokens; at their most
/// recent earlier occurrence in the output, the value tokens after them are skipped and the tokens
/// without value bytes that follow are returned (`","` after a string, `,"` after a number,
/// `"},{"` at a record's end). Empty when the key never occurred before.
fn closing_syntax(
    text: &TextCursor,
    tokens: &[u32],
    prompt_len: usize,
    value_start: usize,
    max_n: usize,
) -> Vec<u32> {
    let value = |t: u32| has_value_byte(text.bytes(t));
    for n in (1..=max_n.min(value_start)).rev() {
        let key = &tokens[value_start - n..value_start];
        let mut end = value_start;
        // Only the output's own syntax: the prompt's text around a value is what the
        // output replaces.
        while end > n + prompt_len {
            end -= 1;
            if tokens[end - n..end] != *key {
                continue;
            }
            let mut i = end;
            while i < value_start && value(tokens[i]) {
                i += 1;
            }
            if i == end {
                continue;
            }
            let close: Vec<u32> = tokens[i..value_start]
                .iter()
                .take_while(|&&t| !value(t) && !text.bytes(t).is_empty())
                .copied()
                .collect();
            if !close.is_empty() {
                return close;
            }
        }
    }
    Vec::new()
}

/// The start of the continuation after the most recent earlier occurrence of the last `n`
/// tokens of `tokens`, trying `n` from `max_n` down to `min_n`: `(n, start)` where
/// `tokens[start - n..start]` equals the key and `start < tokens.len()`.
pub fn find_match(tokens: &[u32], max_n: usize, min_n: usize) -> Option<(usize, usize)> {
    let len = tokens.len();
    for n in (min_n.max(1)..=max_n).rev() {
        if n >= len {
            continue;
        }
        let key = &tokens[len - n..];
        // Most recent occurrence ending before the key itself.
        let mut end = len - 1;
        while end >= n {
            if tokens[end - n..end] == *key {
                return Some((n, end));
            }
            end -= 1;
        }
    }
    None
}

impl Drafter for NgramDrafter {
    fn kind(&self) -> DrafterKind {
        DrafterKind::Ngram
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let k = ctx.max_draft.min(ctx.max_tokens);
        if k == 0 {
            return DraftProposal::default();
        }
        let constrained = mirror.is_constrained();
        if constrained && self.text.is_some() {
            return self.propose_in_text(ctx, mirror, k);
        }
        if constrained {
            let p = self.propose_from_cursor(ctx, mirror, k);
            if !p.is_empty() {
                return p;
            }
        }
        if let Some((_, start)) = find_match(ctx.tokens, self.cfg.max_n, self.cfg.min_n) {
            let p = self.copy_from(ctx, mirror, start, k, usize::MAX);
            if !p.is_empty() || constrained {
                return p;
            }
        }
        if constrained {
            DraftProposal::default()
        } else {
            self.propose_from_cursor(ctx, mirror, k)
        }
    }

    fn observe(&mut self, committed: &[u32]) {
        if let Some(text) = self.text.as_mut() {
            text.observe(committed);
        }
        // Where a copy from the prompt was (partly) accepted, the cursor moves to just
        // after the accepted part. Copies from the output leave it alone.
        for c in std::mem::take(&mut self.pending) {
            let mut j = 0;
            while j < c.len
                && c.base + j < committed.len()
                && c.src + j < c.base
                && committed[c.base + j] == committed[c.src + j]
            {
                j += 1;
            }
            if j > 0 && c.src < c.prompt_len {
                self.cursor = Some(c.src + j);
            } else if j == 0
                && c.cursor
                && c.src + 1 < c.prompt_len
                && c.base < committed.len()
                && committed[c.base] == committed[c.src + 1]
            {
                // The target skipped the cursor's first token and took the next prompt
                // token: the skipped one separates values.
                let d = committed[c.src];
                if !self.delimiters.contains(&d) && self.delimiters.len() < MAX_DELIMITERS {
                    self.delimiters.push(d);
                }
                self.cursor = Some(c.src + 2);
            }
        }
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
    ) -> DraftContext<'a> {
        DraftContext {
            tokens,
            prompt_len: 1,
            params,
            never,
            max_tokens: 4,
            max_draft: 4,
            kind_caps: &[],
            allow_costly: true,
            bars: &[],
            eos_ends: true,
            eos: &[99],
            target: None,
        }
    }

    #[test]
    fn the_longest_most_recent_match_wins() {
        // ... 1 2 3 [7] ... 2 3 [8] ... 1 2 3 -> the 3-gram match continues with 7.
        let t = [1, 2, 3, 7, 5, 2, 3, 8, 6, 1, 2, 3];
        assert_eq!(find_match(&t, 3, 1), Some((3, 3)));
        // With keys of at most 2 tokens, the most recent "2 3" wins (followed by 8).
        assert_eq!(find_match(&t, 2, 1), Some((2, 7)));
        assert_eq!(find_match(&[4, 5, 6], 3, 1), None);
    }

    #[test]
    fn proposes_the_continuation_and_runs_into_its_own_drafts() {
        let p = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let t = [5, 1, 2, 1, 2];
        let mut d = NgramDrafter::new(NgramConfig::default());
        let prop = d.propose(&ctx(&t, &p, &never), &mut Mirror::unconstrained());
        // "1 2" was followed by "1 2": periodic continuation 1 2 1 2.
        assert_eq!(prop.tokens, vec![1, 2, 1, 2]);
        assert_eq!(prop.source, Some(DrafterKind::Ngram));
    }

    #[test]
    fn drafting_stops_after_an_end_of_generation_token() {
        let p = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let t = [3, 4, 99, 7, 3, 4];
        let prop =
            NgramDrafter::default().propose(&ctx(&t, &p, &never), &mut Mirror::unconstrained());
        assert_eq!(prop.tokens, vec![99]);
    }
}

#[cfg(test)]
mod cursor_tests {
    use super::*;
    use sampling::{ConstraintError, SamplingParams, TokenConstraint, TokenMask};

    /// A grammar stand-in over 200 ids: rejects the "separator" ids (≥ 100) and accepts
    /// the rest.
    struct NoSeparators;

    impl TokenConstraint for NoSeparators {
        fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
            mask.fill_words(200, |i| match i {
                0 => u64::MAX,
                1 => (1 << 36) - 1,
                _ => 0,
            });
            Ok(())
        }
        fn accepts(&mut self, token: u32) -> bool {
            token < 100
        }
        fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
            if token < 100 {
                Ok(())
            } else {
                Err(ConstraintError::TokenRejected {
                    token,
                    text: String::new(),
                    position: 0,
                })
            }
        }
        fn rollback(&mut self, _: usize) -> Result<(), ConstraintError> {
            Ok(())
        }
        fn fork(&self) -> Box<dyn TokenConstraint> {
            Box::new(NoSeparators)
        }
        fn is_finished(&self) -> bool {
            false
        }
    }

    #[test]
    fn the_stand_in_keeps_the_constraint_contract() {
        sampling::check_contract(&mut NoSeparators, 200).unwrap();
    }

    fn ctx<'a>(
        tokens: &'a [u32],
        prompt_len: usize,
        p: &'a SamplingParams,
        never: &'a TokenMask,
    ) -> DraftContext<'a> {
        DraftContext {
            tokens,
            prompt_len,
            params: p,
            never,
            max_tokens: 8,
            max_draft: 8,
            kind_caps: &[],
            allow_costly: true,
            bars: &[],
            eos_ends: true,
            eos: &[99],
            target: None,
        }
    }

    #[test]
    fn the_cursor_follows_the_prompt_past_separators_after_an_accepted_copy() {
        let p = SamplingParams::greedy();
        let never = TokenMask::new(0);
        // Prompt: "a b , c d , e" as 1 2 100 3 4 100 5; output so far: 50 1.
        let prompt = [1u32, 2, 100, 3, 4, 100, 5];
        let mut toks: Vec<u32> = prompt.to_vec();
        toks.extend([50, 1]);
        let mut d = NgramDrafter::new(NgramConfig::default());
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        // No cursor yet: the lookup keyed on "1" copies "2" and stops at the separator.
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![2]);
        assert_eq!(d.cursor(), None);
        // The target accepts it and adds syntax of its own (60, 61: never in the prompt).
        toks.extend([2, 60, 61]);
        d.observe(&toks);
        assert_eq!(d.cursor(), Some(2));
        // A lookup keyed on 60 61 finds nothing; the cursor skips the separator to "3 4".
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![3, 4]);
        // Say the target rejects it and writes "3" itself (a plain step, never observed by
        // the drafter): the cursor re-aligns after the "3" and proposes "4".
        d.observe(&toks);
        toks.push(3);
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![4]);
        // Accepted, with syntax 62 as the bonus: the cursor moves past "4" (prompt index 5,
        // the separator), and the next proposal skips it to "5".
        toks.extend([4, 62]);
        d.observe(&toks);
        assert_eq!(d.cursor(), Some(5));
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![5]);
    }

    #[test]
    fn a_skipped_first_token_is_learned_as_a_delimiter() {
        let p = SamplingParams::greedy();
        let never = TokenMask::new(0);
        // Prompt "1 2 , 3 4 , 5" with "," = 50, which the grammar accepts (inside a string).
        let prompt = [1u32, 2, 50, 3, 4, 50, 5];
        let mut toks: Vec<u32> = prompt.to_vec();
        toks.extend([60, 1]);
        let mut d = NgramDrafter::new(NgramConfig::default());
        d.cursor = Some(2);
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![50, 3, 4, 50, 5]);
        // The target rejects "," and writes "3" itself: "," is learned, the cursor moves on.
        toks.push(3);
        d.observe(&toks);
        assert_eq!(d.delimiters, vec![50]);
        assert_eq!(d.cursor(), Some(4));
        // Later the cursor stands on a "," again: it is skipped.
        d.cursor = Some(5);
        toks.push(61);
        let mut g = NoSeparators;
        let mut m = Mirror::new(&mut g, 200);
        let prop = d.propose(&ctx(&toks, prompt.len(), &p, &never), &mut m);
        assert_eq!(prop.tokens, vec![5]);
    }

    #[test]
    fn copies_from_the_output_leave_the_cursor_alone() {
        let p = SamplingParams::greedy();
        let never = TokenMask::new(0);
        let prompt = [1u32, 2, 3];
        // Output repeats itself: 7 8 9 7 8 -> the lookup copies 9 from the output.
        let mut toks: Vec<u32> = prompt.to_vec();
        toks.extend([7, 8, 9, 7, 8]);
        let mut d = NgramDrafter::new(NgramConfig::default());
        let prop = d.propose(
            &ctx(&toks, prompt.len(), &p, &never),
            &mut Mirror::unconstrained(),
        );
        assert_eq!(prop.tokens[0], 9);
        toks.push(9);
        d.observe(&toks);
        assert_eq!(d.cursor(), None);
    }
}
