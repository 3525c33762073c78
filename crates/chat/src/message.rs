//! Chat messages in the shape OpenAI clients send them, and their conversion into the
//! dictionaries that HF chat templates expect.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ChatError;

/// One chat message, mirroring OpenAI's chat message object.
///
/// Unknown fields (e.g. `reasoning_content`) are kept in [`Message::extra`] and passed to the
/// template unchanged, since some templates read them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Text, or a list of content parts. `None` (JSON `null` or absent) renders as `""`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// Tool calls made by an assistant message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `tool` messages: the id of the call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional participant or tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any other fields, passed through to the template.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Message {
    /// A message with a role and text content, nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            extra: Map::new(),
        }
    }
}

/// Message content: a string, or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed parts (`[{"type": "text", "text": "…"}]`).
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part content list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Other fields of the part (e.g. `image_url`), kept so errors can name the type.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A tool call made by the assistant: `{id, type: "function", function: {name, arguments}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id, when the client sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `function` today.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// The function called.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".to_string()
}

/// Name and arguments of a called function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments: a JSON object, or (as OpenAI clients send it) a string holding JSON.
    /// A string that parses as JSON is given to the template as the parsed value, because
    /// HF templates (Qwen's `tool_call.arguments | tojson`) expect an object.
    pub arguments: Value,
}

/// Joins text parts with `"\n"`, the convention of llama.cpp and vLLM for templates that
/// take string content.
pub(crate) fn content_text(
    content: &Option<MessageContent>,
    message_index: usize,
) -> Result<String, ChatError> {
    match content {
        None => Ok(String::new()),
        Some(MessageContent::Text(t)) => Ok(t.clone()),
        Some(MessageContent::Parts(parts)) => {
            let mut out = String::new();
            for (i, part) in parts.iter().enumerate() {
                if part.kind != "text" {
                    return Err(ChatError::UnsupportedContentPart {
                        message_index,
                        part_type: part.kind.clone(),
                    });
                }
                let text = part
                    .text
                    .as_deref()
                    .ok_or(ChatError::MissingPartText { message_index })?;
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(text);
            }
            Ok(out)
        }
    }
}

/// The dictionary a template sees for one message.
pub(crate) fn message_to_template_value(
    message: &Message,
    message_index: usize,
) -> Result<Value, ChatError> {
    let mut m = Map::new();
    m.insert("role".into(), Value::String(message.role.clone()));
    m.insert(
        "content".into(),
        Value::String(content_text(&message.content, message_index)?),
    );
    if let Some(calls) = &message.tool_calls {
        let calls = calls.iter().map(tool_call_to_template_value).collect();
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &message.tool_call_id {
        m.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    if let Some(name) = &message.name {
        m.insert("name".into(), Value::String(name.clone()));
    }
    for (k, v) in &message.extra {
        m.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Ok(Value::Object(m))
}

fn tool_call_to_template_value(call: &ToolCall) -> Value {
    let arguments = match &call.function.arguments {
        Value::String(s) => {
            serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        other => other.clone(),
    };
    let mut function = Map::new();
    function.insert("name".into(), Value::String(call.function.name.clone()));
    function.insert("arguments".into(), arguments);
    let mut m = Map::new();
    if let Some(id) = &call.id {
        m.insert("id".into(), Value::String(id.clone()));
    }
    m.insert("type".into(), Value::String(call.kind.clone()));
    m.insert("function".into(), Value::Object(function));
    Value::Object(m)
}
