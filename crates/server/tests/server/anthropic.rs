//! The Anthropic Messages API over raw HTTP: the exact event stream, Anthropic's error
//! bodies on its routes (validation, API key through `x-api-key`, wrong method), and
//! `count_tokens`. The official SDK's checks are in `anthropic_sdk.rs`.

use std::sync::OnceLock;

use serde_json::{Value, json};

use crate::common::{TestServer, client, post, post_stream, qwen, smol, smol_model, spawn};
use lockstep_server::ServerConfig;

/// Asserts Anthropic's error body with this status; returns `error`.
fn assert_anthropic_error(status: u16, body: &Value, expected: u16, kind: &str) -> Value {
    assert_eq!(status, expected, "{body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].as_str().is_some(), "{body}");
    body["error"].clone()
}

#[tokio::test]
async fn a_plain_reply_is_a_message_with_a_text_block() {
    let (s, b) = post(
        smol(),
        "/v1/messages",
        &json!({"model": "claude-opus-4-1", "max_tokens": 8, "temperature": 0,
                "system": [{"type": "text", "text": "Be brief."}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["type"], "message");
    assert_eq!(b["role"], "assistant");
    assert_eq!(
        b["model"], "smollm2-135m",
        "the served model answers any name"
    );
    assert!(b["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(b["content"][0]["type"], "text");
    assert!(!b["content"][0]["text"].as_str().unwrap().is_empty(), "{b}");
    assert!(
        ["end_turn", "max_tokens"].contains(&b["stop_reason"].as_str().unwrap()),
        "{b}"
    );
    let u = &b["usage"];
    assert!(u["output_tokens"].as_u64().unwrap() >= 1, "{u}");
    assert!(u["input_tokens"].as_u64().unwrap() >= 1, "{u}");
    assert_eq!(u["cache_creation_input_tokens"], 0);
    assert!(u["cache_read_input_tokens"].is_u64(), "{u}");
}

#[tokio::test]
async fn the_stream_is_anthropics_event_sequence_and_matches_the_plain_reply() {
    let body = json!({"max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": "Name three colors."}]});
    let (s, plain) = post(smol(), "/v1/messages", &body).await;
    assert_eq!(s, 200, "{plain}");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, ctype, events) = post_stream(smol(), "/v1/messages", &sbody).await;
    assert_eq!(s, 200);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    // Every event is named, and the name is the data's `type`.
    for e in &events {
        assert_eq!(e.event.as_deref(), e.json()["type"].as_str(), "{e:?}");
    }
    let names: Vec<&str> = events.iter().filter_map(|e| e.event.as_deref()).collect();
    let n = names.len();
    assert_eq!(
        names[..3],
        ["message_start", "content_block_start", "ping"],
        "{names:?}"
    );
    assert!(names[3..n - 3].iter().all(|e| *e == "content_block_delta"));
    assert_eq!(
        names[n - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .map(|e| e.json()["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, plain["content"][0]["text"].as_str().unwrap());
    let delta = events[n - 2].json();
    assert_eq!(delta["delta"]["stop_reason"], plain["stop_reason"]);
    assert_eq!(
        delta["usage"]["output_tokens"],
        plain["usage"]["output_tokens"]
    );
}

#[tokio::test]
async fn a_forced_tool_streams_input_json_that_validates_against_the_schema() {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let body = json!({"max_tokens": 40, "temperature": 0, "stream": true,
        "tools": [{"name": "pick", "description": "Pick a number", "input_schema": schema}],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Pick a number."}]});
    let (s, _, events) = post_stream(qwen(), "/v1/messages", &body).await;
    assert_eq!(s, 200);
    let start = events
        .iter()
        .find(|e| e.event.as_deref() == Some("content_block_start"))
        .unwrap()
        .json();
    assert_eq!(start["content_block"]["type"], "tool_use", "{start}");
    assert_eq!(start["content_block"]["name"], "pick");
    let partial: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .map(|e| {
            let d = e.json()["delta"].clone();
            assert_eq!(d["type"], "input_json_delta", "{d}");
            d["partial_json"].as_str().unwrap().to_string()
        })
        .collect();
    let input: Value = serde_json::from_str(&partial).unwrap();
    let n = input["n"].as_i64().unwrap();
    assert!((3..=9).contains(&n), "{input}");
    let delta = events
        .iter()
        .find(|e| e.event.as_deref() == Some("message_delta"))
        .unwrap()
        .json();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn count_tokens_counts_the_rendered_prompt() {
    let body = json!({"system": "Be brief.", "messages": [{"role": "user", "content": "Say hi."}]});
    let (s, c) = post(smol(), "/v1/messages/count_tokens", &body).await;
    assert_eq!(s, 200, "{c}");
    let n = c["input_tokens"].as_u64().unwrap();
    let mut run = body.clone();
    run["max_tokens"] = json!(1);
    let (s, r) = post(smol(), "/v1/messages", &run).await;
    assert_eq!(s, 200, "{r}");
    let u = &r["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        n,
        "{u}"
    );
}

#[tokio::test]
async fn bad_requests_are_400_with_anthropics_error_body() {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": msgs}), "max_tokens"),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
            "hologram",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": {"x": 1}}]}]}),
            "messages[0].content[0].content",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]}),
            "wizard",
        ),
        (
            json!({"max_tokens": 4, "messages": msgs, "temperature": 1.5}),
            "temperature",
        ),
        (
            json!({"max_tokens": 4, "messages": msgs, "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}], "tool_choice": {"type": "any"}}),
            "tools[0].input_schema",
        ),
        (json!([1, 2]), "invalid type"),
    ];
    for (body, needle) in cases {
        let (s, b) = post(smol(), "/v1/messages", &body).await;
        let e = assert_anthropic_error(s, &b, 400, "invalid_request_error");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
    let long = "lorem ipsum dolor sit amet ".repeat(600);
    let (s, b) = post(
        smol(),
        "/v1/messages",
        &json!({"max_tokens": 4, "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    let e = assert_anthropic_error(s, &b, 400, "invalid_request_error");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt is too long"),
        "{e}"
    );
    // The server still serves.
    let (s, b) = post(
        smol(),
        "/v1/messages",
        &json!({"max_tokens": 2, "messages": msgs}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let r = client()
        .get(smol().url("/v1/messages"))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_anthropic_error(s, &r.json().await.unwrap(), 405, "invalid_request_error");
}

#[tokio::test]
async fn an_unknown_role_is_400_on_chat_completions_too() {
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &json!({"max_tokens": 2, "messages": [{"role": "wizard", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["param"], "messages[0].role", "{b}");
}

static KEYED: OnceLock<TestServer> = OnceLock::new();

#[tokio::test]
async fn x_api_key_is_accepted_like_bearer_and_a_wrong_key_is_an_authentication_error() {
    let server = KEYED.get_or_init(|| {
        spawn(
            smol_model(),
            ServerConfig {
                api_key: Some("k3y".into()),
                ..ServerConfig::default()
            },
        )
    });
    let body = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let send = |key: Option<&'static str>, path: &'static str| {
        let mut req = client()
            .post(server.url(path))
            .header("anthropic-version", "2023-06-01")
            .header("anthropic-beta", "prompt-caching-2024-07-31")
            .json(&body);
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        req.send()
    };
    let r = send(Some("wrong"), "/v1/messages").await.unwrap();
    let s = r.status().as_u16();
    assert_anthropic_error(s, &r.json().await.unwrap(), 401, "authentication_error");
    let r = send(None, "/v1/messages").await.unwrap();
    let s = r.status().as_u16();
    assert_anthropic_error(s, &r.json().await.unwrap(), 401, "authentication_error");
    let r = send(Some("k3y"), "/v1/messages").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // The OpenAI routes take x-api-key as well.
    let r = send(Some("k3y"), "/v1/chat/completions").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

static THINKER: OnceLock<TestServer> = OnceLock::new();

/// The tiny DeepSeek V4 reference checkpoint (random weights; its built-in encoding has a
/// thinking mode).
fn thinker() -> &'static TestServer {
    THINKER.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/deepseek4/flash-layout.gguf");
        let mut opts = lockstep_server::ModelOptions::new("flash-layout");
        opts.ctx_size = Some(1024);
        opts.kv_tokens = Some(4096);
        opts.threads = Some(1);
        let model = std::sync::Arc::new(lockstep_server::Runtime::open(&path, &opts).unwrap());
        assert!(model.thinks());
        spawn(model, ServerConfig::default())
    })
}

#[tokio::test]
async fn thinking_on_a_model_that_thinks_comes_back_as_a_thinking_block_first() {
    let body = json!({"max_tokens": 12, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Hi"}]});
    let (s, b) = post(thinker(), "/v1/messages", &body).await;
    assert_eq!(s, 200, "{b}");
    let first = &b["content"][0];
    assert_eq!(first["type"], "thinking", "{b}");
    assert!(!first["thinking"].as_str().unwrap().is_empty(), "{b}");
    // The same request streamed: a thinking block with thinking_delta events, the same text.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, _, events) = post_stream(thinker(), "/v1/messages", &sbody).await;
    assert_eq!(s, 200);
    let start = events
        .iter()
        .find(|e| e.event.as_deref() == Some("content_block_start"))
        .unwrap()
        .json();
    assert_eq!(start["content_block"]["type"], "thinking", "{start}");
    let streamed: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .filter_map(|e| {
            let d = e.json()["delta"].clone();
            (d["type"] == "thinking_delta").then(|| d["thinking"].as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(streamed, first["thinking"].as_str().unwrap());
    // Without `thinking` the prompt is in chat mode: no thinking block.
    let (s, b) = post(
        thinker(),
        "/v1/messages",
        &json!({"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert!(
        b["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["type"] != "thinking"),
        "{b}"
    );
    // A model without a thinking mode ignores it.
    let (s, b) = post(smol(), "/v1/messages", &body).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["content"][0]["type"], "text", "{b}");
}
