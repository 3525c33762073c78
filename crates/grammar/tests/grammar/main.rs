//! Token-level tests of the grammar crate against real tokenizers (no model forward).

mod common;
mod constraint_trait;
mod errors;
mod json_schema;
mod matcher;
mod regex_lark;
mod special_tokens;
mod timing;
