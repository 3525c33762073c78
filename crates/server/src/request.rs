//! From a parsed request body to a [`Job`]: sampling parameters (validated, with a seed),
//! the prompt tokens (chat template with client text kept plain), the tools and the
//! constraint, all checked before any generation work starts.

use std::collections::BTreeMap;

use chat::{Message, MessageContent};
use engine::{GenerateRequest, SamplingParams};
use grammar::Constraint;
use serde_json::Value;

use crate::api::{ResponseFormat, SamplingFields};
use crate::error::ApiError;
use crate::tools::{CustomFormat, ToolKind, ToolMode, ToolSetup, ToolSpec};
use runtime::Runtime;
use runtime::constraint::ConstraintPlan;

/// Most choices per request.
pub const MAX_N: u32 = 16;
/// Most `top_logprobs`.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A request ready for the engine: everything validated.
#[derive(Debug, Clone)]
pub struct Job {
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Sampling for choice 0 (choice `i` uses seed `seed + i`).
    pub sampling: SamplingParams,
    /// Choices.
    pub n: usize,
    /// Most generated tokens.
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-text.
    pub ignore_eos: bool,
    /// Report log-probabilities (with this many alternatives).
    pub logprobs: Option<usize>,
    /// The constraint of every choice.
    pub constraint: Option<ConstraintPlan>,
    /// Active tools (the output is parsed for calls).
    pub tools: Option<ToolSetup>,
    /// Split a reasoning segment (`<think>…</think>`) off the front of the output:
    /// `Some(true)` when the prompt already opened it, `Some(false)` when the model opens
    /// it itself (if it does); `None`: the output is all answer.
    pub thinking: Option<bool>,
}

impl Job {
    /// The seed of choice 0.
    pub fn seed(&self) -> u64 {
        self.sampling.seed
    }

    /// The engine requests, one per choice.
    pub fn requests(&self, model: &Runtime) -> Vec<GenerateRequest> {
        (0..self.n)
            .map(|i| {
                let mut sampling = self.sampling.clone();
                sampling.seed = sampling.seed.wrapping_add(i as u64);
                let mut req = GenerateRequest::new(self.prompt.clone(), sampling);
                req.max_tokens = self.max_tokens;
                req.stop_strings = self.stop.clone();
                req.ignore_eos = self.ignore_eos;
                req.logprobs = self.logprobs;
                req.constraint = self
                    .constraint
                    .as_ref()
                    .map(|c| c.instantiate(model.token_env()));
                req
            })
            .collect()
    }
}

/// A random seed within JSON's exact integer range.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.finish() & ((1u64 << 53) - 1)
}

/// Validated sampling parameters (OpenAI's ranges) with the seed.
pub fn sampling_params(
    req: &dyn SamplingFields,
    n_vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams::default();
    if let Some(t) = req.temperature() {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be between 0 and 2, got {t}"),
            ));
        }
        p.temperature = t;
    }
    if let Some(v) = req.top_p() {
        if !(v > 0.0 && v <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {v}"),
            ));
        }
        p.top_p = v;
    }
    if let Some(k) = req.top_k() {
        // -1 means off in several servers' dialects.
        p.top_k = if k <= 0 {
            0
        } else {
            usize::try_from(k).unwrap_or(usize::MAX)
        };
    }
    if let Some(v) = req.min_p() {
        if !(0.0..=1.0).contains(&v) {
            return Err(ApiError::invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {v}"),
            ));
        }
        p.min_p = v;
    }
    for (name, value, slot) in [
        (
            "presence_penalty",
            req.presence_penalty(),
            &mut p.presence_penalty,
        ),
        (
            "frequency_penalty",
            req.frequency_penalty(),
            &mut p.frequency_penalty,
        ),
    ] {
        if let Some(v) = value {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(
                    name,
                    format!("{name} must be between -2 and 2, got {v}"),
                ));
            }
            *slot = v;
        }
    }
    if let Some(v) = req.repetition_penalty() {
        if !(v.is_finite() && v > 0.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("repetition_penalty must be positive, got {v}"),
            ));
        }
        p.repetition_penalty = v;
    }
    if let Some(bias) = req.logit_bias() {
        p.logit_bias = logit_bias(bias, n_vocab)?;
    }
    p.seed = match req.seed() {
        Some(s) => s as u64,
        None => random_seed(),
    };
    p.validate()
        .map_err(|e| ApiError::bad_request(format!("invalid sampling parameters: {e}")))?;
    Ok(p)
}

fn logit_bias(bias: &BTreeMap<String, f32>, n_vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::with_capacity(bias.len());
    for (k, &v) in bias {
        let param = format!("logit_bias.{k}");
        let id: u32 = k.trim().parse().map_err(|_| {
            ApiError::invalid(
                param.clone(),
                format!("logit_bias key {k:?} is not a token id"),
            )
        })?;
        if id as usize >= n_vocab {
            return Err(ApiError::invalid(
                param,
                format!("token id {id} is outside the vocabulary of {n_vocab} tokens"),
            ));
        }
        if !(-100.0..=100.0).contains(&v) {
            return Err(ApiError::invalid(
                param,
                format!("logit_bias values must be between -100 and 100, got {v}"),
            ));
        }
        // OpenAI: -100 effectively bans the token.
        out.push((id, if v <= -100.0 { f32::NEG_INFINITY } else { v }));
    }
    Ok(out)
}

/// The `speculation` extension field checked against the server: `true` when this request
/// decodes plainly (`speculation: false`); asking for speculation from a server started
/// without it is a 400.
pub fn plain_decoding(
    speculation: Option<bool>,
    server_speculates: bool,
) -> Result<bool, ApiError> {
    match speculation {
        Some(true) if !server_speculates => Err(ApiError::invalid(
            "speculation",
            "this server was started without speculative decoding (--spec off; it is on by \
             default); `speculation: true` cannot be honoured",
        )),
        Some(on) => Ok(!on),
        None => Ok(false),
    }
}

/// `n` checked.
pub fn choices(n: Option<u32>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_N).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}"),
        )),
    }
}

/// A `max_tokens`-style value checked.
pub fn max_tokens(param: &str, v: Option<u64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(0) => Err(ApiError::invalid(
            param,
            format!("{param} must be at least 1"),
        )),
        Some(v) => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
    }
}

/// Stop strings checked (at most 4, as OpenAI, none empty).
pub fn stop_strings(stop: Vec<String>) -> Result<Vec<String>, ApiError> {
    if stop.len() > 16 {
        return Err(ApiError::invalid("stop", "at most 16 stop strings"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    Ok(stop)
}

/// Checks that the prompt leaves room in the context.
pub fn check_prompt_len(prompt_len: usize, context_len: usize) -> Result<(), ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    if prompt_len >= context_len {
        return Err(ApiError::BadRequest {
            message: format!(
                "this model's maximum context length is {context_len} tokens, but the prompt \
                 has {prompt_len} tokens (no room left to generate)"
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    Ok(())
}

/// Reads OpenAI tools (chat-completions shape `{"type":"function","function":{…}}` or the
/// Responses shape `{"type":"function","name":…}`, and custom tools in both shapes).
/// Tool types lockstep cannot run (web search, …) are skipped with a debug log.
pub fn parse_tools(tools: &[Value], param: &str) -> Result<Vec<ToolSpec>, ApiError> {
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let p = format!("{param}[{i}]");
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("function");
        match kind {
            "function" => {
                let f = t.get("function").unwrap_or(t);
                let name = str_field(f, "name", &p)?;
                let parameters = f.get("parameters").cloned().unwrap_or(Value::Null);
                if !(parameters.is_object() || parameters.is_null()) {
                    return Err(ApiError::invalid(
                        format!("{p}.parameters"),
                        "parameters must be a JSON Schema object",
                    ));
                }
                out.push(ToolSpec {
                    name,
                    description: f
                        .get("description")
                        .and_then(Value::as_str)
                        .map(String::from),
                    kind: ToolKind::Function { parameters },
                });
            }
            "custom" => {
                let c = t.get("custom").unwrap_or(t);
                let name = str_field(c, "name", &p)?;
                let format = custom_format(c.get("format"), &format!("{p}.format"))?;
                out.push(ToolSpec {
                    name,
                    description: c
                        .get("description")
                        .and_then(Value::as_str)
                        .map(String::from),
                    kind: ToolKind::Custom { format },
                });
            }
            other => {
                tracing::debug!("ignoring tool {i} of unsupported type {other:?}");
            }
        }
    }
    Ok(out)
}

fn str_field(v: &Value, key: &str, p: &str) -> Result<String, ApiError> {
    match v.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::invalid(
            format!("{p}.{key}"),
            format!("'{p}.{key}' must be a string"),
        )),
        None => Err(ApiError::invalid(
            format!("{p}.{key}"),
            format!("missing required parameter '{p}.{key}'"),
        )),
    }
}

fn custom_format(v: Option<&Value>, p: &str) -> Result<CustomFormat, ApiError> {
    let Some(v) = v else {
        return Ok(CustomFormat::Text);
    };
    match v.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(CustomFormat::Text),
        Some("grammar") => {
            // Responses: {type, syntax, definition}; chat: {type, grammar: {syntax, definition}}.
            let g = v.get("grammar").unwrap_or(v);
            let definition = str_field(g, "definition", p)?;
            match g.get("syntax").and_then(Value::as_str) {
                Some("lark") => Ok(CustomFormat::Lark(definition)),
                Some("regex") => Ok(CustomFormat::Regex(definition)),
                other => Err(ApiError::invalid(
                    format!("{p}.syntax"),
                    format!("grammar syntax must be \"lark\" or \"regex\", got {other:?}"),
                )),
            }
        }
        Some(other) => Err(ApiError::invalid(
            format!("{p}.type"),
            format!("unsupported custom tool format {other:?}"),
        )),
    }
}

/// `tool_choice` in either API's shape.
pub fn tool_mode(choice: Option<&Value>, has_tools: bool) -> Result<ToolMode, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "tool_choice must be \"none\", \"auto\", \"required\" or a named tool",
        )
    };
    match choice {
        None | Some(Value::Null) => Ok(if has_tools {
            ToolMode::Auto
        } else {
            ToolMode::None
        }),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolMode::None),
            "auto" => Ok(ToolMode::Auto),
            "required" | "any" => Ok(ToolMode::Required),
            _ => Err(bad()),
        },
        Some(Value::Object(o)) => {
            let kind = o.get("type").and_then(Value::as_str).ok_or_else(bad)?;
            let name = o
                .get(kind)
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            Ok(ToolMode::Named(name.to_string()))
        }
        Some(_) => Err(bad()),
    }
}

/// The constraint of a chat `response_format`.
pub fn chat_format(format: Option<&ResponseFormat>) -> Result<Option<Constraint>, ApiError> {
    match format {
        None | Some(ResponseFormat::Text) => Ok(None),
        Some(ResponseFormat::JsonObject) => Ok(Some(Constraint::json_object())),
        Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
            Some(s) if s.is_object() || s.is_boolean() => {
                Ok(Some(Constraint::json_schema(s.clone())))
            }
            Some(_) => Err(ApiError::invalid(
                "response_format.json_schema.schema",
                "the schema must be a JSON object",
            )),
            None => Ok(Some(Constraint::json_object())),
        },
    }
}

/// The constraint of a Responses `text.format`.
pub fn responses_format(format: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(f) = format else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_object())),
        Some("json_schema") => match f.get("schema") {
            Some(s) if s.is_object() || s.is_boolean() => {
                Ok(Some(Constraint::json_schema(s.clone())))
            }
            Some(_) => Err(ApiError::invalid(
                "text.format.schema",
                "the schema must be a JSON object",
            )),
            None => Err(ApiError::invalid(
                "text.format.schema",
                "missing required parameter 'text.format.schema'",
            )),
        },
        Some(other) => Err(ApiError::invalid(
            "text.format.type",
            format!("unsupported text format {other:?}"),
        )),
    }
}

/// The roles a chat-completions message may have (OpenAI's list).
pub const CHAT_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Refuses a message whose role is not one of [`CHAT_ROLES`] (OpenAI answers 400; a
/// template would otherwise render an unknown role as if it were valid).
pub fn check_roles(messages: &[Message]) -> Result<(), ApiError> {
    for (i, m) in messages.iter().enumerate() {
        if !CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!(
                    "invalid role {:?} in messages[{i}]: expected one of {}",
                    m.role,
                    CHAT_ROLES.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// Renders a conversation (with the tools when active) into prompt tokens.
pub fn chat_prompt(
    model: &Runtime,
    messages: &[Message],
    tools: Option<&ToolSetup>,
) -> Result<Vec<u32>, ApiError> {
    chat_prompt_with(model, messages, tools, Default::default()).map(|p| p.tokens)
}

/// [`chat_prompt`] with extra template variables (`enable_thinking`), returning the
/// rendered text with the tokens.
pub fn chat_prompt_with(
    model: &Runtime,
    messages: &[Message],
    tools: Option<&ToolSetup>,
    extra: serde_json::Map<String, Value>,
) -> Result<runtime::prompt::ChatPrompt, ApiError> {
    let prompter = model.prompter().ok_or_else(|| {
        ApiError::bad_request(format!(
            "the model {} has no chat template (it is a base model); use /v1/completions",
            model.name()
        ))
    })?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let active = tools.filter(|t| t.active());
    let template_tools = active
        .filter(|_| model.template_has_tools())
        .map(ToolSetup::template_tools);
    let mut msgs: Vec<Message> = messages.to_vec();
    if let Some(setup) = active
        && !model.template_has_tools()
    {
        let note = setup.system_note(model.tool_format());
        match msgs.first_mut() {
            Some(first) if first.role == "system" => {
                let old = match &first.content {
                    Some(MessageContent::Text(t)) => t.clone(),
                    _ => String::new(),
                };
                first.content = Some(MessageContent::Text(format!("{old}\n\n{note}")));
            }
            _ => msgs.insert(0, Message::new("system", note)),
        }
    }
    for m in &mut msgs {
        if m.role == "developer" {
            m.role = "system".into();
        }
    }
    prompter
        .prompt_with(model.tokenizer(), &msgs, template_tools.as_deref(), extra)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}
