//! Snapshots of prompts rendered from the real models' templates for conversations the
//! golden files do not cover (OpenAI-style string arguments, ids, parallel calls and
//! results, content parts), so any change in rendering is a visible diff.

use crate::common::model_template;
use lockstep_chat::{ChatTemplate, Message};
use serde_json::{Map, Value, json};

fn template(model: &str) -> ChatTemplate {
    let (source, bos, eos) = model_template(model);
    ChatTemplate::new(&source, &bos, &eos).expect("template compiles")
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }})
}

/// An OpenAI client's conversation: arguments as JSON strings, call ids, two parallel
/// calls answered by two tool messages, null assistant content.
fn openai_conversation() -> Vec<Message> {
    serde_json::from_value(json!([
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo"}, {"type": "text", "text": "and Bergen?"}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Bergen\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 7.5}"},
        {"role": "assistant", "content": "Oslo 3°C, Bergen 7.5°C."},
        {"role": "user", "content": "Thanks!"}
    ]))
    .expect("conversation")
}

#[test]
fn qwen_prompt_with_parallel_calls_and_string_arguments() {
    let prompt = template("qwen2.5-coder-0.5b")
        .render(
            &openai_conversation(),
            Some(&[weather_tool()]),
            true,
            Map::new(),
        )
        .expect("renders");
    // String arguments reach the template as objects: no double-encoded JSON.
    assert!(prompt.contains(r#"{"name": "get_weather", "arguments": {"city": "Bergen"}}"#));
    insta::assert_snapshot!("qwen_0_5b_parallel_calls", prompt);
}

#[test]
fn qwen_1_5b_prompt_with_parallel_calls_and_string_arguments() {
    let prompt = template("qwen2.5-coder-1.5b")
        .render(
            &openai_conversation(),
            Some(&[weather_tool()]),
            true,
            Map::new(),
        )
        .expect("renders");
    insta::assert_snapshot!("qwen_1_5b_parallel_calls", prompt);
}

#[test]
fn smollm_prompt_of_the_same_conversation() {
    let prompt = template("smollm2-135m")
        .render(&openai_conversation(), None, true, Map::new())
        .expect("renders");
    insta::assert_snapshot!("smollm2_parallel_calls", prompt);
}
