//! [`TokenConstraint`]: the one interface between a structured-output constraint (a
//! grammar) and the code that decodes under it — the engine's verified state, the
//! speculative mirror drafters advance, and tests. [`ConstraintError`] is its typed error.

use thiserror::Error;

use crate::TokenMask;

/// Why a constraint refused a token or cannot go on. Callers act on the variant: a
/// rejected token or a dead end ends a sequence, a failed rollback is a caller bug, and
/// [`ConstraintError::Invalid`] / [`ConstraintError::TooComplex`] reject a request.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConstraintError {
    /// A token id at or beyond the logit width.
    #[error("token id {token} is outside the vocabulary of {n_logits} logits")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// The logit width the constraint works in.
        n_logits: usize,
    },
    /// The constraint does not allow `token` here; the state is unchanged.
    #[error("token {token} ({text:?}) is not allowed by the constraint after {position} tokens")]
    TokenRejected {
        /// The rejected id.
        token: u32,
        /// The token's text, lossily decoded, for the message.
        text: String,
        /// How many tokens the constraint had consumed.
        position: usize,
    },
    /// No token is allowed in this state (the constraint reached a dead end).
    #[error("no token is allowed after {position} tokens")]
    DeadEnd {
        /// How many tokens the constraint had consumed.
        position: usize,
    },
    /// A rollback of more tokens than were consumed.
    #[error("cannot roll back {requested} tokens, only {available} consumed")]
    Rollback {
        /// Tokens asked to roll back.
        requested: usize,
        /// Tokens consumed.
        available: usize,
    },
    /// The constraint exceeded a parser or lexer budget (at compile time or while
    /// computing a mask).
    #[error("the constraint is too complex: {0}")]
    TooComplex(String),
    /// The constraint itself is malformed or unsupported (a bad grammar, schema or regex,
    /// or one that matches nothing). The message says what is wrong.
    #[error("{0}")]
    Invalid(String),
    /// The constraint failed internally and cannot continue. The message says why.
    #[error("{0}")]
    Failed(String),
}

/// The state of one output under a constraint, as decoding drives it.
///
/// One contract ties the operations together, so verification can use the cheap checks
/// and still reproduce plain decoding exactly: in every state,
/// `accepts(t)` ⇔ `t` is in the mask from [`TokenConstraint::compute_mask`] ⇔
/// [`TokenConstraint::consume`]`(t)` succeeds. The engine holds the *verified* state (it
/// follows committed tokens); [`TokenConstraint::fork`] makes the *speculative mirror* that
/// drafts advance, dropped afterwards.
pub trait TokenConstraint: Send {
    /// Writes the set of tokens allowed next into `mask`, reusing its allocation (the
    /// implementation sets its length to the logit width it works in). An empty set is
    /// [`ConstraintError::DeadEnd`].
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError>;
    /// Whether `token` is allowed next: the mask's answer for that one token, without
    /// computing the whole mask (false in a failed state).
    fn accepts(&mut self, token: u32) -> bool;
    /// Advances over `token`. A token the constraint does not allow is an error and leaves
    /// the state unchanged.
    fn consume(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// Undoes the last `n` consumed tokens.
    fn rollback(&mut self, n: usize) -> Result<(), ConstraintError>;
    /// An independent copy in the same state (the speculative mirror); advancing it never
    /// affects the original.
    fn fork(&self) -> Box<dyn TokenConstraint>;
    /// Tokens the constraint forces from here (fast-forward), in order: each is the only
    /// token the mask allows at its step. Empty when the next token is a free choice.
    fn forced_tokens(&mut self) -> Vec<u32> {
        Vec::new()
    }
    /// Whether the output is complete (nothing but end-of-generation may follow), or the
    /// constraint has failed.
    fn is_finished(&self) -> bool;
    /// Whether the output is free text here: the constraint allows every token it does not
    /// block outright (special tokens), as a lazy tool-call constraint does until the model
    /// opens an envelope. Drafters then draft as they would without a constraint (the
    /// mirror still checks every token). False by default.
    fn is_free(&self) -> bool {
        false
    }
}

/// Checks the [`TokenConstraint`] contract in the current state of `constraint` for every
/// token id below `n_logits`: `accepts(t)` agrees with the mask, and `consume(t)` succeeds
/// exactly for the allowed tokens (each tried on a fork, so `constraint` is unchanged).
/// Returns the first disagreeing token, if any. Costs one fork and one mask per token:
/// meant for tests of implementations (behind the `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub fn check_contract(
    constraint: &mut dyn TokenConstraint,
    n_logits: usize,
) -> Result<(), ContractViolation> {
    let mut mask = TokenMask::new(n_logits);
    let masked = constraint.compute_mask(&mut mask).is_ok();
    for t in 0..n_logits as u32 {
        let in_mask = masked && mask.get(t);
        if constraint.accepts(t) != in_mask {
            return Err(ContractViolation {
                token: t,
                in_mask,
                operation: "accepts",
            });
        }
        if in_mask {
            let mut fork = constraint.fork();
            if fork.consume(t).is_err() {
                return Err(ContractViolation {
                    token: t,
                    in_mask,
                    operation: "consume",
                });
            }
        }
    }
    Ok(())
}

/// A token for which a constraint's `accepts` or `consume` disagreed with its mask
/// ([`check_contract`]).
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("`{operation}({token})` disagrees with the mask (token in mask: {in_mask})")]
pub struct ContractViolation {
    /// The token.
    pub token: u32,
    /// Whether the mask held it.
    pub in_mask: bool,
    /// The operation that disagreed: `accepts` or `consume`.
    pub operation: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows tokens below `limit - consumed`; the smallest test of the contract checker.
    #[derive(Clone)]
    struct Shrinking {
        limit: u32,
        consumed: Vec<u32>,
        lie_about: Option<u32>,
    }

    impl TokenConstraint for Shrinking {
        fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
            let bound = self.limit.saturating_sub(self.consumed.len() as u32);
            mask.fill_words(8, |i| match i {
                0 => (1u64 << bound) - 1,
                _ => 0,
            });
            if bound == 0 {
                return Err(ConstraintError::DeadEnd {
                    position: self.consumed.len(),
                });
            }
            Ok(())
        }
        fn accepts(&mut self, token: u32) -> bool {
            Some(token) == self.lie_about
                || token < self.limit.saturating_sub(self.consumed.len() as u32)
        }
        fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
            if token >= self.limit.saturating_sub(self.consumed.len() as u32) {
                return Err(ConstraintError::TokenRejected {
                    token,
                    text: String::new(),
                    position: self.consumed.len(),
                });
            }
            self.consumed.push(token);
            Ok(())
        }
        fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
            let available = self.consumed.len();
            let keep = available.checked_sub(n).ok_or(ConstraintError::Rollback {
                requested: n,
                available,
            })?;
            self.consumed.truncate(keep);
            Ok(())
        }
        fn fork(&self) -> Box<dyn TokenConstraint> {
            Box::new(self.clone())
        }
        fn is_finished(&self) -> bool {
            self.consumed.len() as u32 >= self.limit
        }
    }

    #[test]
    fn contract_checker_passes_an_honest_constraint_and_names_a_lying_one() {
        let mut honest = Shrinking {
            limit: 5,
            consumed: Vec::new(),
            lie_about: None,
        };
        check_contract(&mut honest, 8).unwrap();
        honest.consume(1).unwrap();
        check_contract(&mut honest, 8).unwrap();
        assert_eq!(
            honest.rollback(2),
            Err(ConstraintError::Rollback {
                requested: 2,
                available: 1
            })
        );
        let mut liar = Shrinking {
            lie_about: Some(6),
            ..honest
        };
        assert_eq!(
            check_contract(&mut liar, 8),
            Err(ContractViolation {
                token: 6,
                in_mask: false,
                operation: "accepts"
            })
        );
    }

    #[test]
    fn errors_say_what_happened() {
        let e = ConstraintError::TokenRejected {
            token: 7,
            text: "x".into(),
            position: 3,
        };
        assert_eq!(
            e.to_string(),
            "token 7 (\"x\") is not allowed by the constraint after 3 tokens"
        );
        let e: Box<dyn std::error::Error> = Box::new(ConstraintError::DeadEnd { position: 2 });
        assert_eq!(e.to_string(), "no token is allowed after 2 tokens");
    }
}
