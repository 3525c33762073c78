//! The Jinja dialect matches jinja2 as HF transformers configures it: every case of
//! `fixtures/jinja_cases.json` (rendered by jinja2 3.1 through `gen_jinja_cases.py`)
//! renders identically, and template failures are clear errors naming the line.

use lockstep_chat::{ChatError, ChatTemplate, ContentPart, Message, MessageContent};
use serde::Deserialize;
use serde_json::{Map, Value, json};

#[derive(Deserialize)]
struct Case {
    name: String,
    template: String,
    context: Map<String, Value>,
    rendered: String,
}

#[test]
fn every_jinja2_reference_case_renders_identically() {
    let cases: Vec<Case> =
        serde_json::from_str(include_str!("../fixtures/jinja_cases.json")).expect("fixture JSON");
    assert!(cases.len() >= 20, "fixture has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let got = ChatTemplate::new(&case.template, "<s>", "</s>")
            .and_then(|t| t.render_context(&case.context));
        match got {
            Ok(text) if text == case.rendered => {}
            Ok(text) => failures.push(format!(
                "{}:\n   want {:?}\n   got  {:?}",
                case.name, case.rendered, text
            )),
            Err(e) => failures.push(format!("{}: error {e}", case.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn user(text: &str) -> Vec<Message> {
    vec![Message::new("user", text)]
}

#[test]
fn raise_exception_message_and_line_surface_in_the_error() {
    let source = "{% for m in messages %}\n{% if m.role not in ['user', 'assistant'] %}\n{{ raise_exception('Only user and assistant roles are supported!') }}\n{% endif %}\n{% endfor %}";
    let t = ChatTemplate::new(source, "", "").expect("compiles");
    let err = t
        .render(&[Message::new("tool", "x")], None, false, Map::new())
        .expect_err("must raise");
    match &err {
        ChatError::Raised { message, line, .. } => {
            assert_eq!(message, "Only user and assistant roles are supported!");
            assert_eq!(*line, Some(3));
        }
        other => panic!("expected Raised, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("Only user and assistant roles are supported!"),
        "{text}"
    );
    assert!(text.contains("line 3"), "{text}");
    // The same template renders fine for allowed roles.
    assert_eq!(
        t.render(&user("hi"), None, false, Map::new()).as_deref(),
        Ok("")
    );
}

#[test]
fn syntax_error_names_the_template_line() {
    let source =
        "{% for m in messages %}\n{{ m.content }}\n{% if m.role == 'user' %}\n{% endfor %}";
    let err = ChatTemplate::new(source, "", "").expect_err("unbalanced blocks");
    match &err {
        ChatError::Syntax { line, message, .. } => {
            assert_eq!(*line, Some(4), "{message}");
        }
        other => panic!("expected Syntax, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.starts_with("chat template syntax error at line 4"),
        "{text}"
    );
    assert!(text.contains("{% endfor %}"), "snippet of the line: {text}");
}

#[test]
fn render_error_names_the_template_line() {
    let source = "{{ bos_token }}\n{% for m in messages %}{{ m.content + 1 }}{% endfor %}";
    let t = ChatTemplate::new(source, "<s>", "").expect("compiles");
    let err = t
        .render(&user("hi"), None, false, Map::new())
        .expect_err("str + int");
    assert!(
        matches!(err, ChatError::Render { line: Some(2), .. }),
        "{err:?}"
    );
}

#[test]
fn tojson_of_undefined_is_an_error_not_a_panic() {
    let t = ChatTemplate::new("{{ missing | tojson }}", "", "").expect("compiles");
    let err = t
        .render(&user("hi"), None, false, Map::new())
        .expect_err("undefined");
    assert!(err.to_string().contains("not JSON serializable"), "{err}");
}

#[test]
fn unknown_tojson_argument_is_an_error() {
    let t = ChatTemplate::new("{{ 1 | tojson(bogus=1) }}", "", "").expect("compiles");
    assert!(t.render(&user("hi"), None, false, Map::new()).is_err());
}

#[test]
fn strftime_now_formats_the_current_date_and_rejects_bad_formats() {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", "", "").expect("compiles");
    let date = t
        .render(&user("hi"), None, false, Map::new())
        .expect("renders");
    let parts: Vec<&str> = date.split('-').collect();
    assert_eq!(parts.len(), 3, "{date}");
    assert!(
        parts.iter().all(|p| p.chars().all(|c| c.is_ascii_digit())),
        "{date}"
    );
    assert_eq!(parts[0].len(), 4);
    let t = ChatTemplate::new("{{ strftime_now('%Q') }}", "", "").expect("compiles");
    assert!(t.render(&user("hi"), None, false, Map::new()).is_err());
}

#[test]
fn content_parts_are_joined_with_newlines() {
    let t = ChatTemplate::new("{{ messages[0].content }}", "", "").expect("compiles");
    let parts: MessageContent = serde_json::from_value(json!([
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"}
    ]))
    .expect("parts");
    let mut m = Message::new("user", "");
    m.content = Some(parts);
    assert_eq!(
        t.render(&[m], None, false, Map::new()).as_deref(),
        Ok("first\nsecond")
    );
}

#[test]
fn non_text_content_part_is_a_clear_error() {
    let t = ChatTemplate::new("{{ messages[0].content }}", "", "").expect("compiles");
    let mut m = Message::new("user", "");
    m.content = Some(MessageContent::Parts(vec![ContentPart {
        kind: "image_url".into(),
        text: None,
        extra: Map::new(),
    }]));
    let err = t.render(&[m], None, false, Map::new()).expect_err("image");
    assert!(err.to_string().contains("image_url"), "{err}");
}

#[test]
fn null_content_renders_as_empty_string() {
    let m: Message =
        serde_json::from_value(json!({"role": "assistant", "content": null})).expect("msg");
    let t = ChatTemplate::new("[{{ messages[0].content }}]", "", "").expect("compiles");
    assert_eq!(t.render(&[m], None, false, Map::new()).as_deref(), Ok("[]"));
}

#[test]
fn extra_variables_are_visible_but_cannot_override_named_ones() {
    let t = ChatTemplate::new(
        "{{ enable_thinking }} {{ add_generation_prompt }} {{ bos_token }} {{ tools is none }} {{ documents is none }}",
        "<s>",
        "",
    )
    .expect("compiles");
    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), json!(false));
    extra.insert("add_generation_prompt".into(), json!("overridden?"));
    extra.insert("bos_token".into(), json!("<bad>"));
    assert_eq!(
        t.render(&user("hi"), None, true, extra).as_deref(),
        Ok("False True <s> True True")
    );
}

#[test]
fn message_extra_fields_and_tool_call_ids_reach_the_template() {
    let m: Message = serde_json::from_value(json!({
        "role": "assistant",
        "content": null,
        "reasoning_content": "thinking",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    }))
    .expect("msg");
    let t = ChatTemplate::new(
        "{% set m = messages[0] %}{{ m.reasoning_content }}|{{ m.tool_calls[0].id }}|{{ m.tool_calls[0].function.arguments.a }}|{{ m.tool_calls[0].function.arguments | tojson }}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        t.render(&[m], None, false, Map::new()).as_deref(),
        Ok("thinking|call_1|1|{\"a\": 1}")
    );
}

#[test]
fn generation_tags_render_their_body() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        t.render(&user("hi"), None, false, Map::new()).as_deref(),
        Ok("hi")
    );
}

#[test]
fn python_json_matches_json_dumps_defaults() {
    let v = json!({"b": [1, 1.0, -0.5, 1e16, true, null], "a": "é<>&\"\n"});
    assert_eq!(
        lockstep_chat::python_json(&v),
        r#"{"b": [1, 1.0, -0.5, 1e+16, true, null], "a": "é<>&\"\n"}"#
    );
}
