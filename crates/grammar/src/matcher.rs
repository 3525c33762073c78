//! The matcher the engine drives: masks, single-token checks, consumption, fast-forward,
//! rollback, and cheap forks for the speculative mirror.

use std::sync::Arc;

use llguidance::Matcher;
use llguidance::api::StopReason;
use sampling::{ConstraintError, TokenConstraint, TokenMask};

use crate::env::TokenEnv;
use crate::error::GrammarError;

/// The state of one output under a constraint.
///
/// One contract ties the operations together, so verification can use the cheap checks
/// and still reproduce plain decoding exactly: in every state,
/// `accepts(t)` ⇔ `consume(t)` succeeds ⇔ `t` is in the mask from `compute_mask`.
/// Where the grammar forces bytes, that set is the single canonical first forced token
/// (llguidance's forcing), and EOS is in it exactly when the constraint accepts.
///
/// The *verified* matcher follows committed tokens; [`GrammarMatcher::fork`] makes the
/// *speculative mirror*, advanced over draft tokens and dropped (or rolled back).
pub struct GrammarMatcher {
    env: Arc<TokenEnv>,
    /// Tokens this constraint may ever allow, as mask words: the environment's non-blocked
    /// ids minus the special tokens the constraint does not name.
    allowed: Arc<Vec<u64>>,
    inner: Matcher,
    consumed: usize,
    /// EOS tokens consumed after the output was complete; they never reach the parser.
    after_stop: usize,
    /// `Some(first forced token or None)` once computed in this state.
    forced_first: Option<Option<u32>>,
    /// The last `accepts` answer in this state.
    checked: Option<(u32, bool)>,
}

impl Clone for GrammarMatcher {
    fn clone(&self) -> Self {
        self.fork()
    }
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("consumed", &self.consumed)
            .field("stopped", &self.inner.is_stopped())
            .field("error", &self.inner.get_error())
            .finish()
    }
}

impl GrammarMatcher {
    pub(crate) fn from_parts(
        env: Arc<TokenEnv>,
        allowed: Arc<Vec<u64>>,
        inner: Matcher,
    ) -> GrammarMatcher {
        GrammarMatcher {
            env,
            allowed,
            inner,
            consumed: 0,
            after_stop: 0,
            forced_first: None,
            checked: None,
        }
    }

    /// A copy of this matcher in the same state, for the speculative mirror. Advancing the
    /// copy never affects the original. It shares the original's lexer cache (same grammar),
    /// so it is cheap: no grammar recompilation, no mask is computed.
    pub fn fork(&self) -> GrammarMatcher {
        GrammarMatcher {
            env: self.env.clone(),
            allowed: self.allowed.clone(),
            inner: self.inner.clone(),
            consumed: self.consumed,
            after_stop: self.after_stop,
            forced_first: self.forced_first,
            checked: self.checked,
        }
    }

    /// A copy with its own lexer cache, for an independent request.
    pub(crate) fn deep_fork(&self) -> GrammarMatcher {
        GrammarMatcher {
            inner: self.inner.deep_clone(),
            ..self.fork()
        }
    }

    /// The token environment this matcher works in.
    pub fn env(&self) -> &Arc<TokenEnv> {
        &self.env
    }

    /// Tokens consumed so far (an end-of-generation token included once consumed).
    pub fn num_consumed(&self) -> usize {
        self.consumed
    }

    fn state_changed(&mut self) {
        self.forced_first = None;
        self.checked = None;
    }

    fn inner_error(&self, fallback: String) -> GrammarError {
        let msg = self.inner.get_error().unwrap_or(fallback);
        // After a failure the matcher reports `InternalError`; the reason is in the text.
        if msg.starts_with("NoExtensionBias") {
            return GrammarError::DeadEnd {
                position: self.consumed,
            };
        }
        match self.inner.stop_reason() {
            StopReason::NoExtensionBias => GrammarError::DeadEnd {
                position: self.consumed,
            },
            StopReason::LexerTooComplex | StopReason::ParserTooComplex => {
                GrammarError::TooComplex(msg)
            }
            _ => GrammarError::Matcher(msg),
        }
    }

    /// Writes the set of tokens allowed next into `out` (set to the logit width, its
    /// allocation reused).
    /// Blocked ids (padding, never-sample, past the vocabulary) and special tokens the
    /// constraint does not name are never in it; EOS ids are
    /// in it exactly where the constraint accepts; after the output is complete only EOS ids.
    /// An empty set is [`GrammarError::DeadEnd`].
    pub fn compute_mask(&mut self, out: &mut TokenMask) -> Result<(), GrammarError> {
        let vob = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| self.inner_error(format!("{e:#}")))?;
        let n = self.env.n_logits();
        let src = vob.as_slice();
        let allowed = &self.allowed;
        out.fill_words(n, |i| {
            let lo = src.get(2 * i).copied().unwrap_or(0) as u64;
            let hi = src.get(2 * i + 1).copied().unwrap_or(0) as u64;
            (lo | hi << 32) & allowed.get(i).copied().unwrap_or(0)
        });
        if out.words().iter().any(|&w| w != 0) {
            Ok(())
        } else {
            Err(GrammarError::DeadEnd {
                position: self.consumed,
            })
        }
    }

    /// Whether `token` is allowed next — the same answer as the mask, without computing
    /// the whole mask (a fast path for verifying a drafted or sampled token).
    pub fn accepts(&mut self, token: u32) -> bool {
        if let Some((t, ok)) = self.checked
            && t == token
        {
            return ok;
        }
        let ok = self.accepts_uncached(token);
        self.checked = Some((token, ok));
        ok
    }

    fn accepts_uncached(&mut self, token: u32) -> bool {
        if !self.may_allow(token) {
            return false;
        }
        if self.inner.is_error() {
            return false;
        }
        if self.inner.is_stopped() {
            // The output is complete: only end-of-generation remains (as in the mask).
            return self.env.is_eos(token);
        }
        if let Some(first) = self.forced_first_token() {
            return token == first;
        }
        if self.env.is_eos(token) {
            return self.inner.is_accepting().unwrap_or(false);
        }
        matches!(self.inner.validate_tokens(&[token]), Ok(1))
    }

    /// Whether the constraint may ever allow `token` (in range, not blocked, not an unnamed
    /// special token).
    fn may_allow(&self, token: u32) -> bool {
        let t = token as usize;
        t < self.env.n_logits()
            && self
                .allowed
                .get(t / 64)
                .is_some_and(|w| w >> (t % 64) & 1 == 1)
    }

    fn forced_first_token(&mut self) -> Option<u32> {
        if let Some(f) = self.forced_first {
            return f;
        }
        let first = self.inner.compute_ff_tokens().first().copied();
        self.forced_first = Some(first);
        first
    }

    /// Advances over `token`. A token the constraint does not allow is
    /// [`GrammarError::TokenRejected`] and leaves the state unchanged.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if token as usize >= self.env.n_logits() {
            return Err(GrammarError::TokenOutOfRange {
                token,
                n_logits: self.env.n_logits(),
            });
        }
        if !self.accepts(token) {
            if self.inner.is_error() {
                return Err(self.inner_error("matcher is in an error state".to_string()));
            }
            return Err(GrammarError::TokenRejected {
                token,
                text: String::from_utf8_lossy(self.env.grammar_bytes(token)).into_owned(),
                position: self.consumed,
            });
        }
        if self.inner.is_stopped() {
            // EOS after a complete output: nothing left to parse; count it for rollback.
            self.consumed += 1;
            self.after_stop += 1;
            self.state_changed();
            return Ok(());
        }
        self.inner
            .consume_token(token)
            .map_err(|e| self.inner_error(format!("{e:#}")))?;
        self.consumed += 1;
        self.state_changed();
        Ok(())
    }

    /// Advances over several tokens; stops at the first rejected one (the tokens before it
    /// stay consumed).
    pub fn consume_all(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        tokens.iter().try_for_each(|&t| self.consume(t))
    }

    /// Whether the output is complete: EOS was consumed, or the constraint can add nothing
    /// more (only EOS is allowed now). Also true once the matcher has failed.
    pub fn is_finished(&self) -> bool {
        self.inner.is_stopped()
    }

    /// Whether the constraint accepts the output so far (EOS is allowed now).
    pub fn is_accepting(&mut self) -> bool {
        if self.inner.is_error() {
            return false;
        }
        if self.inner.is_stopped() {
            return true;
        }
        if self.forced_first_token().is_some() {
            return false;
        }
        self.inner.is_accepting().unwrap_or(false)
    }

    /// The error that stopped the matcher, if any.
    pub fn error(&self) -> Option<String> {
        self.inner.get_error()
    }

    /// Tokens the constraint forces from here (fast-forward), in order: each is the only
    /// token the mask allows at its step. Empty when the next token is a free choice.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        if self.inner.is_stopped() {
            return Vec::new();
        }
        let tokens = self.inner.compute_ff_tokens();
        self.forced_first = Some(tokens.first().copied());
        tokens
    }

    /// Undoes the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n > self.consumed {
            return Err(GrammarError::Rollback {
                requested: n,
                available: self.consumed,
            });
        }
        if n == 0 {
            return Ok(());
        }
        // EOS consumed after a complete output never reached the parser.
        let from_stop = n.min(self.after_stop);
        let to_parser = n - from_stop;
        if to_parser > 0 {
            self.inner
                .rollback(to_parser)
                .map_err(|e| self.inner_error(format!("{e:#}")))?;
        }
        self.after_stop -= from_stop;
        self.consumed -= n;
        self.state_changed();
        Ok(())
    }
}

/// The engine drives a matcher through [`TokenConstraint`]; errors become
/// [`ConstraintError`]s with the same messages.
impl TokenConstraint for GrammarMatcher {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        GrammarMatcher::compute_mask(self, mask).map_err(ConstraintError::from)
    }

    fn accepts(&mut self, token: u32) -> bool {
        GrammarMatcher::accepts(self, token)
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        GrammarMatcher::consume(self, token).map_err(ConstraintError::from)
    }

    fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
        GrammarMatcher::rollback(self, n).map_err(ConstraintError::from)
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(GrammarMatcher::fork(self))
    }

    fn forced_tokens(&mut self) -> Vec<u32> {
        GrammarMatcher::forced_tokens(self)
    }

    fn is_finished(&self) -> bool {
        GrammarMatcher::is_finished(self)
    }
}
