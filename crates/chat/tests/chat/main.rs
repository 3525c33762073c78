//! Integration tests of the chat crate: golden templates rendered from the real models' GGUFs,
//! the Jinja dialect against jinja2, prompt snapshots, and the tool-call formats (Hermes
//! `<tool_call>`, DeepSeek V4 DSML).

mod common;
mod dsml;
mod golden_templates;
mod jinja_semantics;
mod prompt_snapshots;
mod tool_calls;
