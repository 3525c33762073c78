//! Tool calls on qwen2.5-coder-0.5b (its template renders tools; Hermes envelope).

use serde_json::{Value, json};

use crate::common::{post, post_stream, qwen};

fn weather_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        }
    })
}

fn time_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}
        }
    })
}

fn ask(tool_choice: Value, extra: Value) -> Value {
    let mut body = json!({
        "model": "qwen2.5-coder-0.5b",
        "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
        "tools": [weather_tool(), time_tool()],
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 60
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

fn schema_of(name: &str) -> Value {
    let t = if name == "get_weather" {
        weather_tool()
    } else {
        time_tool()
    };
    t["function"]["parameters"].clone()
}

fn assert_valid_calls(calls: &[Value]) {
    assert!(!calls.is_empty());
    for c in calls {
        assert_eq!(c["type"], "function");
        assert!(c["id"].as_str().unwrap().starts_with("call_"));
        let name = c["function"]["name"].as_str().unwrap();
        let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("arguments are JSON: {e}: {c}"));
        let validator = jsonschema::validator_for(&schema_of(name)).unwrap();
        assert!(validator.is_valid(&args), "{name}: {args}");
    }
}

#[tokio::test]
async fn tool_choice_required_produces_valid_tool_calls() {
    let (status, body) = post(
        qwen(),
        "/v1/chat/completions",
        &ask(json!("required"), json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert_valid_calls(choice["message"]["tool_calls"].as_array().unwrap());
    assert!(choice["message"]["content"].is_null(), "{body}");
}

#[tokio::test]
async fn a_named_tool_choice_calls_that_tool() {
    let choice = json!({"type": "function", "function": {"name": "get_time"}});
    let (status, body) = post(
        qwen(),
        "/v1/chat/completions",
        &ask(choice, json!({"parallel_tool_calls": false})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let calls = body["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["function"]["name"], "get_time");
    assert_valid_calls(calls);
}

#[tokio::test]
async fn streamed_tool_calls_assemble_into_the_same_calls() {
    let (_, whole) = post(
        qwen(),
        "/v1/chat/completions",
        &ask(json!("required"), json!({"seed": 3})),
    )
    .await;
    let (status, _, events) = post_stream(
        qwen(),
        "/v1/chat/completions",
        &ask(json!("required"), json!({"seed": 3, "stream": true})),
    )
    .await;
    assert_eq!(status, 200);
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish = None;
    for e in events.iter().filter(|e| e.data != "[DONE]") {
        let v = e.json();
        let c = &v["choices"][0];
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        for tc in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(name) = tc["function"]["name"].as_str() {
                assert_eq!(i, calls.len());
                assert!(tc["id"].as_str().is_some());
                calls.push((name.to_string(), String::new()));
            }
            if let Some(a) = tc["function"]["arguments"].as_str() {
                calls[i].1.push_str(a);
            }
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    let expected: Vec<(String, String)> = whole["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["function"]["name"].as_str().unwrap().to_string(),
                c["function"]["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(calls, expected);
}

#[tokio::test]
async fn auto_tool_choice_yields_text_or_schema_valid_calls() {
    let (status, body) = post(
        qwen(),
        "/v1/chat/completions",
        &ask(json!("auto"), json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let msg = &body["choices"][0]["message"];
    match msg["tool_calls"].as_array() {
        Some(calls) => {
            assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
            assert_valid_calls(calls);
        }
        None => assert!(!msg["content"].as_str().unwrap_or("").is_empty(), "{body}"),
    }
    // tool_choice none: tools are not shown and nothing is parsed as a call.
    let (status, body) = post(
        qwen(),
        "/v1/chat/completions",
        &ask(json!("none"), json!({"max_tokens": 8})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["choices"][0]["message"].get("tool_calls").is_none());
}

#[tokio::test]
async fn a_tool_result_conversation_renders_and_answers() {
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}
        ],
        "tools": [weather_tool()],
        "temperature": 0,
        "max_tokens": 16
    });
    let (status, resp) = post(qwen(), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
}

#[test]
fn the_auto_constraint_is_free_text_until_the_envelope_opens_then_forces_it() {
    use lockstep_server::tools::{ToolMode, ToolSetup};
    let model = crate::common::qwen_model();
    let cache = runtime::constraint::GrammarCache::new(model.token_env().clone(), 4);
    let specs = lockstep_server::request::parse_tools(&[weather_tool()], "tools").unwrap();
    let setup = ToolSetup {
        tools: specs,
        mode: ToolMode::Auto,
        parallel: false,
    };
    let plan = runtime::constraint::plan(
        &model,
        &cache,
        Some(&setup),
        None,
        &[],
        ("tools", "response_format"),
    )
    .unwrap()
    .expect("a lazy plan");
    let mut c = plan.instantiate(model.token_env());
    let tok = model.tokenizer();
    let mut mask = engine::TokenMask::new(0);
    c.compute_mask(&mut mask).unwrap();
    assert!(mask.count() > 100_000, "free text before the envelope");
    for t in tok.encode(
        "Let me check.\n<tool_call>",
        text::EncodeOptions::plain_text(),
    ) {
        c.consume(t).unwrap();
    }
    c.compute_mask(&mut mask).unwrap();
    let allowed: Vec<u32> = mask.iter().collect();
    assert!(
        allowed.len() < 10,
        "inside the envelope only the forced text is allowed: {allowed:?}"
    );
    let forced = tok.decode(&c.forced_tokens()).unwrap();
    assert!(
        String::from_utf8_lossy(&forced).starts_with("\n{\"name\": \"get_weather\""),
        "{forced:?}"
    );
}

// --- the DSML calls grammar (DeepSeek V4's envelope), compiled with Qwen's tokenizer ---

/// The DSML calls grammar of `tools` as Lark text.
fn dsml_calls_lark(
    tools: &[(&str, &Value)],
    parallel: bool,
) -> Result<String, lockstep_server::tools::dsml::ToolGrammarError> {
    Ok(
        lockstep_server::tools::dsml::calls_grammar(tools, parallel)?
            .to_lark()
            .expect("valid rule names"),
    )
}

/// Whether the grammar accepts `text` entirely and may end there.
fn accepts(lark: &str, text: &str) -> bool {
    let model = crate::common::qwen_model();
    let compiled = grammar::Constraint::lark(format!("start: calls\n{lark}"))
        .compile(model.token_env(), &grammar::GrammarLimits::default())
        .unwrap_or_else(|e| panic!("compile: {e}\n{lark}"));
    let mut m = compiled.matcher();
    for t in model
        .tokenizer()
        .encode(text, text::EncodeOptions::plain_text())
    {
        if m.consume(t).is_err() {
            return false;
        }
    }
    m.is_accepting()
}

fn weather_tools() -> Vec<(&'static str, Value)> {
    vec![
        (
            "get_weather",
            json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "where": {"$ref": "#/$defs/point"}
                },
                "required": ["city"],
                "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"], "additionalProperties": false}}
            }),
        ),
        ("noop", json!({"type": "object", "properties": {}})),
    ]
}

#[test]
fn the_dsml_grammar_accepts_rendered_calls_and_rejects_schema_violations() {
    let tools = weather_tools();
    let refs: Vec<(&str, &Value)> = tools.iter().map(|(n, s)| (*n, s)).collect();
    let single = dsml_calls_lark(&refs, false).unwrap();
    let parallel = dsml_calls_lark(&refs, true).unwrap();
    let good = [
        json!({"city": "Paris"}),
        json!({"city": "New\nYork \"big\" 北京", "days": 3}),
        json!({"city": "Oslo", "days": 2, "unit": "celsius", "where": {"lat": 59.9}}),
    ];
    for args in &good {
        let text = chat::DsmlFormat::render_calls([("get_weather", args)]);
        assert!(accepts(&single, &text), "{text}");
        assert!(accepts(&parallel, &text), "{text}");
    }
    let noop = chat::DsmlFormat::render_calls([("noop", &json!({}))]);
    assert!(accepts(&single, &noop), "{noop}");
    let two = chat::DsmlFormat::render_calls([("get_weather", &good[0]), ("noop", &json!({}))]);
    assert!(accepts(&parallel, &two), "{two}");
    assert!(!accepts(&single, &two), "one call only without parallel");
    let bad = [
        json!({"days": 3}),                            // missing required city
        json!({"city": "Paris", "days": 0}),           // minimum
        json!({"city": "Paris", "days": "3"}),         // string for an integer
        json!({"city": "Paris", "unit": "kelvin"}),    // not in the enum
        json!({"city": "Paris", "where": {"lon": 1}}), // $ref'd schema
        json!({"city": "Paris", "extra": 1}),          // unknown parameter
    ];
    for args in &bad {
        let text = chat::DsmlFormat::render_calls([("get_weather", args)]);
        assert!(!accepts(&single, &text), "accepted {text}");
    }
    let unknown = chat::DsmlFormat::render_calls([("delete_all", &json!({}))]);
    assert!(!accepts(&parallel, &unknown), "unknown tool");
    // The grammar starts with the start marker (the lazy trigger).
    assert!(single.contains(&format!(
        "calls: \"{}\\n\"",
        chat::ToolCallFormat::start_marker(&chat::DsmlFormat)
    )));
}

#[test]
fn the_dsml_grammar_handles_schemas_without_properties_and_mixed_types() {
    let any = json!({"type": "object"});
    let mixed = json!({"type": "object", "properties": {"v": {"type": ["string", "integer"]}}, "required": ["v"]});
    let tools = [("any", &any), ("mixed", &mixed)];
    let lark = dsml_calls_lark(&tools, true).unwrap();
    for (name, args) in [
        ("any", json!({})),
        ("any", json!({"x": "free text", "y": [1, {"z": null}]})),
        ("mixed", json!({"v": "text"})),
        ("mixed", json!({"v": 7})),
    ] {
        let text = chat::DsmlFormat::render_calls([(name, &args)]);
        assert!(accepts(&lark, &text), "{text}");
    }
    let text = chat::DsmlFormat::render_calls([("mixed", &json!({"v": [1]}))]);
    assert!(!accepts(&lark, &text), "{text}");
    assert_eq!(
        dsml_calls_lark(&[], false),
        Err(lockstep_server::tools::dsml::ToolGrammarError::NoTools)
    );
    assert_eq!(
        dsml_calls_lark(&[("a\"b", &any)], false),
        Err(lockstep_server::tools::dsml::ToolGrammarError::ToolName(
            "a\"b".to_string()
        ))
    );
}

#[test]
fn the_dsml_grammar_handles_consts_mixed_enums_and_true_schemas() {
    let opts = json!({"type": "object", "properties": {
        "mode": {"const": "fast"},
        "level": {"enum": ["low", 1]},
        "anything": true,
        "n": {"type": "number"}
    }});
    let lark = dsml_calls_lark(&[("opts", &opts)], false).unwrap();
    for args in [
        json!({}),
        json!({"mode": "fast"}),
        json!({"level": "low"}),
        json!({"level": 1}),
        json!({"anything": [1, "x", {"k": null}]}),
        json!({"mode": "fast", "level": 1, "anything": "text", "n": 2.5}),
    ] {
        let text = chat::DsmlFormat::render_calls([("opts", &args)]);
        assert!(accepts(&lark, &text), "{text}");
    }
    for args in [
        json!({"mode": "slow"}),
        json!({"level": 2}),
        json!({"n": "many"}),
        json!({"n": 1, "mode": "fast"}), // out of schema order
    ] {
        let text = chat::DsmlFormat::render_calls([("opts", &args)]);
        assert!(!accepts(&lark, &text), "accepted {text}");
    }
}
