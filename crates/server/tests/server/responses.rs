//! `/v1/responses`: output items, streaming events, custom tools with a Lark grammar,
//! function tools, `text.format`, and `previous_response_id`.

use serde_json::{Value, json};

use crate::common::{assert_error, client, post, post_stream, qwen, smol};

const SHELL_GRAMMAR: &str = "start: \"ls \" PATH\nPATH: /[a-z\\/]{1,20}/\n";

fn shell_tool() -> Value {
    json!({
        "type": "custom",
        "name": "shell",
        "description": "Runs a shell command",
        "format": {"type": "grammar", "syntax": "lark", "definition": SHELL_GRAMMAR}
    })
}

fn output_text(resp: &Value) -> String {
    resp["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter())
        .filter_map(|c| c["text"].as_str())
        .collect()
}

#[tokio::test]
async fn a_string_input_gives_a_completed_message_with_usage() {
    let (s, r) = post(
        smol(),
        "/v1/responses",
        &json!({"model": "smollm2-135m", "input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert!(["completed", "incomplete"].contains(&r["status"].as_str().unwrap()));
    assert!(!output_text(&r).is_empty());
    assert_eq!(r["output"][0]["role"], "assistant");
    let u = &r["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()
    );
    assert!(
        u["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .is_some()
    );
}

#[tokio::test]
async fn streaming_emits_the_event_sequence_and_the_same_text() {
    let body = json!({"input": "Say hi.", "max_output_tokens": 8, "temperature": 0});
    let (_, whole) = post(smol(), "/v1/responses", &body).await;
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, _, events) = post_stream(smol(), "/v1/responses", &sbody).await;
    assert_eq!(s, 200);
    let kinds: Vec<String> = events
        .iter()
        .map(|e| e.event.clone().unwrap_or_default())
        .collect();
    for (e, k) in events.iter().zip(&kinds) {
        assert_eq!(
            e.json()["type"].as_str().unwrap(),
            k,
            "event name equals data.type"
        );
    }
    assert_eq!(kinds[0], "response.created");
    assert_eq!(kinds[1], "response.in_progress");
    assert_eq!(kinds[2], "response.output_item.added");
    assert_eq!(kinds[3], "response.content_part.added");
    let last = kinds.last().unwrap();
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "{kinds:?}"
    );
    for k in [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ] {
        assert!(kinds.iter().any(|x| x == k), "missing {k}: {kinds:?}");
    }
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e.json()["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let deltas: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.output_text.delta"))
        .map(|e| e.json()["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, output_text(&whole));
    let done = events.last().unwrap().json();
    assert_eq!(output_text(&done["response"]), deltas);
}

#[tokio::test]
async fn a_custom_tool_with_a_lark_grammar_yields_a_grammatical_custom_tool_call() {
    let body = json!({
        "input": "List the files in the /tmp directory.",
        "tools": [shell_tool()],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 40
    });
    let (s, r) = post(qwen(), "/v1/responses", &body).await;
    assert_eq!(s, 200, "{r}");
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "custom_tool_call")
        .unwrap_or_else(|| panic!("no custom_tool_call: {r}"));
    assert_eq!(call["name"], "shell");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    let input = call["input"].as_str().unwrap();
    let re = regex_lite_match(input);
    assert!(re, "input {input:?} is in the grammar's language");
    // Streaming: input deltas and a done event carrying the same input.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (_, _, events) = post_stream(qwen(), "/v1/responses", &sbody).await;
    let delta: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.custom_tool_call_input.delta"))
        .map(|e| e.json()["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(delta, input);
    let done = events
        .iter()
        .find(|e| e.event.as_deref() == Some("response.custom_tool_call_input.done"))
        .expect("input.done event");
    assert_eq!(done.json()["input"], input);
}

/// `^ls [a-z/]{1,20}$` without a regex dependency.
fn regex_lite_match(s: &str) -> bool {
    s.strip_prefix("ls ").is_some_and(|p| {
        (1..=20).contains(&p.len()) && p.chars().all(|c| c.is_ascii_lowercase() || c == '/')
    })
}

#[tokio::test]
async fn function_tools_stream_argument_deltas_and_a_follow_up_uses_previous_response_id() {
    let tool = json!({
        "type": "function", "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    });
    let body = json!({"input": "Weather in Oslo?", "tools": [tool], "tool_choice": "required",
                      "temperature": 0, "max_output_tokens": 40, "stream": true});
    let (_, _, events) = post_stream(qwen(), "/v1/responses", &body).await;
    let args: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.function_call_arguments.delta"))
        .map(|e| e.json()["delta"].as_str().unwrap().to_string())
        .collect();
    let parsed: Value = serde_json::from_str(&args).expect("arguments are JSON");
    assert!(parsed["city"].is_string());
    let done = events.last().unwrap().json();
    assert_eq!(done["type"], "response.completed");
    let resp = &done["response"];
    let call = resp["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(call["arguments"].as_str().unwrap(), args);
    let follow = json!({
        "previous_response_id": resp["id"],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "3 degrees, snow"}],
        "temperature": 0, "max_output_tokens": 12
    });
    let (s, r) = post(qwen(), "/v1/responses", &follow).await;
    assert_eq!(s, 200, "{r}");
    let mut alone = follow.clone();
    alone
        .as_object_mut()
        .unwrap()
        .remove("previous_response_id");
    let (_, a) = post(qwen(), "/v1/responses", &alone).await;
    // The stored conversation (question and call) precedes the new input.
    assert!(
        r["usage"]["input_tokens"].as_u64().unwrap()
            > a["usage"]["input_tokens"].as_u64().unwrap() + 10
    );
    let got: Value = client()
        .get(qwen().url(&format!("/v1/responses/{}", r["id"].as_str().unwrap())))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["id"], r["id"]);
}

#[tokio::test]
async fn text_format_json_schema_is_enforced_and_unstored_responses_cannot_be_continued() {
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"], "additionalProperties": false});
    let body = json!({"input": "Reply in JSON.", "store": false, "temperature": 0, "max_output_tokens": 40,
                      "text": {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": true}}});
    let (s, r) = post(smol(), "/v1/responses", &body).await;
    assert_eq!(s, 200, "{r}");
    let v: Value = serde_json::from_str(&output_text(&r)).expect("JSON output");
    assert!(
        jsonschema::validator_for(&schema).unwrap().is_valid(&v),
        "{v}"
    );
    let (s, e) = post(
        smol(),
        "/v1/responses",
        &json!({"previous_response_id": r["id"], "input": "more"}),
    )
    .await;
    assert_error(s, &e, 404);
}
