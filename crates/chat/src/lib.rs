//! Chat templates (Jinja, rendered as HF transformers does) and tool-call envelope formats.
//!
//! - [`ChatTemplate`] renders a GGUF's `tokenizer.chat_template` for a conversation of
//!   [`Message`]s, byte for byte as `transformers`' `apply_chat_template` does.
//! - [`ToolCallFormat`] describes one model family's tool-call envelope (Qwen/Hermes
//!   `<tool_call>` today): parsing whole outputs, parsing streams, and rendering a call.
//!
//! This crate never depends on the tokenizer or on GGUF: callers pass the template source
//! and the BOS/EOS token strings.

mod error;
mod message;
mod pyjson;
mod template;
mod tool_call;

pub use error::ChatError;
pub use message::{ContentPart, FunctionCall, Message, MessageContent, ToolCall};
pub use template::ChatTemplate;
pub use tool_call::{
    HermesFormat, ParsedOutput, ParsedToolCall, ToolCallError, ToolCallFormat, ToolStreamEvent,
    ToolStreamParser, detect_format,
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
