//! `POST /v1/responses` (and `GET /v1/responses/{id}`): input items → a chat conversation,
//! function and custom tools, `text.format`, `previous_response_id` from a bounded
//! in-memory store, and the typed streaming events (`response.created` …
//! `response.completed`) that Codex CLI and the OpenAI SDKs consume.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use chat::{FunctionCall, Message, MessageContent, ToolCall};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::ResponsesRequest;
use crate::chat_completions::receiver_stream;
use crate::error::ApiError;
use crate::request::{self, Job};
use crate::run::{Run, RunEvent};
use crate::state::{AppState, unix_now};
use crate::tools::{ToolMode, ToolSetup};
use crate::usage;

/// A stored response: the conversation up to and including its output, and its object.
#[derive(Debug, Clone)]
struct Stored {
    id: String,
    messages: Vec<Message>,
    object: Value,
}

/// Bounded LRU store of responses for `previous_response_id` and `GET /v1/responses/{id}`.
#[derive(Debug)]
pub struct ResponseStore {
    entries: Mutex<VecDeque<Stored>>,
    capacity: usize,
}

impl ResponseStore {
    /// A store of at most `capacity` responses (0 disables storing).
    pub fn new(capacity: usize) -> ResponseStore {
        ResponseStore {
            entries: Mutex::new(VecDeque::new()),
            capacity,
        }
    }

    fn put(&self, s: Stored) {
        if self.capacity == 0 {
            return;
        }
        if let Ok(mut e) = self.entries.lock() {
            e.retain(|x| x.id != s.id);
            while e.len() >= self.capacity {
                e.pop_front();
            }
            e.push_back(s);
        }
    }

    fn get(&self, id: &str) -> Option<Stored> {
        let mut e = self.entries.lock().ok()?;
        let pos = e.iter().position(|x| x.id == id)?;
        let s = e.remove(pos)?;
        e.push_back(s.clone());
        Some(s)
    }

    /// The stored response object with this id.
    pub fn object(&self, id: &str) -> Option<Value> {
        self.get(id).map(|s| s.object)
    }
}

/// Text of a content value: a string, or parts with `text`.
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out: Vec<&str> = Vec::new();
            for (i, p) in parts.iter().enumerate() {
                if let Value::String(t) = p {
                    out.push(t);
                    continue;
                }
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (
                        Some("input_text" | "output_text" | "text" | "refusal"),
                        Some(Value::String(t)),
                    ) => out.push(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{i}]"),
                            format!("unsupported content part {kind:?}: only text is supported"),
                        ));
                    }
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(ApiError::invalid(
            param,
            "content must be a string or a list of parts",
        )),
    }
}

/// Appends an assistant tool call, merging into a directly preceding assistant message.
fn push_call(msgs: &mut Vec<Message>, call: ToolCall) {
    if let Some(last) = msgs.last_mut()
        && last.role == "assistant"
    {
        last.tool_calls.get_or_insert_with(Vec::new).push(call);
        return;
    }
    let mut m = Message::new("assistant", "");
    m.content = None;
    m.tool_calls = Some(vec![call]);
    msgs.push(m);
}

fn push_assistant_text(msgs: &mut Vec<Message>, text: &str) {
    if let Some(last) = msgs.last_mut()
        && last.role == "assistant"
        && last.tool_calls.is_none()
    {
        let old = match &last.content {
            Some(MessageContent::Text(t)) => t.clone(),
            _ => String::new(),
        };
        last.content = Some(MessageContent::Text(format!("{old}{text}")));
        return;
    }
    msgs.push(Message::new("assistant", text));
}

/// Converts `input` (a string or items) into chat messages.
pub fn input_messages(
    input: Option<&Value>,
    format: &dyn chat::ToolCallFormat,
) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::new();
    match input {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => msgs.push(Message::new("user", s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let p = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                let s = |key: &str| {
                    item.get(key)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                };
                match kind {
                    "message" => {
                        let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::invalid(
                                format!("{p}.role"),
                                "missing required parameter 'role'",
                            )
                        })?;
                        let role = match role {
                            "developer" => "system",
                            "user" | "system" | "assistant" => role,
                            other => {
                                return Err(ApiError::invalid(
                                    format!("{p}.role"),
                                    format!("unsupported role {other:?}"),
                                ));
                            }
                        };
                        let text = content_text(
                            item.get("content").unwrap_or(&Value::Null),
                            &format!("{p}.content"),
                        )?;
                        if role == "assistant" {
                            push_assistant_text(&mut msgs, &text);
                        } else {
                            msgs.push(Message::new(role, text));
                        }
                    }
                    "function_call" => push_call(
                        &mut msgs,
                        ToolCall {
                            id: Some(s("call_id")),
                            kind: "function".into(),
                            function: FunctionCall {
                                name: s("name"),
                                arguments: Value::String(s("arguments")),
                            },
                        },
                    ),
                    "custom_tool_call" => {
                        let envelope = format!(
                            "{}{}\n{}",
                            crate::tools::custom_header(format, &s("name")),
                            s("input"),
                            format.end_marker()
                        );
                        push_assistant_text(&mut msgs, &envelope);
                    }
                    "function_call_output" | "custom_tool_call_output" => {
                        let output = content_text(
                            item.get("output").unwrap_or(&Value::Null),
                            &format!("{p}.output"),
                        )?;
                        let mut m = Message::new("tool", output);
                        m.tool_call_id = Some(s("call_id"));
                        msgs.push(m);
                    }
                    other => tracing::debug!("ignoring input item {i} of type {other:?}"),
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "input",
                "input must be a string or a list of items",
            ));
        }
    }
    Ok(msgs)
}

/// Everything needed to answer besides the run.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created_at: u64,
    request_echo: Value,
    store: bool,
    /// The conversation without instructions (what a follow-up continues).
    history: Vec<Message>,
}

fn prepare(state: &AppState, req: &ResponsesRequest) -> Result<(Job, Vec<Message>), ApiError> {
    let model = &state.model;
    let mut history = match &req.previous_response_id {
        Some(id) => {
            state
                .responses
                .get(id)
                .ok_or_else(|| ApiError::NotFound(format!("no stored response with id {id:?}")))?
                .messages
        }
        None => Vec::new(),
    };
    history.extend(input_messages(req.input.as_ref(), model.tool_format())?);
    if history.is_empty() {
        return Err(ApiError::invalid("input", "input must not be empty"));
    }
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(instr) = req.instructions.as_ref().filter(|s| !s.is_empty()) {
        messages.push(Message::new("system", instr.clone()));
    }
    messages.extend(history.iter().cloned());
    let specs = request::parse_tools(req.tools.as_deref().unwrap_or(&[]), "tools")?;
    let mode = request::tool_mode(req.tool_choice.as_ref(), !specs.is_empty())?;
    let setup = ToolSetup {
        tools: specs,
        mode,
        parallel: req.parallel_tool_calls.unwrap_or(true),
    };
    setup.validate("tools")?;
    let format = request::responses_format(req.text.as_ref().and_then(|t| t.format.as_ref()))?;
    let prompt = request::chat_prompt(model, &messages, Some(&setup))?;
    request::check_prompt_len(prompt.len(), model.context_len())?;
    let constraint = runtime::constraint::plan(
        model,
        &state.grammars,
        Some(&setup),
        format,
        &prompt,
        ("tools", "text.format"),
    )?;
    let job = Job {
        prompt,
        sampling: request::sampling_params(req, model.engine().n_vocab())?,
        n: 1,
        max_tokens: request::max_tokens("max_output_tokens", req.max_output_tokens)?,
        stop: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        constraint,
        tools: setup.active().then_some(setup),
        thinking: None,
    };
    Ok((job, history))
}

fn tool_choice_echo(v: Option<&Value>, setup: Option<&ToolSetup>) -> Value {
    match (v, setup.map(|s| &s.mode)) {
        (Some(v), _) if !v.is_null() => v.clone(),
        (_, Some(ToolMode::Required)) => json!("required"),
        (_, Some(ToolMode::None)) => json!("none"),
        _ => json!("auto"),
    }
}

/// Serves one Responses request.
pub async fn serve(state: Arc<AppState>, req: ResponsesRequest) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let stream = req.stream.unwrap_or(false);
    let store = req.store.unwrap_or(true);
    let echo = json!({
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": state.model.name(),
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.clone().unwrap_or(json!({"effort": null, "summary": null})),
        "store": store,
        "temperature": req.temperature.unwrap_or(1.0),
        "text": {"format": req.text.as_ref().and_then(|t| t.format.clone()).unwrap_or(json!({"type": "text"}))},
        "tools": req.tools.clone().unwrap_or_default(),
        "top_p": req.top_p.unwrap_or(1.0),
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata.clone().unwrap_or(json!({})),
    });
    let tool_choice = req.tool_choice.clone();
    let st = Arc::clone(&state);
    let (job, history) = tokio::task::spawn_blocking(move || prepare(&st, &req))
        .await
        .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??;
    let mut request_echo = echo;
    request_echo["tool_choice"] = tool_choice_echo(tool_choice.as_ref(), job.tools.as_ref());
    request_echo["seed"] = json!(job.seed());
    let meta = Meta {
        id: state.new_id("resp_"),
        created_at: unix_now(),
        request_echo,
        store,
        history,
    };
    let run = Run::start(Arc::clone(&state.model), Arc::clone(&state.metrics), &job)?;
    if stream {
        Ok(stream_response(run, meta, state).into_response())
    } else {
        let mut b = Builder::new(meta);
        let mut run = run;
        while let Some(e) = run.next().await {
            if let RunEvent::Failed { message, .. } = &e {
                return Err(ApiError::Internal(format!("generation failed: {message}")));
            }
            b.absorb(e);
        }
        let object = b.finish(&state);
        Ok(axum::Json(object).into_response())
    }
}

/// An output item being built.
#[derive(Debug, Clone)]
enum Item {
    Message {
        id: String,
        text: String,
    },
    Function {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
    Custom {
        id: String,
        call_id: String,
        name: String,
        input: String,
    },
}

impl Item {
    fn json(&self, status: &str) -> Value {
        match self {
            Item::Message { id, text } => json!({
                "type": "message", "id": id, "status": status, "role": "assistant",
                "content": if status == "in_progress" && text.is_empty() {
                    json!([])
                } else {
                    json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
                },
            }),
            Item::Function {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status,
            }),
            Item::Custom {
                id,
                call_id,
                name,
                input,
            } => json!({
                "type": "custom_tool_call", "id": id, "call_id": call_id, "name": name,
                "input": input, "status": status,
            }),
        }
    }
}

/// Builds the output items and the streaming events from run events.
struct Builder {
    meta: Meta,
    items: Vec<Item>,
    /// Index in `items` of the open item, if any.
    open: Option<usize>,
    /// Call index in the run → item index.
    calls: Vec<(usize, usize)>,
    seq: u64,
    finish: &'static str,
    usage: engine::Usage,
    ids: Vec<String>,
}

impl Builder {
    fn new(meta: Meta) -> Builder {
        let ids = Vec::new();
        Builder {
            meta,
            items: Vec::new(),
            open: None,
            calls: Vec::new(),
            seq: 0,
            finish: "stop",
            usage: engine::Usage::default(),
            ids,
        }
    }

    fn event(&mut self, kind: &str, mut body: Value) -> (String, Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind.to_string(), body)
    }

    fn response(&self, status: &str, with_usage: bool) -> Value {
        let mut r = self.meta.request_echo.clone();
        r["id"] = json!(self.meta.id);
        r["object"] = json!("response");
        r["created_at"] = json!(self.meta.created_at);
        r["status"] = json!(status);
        r["error"] = Value::Null;
        r["incomplete_details"] = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        let item_status = if status == "in_progress" {
            "in_progress"
        } else {
            "completed"
        };
        r["output"] = self.items.iter().map(|i| i.json(item_status)).collect();
        r["usage"] = if with_usage {
            usage::response_usage(std::slice::from_ref(&self.usage))
        } else {
            Value::Null
        };
        r
    }

    fn start_events(&mut self) -> Vec<(String, Value)> {
        let r = self.response("in_progress", false);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn close_open(&mut self) -> Vec<(String, Value)> {
        let Some(idx) = self.open.take() else {
            return Vec::new();
        };
        let Some(item) = self.items.get(idx).cloned() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        match &item {
            Item::Message { id, text } => {
                out.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": idx, "content_index": 0, "text": text, "logprobs": []}),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": idx, "content_index": 0,
                           "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
                ));
            }
            Item::Function {
                id,
                name,
                arguments,
                ..
            } => out.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": idx, "name": name, "arguments": arguments}),
            )),
            Item::Custom { id, input, .. } => out.push(self.event(
                "response.custom_tool_call_input.done",
                json!({"item_id": id, "output_index": idx, "input": input}),
            )),
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": idx, "item": item.json("completed")}),
        ));
        out
    }

    fn absorb(&mut self, e: RunEvent) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        match e {
            RunEvent::Content { text, .. } => {
                let is_message_open = self
                    .open
                    .and_then(|i| self.items.get(i))
                    .is_some_and(|it| matches!(it, Item::Message { .. }));
                if !is_message_open {
                    out.extend(self.close_open());
                    let id = format!("msg_{}", self.next_id());
                    let idx = self.items.len();
                    self.items.push(Item::Message {
                        id: id.clone(),
                        text: String::new(),
                    });
                    self.open = Some(idx);
                    let item = self
                        .items
                        .get(idx)
                        .map(|i| i.json("in_progress"))
                        .unwrap_or(Value::Null);
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": idx, "item": item}),
                    ));
                    out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": idx, "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
                    ));
                }
                if let Some(idx) = self.open
                    && let Some(Item::Message { id, text: t }) = self.items.get_mut(idx)
                {
                    t.push_str(&text);
                    let id = id.clone();
                    out.push(self.event(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": idx, "content_index": 0, "delta": text, "logprobs": []}),
                    ));
                }
            }
            RunEvent::CallStart {
                index,
                name,
                custom,
                ..
            } => {
                out.extend(self.close_open());
                let n = self.next_id();
                let call_id = format!("call_{n}");
                let idx = self.items.len();
                self.items.push(if custom {
                    Item::Custom {
                        id: format!("ctc_{n}"),
                        call_id,
                        name,
                        input: String::new(),
                    }
                } else {
                    Item::Function {
                        id: format!("fc_{n}"),
                        call_id,
                        name,
                        arguments: String::new(),
                    }
                });
                self.open = Some(idx);
                self.calls.push((index, idx));
                let item = self
                    .items
                    .get(idx)
                    .map(|i| i.json("in_progress"))
                    .unwrap_or(Value::Null);
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": idx, "item": item}),
                ));
            }
            RunEvent::CallDelta { index, text, .. } => {
                if let Some(&(_, idx)) = self.calls.iter().find(|(c, _)| *c == index) {
                    let ev = match self.items.get_mut(idx) {
                        Some(Item::Function { id, arguments, .. }) => {
                            arguments.push_str(&text);
                            Some(("response.function_call_arguments.delta", id.clone()))
                        }
                        Some(Item::Custom { id, input, .. }) => {
                            input.push_str(&text);
                            Some(("response.custom_tool_call_input.delta", id.clone()))
                        }
                        _ => None,
                    };
                    if let Some((kind, id)) = ev {
                        out.push(self.event(
                            kind,
                            json!({"item_id": id, "output_index": idx, "delta": text}),
                        ));
                    }
                }
            }
            RunEvent::CallEnd { .. } => out.extend(self.close_open()),
            RunEvent::Done {
                finish_reason,
                usage,
                ..
            } => {
                out.extend(self.close_open());
                self.finish = finish_reason;
                self.usage = *usage;
            }
            RunEvent::Logprobs { .. } | RunEvent::Failed { .. } | RunEvent::Thinking { .. } => {}
        }
        out
    }

    fn next_id(&mut self) -> String {
        let n = self.ids.len();
        let id = format!("{}{n:04x}", self.meta.id.trim_start_matches("resp_"));
        self.ids.push(id.clone());
        id
    }

    fn status(&self) -> &'static str {
        if self.finish == "length" {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// The final response object; stores it when asked.
    fn finish(&mut self, state: &AppState) -> Value {
        let object = self.response(self.status(), true);
        if self.meta.store {
            let mut messages = std::mem::take(&mut self.meta.history);
            for item in &self.items {
                match item {
                    Item::Message { text, .. } => push_assistant_text(&mut messages, text),
                    Item::Function {
                        call_id,
                        name,
                        arguments,
                        ..
                    } => push_call(
                        &mut messages,
                        ToolCall {
                            id: Some(call_id.clone()),
                            kind: "function".into(),
                            function: FunctionCall {
                                name: name.clone(),
                                arguments: Value::String(arguments.clone()),
                            },
                        },
                    ),
                    Item::Custom { name, input, .. } => {
                        let format = state.model.tool_format();
                        let envelope = format!(
                            "{}{input}\n{}",
                            crate::tools::custom_header(format, name),
                            format.end_marker()
                        );
                        push_assistant_text(&mut messages, &envelope);
                    }
                }
            }
            state.responses.put(Stored {
                id: self.meta.id.clone(),
                messages,
                object: object.clone(),
            });
        }
        object
    }
}

fn stream_response(mut run: Run, meta: Meta, state: Arc<AppState>) -> impl IntoResponse {
    let (tx, rx) = mpsc::channel::<SseEvent>(256);
    let keep_alive = state.config.keep_alive;
    tokio::spawn(async move {
        let mut b = Builder::new(meta);
        let to_sse =
            |(kind, body): (String, Value)| SseEvent::default().event(kind).data(body.to_string());
        for e in b.start_events() {
            if tx.send(to_sse(e)).await.is_err() {
                return;
            }
        }
        while let Some(e) = run.next().await {
            if let RunEvent::Failed { message, .. } = &e {
                let mut r = b.response("failed", false);
                r["error"] = json!({"code": "server_error", "message": format!("generation failed: {message}")});
                let ev = b.event("response.failed", json!({"response": r}));
                let _ = tx.send(to_sse(ev)).await;
                return;
            }
            for ev in b.absorb(e) {
                if tx.send(to_sse(ev)).await.is_err() {
                    return;
                }
            }
        }
        let object = b.finish(&state);
        let kind = if object["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        let ev = b.event(kind, json!({"response": object}));
        let _ = tx.send(to_sse(ev)).await;
    });
    Sse::new(receiver_stream(rx)).keep_alive(KeepAlive::new().interval(keep_alive))
}

/// `GET /v1/responses/{id}`.
pub fn get_stored(state: &AppState, id: &str) -> Result<Value, ApiError> {
    state
        .responses
        .object(id)
        .ok_or_else(|| ApiError::NotFound(format!("no stored response with id {id:?}")))
}
