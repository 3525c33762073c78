//! Structured-output constraints over llguidance: token environment, verified matcher and
//! speculative mirror.
//!
//! - [`TokenEnv`]: a model's vocabulary as the grammar sees it, built once per model.
//!   Special tokens (BOS, EOS, chat markers) are markers no terminal can spell; padding and
//!   never-sample ids are never allowed.
//! - [`Constraint`]: JSON Schema, any JSON object, regex, Lark or a choice list, optionally
//!   behind a `<think>…</think>` reasoning segment; [`Constraint::compile`] turns it into a
//!   [`CompiledConstraint`] for one model.
//! - [`GrammarMatcher`]: masks ([`sampling::TokenMask`]), single-token checks, consumption,
//!   forced tokens, rollback, and [`GrammarMatcher::fork`] for the speculative mirror.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use lockstep_grammar::{Constraint, GrammarLimits, TokenEnv};
//!
//! let file = gguf::GgufFile::open("model.gguf")?;
//! let tokenizer = Arc::new(text::Tokenizer::from_gguf(&file)?);
//! let env = TokenEnv::new(tokenizer)?;
//! let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
//! let compiled = Constraint::json_schema(schema).compile(&env, &GrammarLimits::default())?;
//! let mut matcher = compiled.matcher();
//! let mut mask = sampling::TokenMask::new(env.n_logits());
//! matcher.compute_mask(&mut mask)?;
//! let token = mask.iter().next().ok_or("empty mask")?;
//! let mut mirror = matcher.fork(); // speculative mirror: advance over drafts, then drop
//! mirror.consume(token)?;
//! matcher.consume(token)?;
//! # Ok(()) }
//! ```

mod constraint;
mod env;
mod error;
pub mod lark;
mod limits;
mod matcher;
mod schema_check;

pub use constraint::{
    CompiledConstraint, Constraint, ConstraintKey, ConstraintSource, JsonWhitespace,
};
pub use env::TokenEnv;
pub use error::GrammarError;
pub use limits::GrammarLimits;
pub use matcher::GrammarMatcher;

#[cfg(test)]
mod tests {
    #[test]
    fn matchers_move_between_threads_and_envs_are_shared() {
        fn send<T: Send>() {}
        fn sync<T: Send + Sync>() {}
        send::<crate::GrammarMatcher>();
        send::<crate::CompiledConstraint>();
        sync::<crate::TokenEnv>();
        sync::<crate::CompiledConstraint>();
    }
}
