//! `POST /v1/chat/completions`: request → [`Job`], and the run → OpenAI's
//! `chat.completion` body or `chat.completion.chunk` stream.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::ChatCompletionRequest;
use crate::error::ApiError;
use crate::request::{self, Job, MAX_TOP_LOGPROBS};
use crate::run::{ChoiceResult, Run, RunEvent, TokenLogprob, collect};
use crate::state::{AppState, unix_now};
use crate::tools::ToolSetup;
use crate::usage;

/// What the response needs besides the run.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    seed: u64,
    n: usize,
    logprobs: bool,
    include_usage: bool,
}

/// Validates and prepares a chat request (blocking work: template, tokenizer, grammars).
pub fn prepare(state: &AppState, req: &ChatCompletionRequest) -> Result<Job, ApiError> {
    let model = &state.model;
    let n = request::choices(req.n)?;
    let sampling = request::sampling_params(req, model.engine().n_vocab())?;
    let max_tokens = match req.max_completion_tokens {
        Some(v) => request::max_tokens("max_completion_tokens", Some(v))?,
        None => request::max_tokens("max_tokens", req.max_tokens)?,
    };
    let stop = request::stop_strings(req.stop.clone().map(|s| s.into_vec()).unwrap_or_default())?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(k)) if k > 0 => {
            return Err(ApiError::invalid(
                "logprobs",
                "top_logprobs requires logprobs to be true",
            ));
        }
        _ => None,
    };
    let tool_specs = request::parse_tools(req.tools.as_deref().unwrap_or(&[]), "tools")?;
    let mode = request::tool_mode(req.tool_choice.as_ref(), !tool_specs.is_empty())?;
    let setup = ToolSetup {
        tools: tool_specs,
        mode,
        parallel: req.parallel_tool_calls.unwrap_or(true),
    };
    setup.validate("tools")?;
    request::check_roles(&req.messages)?;
    let format = request::chat_format(req.response_format.as_ref())?;
    let prompt = request::chat_prompt(model, &req.messages, Some(&setup))?;
    request::check_prompt_len(prompt.len(), model.context_len())?;
    let constraint = runtime::constraint::plan(
        model,
        &state.grammars,
        Some(&setup),
        format,
        &prompt,
        ("tools", "response_format"),
    )?;
    Ok(Job {
        prompt,
        sampling,
        n,
        max_tokens,
        stop,
        ignore_eos: req.ignore_eos.unwrap_or(false),
        logprobs,
        constraint,
        tools: setup.active().then_some(setup),
        thinking: None,
    })
}

/// Serves one chat completion request.
pub async fn serve(state: Arc<AppState>, req: ChatCompletionRequest) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let plain = request::plain_decoding(req.speculation, state.model.speculates())?;
    let st = Arc::clone(&state);
    let job = tokio::task::spawn_blocking(move || prepare(&st, &req))
        .await
        .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??;
    let meta = Meta {
        id: state.new_id("chatcmpl-"),
        created: unix_now(),
        model: state.model.name().to_string(),
        fingerprint: state.model.fingerprint().to_string(),
        seed: job.seed(),
        n: job.n,
        logprobs: job.logprobs.is_some(),
        include_usage,
    };
    let run = Run::start_with(
        Arc::clone(&state.model),
        Arc::clone(&state.metrics),
        &job,
        plain,
    )?;
    if stream {
        Ok(stream_response(run, meta, state).into_response())
    } else {
        let results = collect(run, job.n).await?;
        Ok(axum::Json(completion_body(&state, &meta, &results)).into_response())
    }
}

/// OpenAI's logprob entry for one token.
pub fn logprob_entry(t: &TokenLogprob) -> Value {
    json!({
        "token": t.token,
        "logprob": t.logprob,
        "bytes": t.bytes,
        "top_logprobs": t.top.iter().map(|(tok, bytes, lp)| json!({
            "token": tok, "logprob": lp, "bytes": bytes,
        })).collect::<Vec<_>>(),
    })
}

/// The engine usage of each choice.
pub fn choice_usages(results: &[ChoiceResult]) -> Vec<engine::Usage> {
    results.iter().map(|r| r.usage).collect()
}

fn tool_call_json(state: &AppState, name: &str, body: &str, custom: bool) -> Value {
    let id = state.new_id("call_");
    if custom {
        json!({"id": id, "type": "custom", "custom": {"name": name, "input": body}})
    } else {
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": body}})
    }
}

fn completion_body(state: &AppState, meta: &Meta, results: &[ChoiceResult]) -> Value {
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut message = json!({
                "role": "assistant",
                "content": if r.content.is_empty() && !r.calls.is_empty() {
                    Value::Null
                } else {
                    Value::String(r.content.clone())
                },
                "refusal": null,
            });
            if !r.calls.is_empty() {
                message["tool_calls"] = r
                    .calls
                    .iter()
                    .map(|(name, body, custom)| tool_call_json(state, name, body, *custom))
                    .collect();
            }
            json!({
                "index": i,
                "message": message,
                "logprobs": if meta.logprobs {
                    json!({"content": r.logprobs.iter().map(logprob_entry).collect::<Vec<_>>(), "refusal": null})
                } else {
                    Value::Null
                },
                "finish_reason": r.finish_reason,
            })
        })
        .collect();
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "seed": meta.seed,
        "choices": choices,
        "usage": usage::chat_usage(&choice_usages(results)),
    })
}

/// Turns run events into chunks.
struct ChunkEncoder {
    meta: Meta,
    pending_logprobs: HashMap<usize, Vec<TokenLogprob>>,
    usage: Vec<engine::Usage>,
    call_ids: HashMap<(usize, usize), String>,
}

impl ChunkEncoder {
    fn chunk(&self, choices: Vec<Value>) -> Value {
        let mut c = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "seed": self.meta.seed,
            "choices": choices,
        });
        if self.meta.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn choice(&mut self, index: usize, delta: Value, finish: Option<&str>) -> Value {
        let logprobs = match self.pending_logprobs.remove(&index) {
            Some(toks) if self.meta.logprobs => {
                json!({"content": toks.iter().map(logprob_entry).collect::<Vec<_>>(), "refusal": null})
            }
            _ => Value::Null,
        };
        json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
    }

    fn first_chunks(&mut self) -> Vec<Value> {
        (0..self.meta.n)
            .map(|i| {
                let c = self.choice(i, json!({"role": "assistant", "content": ""}), None);
                self.chunk(vec![c])
            })
            .collect()
    }

    fn encode(&mut self, state: &AppState, e: RunEvent) -> Vec<Value> {
        match e {
            RunEvent::Logprobs { choice, tokens } => {
                self.pending_logprobs
                    .entry(choice)
                    .or_default()
                    .extend(tokens);
                Vec::new()
            }
            RunEvent::Content { choice, text } => {
                let c = self.choice(choice, json!({"content": text}), None);
                vec![self.chunk(vec![c])]
            }
            RunEvent::CallStart {
                choice,
                index,
                name,
                custom,
            } => {
                let id = state.new_id("call_");
                self.call_ids.insert((choice, index), id.clone());
                let call = if custom {
                    json!({"index": index, "id": id, "type": "custom", "custom": {"name": name, "input": ""}})
                } else {
                    json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}})
                };
                let c = self.choice(choice, json!({"tool_calls": [call]}), None);
                vec![self.chunk(vec![c])]
            }
            RunEvent::CallDelta {
                choice,
                index,
                text,
            } => {
                let call = json!({"index": index, "function": {"arguments": text}});
                let c = self.choice(choice, json!({"tool_calls": [call]}), None);
                vec![self.chunk(vec![c])]
            }
            RunEvent::CallEnd { .. } | RunEvent::Thinking { .. } => Vec::new(),
            RunEvent::Done {
                choice,
                finish_reason,
                usage,
                ..
            } => {
                self.usage.push(*usage);
                let c = self.choice(choice, json!({}), Some(finish_reason));
                vec![self.chunk(vec![c])]
            }
            RunEvent::Failed { message, .. } => {
                vec![ApiError::Internal(format!("generation failed: {message}")).body()]
            }
        }
    }

    fn usage_chunk(&self) -> Value {
        let mut c = self.chunk(Vec::new());
        c["usage"] = usage::chat_usage(&self.usage);
        c
    }
}

fn stream_response(
    mut run: Run,
    meta: Meta,
    state: Arc<AppState>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = mpsc::channel::<SseEvent>(256);
    let keep_alive = state.config.keep_alive;
    tokio::spawn(async move {
        let mut enc = ChunkEncoder {
            meta,
            pending_logprobs: HashMap::new(),
            usage: Vec::new(),
            call_ids: HashMap::new(),
        };
        for c in enc.first_chunks() {
            if tx
                .send(SseEvent::default().data(c.to_string()))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut failed = false;
        while let Some(e) = run.next().await {
            failed |= matches!(e, RunEvent::Failed { .. });
            for c in enc.encode(&state, e) {
                if tx
                    .send(SseEvent::default().data(c.to_string()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if failed {
                break;
            }
        }
        if enc.meta.include_usage && !failed {
            let c = enc.usage_chunk();
            if tx
                .send(SseEvent::default().data(c.to_string()))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    Sse::new(receiver_stream(rx)).keep_alive(KeepAlive::new().interval(keep_alive))
}

/// A tokio receiver as a stream of SSE events.
pub fn receiver_stream(
    rx: mpsc::Receiver<SseEvent>,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}
