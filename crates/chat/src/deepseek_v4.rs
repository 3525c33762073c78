//! The DeepSeek V4 chat encoding, rendered in Rust: DeepSeek ships it as Python
//! (`encoding/encoding_dsv4.py` of the DeepSeek-V4-Flash release) rather than as a Jinja
//! `chat_template`, so a deepseek4 GGUF may carry none. [`crate::ChatTemplate::deepseek_v4`]
//! wraps this renderer.
//!
//! Followed: `encode_messages`, `render_message`, `merge_tool_messages`,
//! `sort_tool_results_by_call_order`, `_drop_thinking_messages`, `render_tools` and
//! `TOOLS_TEMPLATE` of `encoding_dsv4.py` (as vendored in `supermy/ds4rs`,
//! `encoding/encoding_dsv4.py`):
//! - `<｜begin▁of▁sentence｜>`, then per message: system content (plus `"\n\n"` and the
//!   tools section when tools are given); `<｜User｜>` + user content; assistant
//!   `[reasoning</think>]content["\n\n" DSML block]<｜end▁of▁sentence｜>`.
//! - `tool` messages have no role of their own: consecutive user and tool messages merge
//!   into one user turn whose parts are joined by `"\n\n"`, each tool result written
//!   `<tool_result>…</tool_result>`, results ordered as the preceding assistant's calls.
//! - After a user (or developer) turn that is last or followed by the assistant:
//!   `<｜Assistant｜>` then `<think>` (thinking mode, latest turn) or `</think>` (chat mode,
//!   or an older turn whose reasoning is dropped).
//! - Thinking mode drops the reasoning of assistant turns before the last user turn,
//!   unless tools are given; `reasoning_effort = "max"` prefixes the reasoning-effort
//!   prompt.
//!
//! Where the reference has no answer for an OpenAI-shaped request: the reference attaches
//! the tools to the first message and only a system or developer message renders them, so
//! when the conversation does not start with one, the tools section opens the prompt on
//! its own. Variables read from the render's `extra`: `enable_thinking` / `thinking`
//! (bool, default false: chat mode), `reasoning_effort` (`"high"`, `"max"`),
//! `drop_thinking` (bool, default true).

use serde_json::{Map, Value};

use crate::message::content_text;
use crate::tool_call::dsml_encode_arguments;
use crate::{ChatError, Message, python_json};

/// `<｜begin▁of▁sentence｜>`.
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
/// `<｜end▁of▁sentence｜>`.
pub const EOS: &str = "<｜end▁of▁sentence｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";
const LATEST_REMINDER: &str = "<｜latest_reminder｜>";
const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// The tools section (`TOOLS_TEMPLATE`), `{tool_schemas}` left to fill.
pub(crate) const TOOLS_TEMPLATE: &str = "## Tools\n\n\
You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after </think> with tool calls or final response.\n\n\
### Available Tool Schemas\n\n\
{tool_schemas}\n\n\
You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

/// One message after preprocessing.
#[derive(Debug, Clone)]
struct Turn {
    role: String,
    content: String,
    /// User turns: parts (text, or a tool result with its call id).
    parts: Vec<Part>,
    /// Assistant turns: `(id, name, arguments)`.
    calls: Vec<(Option<String>, String, Value)>,
    reasoning: String,
    tools: bool,
}

#[derive(Debug, Clone)]
enum Part {
    Text(String),
    ToolResult(Option<String>, String),
}

fn error(message: impl Into<String>) -> ChatError {
    ChatError::Render {
        line: None,
        snippet: None,
        message: message.into(),
    }
}

/// Renders a conversation as DeepSeek V4's `encode_messages` does (see the module docs).
pub fn render(
    messages: &[Message],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
    extra: &Map<String, Value>,
) -> Result<String, ChatError> {
    let thinking = ["enable_thinking", "thinking"]
        .iter()
        .any(|k| extra.get(*k).is_some_and(|v| v.as_bool() == Some(true)));
    let effort = match extra.get("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "max" || s == "high" => Some(s.as_str()),
        Some(other) => {
            return Err(error(format!(
                "reasoning_effort must be \"high\" or \"max\", not {other}"
            )));
        }
    };
    let drop_thinking = extra
        .get("drop_thinking")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let tools = tools.filter(|t| !t.is_empty());

    let mut turns = merge(messages)?;
    sort_tool_results(&mut turns);
    let mut tools_prefix = None;
    if let Some(t) = tools {
        let section = render_tools(t);
        match turns.first_mut() {
            Some(first) if first.role == "system" || first.role == "developer" => {
                first.tools = true;
            }
            _ => tools_prefix = Some(section),
        }
    }
    let drop = drop_thinking && tools.is_none();
    if thinking && drop {
        turns = drop_thinking_turns(turns);
    }
    let last_user = turns
        .iter()
        .rposition(|t| t.role == "user" || t.role == "developer");

    let mut out = String::from(BOS);
    if let Some(section) = &tools_prefix {
        if thinking && effort == Some("max") {
            out.push_str(REASONING_EFFORT_MAX);
        }
        out.push_str(section);
    }
    let tools_section = tools.map(render_tools).unwrap_or_default();
    for (i, turn) in turns.iter().enumerate() {
        if i == 0 && tools_prefix.is_none() && thinking && effort == Some("max") {
            out.push_str(REASONING_EFFORT_MAX);
        }
        match turn.role.as_str() {
            "system" => {
                out.push_str(&turn.content);
                if turn.tools {
                    out.push_str("\n\n");
                    out.push_str(&tools_section);
                }
            }
            "developer" => {
                if turn.content.is_empty() {
                    return Err(error("a developer message needs content"));
                }
                out.push_str(USER);
                out.push_str(&turn.content);
                if turn.tools {
                    out.push_str("\n\n");
                    out.push_str(&tools_section);
                }
            }
            "user" => {
                out.push_str(USER);
                let parts: Vec<String> = turn
                    .parts
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => t.clone(),
                        Part::ToolResult(_, c) => format!("<tool_result>{c}</tool_result>"),
                    })
                    .collect();
                out.push_str(&parts.join("\n\n"));
            }
            "latest_reminder" => {
                out.push_str(LATEST_REMINDER);
                out.push_str(&turn.content);
            }
            "assistant" => {
                if thinking && (!drop || last_user.is_none_or(|u| i > u)) {
                    out.push_str(&turn.reasoning);
                    out.push_str(THINK_END);
                }
                out.push_str(&turn.content);
                if !turn.calls.is_empty() {
                    let invokes: Vec<String> = turn
                        .calls
                        .iter()
                        .map(|(_, name, args)| {
                            format!(
                                "<｜DSML｜invoke name=\"{name}\">\n{}\n</｜DSML｜invoke>",
                                dsml_encode_arguments(args)
                            )
                        })
                        .collect();
                    out.push_str("\n\n<｜DSML｜tool_calls>\n");
                    out.push_str(&invokes.join("\n"));
                    out.push_str("\n</｜DSML｜tool_calls>");
                }
                out.push_str(EOS);
            }
            other => return Err(error(format!("unknown message role {other:?}"))),
        }
        let next = turns.get(i + 1).map(|t| t.role.as_str());
        let opens_reply = match next {
            None => add_generation_prompt,
            Some(r) => r == "assistant" || r == "latest_reminder",
        };
        if opens_reply && (turn.role == "user" || turn.role == "developer") {
            out.push_str(ASSISTANT);
            let think = thinking && (!drop || last_user.is_some_and(|u| i >= u));
            out.push_str(if think { THINK_START } else { THINK_END });
        }
    }
    Ok(out)
}

/// The tools section for OpenAI-shaped tools (`{"type": "function", "function": {…}}`).
fn render_tools(tools: &[Value]) -> String {
    let schemas: Vec<String> = tools
        .iter()
        .map(|t| python_json(t.get("function").unwrap_or(t)))
        .collect();
    TOOLS_TEMPLATE.replace("{tool_schemas}", &schemas.join("\n"))
}

/// OpenAI messages → turns, merging runs of user and tool messages.
fn merge(messages: &[Message]) -> Result<Vec<Turn>, ChatError> {
    let mut turns: Vec<Turn> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let content = content_text(&m.content, i)?;
        let part = match m.role.as_str() {
            "tool" => Some(Part::ToolResult(m.tool_call_id.clone(), content.clone())),
            "user" => Some(Part::Text(content.clone())),
            _ => None,
        };
        if let Some(part) = part {
            match turns.last_mut() {
                Some(last) if last.role == "user" => last.parts.push(part),
                _ => turns.push(Turn {
                    role: "user".into(),
                    content: String::new(),
                    parts: vec![part],
                    calls: Vec::new(),
                    reasoning: String::new(),
                    tools: false,
                }),
            }
            continue;
        }
        let mut calls = Vec::new();
        for c in m.tool_calls.iter().flatten() {
            let args = match &c.function.arguments {
                Value::String(s) => serde_json::from_str::<Value>(s)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| Value::String(s.clone())),
                other => other.clone(),
            };
            calls.push((c.id.clone(), c.function.name.clone(), args));
        }
        let reasoning = m
            .extra
            .get("reasoning_content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        turns.push(Turn {
            role: m.role.clone(),
            content,
            parts: Vec::new(),
            calls,
            reasoning,
            tools: false,
        });
    }
    Ok(turns)
}

/// Orders the tool results of each user turn as the preceding assistant's calls (a
/// stable sort; results with an unknown id count as the first call).
fn sort_tool_results(turns: &mut [Turn]) {
    let mut order: Vec<String> = Vec::new();
    for turn in turns.iter_mut() {
        if turn.role == "assistant" && !turn.calls.is_empty() {
            order = turn
                .calls
                .iter()
                .map(|(id, _, _)| id.clone().unwrap_or_default())
                .collect();
        } else if turn.role == "user" && !order.is_empty() {
            let key = |p: &Part| match p {
                Part::ToolResult(Some(id), _) => order
                    .iter()
                    .position(|o| !o.is_empty() && o == id)
                    .unwrap_or(0),
                _ => 0,
            };
            let mut results: Vec<Part> = turn
                .parts
                .iter()
                .filter(|p| matches!(p, Part::ToolResult(..)))
                .cloned()
                .collect();
            if results.len() < 2 {
                continue;
            }
            results.sort_by_key(key);
            let mut it = results.into_iter();
            for p in turn.parts.iter_mut() {
                if matches!(p, Part::ToolResult(..))
                    && let Some(r) = it.next()
                {
                    *p = r;
                }
            }
        }
    }
}

/// `_drop_thinking_messages`: before the last user turn, assistant reasoning is removed
/// and developer turns are dropped.
fn drop_thinking_turns(turns: Vec<Turn>) -> Vec<Turn> {
    let last_user = turns
        .iter()
        .rposition(|t| t.role == "user" || t.role == "developer");
    turns
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut t)| {
            let keep = matches!(t.role.as_str(), "user" | "system" | "latest_reminder")
                || last_user.is_none_or(|u| i >= u);
            if keep {
                Some(t)
            } else if t.role == "assistant" {
                t.reasoning.clear();
                Some(t)
            } else {
                None
            }
        })
        .collect()
}
