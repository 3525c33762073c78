//! Chat templates (Jinja, rendered as HF transformers does) and tool-call envelope formats.
//!
//! - [`ChatTemplate`] renders a GGUF's `tokenizer.chat_template` for a conversation of
//!   [`Message`]s, byte for byte as `transformers`' `apply_chat_template` does.
//! - [`ToolCallFormat`] describes one model family's tool-call envelope (Qwen/Hermes
//!   `<tool_call>`, DeepSeek V4 DSML `<｜DSML｜tool_calls>`): parsing whole outputs, parsing
//!   streams, rendering a call, and the layout facts (markers, the DSML parameter layout)
//!   from which the server builds the grammar of the calls; this crate writes no grammar.
//! - [`ChatTemplate::deepseek_v4`] renders DeepSeek V4's chat encoding, which DeepSeek
//!   ships as Python rather than Jinja ([`deepseek_v4`]).
//!
//! This crate never depends on the tokenizer or on GGUF: callers pass the template source
//! and the BOS/EOS token strings.

pub mod deepseek_v4;
mod error;
mod message;
mod pyjson;
mod template;
mod tool_call;

pub use error::ChatError;
pub use message::{ContentPart, FunctionCall, Message, MessageContent, ToolCall};
pub use template::ChatTemplate;
pub use tool_call::{
    CallLayout, DSML_TOKEN, DsmlFormat, HermesFormat, ParsedOutput, ParsedToolCall, ToolCallError,
    ToolCallFormat, ToolStreamEvent, ToolStreamParser, detect_format,
};

/// Python's `json.dumps(value, ensure_ascii=False)` (HF's `tojson` with default options):
/// separators `", "` and `": "`, key order kept, no HTML escaping, floats as Python `repr`.
pub fn python_json(value: &serde_json::Value) -> String {
    pyjson::dumps(
        &minijinja::Value::from_serialize(value),
        &pyjson::DumpOptions::default(),
    )
    .unwrap_or_else(|_| "null".to_string())
}
