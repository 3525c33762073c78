//! n-gram / prompt lookup: find the most recent earlier occurrence of the last `n` tokens
//! (n from `max_n` down to 1) in prompt + output and propose what followed it. Free to
//! run and strong on structured payloads, code edits and anything that repeats the prompt.

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};

/// Settings of the n-gram drafter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Longest key tried (the last `max_n` tokens), at least 1.
    pub max_n: usize,
    /// Shortest key accepted (1 = a single-token match proposes a continuation).
    pub min_n: usize,
}

impl Default for NgramConfig {
    /// Keys of 3, 2 and 1 tokens.
    fn default() -> Self {
        NgramConfig { max_n: 3, min_n: 1 }
    }
}

/// The n-gram / prompt-lookup drafter.
#[derive(Clone, Debug, Default)]
pub struct NgramDrafter {
    cfg: NgramConfig,
}

impl NgramDrafter {
    /// A drafter with `cfg` (`max_n` at least 1, `min_n` clamped to `1..=max_n`).
    pub fn new(cfg: NgramConfig) -> NgramDrafter {
        let max_n = cfg.max_n.max(1);
        NgramDrafter {
            cfg: NgramConfig {
                max_n,
                min_n: cfg.min_n.clamp(1, max_n),
            },
        }
    }
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
        let mut out = DraftProposal::default();
        let k = ctx.max_draft.min(ctx.max_tokens);
        if k == 0 {
            return out;
        }
        let Some((_, start)) = find_match(ctx.tokens, self.cfg.max_n, self.cfg.min_n) else {
            return out;
        };
        // The continuation may run into the drafts themselves (periodic text).
        let at = |i: usize, drafts: &[u32]| -> Option<u32> {
            if i < ctx.tokens.len() {
                Some(ctx.tokens[i])
            } else {
                drafts.get(i - ctx.tokens.len()).copied()
            }
        };
        let mut i = start;
        while out.tokens.len() < k {
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
        }
        out
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
            allow_costly: true,
            bars: &[],
            eos_ends: true,
            eos: &[99],
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
