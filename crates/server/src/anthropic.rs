//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! A request is translated onto the chat-completions path rather than served by a second
//! copy of it: the conversation becomes chat [`Message`]s (`tool_use` blocks → assistant
//! tool calls, `tool_result` blocks → `tool` messages), the tools become [`ToolSpec`]s
//! whose parameters are their `input_schema`, and `tool_choice` a [`ToolMode`]. The prompt,
//! the tool grammars (a `tool_use` input always validates against its schema), the prefix
//! cache and speculation are therefore those of an OpenAI request. The run is encoded as a
//! `message` body or as Anthropic's event stream (`message_start`, `content_block_start`,
//! `ping`, `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`;
//! a failure mid-stream is an `error` event). Every error on these routes carries
//! Anthropic's body `{"type": "error", "error": {"type", "message"}}` ([`error_bodies`]).
//!
//! `thinking` (`enabled` or `adaptive`) renders the prompt in thinking mode when the served
//! model has one ([`runtime::Runtime::thinks`]: its template reads
//! `enable_thinking`, or DeepSeek V4): the reasoning segment `<think>…</think>` then comes
//! back as a `thinking` block before the answer (`thinking_delta` events when streaming;
//! its `signature` is empty). Other models ignore it. `metadata` is ignored;
//! `anthropic-version` and `anthropic-beta` headers are accepted whatever their value.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chat::{FunctionCall, Message, MessageContent, ToolCall};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::api::SamplingFields;
use crate::chat_completions::receiver_stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::request::{self, Job};
use crate::run::{ChoiceResult, Run, RunEvent, collect};
use crate::state::AppState;
use crate::tools::{ToolKind, ToolMode, ToolSetup, ToolSpec};
use crate::usage;

/// Most stop sequences per request.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// `POST /v1/messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// The model name (any name is answered by the served model unless the server is
    /// strict about names).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation: `{role, content}` with content a string or a list of blocks.
    pub messages: Vec<Value>,
    /// The system prompt: a string or a list of text blocks.
    #[serde(default)]
    pub system: Option<Value>,
    /// Most tokens to generate (required, as Anthropic requires it).
    pub max_tokens: u64,
    /// Strings that end the reply (reported in `stop_sequence`).
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Stream events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Temperature (0 to 1).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Tools: `{name, description, input_schema}`.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Ignored.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// Extended thinking (see the module docs).
    #[serde(default)]
    pub thinking: Option<Value>,
    /// Seed (extension; random when absent).
    #[serde(default)]
    pub seed: Option<i64>,
}

impl SamplingFields for MessagesRequest {
    fn temperature(&self) -> Option<f32> {
        self.temperature
    }
    fn top_p(&self) -> Option<f32> {
        self.top_p
    }
    fn top_k(&self) -> Option<i64> {
        self.top_k
    }
    fn min_p(&self) -> Option<f32> {
        None
    }
    fn seed(&self) -> Option<i64> {
        self.seed
    }
    fn presence_penalty(&self) -> Option<f32> {
        None
    }
    fn frequency_penalty(&self) -> Option<f32> {
        None
    }
    fn repetition_penalty(&self) -> Option<f32> {
        None
    }
    fn logit_bias(&self) -> Option<&BTreeMap<String, f32>> {
        None
    }
}

/// `POST /v1/messages/count_tokens`: the prompt-shaping fields of a messages request.
#[derive(Debug, Clone, Deserialize)]
pub struct CountTokensRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<Value>,
    /// The system prompt.
    #[serde(default)]
    pub system: Option<Value>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Tool choice.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Extended thinking (changes the prompt of a model that thinks).
    #[serde(default)]
    pub thinking: Option<Value>,
}

/// The two routes (the API-key check and the error bodies are added by the router).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
}

/// Whether `path` is one of this module's routes (their errors take Anthropic's body).
pub fn is_messages_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

async fn messages(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    serve(state, req).await
}

async fn count_tokens(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CountTokensRequest>,
) -> Result<Json<Value>, ApiError> {
    state.check_model(req.model.as_deref())?;
    let st = Arc::clone(&state);
    let n = tokio::task::spawn_blocking(move || {
        let setup = tool_setup(req.tools.as_deref(), req.tool_choice.as_ref())?;
        let thinking = check_thinking(req.thinking.as_ref())? && st.model.thinks();
        let messages = conversation(req.system.as_ref(), &req.messages)?;
        prompt(&st.model, &messages, &setup, thinking).map(|(p, _)| p.len())
    })
    .await
    .map_err(|e| ApiError::Internal(format!("counting tokens failed: {e}")))??;
    Ok(Json(json!({ "input_tokens": n })))
}

/// Serves one messages request.
pub async fn serve(state: Arc<AppState>, req: MessagesRequest) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let stream = req.stream.unwrap_or(false);
    let st = Arc::clone(&state);
    let job = tokio::task::spawn_blocking(move || prepare(&st, &req))
        .await
        .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??;
    let meta = Meta {
        id: state.new_id("msg_"),
        model: state.model.name().to_string(),
        prompt_tokens: job.prompt.len(),
        stop_sequences: job.stop.clone(),
    };
    let run = Run::start(Arc::clone(&state.model), Arc::clone(&state.metrics), &job)?;
    if stream {
        Ok(stream_response(run, meta, state).into_response())
    } else {
        let results = collect(run, 1).await?;
        let r = results
            .first()
            .ok_or_else(|| ApiError::Internal("the run produced no reply".into()))?;
        Ok(Json(message_body(&meta, r, || state.new_id("toolu_"))).into_response())
    }
}

/// Validates a messages request and builds its [`Job`] (blocking work: template,
/// tokenizer, grammars).
pub fn prepare(state: &AppState, req: &MessagesRequest) -> Result<Job, ApiError> {
    let model = &state.model;
    if let Some(t) = req.temperature
        && !(0.0..=1.0).contains(&t)
    {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be between 0 and 1, got {t}"),
        ));
    }
    let sampling = request::sampling_params(req, model.engine().n_vocab())?;
    let max_tokens = request::max_tokens("max_tokens", Some(req.max_tokens))?;
    let stop = stop_sequences(req.stop_sequences.as_deref().unwrap_or(&[]))?;
    let setup = tool_setup(req.tools.as_deref(), req.tool_choice.as_ref())?;
    let thinking = check_thinking(req.thinking.as_ref())? && model.thinks();
    if thinking && matches!(setup.mode, ToolMode::Required | ToolMode::Named(_)) {
        return Err(ApiError::invalid(
            "thinking",
            "thinking may not be enabled when tool_choice forces tool use",
        ));
    }
    let messages = conversation(req.system.as_ref(), &req.messages)?;
    let (prompt, opened) = prompt(model, &messages, &setup, thinking)?;
    let ctx = model.context_len();
    if prompt.len() >= ctx {
        // Anthropic's wording: clients (Claude Code) recognise it and compact.
        return Err(ApiError::BadRequest {
            message: format!(
                "prompt is too long: {} tokens > {} maximum (this server's context is {ctx} \
                 tokens; `lockstep serve -c N` sets it)",
                prompt.len(),
                ctx - 1
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    let constraint = runtime::constraint::plan(
        model,
        &state.grammars,
        Some(&setup),
        None,
        &prompt,
        ("tools", "tools"),
    )
    .map_err(|e| input_schema_names(e.into()))?;
    Ok(Job {
        prompt,
        sampling,
        n: 1,
        max_tokens,
        stop,
        ignore_eos: false,
        logprobs: None,
        constraint,
        tools: setup.active().then_some(setup),
        thinking: thinking.then_some(opened),
    })
}

/// The prompt tokens, rendered in thinking mode when `thinking`; with whether the prompt
/// opened the reasoning segment itself (it ends with `<think>`).
fn prompt(
    model: &runtime::Runtime,
    messages: &[Message],
    setup: &ToolSetup,
    thinking: bool,
) -> Result<(Vec<u32>, bool), ApiError> {
    let mut extra = Map::new();
    if thinking {
        extra.insert("enable_thinking".into(), Value::Bool(true));
    }
    let p = request::chat_prompt_with(model, messages, Some(setup), extra)?;
    let opened = thinking && p.text.trim_end().ends_with("<think>");
    Ok((p.tokens, opened))
}

/// The shared tool code names a function's schema `parameters`; here it is `input_schema`.
fn input_schema_names(e: ApiError) -> ApiError {
    match e {
        ApiError::BadRequest {
            message,
            param,
            code,
        } => ApiError::BadRequest {
            message: message.replace(".parameters", ".input_schema"),
            param: param.map(|p| p.replace(".parameters", ".input_schema")),
            code,
        },
        other => other,
    }
}

fn stop_sequences(stop: &[String]) -> Result<Vec<String>, ApiError> {
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid(
            "stop_sequences",
            format!("at most {MAX_STOP_SEQUENCES} stop sequences"),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            format!("stop_sequences[{i}]"),
            "stop sequences must not be empty",
        ));
    }
    Ok(stop.to_vec())
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` and `{"type": "adaptive"}` turn
/// thinking on (for a model that thinks: see [`runtime::Runtime::thinks`]),
/// `{"type": "disabled"}` or none leave it off; anything else is a 400.
fn check_thinking(thinking: Option<&Value>) -> Result<bool, ApiError> {
    let Some(t) = thinking.filter(|t| !t.is_null()) else {
        return Ok(false);
    };
    match t.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(true),
        Some("disabled") => Ok(false),
        _ => Err(ApiError::invalid(
            "thinking.type",
            "thinking.type must be \"enabled\", \"disabled\" or \"adaptive\"",
        )),
    }
}

/// Anthropic tools and `tool_choice` as a [`ToolSetup`]. Tools with a `type` other than
/// `custom` (Anthropic's server tools: web search, code execution, …) cannot run here and
/// are skipped, as the OpenAI path skips the tool types it cannot run; so are tools with
/// `defer_loading` (Anthropic shows them to the model only once a tool search found them).
pub fn tool_setup(tools: Option<&[Value]>, choice: Option<&Value>) -> Result<ToolSetup, ApiError> {
    let mut specs = Vec::new();
    for (i, t) in tools.unwrap_or(&[]).iter().enumerate() {
        let p = format!("tools[{i}]");
        let Some(obj) = t.as_object() else {
            return Err(ApiError::invalid(
                p,
                format!("tools[{i}] must be an object"),
            ));
        };
        match obj.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                tracing::debug!("ignoring tool {i} of unsupported type {other:?}");
                continue;
            }
        }
        // A deferred tool is not shown to the model until a tool search loads it.
        if obj.get("defer_loading").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let name = string_field(obj, "name", &p)?;
        let description = match obj.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.description"),
                    format!("{p}.description must be a string"),
                ));
            }
        };
        let parameters = match obj.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.input_schema"),
                    format!("{p}.input_schema must be a JSON Schema object"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.input_schema"),
                    format!("missing required parameter '{p}.input_schema'"),
                ));
            }
        };
        specs.push(ToolSpec {
            name,
            description,
            kind: ToolKind::Function { parameters },
        });
    }
    let (mode, parallel) = tool_mode(choice, !specs.is_empty())?;
    let setup = ToolSetup {
        tools: specs,
        mode,
        parallel,
    };
    setup.validate("tools")?;
    Ok(setup)
}

/// `tool_choice` as a mode and whether several calls are allowed.
fn tool_mode(choice: Option<&Value>, has_tools: bool) -> Result<(ToolMode, bool), ApiError> {
    let default = if has_tools {
        ToolMode::Auto
    } else {
        ToolMode::None
    };
    let Some(c) = choice.filter(|c| !c.is_null()) else {
        return Ok((default, true));
    };
    let bad = |msg: &str| ApiError::invalid("tool_choice", msg.to_string());
    let Some(obj) = c.as_object() else {
        return Err(bad(
            "tool_choice must be an object such as {\"type\": \"auto\"}",
        ));
    };
    let parallel = match obj.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice.disable_parallel_tool_use",
                "tool_choice.disable_parallel_tool_use must be a boolean",
            ));
        }
    };
    let mode = match obj.get("type").and_then(Value::as_str) {
        Some("auto") => default,
        Some("any") => ToolMode::Required,
        Some("none") => ToolMode::None,
        Some("tool") => match obj.get("name").and_then(Value::as_str) {
            Some(name) => ToolMode::Named(name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    "tool_choice of type \"tool\" needs the tool's name",
                ));
            }
        },
        _ => {
            return Err(bad(
                "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"",
            ));
        }
    };
    Ok((mode, parallel))
}

fn string_field(obj: &Map<String, Value>, key: &str, p: &str) -> Result<String, ApiError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::invalid(
            format!("{p}.{key}"),
            format!("{p}.{key} must be a string"),
        )),
        None => Err(ApiError::invalid(
            format!("{p}.{key}"),
            format!("missing required parameter '{p}.{key}'"),
        )),
    }
}

/// The text of a list of text blocks (a system prompt, a `tool_result`'s content), joined
/// with blank lines; `what` names the list in errors.
fn text_blocks(blocks: &[Value], p: &str, what: &str) -> Result<String, ApiError> {
    let mut parts = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}[{j}]");
        let Some(obj) = b.as_object() else {
            return Err(ApiError::invalid(
                bp.clone(),
                format!("{bp} must be a content block object"),
            ));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("text") => parts.push(string_field(obj, "text", &bp)?),
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{bp}.type"),
                    format!("{what} may hold only text blocks, not {other:?}"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{bp}.type"),
                    format!("missing required parameter '{bp}.type'"),
                ));
            }
        }
    }
    Ok(parts.join("\n\n"))
}

/// The system prompt and Anthropic messages as a chat conversation (OpenAI's shape, the
/// one the chat templates read).
pub fn conversation(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() {
                out.push(Message::new("system", s.as_str()));
            }
        }
        Some(Value::Array(blocks)) => {
            let text = text_blocks(blocks, "system", "system")?;
            if !text.is_empty() {
                out.push(Message::new("system", text));
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "system",
                "system must be a string or a list of text blocks",
            ));
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(
                p.clone(),
                format!("{p} must be an object"),
            ));
        };
        let role = string_field(obj, "role", &p)?;
        if !["user", "assistant", "system"].contains(&role.as_str()) {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!(
                    "invalid role {role:?} in {p}: messages take the roles \"user\", \
                     \"assistant\" and \"system\" (a system turn mid-conversation)"
                ),
            ));
        }
        if role == "system" {
            // A system turn mid-conversation (Claude Code sends them): text only.
            let text = match obj.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(blocks)) => {
                    text_blocks(blocks, &format!("{p}.content"), "a system message")?
                }
                _ => {
                    return Err(ApiError::invalid(
                        format!("{p}.content"),
                        format!("{p}.content must be a string or a list of text blocks"),
                    ));
                }
            };
            out.push(Message::new("system", text));
            continue;
        }
        let assistant = role == "assistant";
        let blocks = match obj.get("content") {
            Some(Value::String(s)) => {
                out.push(Message::new(role, s.as_str()));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.content"),
                    format!("{p}.content must be a string or a list of content blocks"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.content"),
                    format!("missing required parameter '{p}.content'"),
                ));
            }
        };
        let mut texts: Vec<String> = Vec::new();
        let mut calls: Vec<ToolCall> = Vec::new();
        let mut results: Vec<Message> = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bp = format!("{p}.content[{j}]");
            let Some(block) = b.as_object() else {
                return Err(ApiError::invalid(
                    bp.clone(),
                    format!("{bp} must be a content block object"),
                ));
            };
            let kind = string_field(block, "type", &bp)?;
            match kind.as_str() {
                "text" => texts.push(string_field(block, "text", &bp)?),
                "tool_use" if assistant => {
                    let id = string_field(block, "id", &bp)?;
                    let name = string_field(block, "name", &bp)?;
                    let input = match block.get("input") {
                        None | Some(Value::Null) => json!({}),
                        Some(v @ Value::Object(_)) => v.clone(),
                        Some(_) => {
                            return Err(ApiError::invalid(
                                format!("{bp}.input"),
                                format!("{bp}.input must be an object"),
                            ));
                        }
                    };
                    calls.push(ToolCall {
                        id: Some(id),
                        kind: "function".into(),
                        function: FunctionCall {
                            name,
                            arguments: input,
                        },
                    });
                }
                "tool_result" if !assistant => {
                    results.push(tool_result(block, &bp)?);
                }
                "tool_use" | "tool_result" => {
                    return Err(ApiError::invalid(
                        format!("{bp}.type"),
                        format!(
                            "{kind} blocks belong in {} messages, found one in a {role} message",
                            if kind == "tool_use" {
                                "assistant"
                            } else {
                                "user"
                            }
                        ),
                    ));
                }
                // Earlier reasoning is not shown to the model again.
                "thinking" | "redacted_thinking" if assistant => {}
                "image" | "document" => {
                    return Err(ApiError::invalid(
                        format!("{bp}.type"),
                        format!("{kind} blocks are not supported: lockstep serves text models"),
                    ));
                }
                other => {
                    return Err(ApiError::invalid(
                        format!("{bp}.type"),
                        format!(
                            "unknown content block type {other:?} in {p}; expected text, \
                             tool_use, tool_result or thinking"
                        ),
                    ));
                }
            }
        }
        // Tool results answer the previous assistant turn: they come first.
        out.extend(results);
        let text = texts.join("\n\n");
        if assistant {
            let mut msg = Message::new("assistant", text);
            if !calls.is_empty() {
                if matches!(&msg.content, Some(MessageContent::Text(t)) if t.is_empty()) {
                    msg.content = None;
                }
                msg.tool_calls = Some(calls);
            }
            out.push(msg);
        } else if !texts.is_empty() || blocks.is_empty() {
            out.push(Message::new("user", text));
        }
    }
    Ok(out)
}

/// A `tool_result` block as a `tool` message: its content (a string or text blocks), with
/// `is_error` results marked as errors.
fn tool_result(block: &Map<String, Value>, bp: &str) -> Result<Message, ApiError> {
    let id = string_field(block, "tool_use_id", bp)?;
    let text = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            text_blocks(blocks, &format!("{bp}.content"), "a tool_result's content")?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{bp}.content"),
                format!("{bp}.content must be a string or a list of text blocks"),
            ));
        }
    };
    let is_error = match block.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{bp}.is_error"),
                format!("{bp}.is_error must be a boolean"),
            ));
        }
    };
    let content = if is_error {
        format!("Error: {text}")
    } else {
        text
    };
    let mut msg = Message::new("tool", content);
    msg.tool_call_id = Some(id);
    Ok(msg)
}

/// What the reply needs besides the run.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    model: String,
    prompt_tokens: usize,
    stop_sequences: Vec<String>,
}

/// `stop_reason` and `stop_sequence` of a finished reply.
pub fn stop_reason(
    finish_reason: &str,
    stop_string: Option<usize>,
    stop_sequences: &[String],
) -> (&'static str, Option<String>) {
    match finish_reason {
        "tool_calls" => ("tool_use", None),
        "length" => ("max_tokens", None),
        _ => match stop_string.and_then(|i| stop_sequences.get(i)) {
            Some(s) => ("stop_sequence", Some(s.clone())),
            None => ("end_turn", None),
        },
    }
}

/// A call's arguments as the `input` object (`{}` when they were cut off).
fn call_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

/// The `message` body of a finished reply; `tool_id` makes the `toolu_…` ids.
fn message_body(meta: &Meta, r: &ChoiceResult, mut tool_id: impl FnMut() -> String) -> Value {
    let mut content = Vec::new();
    if !r.thinking.is_empty() {
        content.push(json!({"type": "thinking", "thinking": r.thinking, "signature": ""}));
    }
    if !r.content.trim().is_empty() {
        content.push(json!({"type": "text", "text": r.content}));
    }
    for (name, arguments, _) in &r.calls {
        content.push(json!({
            "type": "tool_use",
            "id": tool_id(),
            "name": name,
            "input": call_input(arguments),
        }));
    }
    let (reason, sequence) = stop_reason(r.finish_reason, r.stop_string, &meta.stop_sequences);
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage::messages_usage(&[r.usage]),
    })
}

/// Which block is open in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
    Tool,
}

/// Turns run events into Anthropic's stream events `(event name, data)`.
struct StreamEncoder {
    meta: Meta,
    open: Option<Open>,
    index: usize,
    pinged: bool,
    /// Whitespace seen while no text block was open: sent with the next text, dropped if
    /// none follows (the newlines between tool calls).
    pending_space: String,
}

type Out = Vec<(&'static str, Value)>;

impl StreamEncoder {
    fn new(meta: Meta) -> StreamEncoder {
        StreamEncoder {
            meta,
            open: None,
            index: 0,
            pinged: false,
            pending_space: String::new(),
        }
    }

    fn start(&self) -> Out {
        vec![(
            "message_start",
            json!({
                "type": "message_start",
                "message": {
                    "id": self.meta.id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.meta.model,
                    "content": [],
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {
                        "input_tokens": self.meta.prompt_tokens,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0,
                        "output_tokens": 0,
                    },
                },
            }),
        )]
    }

    fn close(&mut self, out: &mut Out) {
        if self.open.take().is_some() {
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
        }
    }

    fn open_block(&mut self, kind: Open, block: Value, out: &mut Out) {
        self.close(out);
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = Some(kind);
        if !self.pinged {
            self.pinged = true;
            out.push(("ping", json!({"type": "ping"})));
        }
    }

    fn delta(&self, delta: Value) -> (&'static str, Value) {
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        )
    }

    fn encode(&mut self, e: RunEvent, tool_id: &mut dyn FnMut() -> String) -> Out {
        let mut out = Vec::new();
        match e {
            RunEvent::Thinking { text, .. } => {
                if self.open != Some(Open::Thinking) {
                    let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                    self.open_block(Open::Thinking, block, &mut out);
                }
                out.push(self.delta(json!({"type": "thinking_delta", "thinking": text})));
            }
            RunEvent::Content { text, .. } => {
                if self.open != Some(Open::Text) {
                    self.pending_space.push_str(&text);
                    if self.pending_space.trim().is_empty() {
                        return out;
                    }
                    self.open_block(Open::Text, json!({"type": "text", "text": ""}), &mut out);
                    let text = std::mem::take(&mut self.pending_space);
                    out.push(self.delta(json!({"type": "text_delta", "text": text})));
                } else if !text.is_empty() {
                    out.push(self.delta(json!({"type": "text_delta", "text": text})));
                }
            }
            RunEvent::CallStart { name, .. } => {
                self.pending_space.clear();
                let block = json!({"type": "tool_use", "id": tool_id(), "name": name, "input": {}});
                self.open_block(Open::Tool, block, &mut out);
            }
            RunEvent::CallDelta { text, .. } => {
                if self.open == Some(Open::Tool) && !text.is_empty() {
                    out.push(self.delta(json!({"type": "input_json_delta", "partial_json": text})));
                }
            }
            RunEvent::CallEnd { .. } => {
                if self.open == Some(Open::Tool) {
                    self.close(&mut out);
                }
            }
            RunEvent::Logprobs { .. } => {}
            RunEvent::Done {
                finish_reason,
                usage,
                stop_string,
                ..
            } => {
                self.close(&mut out);
                let (reason, sequence) =
                    stop_reason(finish_reason, stop_string, &self.meta.stop_sequences);
                out.push((
                    "message_delta",
                    json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage::messages_usage(&[*usage]),
                    }),
                ));
                out.push(("message_stop", json!({"type": "message_stop"})));
            }
            RunEvent::Failed { message, .. } => {
                out.push((
                    "error",
                    error_body(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        &format!("generation failed: {message}"),
                    ),
                ));
            }
        }
        out
    }
}

fn stream_response(
    mut run: Run,
    meta: Meta,
    state: Arc<AppState>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let (tx, rx) = mpsc::channel::<SseEvent>(256);
    let keep_alive = state.config.keep_alive;
    tokio::spawn(async move {
        let mut enc = StreamEncoder::new(meta);
        let to_sse = |(name, data): (&'static str, Value)| {
            SseEvent::default().event(name).data(data.to_string())
        };
        for e in enc.start() {
            if tx.send(to_sse(e)).await.is_err() {
                return;
            }
        }
        let mut tool_id = || state.new_id("toolu_");
        while let Some(e) = run.next().await {
            let last = matches!(e, RunEvent::Failed { .. } | RunEvent::Done { .. });
            for out in enc.encode(e, &mut tool_id) {
                if tx.send(to_sse(out)).await.is_err() {
                    return;
                }
            }
            if last {
                break;
            }
        }
    });
    Sse::new(receiver_stream(rx)).keep_alive(KeepAlive::new().interval(keep_alive))
}

/// Anthropic's `error.type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s < 500 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error body.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Middleware: gives every error answered on the messages routes (validation, API key,
/// body limit, unknown model, wrong method, engine refusal) Anthropic's body, with the
/// same status and message (the messages name the field at fault).
pub async fn error_bodies(req: Request, next: Next) -> Response {
    if !is_messages_path(req.uri().path()) {
        return next.run(req).await;
    }
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let openai: Option<Value> = serde_json::from_slice(&bytes).ok();
    let err = openai.as_ref().map(|v| &v["error"]);
    let message = err
        .and_then(|e| e["message"].as_str())
        .map(String::from)
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(&bytes).trim().to_string();
            if text.is_empty() {
                status.canonical_reason().unwrap_or("error").to_string()
            } else {
                text
            }
        });
    let mut out = (status, Json(error_body(status, &message))).into_response();
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::Usage;

    fn meta() -> Meta {
        Meta {
            id: "msg_test".into(),
            model: "qwen2.5-coder-0.5b".into(),
            prompt_tokens: 12,
            stop_sequences: vec!["END".into(), "STOP".into()],
        }
    }

    fn usage() -> Usage {
        Usage {
            prompt_tokens: 12,
            completion_tokens: 7,
            cached_tokens: 5,
            spec: None,
        }
    }

    fn encode_all(events: Vec<RunEvent>) -> Out {
        let mut enc = StreamEncoder::new(meta());
        let mut n = 0;
        let mut id = || {
            n += 1;
            format!("toolu_{n}")
        };
        let mut out = enc.start();
        for e in events {
            out.extend(enc.encode(e, &mut id));
        }
        out
    }

    #[test]
    fn a_text_then_tool_stream_has_anthropics_event_sequence() {
        let events = vec![
            RunEvent::Content {
                choice: 0,
                text: "Let me check.".into(),
            },
            RunEvent::Content {
                choice: 0,
                text: "\n".into(),
            },
            RunEvent::CallStart {
                choice: 0,
                index: 0,
                name: "get_weather".into(),
                custom: false,
            },
            RunEvent::CallDelta {
                choice: 0,
                index: 0,
                text: "{\"city\": ".into(),
            },
            RunEvent::CallDelta {
                choice: 0,
                index: 0,
                text: "\"Paris\"}".into(),
            },
            RunEvent::CallEnd {
                choice: 0,
                index: 0,
            },
            RunEvent::Content {
                choice: 0,
                text: "\n".into(),
            },
            RunEvent::Done {
                choice: 0,
                finish_reason: "tool_calls",
                usage: Box::new(usage()),
                stop_string: None,
            },
        ];
        let out = encode_all(events);
        let names: Vec<&str> = out.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let bodies: Vec<Value> = out
            .into_iter()
            .map(|(name, data)| json!({"event": name, "data": data}))
            .collect();
        insta::assert_json_snapshot!(bodies);
    }

    #[test]
    fn a_stop_sequence_is_reported_by_its_text() {
        let out = encode_all(vec![RunEvent::Done {
            choice: 0,
            finish_reason: "stop",
            usage: Box::new(usage()),
            stop_string: Some(1),
        }]);
        let delta = &out.iter().find(|(n, _)| *n == "message_delta").unwrap().1;
        assert_eq!(delta["delta"]["stop_reason"], "stop_sequence");
        assert_eq!(delta["delta"]["stop_sequence"], "STOP");
        assert_eq!(delta["usage"]["input_tokens"], 7);
        assert_eq!(delta["usage"]["cache_read_input_tokens"], 5);
        assert_eq!(delta["usage"]["output_tokens"], 7);
        assert_eq!(
            stop_reason("length", None, &[]),
            ("max_tokens", None),
            "a cut-off reply"
        );
        assert_eq!(stop_reason("stop", None, &[]), ("end_turn", None));
    }

    #[test]
    fn a_failure_mid_stream_is_an_error_event() {
        let out = encode_all(vec![
            RunEvent::Content {
                choice: 0,
                text: "Hi".into(),
            },
            RunEvent::Failed {
                choice: 0,
                message: "the engine stopped".into(),
            },
        ]);
        let (name, data) = out.last().unwrap();
        assert_eq!(*name, "error");
        assert_eq!(data["type"], "error");
        assert_eq!(data["error"]["type"], "api_error");
        assert!(
            data["error"]["message"]
                .as_str()
                .unwrap()
                .contains("the engine stopped")
        );
    }

    #[test]
    fn the_message_body_has_thinking_text_then_tool_use_blocks() {
        let r = ChoiceResult {
            thinking: "The user wants weather.".into(),
            content: "Checking.".into(),
            calls: vec![("get_weather".into(), "{\"city\": \"Paris\"}".into(), false)],
            logprobs: Vec::new(),
            finish_reason: "tool_calls",
            usage: usage(),
            stop_string: None,
        };
        let body = message_body(&meta(), &r, || "toolu_1".into());
        insta::assert_json_snapshot!(body);
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_messages() {
        let msgs = conversation(
            Some(&json!([{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}])),
            &[
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                ]}),
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                    {"type": "text", "text": "Thanks"}
                ]}),
                json!({"role": "system", "content": [{"type": "text", "text": "Reminder."}]}),
            ],
        )
        .unwrap();
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "tool",
                "tool",
                "user",
                "system"
            ]
        );
        assert_eq!(
            msgs[6].content,
            Some(MessageContent::Text("Reminder.".into()))
        );
        assert_eq!(
            msgs[0].content,
            Some(MessageContent::Text("Be brief.\n\nUse tools.".into()))
        );
        assert_eq!(msgs[2].content, None);
        let call = &msgs[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(call.id.as_deref(), Some("toolu_1"));
        assert_eq!(call.function.arguments, json!({"city": "Paris"}));
        assert_eq!(msgs[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(msgs[3].content, Some(MessageContent::Text("sunny".into())));
        assert_eq!(
            msgs[4].content,
            Some(MessageContent::Text("Error: boom".into()))
        );
    }

    #[test]
    fn malformed_conversations_are_refused_naming_the_block() {
        let cases = [
            (
                json!({"role": "wizard", "content": "hi"}),
                "messages[0].role",
            ),
            (
                json!({"role": "user", "content": [{"type": "hologram", "text": "x"}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"role": "user", "content": [{"type": "tool_result", "content": "x"}]}),
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}),
                "messages[0].content[0].content",
            ),
            (
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}),
                "messages[0].content[0].content[0].type",
            ),
            (
                json!({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}),
                "messages[0].content[0].type",
            ),
            (json!({"role": "user"}), "messages[0].content"),
        ];
        for (m, param) in cases {
            let e = conversation(None, std::slice::from_ref(&m)).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{m}");
            assert_eq!(e.param(), Some(param), "{m}: {e}");
        }
    }

    #[test]
    fn tool_choice_maps_onto_the_openai_modes() {
        let tools = [json!({"name": "f", "input_schema": {"type": "object"}})];
        let mode = |c: Value| tool_setup(Some(&tools), Some(&c)).map(|s| (s.mode, s.parallel));
        assert_eq!(mode(json!({"type": "auto"})), Ok((ToolMode::Auto, true)));
        assert_eq!(
            mode(json!({"type": "any", "disable_parallel_tool_use": true})),
            Ok((ToolMode::Required, false))
        );
        assert_eq!(
            mode(json!({"type": "tool", "name": "f"})),
            Ok((ToolMode::Named("f".into()), true))
        );
        assert_eq!(mode(json!({"type": "none"})), Ok((ToolMode::None, true)));
        assert_eq!(
            mode(json!({"type": "tool", "name": "g"}))
                .unwrap_err()
                .param(),
            Some("tool_choice")
        );
        assert!(mode(json!("auto")).is_err());
        let e = tool_setup(Some(&[json!({"name": "f"})]), None).unwrap_err();
        assert_eq!(e.param(), Some("tools[0].input_schema"));
        // Server tools (web search, …) cannot run here, deferred tools are not loaded
        // yet: both skipped.
        let s = tool_setup(
            Some(&[
                json!({"type": "web_search_20250305", "name": "web_search"}),
                json!({"name": "later", "input_schema": {"type": "object"}, "defer_loading": true}),
            ]),
            None,
        )
        .unwrap();
        assert!(s.tools.is_empty() && s.mode == ToolMode::None);
    }

    #[test]
    fn error_types_follow_anthropics_status_table() {
        let body = error_body(StatusCode::BAD_REQUEST, "bad");
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
        );
        for (status, kind) in [
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
    }
}
