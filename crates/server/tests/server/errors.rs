//! Request policy: every refusal is OpenAI's error body with the right status, before any
//! generation work.

use std::sync::OnceLock;

use lockstep_server::ServerConfig;
use serde_json::{Value, json};

use crate::common::{TestServer, assert_error, client, post, smol, smol_model, spawn};

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

#[tokio::test]
async fn a_field_of_the_wrong_type_is_400_naming_the_field() {
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &chat(json!({"temperature": "hot"})),
    )
    .await;
    assert_eq!(assert_error(s, &b, 400)["param"], "temperature");
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": 5}]}),
    )
    .await;
    assert_eq!(assert_error(s, &b, 400)["param"], "messages[0].content");
    let (s, b) = post(smol(), "/v1/chat/completions", &json!({"max_tokens": 3})).await;
    assert_eq!(assert_error(s, &b, 400)["param"], "messages");
    let (s, b) = post(smol(), "/v1/chat/completions", &chat(json!({"n": 0}))).await;
    assert_eq!(assert_error(s, &b, 400)["param"], "n");
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &chat(json!({"logit_bias": {"abc": 1}})),
    )
    .await;
    assert_eq!(assert_error(s, &b, 400)["param"], "logit_bias.abc");
    let (s, b) = post(smol(), "/v1/chat/completions", &chat(json!({"top_p": 0}))).await;
    assert_eq!(assert_error(s, &b, 400)["param"], "top_p");
}

#[tokio::test]
async fn unknown_fields_are_ignored() {
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &chat(json!({"frobnicate": {"x": [1]}, "user": "u"})),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}

#[tokio::test]
async fn malformed_json_and_empty_bodies_are_400() {
    for body in ["{", "", "[1, 2]", "{\"messages\": []} trailing"] {
        let resp = client()
            .post(smol().url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap();
        assert_error(status, &v, 400);
    }
    let (s, b) = post(smol(), "/v1/chat/completions", &json!({"messages": []})).await;
    assert_error(s, &b, 400);
}

#[tokio::test]
async fn any_model_name_is_answered_by_the_served_model() {
    for endpoint in ["/v1/chat/completions", "/v1/messages"] {
        let mut body = chat(json!({"model": "gpt-9"}));
        body["max_tokens"] = json!(2);
        let (s, b) = post(smol(), endpoint, &body).await;
        assert_eq!(s, 200, "{endpoint}: {b}");
        assert_eq!(
            b["model"], "smollm2-135m",
            "the response names the served model"
        );
    }
    let models: Value = client()
        .get(smol().url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "smollm2-135m");
    assert_eq!(models["data"][0]["object"], "model");
    let r = client()
        .get(smol().url("/v1/models/claude-sonnet-4-5"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "smollm2-135m");
}

static STRICT: OnceLock<TestServer> = OnceLock::new();

#[tokio::test]
async fn a_strict_server_answers_only_its_name_and_aliases_which_models_lists() {
    let server = STRICT.get_or_init(|| {
        let mut opts = lockstep_server::ModelOptions::new("smollm2-135m");
        opts.aliases = vec!["tiny".into(), "claude-haiku-4-5".into()];
        opts.ctx_size = Some(512);
        opts.kv_tokens = Some(2048);
        opts.threads = Some(1);
        let path = runtime::load::ensure_model("smollm2-135m").unwrap();
        let model = std::sync::Arc::new(lockstep_server::Runtime::open(&path, &opts).unwrap());
        spawn(
            model,
            ServerConfig {
                strict_model_name: true,
                ..ServerConfig::default()
            },
        )
    });
    let (s, b) = post(
        server,
        "/v1/chat/completions",
        &chat(json!({"model": "gpt-9"})),
    )
    .await;
    assert_eq!(assert_error(s, &b, 404)["code"], "model_not_found");
    let (s, b) = post(
        server,
        "/v1/messages",
        &json!({"model": "gpt-9", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 404, "{b}");
    assert_eq!(b["error"]["type"], "not_found_error", "{b}");
    for name in ["smollm2-135m", "tiny", "claude-haiku-4-5"] {
        let mut body = chat(json!({"model": name}));
        body["max_tokens"] = json!(2);
        let (s, b) = post(server, "/v1/chat/completions", &body).await;
        assert_eq!(s, 200, "{name}: {b}");
        assert_eq!(b["model"], "smollm2-135m");
    }
    let models: Value = client()
        .get(server.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["smollm2-135m", "tiny", "claude-haiku-4-5"]);
    let r = client()
        .get(server.url("/v1/models/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = client()
        .get(server.url("/v1/models/tiny"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "tiny");
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_400_with_the_numbers() {
    let long = "lorem ipsum dolor sit amet ".repeat(600);
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": long}], "max_tokens": 2}),
    )
    .await;
    let e = assert_error(s, &b, 400);
    assert_eq!(e["code"], "context_length_exceeded");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("2048"), "{msg}");
}

#[tokio::test]
async fn an_invalid_schema_or_grammar_is_400_before_any_work() {
    let bad_schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}});
    let (s, b) = post(
        smol(),
        "/v1/chat/completions",
        &chat(json!({"response_format": bad_schema})),
    )
    .await;
    assert_eq!(assert_error(s, &b, 400)["param"], "response_format");
    let bad_tool = json!([{"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "lark", "definition": "start: (("}}]);
    let (s, b) = post(
        smol(),
        "/v1/responses",
        &json!({"input": "hi", "tools": bad_tool, "tool_choice": "required", "max_output_tokens": 4}),
    )
    .await;
    assert_eq!(assert_error(s, &b, 400)["param"], "tools[0].format");
    let bad_choice = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}});
    let (s, b) = post(smol(), "/v1/chat/completions", &chat(bad_choice)).await;
    assert_eq!(assert_error(s, &b, 400)["param"], "tool_choice");
}

#[tokio::test]
async fn unknown_routes_are_404_and_wrong_methods_405_with_error_bodies() {
    let r = client()
        .get(smol().url("/v1/nothing"))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.json().await.unwrap(), 404);
    let r = client()
        .get(smol().url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.json().await.unwrap(), 405);
}

static KEYED: OnceLock<TestServer> = OnceLock::new();

#[tokio::test]
async fn a_bad_or_missing_api_key_is_401_and_health_stays_open() {
    let server = KEYED.get_or_init(|| {
        spawn(
            smol_model(),
            ServerConfig {
                api_key: Some("s3cret".into()),
                body_limit: 2048,
                ..ServerConfig::default()
            },
        )
    });
    for auth in [None, Some("Bearer wrong"), Some("s3cret")] {
        let mut req = client().get(server.url("/v1/models"));
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        let s = r.status().as_u16();
        assert_eq!(
            assert_error(s, &r.json().await.unwrap(), 401)["code"],
            "invalid_api_key"
        );
    }
    let ok = client()
        .get(server.url("/v1/models"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    let health = client().get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    // The same server has a 2 KiB body limit: a bigger body is 413.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]});
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .bearer_auth("s3cret")
        .json(&big)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.json().await.unwrap(), 413);
}

#[tokio::test]
async fn a_full_queue_is_429() {
    let mut opts = lockstep_server::ModelOptions::new("smollm2-135m");
    opts.max_seqs = 1;
    opts.queue_capacity = 1;
    opts.ctx_size = Some(512);
    opts.kv_tokens = Some(2048);
    opts.threads = Some(1);
    let path = runtime::load::ensure_model("smollm2-135m").unwrap();
    let model = std::sync::Arc::new(lockstep_server::Runtime::open(&path, &opts).unwrap());
    let server = spawn(model, ServerConfig::default());
    let (s, b) = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"n": 3, "max_tokens": 4})),
    )
    .await;
    assert_eq!(assert_error(s, &b, 429)["type"], "rate_limit_error");
    // The refused request left nothing behind: the next one runs.
    let (s, b) = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}
