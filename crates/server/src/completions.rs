//! `POST /v1/completions`: a raw prompt (text, with control-token texts parsed as llama.cpp
//! does for raw prompts, or token ids) continued as `text_completion` objects.

use std::collections::HashMap;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{CompletionRequest, PromptSpec};
use crate::chat_completions::{choice_usages, receiver_stream};
use crate::error::ApiError;
use crate::request::{self, Job};
use crate::run::{ChoiceResult, Run, RunEvent, TokenLogprob, collect};
use crate::state::{AppState, unix_now};
use crate::usage;

/// Most alternatives per position for the legacy `logprobs` field.
const MAX_LOGPROBS: u32 = 20;

/// Prepares a completion request; returns the job and the prompt text (for `echo`).
pub fn prepare(state: &AppState, req: &CompletionRequest) -> Result<(Job, String), ApiError> {
    let model = &state.model;
    let tok = model.tokenizer();
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let n_vocab = model.engine().n_vocab();
    let (prompt, text) = match &req.prompt {
        PromptSpec::Text(t) => (tok.encode(t, text::EncodeOptions::raw_prompt()), t.clone()),
        PromptSpec::TextBatch(v) => match v.as_slice() {
            [t] => (tok.encode(t, text::EncodeOptions::raw_prompt()), t.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "a batch of prompts is not supported: send one prompt per request",
                ));
            }
        },
        PromptSpec::Tokens(ids) => (ids.clone(), String::new()),
        PromptSpec::TokenBatch(v) => match v.as_slice() {
            [ids] => (ids.clone(), String::new()),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "a batch of prompts is not supported: send one prompt per request",
                ));
            }
        },
    };
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {n_vocab} tokens"),
        ));
    }
    let text = if text.is_empty() && !prompt.is_empty() {
        tok.decode_lossy(&prompt, text::DecodeOptions::default())
            .unwrap_or_default()
    } else {
        text
    };
    request::check_prompt_len(prompt.len(), model.context_len()).map_err(|e| match e {
        ApiError::BadRequest { message, code, .. } => ApiError::BadRequest {
            message,
            param: Some("prompt".into()),
            code,
        },
        other => other,
    })?;
    let logprobs = match req.logprobs {
        Some(k) if k > MAX_LOGPROBS => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_LOGPROBS}, got {k}"),
            ));
        }
        Some(k) => Some(k as usize),
        None => None,
    };
    let job = Job {
        prompt,
        sampling: request::sampling_params(req, n_vocab)?,
        n: request::choices(req.n)?,
        max_tokens: request::max_tokens("max_tokens", Some(req.max_tokens.unwrap_or(16)))?,
        stop: request::stop_strings(req.stop.clone().map(|s| s.into_vec()).unwrap_or_default())?,
        ignore_eos: req.ignore_eos.unwrap_or(false),
        logprobs,
        constraint: None,
        tools: None,
        thinking: None,
    };
    Ok((job, text))
}

/// Serves one completion request.
pub async fn serve(state: Arc<AppState>, req: CompletionRequest) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let stream = req.stream.unwrap_or(false);
    let echo = req.echo.unwrap_or(false);
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let st = Arc::clone(&state);
    let (job, prompt_text) = tokio::task::spawn_blocking(move || prepare(&st, &req))
        .await
        .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??;
    let head = Head {
        id: state.new_id("cmpl-"),
        created: unix_now(),
        model: state.model.name().to_string(),
        fingerprint: state.model.fingerprint().to_string(),
        seed: job.seed(),
        logprobs: job.logprobs.is_some(),
        echo: echo.then_some(prompt_text),
    };
    let run = Run::start(Arc::clone(&state.model), Arc::clone(&state.metrics), &job)?;
    if stream {
        Ok(stream_response(run, head, include_usage, state.config.keep_alive).into_response())
    } else {
        let results = collect(run, job.n).await?;
        Ok(axum::Json(body(&head, &results)).into_response())
    }
}

#[derive(Debug, Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    seed: u64,
    logprobs: bool,
    echo: Option<String>,
}

impl Head {
    fn object(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "seed": self.seed,
            "choices": choices,
        })
    }
}

/// The legacy logprobs object; offsets count bytes from `start`.
fn logprobs_json(tokens: &[TokenLogprob], start: usize) -> Value {
    let mut offset = start;
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(offset);
        offset += t.token.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            let m: serde_json::Map<String, Value> = t.top.iter().map(|(s, _, lp)| (s.clone(), json!(lp))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn body(head: &Head, results: &[ChoiceResult]) -> Value {
    let echo = head.echo.clone().unwrap_or_default();
    let choices = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({
                "text": format!("{echo}{}", r.content),
                "index": i,
                "logprobs": if head.logprobs { logprobs_json(&r.logprobs, echo.len()) } else { Value::Null },
                "finish_reason": r.finish_reason,
            })
        })
        .collect();
    let mut b = head.object(choices);
    b["usage"] = usage::completion_usage(&choice_usages(results));
    b
}

fn stream_response(
    mut run: Run,
    head: Head,
    include_usage: bool,
    keep_alive: std::time::Duration,
) -> impl IntoResponse {
    let (tx, rx) = mpsc::channel::<SseEvent>(256);
    tokio::spawn(async move {
        let send = |v: Value| SseEvent::default().data(v.to_string());
        if let Some(echo) = head.echo.clone().filter(|e| !e.is_empty()) {
            let c = head.object(vec![
                json!({"text": echo, "index": 0, "logprobs": null, "finish_reason": null}),
            ]);
            if tx.send(send(c)).await.is_err() {
                return;
            }
        }
        let mut pending: HashMap<usize, Vec<TokenLogprob>> = HashMap::new();
        let mut offsets: HashMap<usize, usize> = HashMap::new();
        let mut usage = Vec::new();
        while let Some(e) = run.next().await {
            let (choice, text, finish) = match e {
                RunEvent::Logprobs { choice, tokens } => {
                    pending.entry(choice).or_default().extend(tokens);
                    continue;
                }
                RunEvent::Content { choice, text } => (choice, text, None),
                RunEvent::Done {
                    choice,
                    finish_reason,
                    usage: u,
                    ..
                } => {
                    usage.push(*u);
                    (choice, String::new(), Some(finish_reason))
                }
                RunEvent::Failed { message, .. } => {
                    let err = ApiError::Internal(format!("generation failed: {message}")).body();
                    let _ = tx.send(send(err)).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                RunEvent::CallStart { .. }
                | RunEvent::CallDelta { .. }
                | RunEvent::CallEnd { .. }
                | RunEvent::Thinking { .. } => {
                    continue;
                }
            };
            let start = offsets.entry(choice).or_insert(0);
            let lp = match pending.remove(&choice) {
                Some(toks) if head.logprobs => {
                    let v = logprobs_json(&toks, *start);
                    *start += toks.iter().map(|t| t.token.len()).sum::<usize>();
                    v
                }
                _ => Value::Null,
            };
            let c = head.object(vec![
                json!({"text": text, "index": choice, "logprobs": lp, "finish_reason": finish}),
            ]);
            if tx.send(send(c)).await.is_err() {
                return;
            }
        }
        if include_usage {
            let mut c = head.object(Vec::new());
            c["usage"] = usage::completion_usage(&usage);
            if tx.send(send(c)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    Sse::new(receiver_stream(rx)).keep_alive(KeepAlive::new().interval(keep_alive))
}
