//! Test drafters that make the G2 tests non-vacuous: an [`Oracle`] that replays a known
//! plain output (every draft is accepted) and an [`Adversary`] that is always wrong (every
//! draft is rejected) — the output must be identical to plain decoding either way.

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};

/// Replays `expected` (prompt followed by the plain output): proposes the next plain
/// tokens while the committed tokens agree with it.
#[derive(Clone, Debug)]
pub struct Oracle {
    expected: Vec<u32>,
}

impl Oracle {
    /// An oracle for the sequence `expected` = prompt ++ plain output.
    pub fn new(expected: Vec<u32>) -> Oracle {
        Oracle { expected }
    }
}

impl Drafter for Oracle {
    fn kind(&self) -> DrafterKind {
        DrafterKind::Oracle
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let l = ctx.tokens.len();
        if l > self.expected.len() || self.expected[..l] != *ctx.tokens {
            return out;
        }
        let k = ctx.max_draft.min(ctx.max_tokens);
        for &t in self.expected[l..].iter().take(k) {
            if !mirror.try_push(t) {
                break;
            }
            out.tokens.push(t);
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::Oracle);
        }
        out
    }
}

/// Always wrong: at each draft position it proposes a token (allowed by the mirror, never
/// a never-sample token) that differs from the plain output's token there. Where the
/// grammar allows only the plain token, it stops.
#[derive(Clone, Debug)]
pub struct Adversary {
    expected: Vec<u32>,
}

impl Adversary {
    /// An adversary against `expected` = prompt ++ plain output.
    pub fn new(expected: Vec<u32>) -> Adversary {
        Adversary { expected }
    }
}

impl Drafter for Adversary {
    fn kind(&self) -> DrafterKind {
        DrafterKind::Adversary
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let l = ctx.tokens.len();
        let k = ctx.max_draft.min(ctx.max_tokens);
        let n = ctx.never.len().max(1);
        for j in 0..k {
            let right = self.expected.get(l + j).copied();
            let pick = match mirror.allowed() {
                None => None,
                Some(Some(mask)) => mask
                    .iter()
                    .find(|&t| Some(t) != right && !ctx.never.get(t) && !ctx.ends(t)),
                Some(None) => {
                    let start = right.map_or(0, |r| r as usize + 1);
                    (0..n)
                        .map(|i| ((start + i) % n) as u32)
                        .find(|&t| Some(t) != right && !ctx.never.get(t) && !ctx.ends(t))
                }
            };
            let Some(t) = pick else { break };
            if !mirror.advance(t) {
                break;
            }
            out.tokens.push(t);
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::Adversary);
        }
        out
    }
}
