//! Grammar fast-forward and the drafter chain the engine runs per sequence: forced tokens
//! first (free and certain), then the first drafter that has something, then forced tokens
//! again, and so on until the caps or the mirror stop it.

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};
use std::time::Instant;

/// Grammar fast-forward alone: the tokens the constraint forces from the current state
/// (each the only token its mask allows), drafted for free and verified like any draft.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastForward;

impl Drafter for FastForward {
    fn kind(&self) -> DrafterKind {
        DrafterKind::FastForward
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        push_forced(ctx, mirror, &mut out);
        out
    }
}

/// Appends forced tokens to `out` (up to `ctx.max_tokens` in all); returns how many.
fn push_forced(ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>, out: &mut DraftProposal) -> usize {
    let mut n = 0;
    while out.tokens.len() < ctx.max_tokens {
        let forced = mirror.forced();
        if forced.is_empty() {
            break;
        }
        let before = n;
        for t in forced {
            if out.tokens.len() >= ctx.max_tokens || !mirror.try_push(t) {
                break;
            }
            out.tokens.push(t);
            n += 1;
            if ctx.ends(t) {
                return n;
            }
        }
        if n == before || mirror.is_stopped() {
            break;
        }
    }
    out.forced += n;
    out.push_run(DrafterKind::FastForward, n);
    n
}

/// The engine's per-sequence drafter: optional grammar fast-forward plus an ordered list
/// of drafters (e.g. n-gram first, then the draft model). Each round takes the forced
/// tokens, then asks the drafters in order until one proposes something; rounds repeat
/// while both make progress.
pub struct Chain {
    fast_forward: bool,
    drafters: Vec<Box<dyn Drafter>>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("fast_forward", &self.fast_forward)
            .field(
                "drafters",
                &self.drafters.iter().map(|d| d.kind()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Chain {
    /// A chain with fast-forward on or off and `drafters` in priority order.
    pub fn new(fast_forward: bool, drafters: Vec<Box<dyn Drafter>>) -> Chain {
        Chain {
            fast_forward,
            drafters,
        }
    }
}

impl Drafter for Chain {
    fn kind(&self) -> DrafterKind {
        self.drafters
            .first()
            .map_or(DrafterKind::FastForward, |d| d.kind())
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let mut free = 0usize;
        let mut ext: Vec<u32> = Vec::new();
        loop {
            let before = out.tokens.len();
            if self.fast_forward {
                let n = push_forced(ctx, mirror, &mut out);
                if n > 0 && out.tokens.last().is_some_and(|&t| ctx.ends(t)) {
                    break;
                }
            }
            if out.tokens.len() >= ctx.max_tokens || mirror.is_stopped() || free >= ctx.max_draft {
                break;
            }
            // The drafters continue from the committed tokens plus the drafts so far.
            ext.clear();
            ext.extend_from_slice(ctx.tokens);
            ext.extend_from_slice(&out.tokens);
            let mut got = DraftProposal::default();
            for d in self.drafters.iter_mut() {
                if d.kind().is_costly() && !ctx.allow_costly {
                    continue;
                }
                // Each drafter drafts as far as its own measured acceptance pays.
                let cap = ctx.cap_of(d.kind()).min(ctx.max_draft - free);
                if cap == 0 {
                    continue;
                }
                let sub = DraftContext {
                    tokens: &ext,
                    max_tokens: ctx.max_tokens - out.tokens.len(),
                    max_draft: cap,
                    ..*ctx
                };
                let t0 = Instant::now();
                got = d.propose(&sub, mirror);
                if d.kind().is_costly() {
                    got.cost_us += t0.elapsed().as_micros() as u64;
                }
                if !got.tokens.is_empty() {
                    break;
                }
            }
            out.cost_us += got.cost_us;
            if got.tokens.is_empty() {
                break;
            }
            if out.source.is_none() {
                out.source = got.source;
            }
            free += got.tokens.len() - got.forced;
            let ended = got.tokens.last().is_some_and(|&t| ctx.ends(t));
            for (kind, n) in got.segments() {
                out.push_run(kind, n);
            }
            out.forced += got.forced;
            out.tokens.extend(got.tokens);
            if ended || !self.fast_forward || out.tokens.len() == before {
                break;
            }
        }
        out
    }

    fn observe(&mut self, committed: &[u32]) {
        for d in self.drafters.iter_mut() {
            d.observe(committed);
        }
    }

    fn finish(&mut self, committed: &[u32]) {
        for d in self.drafters.iter_mut() {
            d.finish(committed);
        }
    }
}
