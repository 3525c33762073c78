//! The real grammar behind [`TokenConstraint`]: llguidance's verified matcher from the
//! `grammar` crate (feature `grammar`).

use crate::api::{TokenConstraint, TokenMask};
use grammar::GrammarMatcher;

impl TokenConstraint for GrammarMatcher {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), String> {
        GrammarMatcher::compute_mask(self, mask).map_err(|e| e.to_string())
    }

    fn consume(&mut self, token: u32) -> Result<(), String> {
        GrammarMatcher::consume(self, token).map_err(|e| e.to_string())
    }

    fn is_finished(&self) -> bool {
        GrammarMatcher::is_finished(self)
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        GrammarMatcher::rollback(self, n).map_err(|e| e.to_string())
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(GrammarMatcher::fork(self))
    }

    fn forced_tokens(&mut self) -> Vec<u32> {
        GrammarMatcher::forced_tokens(self)
    }

    fn accepts(&mut self, token: u32) -> bool {
        GrammarMatcher::accepts(self, token)
    }
}
