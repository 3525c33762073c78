//! DeepSeek V4 DSML: render → parse round trips, streaming at every byte boundary,
//! malformed envelopes and the V4 chat encoding (the calls grammar is the server's,
//! `lockstep_server::tools::dsml`).

use lockstep_chat::{
    ChatTemplate, DsmlFormat, FunctionCall, Message, ParsedOutput, ToolCall, ToolCallFormat,
    ToolStreamEvent, detect_format,
};
use serde_json::{Map, Value, json};

fn parse_split_everywhere(text: &str) -> ParsedOutput {
    let whole = DsmlFormat.parse(text);
    let bytes = text.as_bytes();
    for cut in 1..bytes.len() {
        if !text.is_char_boundary(cut) {
            continue;
        }
        let mut p = DsmlFormat.stream_parser();
        let mut events = p.feed(&text[..cut]);
        events.extend(p.feed(&text[cut..]));
        events.extend(p.finish());
        assert_eq!(
            ParsedOutput::from_events(&events),
            whole,
            "split at byte {cut} of {text:?}"
        );
    }
    // One char at a time.
    let mut p = DsmlFormat.stream_parser();
    let mut events = Vec::new();
    for c in text.chars() {
        events.extend(p.feed(&c.to_string()));
    }
    events.extend(p.finish());
    assert_eq!(ParsedOutput::from_events(&events), whole, "char by char");
    whole
}

fn calls_of(out: &ParsedOutput) -> Vec<(String, Value)> {
    out.tool_calls
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect()
}

fn shapes() -> Vec<Vec<(&'static str, Value)>> {
    vec![
        vec![("get_weather", json!({"city": "Paris"}))],
        vec![("noop", json!({}))],
        vec![
            (
                "get_weather",
                json!({"city": "Paris", "days": 3, "metric": true}),
            ),
            (
                "search",
                json!({"query": "rust \"async\" <traits>", "limit": null}),
            ),
        ],
        vec![(
            "write",
            json!({"path": "a/b.txt", "content": "line 1\nline 2\n\ttabbed \\ back\"slash\n"}),
        )],
        vec![(
            "nested",
            json!({"filter": {"tags": ["a", "b"], "range": {"lo": 1.5, "hi": -2}}, "ids": [1, 2, 3]}),
        )],
        vec![(
            "unicode",
            json!({"city": "北京", "note": "naïve — ｜DSML｜ ok 🎉", "n": "42"}),
        )],
        vec![("leading_ws", json!({"text": "  padded  ", "empty": ""}))],
    ]
}

#[test]
fn rendered_calls_parse_back_at_every_split() {
    for shape in shapes() {
        let block = DsmlFormat::render_calls(shape.iter().map(|(n, a)| (*n, a)));
        for text in [
            block.to_string(),
            format!("Let me check.\n\n{block}"),
            format!("{block}\n\nDone."),
        ] {
            let out = parse_split_everywhere(&text);
            assert!(out.errors.is_empty(), "{text:?}: {:?}", out.errors);
            let expected: Vec<(String, Value)> = shape
                .iter()
                .map(|(n, a)| (n.to_string(), a.clone()))
                .collect();
            assert_eq!(calls_of(&out), expected, "{text}");
            let content = text.replace(&block, "");
            assert_eq!(out.content, content.trim(), "{text:?}");
        }
    }
}

#[test]
fn render_call_is_the_reference_layout() {
    let text = DsmlFormat.render_call("get_weather", r#"{"city": "Paris", "days": 3}"#);
    assert_eq!(
        text,
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
         <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
         <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
         </｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    );
    assert_eq!(
        DsmlFormat.render_call("noop", "{}"),
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"noop\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    );
    // Not a JSON object: one string parameter `arguments` (the reference's fallback).
    assert!(DsmlFormat.render_call("f", "{ARGS}").contains(
        "<｜DSML｜parameter name=\"arguments\" string=\"true\">{ARGS}</｜DSML｜parameter>"
    ));
}

#[test]
fn arguments_stream_incrementally() {
    let text = DsmlFormat::render_calls([(
        "write",
        &json!({"content": "a long string value that streams", "n": 1}),
    )]);
    let mut p = DsmlFormat.stream_parser();
    let mut deltas = 0;
    let mut started = false;
    let mut events = Vec::new();
    let mut pending = String::new();
    for c in text.chars() {
        pending.push(c);
        if pending.len() >= 5 {
            events.extend(p.feed(&std::mem::take(&mut pending)));
        }
    }
    events.extend(p.feed(&pending));
    events.extend(p.finish());
    for e in &events {
        match e {
            ToolStreamEvent::ToolCallStart { index: 0, name } => {
                assert_eq!(name, "write");
                started = true;
            }
            ToolStreamEvent::ArgumentsDelta { index: 0, .. } => {
                assert!(started);
                deltas += 1;
            }
            ToolStreamEvent::ContentDelta(t) => panic!("unexpected content {t:?}"),
            _ => {}
        }
    }
    assert!(
        deltas > 5,
        "string values stream as they arrive ({deltas} deltas)"
    );
    let out = ParsedOutput::from_events(&events);
    assert_eq!(
        out.tool_calls[0].arguments,
        json!({"content": "a long string value that streams", "n": 1})
    );
}

#[test]
fn malformed_envelopes_are_errors_or_text_never_panics() {
    let cases: &[(&str, &str)] = &[
        (
            "<｜DSML｜tool_calls>\nhello\n</｜DSML｜tool_calls>",
            "expected",
        ),
        (
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "not JSON",
        ),
        (
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter>\n<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "duplicate parameter",
        ),
        (
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"maybe\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "neither",
        ),
        (
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke nom=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "malformed",
        ),
        (
            "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">cut off",
            "unterminated tool call",
        ),
        ("<｜DSML｜tool_calls>\n<｜DSML｜inv", "tool-call block"),
    ];
    for (text, needle) in cases {
        let out = parse_split_everywhere(text);
        assert!(out.tool_calls.is_empty(), "{text:?}: {:?}", out.tool_calls);
        assert_eq!(out.errors.len(), 1, "{text:?}: {:?}", out.errors);
        assert!(
            out.errors[0].message.contains(needle),
            "{text:?}: {:?}",
            out.errors[0].message
        );
        assert!(text.starts_with(&out.errors[0].raw[..out.errors[0].raw.len().min(20)]));
    }
    // A good call survives a bad one in the same block; prose mentioning the marker
    // without the block stays content.
    let text = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"ok\">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"bad\">\n<｜DSML｜parameter name=\"x\" string=\"false\">{</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    let out = parse_split_everywhere(text);
    assert_eq!(calls_of(&out), vec![("ok".to_string(), json!({}))]);
    assert_eq!(out.errors.len(), 1);
    let prose = "The marker ｜DSML｜ and <｜DSML｜invoke> are tags.";
    let out = parse_split_everywhere(prose);
    assert_eq!(out.content, prose);
    // A block whose end marker never came still yields its complete calls.
    let out = parse_split_everywhere(
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool",
    );
    assert_eq!(calls_of(&out), vec![("f".to_string(), json!({}))]);
    assert!(out.errors.is_empty());
    // Arbitrary bytes never panic.
    let junk = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"\"><｜DSML｜parameter>\"\"=>>";
    for end in 0..=junk.len() {
        if junk.is_char_boundary(end) {
            let _ = parse_split_everywhere(&junk[..end]);
        }
    }
}

#[test]
fn the_template_source_selects_dsml() {
    let t = ChatTemplate::deepseek_v4();
    assert_eq!(detect_format(t.source()).unwrap().name(), "dsml");
    assert_eq!(
        detect_format("{{ '<tool_call>' }}").unwrap().name(),
        "hermes"
    );
    // DeepSeek V3.2's block is `function_calls`: not this format.
    let v32 = "{%- set dsml_token = \"｜DSML｜\" -%}<{{ dsml_token }}function_calls>";
    assert!(detect_format(v32).is_none());
}

// --- chat encoding --------------------------------------------------------------------

fn call(id: &str, name: &str, args: Value) -> ToolCall {
    ToolCall {
        id: Some(id.into()),
        kind: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: Value::String(args.to_string()),
        },
    }
}

fn tool_msg(id: &str, content: &str) -> Message {
    let mut m = Message::new("tool", content);
    m.tool_call_id = Some(id.into());
    m
}

#[test]
fn v4_encoding_matches_the_reference_layout() {
    let t = ChatTemplate::deepseek_v4();
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
    ];
    let mut assistant = Message::new("assistant", "");
    assistant.tool_calls = Some(vec![
        call("c1", "get_weather", json!({"city": "Paris"})),
        call("c2", "get_weather", json!({"city": "Oslo", "days": 2})),
    ]);
    let messages = vec![
        Message::new("system", "You are helpful."),
        Message::new("user", "Weather?"),
        assistant,
        tool_msg("c2", "cold"),
        tool_msg("c1", "sunny"),
    ];
    let prompt = t.render(&messages, Some(&tools), true, Map::new()).unwrap();
    let tools_section = "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n";
    let expected = format!("<｜begin▁of▁sentence｜>You are helpful.\n\n{tools_section}");
    assert!(prompt.starts_with(&expected), "{prompt}");
    assert!(prompt.contains(
        "### Available Tool Schemas\n\n{\"name\": \"get_weather\", \"description\": \"Weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>Weather?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Oslo</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
    ), "{prompt}");
    // Tool results merge into one user turn, in call order.
    assert!(
        prompt.ends_with(
            "<｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>cold</tool_result><｜Assistant｜></think>"
        ),
        "{prompt}"
    );
    // The rendered history call parses back with the DSML format.
    let block_start = prompt
        .find("<｜DSML｜tool_calls>\n<｜DSML｜invoke")
        .unwrap();
    let out = DsmlFormat
        .parse(&prompt[block_start..prompt.find("<｜end▁of▁sentence｜><｜User｜><tool").unwrap()]);
    assert_eq!(
        calls_of(&out),
        vec![
            ("get_weather".to_string(), json!({"city": "Paris"})),
            (
                "get_weather".to_string(),
                json!({"city": "Oslo", "days": 2})
            ),
        ]
    );
}

#[test]
fn v4_encoding_thinking_modes() {
    let t = ChatTemplate::deepseek_v4();
    let mut a1 = Message::new("assistant", "Hi!");
    a1.extra.insert("reasoning_content".into(), json!("greet"));
    let messages = vec![
        Message::new("user", "Hello"),
        a1,
        Message::new("user", "And?"),
    ];
    let chat = t.render(&messages, None, true, Map::new()).unwrap();
    assert_eq!(
        chat,
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜User｜>And?<｜Assistant｜></think>"
    );
    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), json!(true));
    let thinking = t.render(&messages, None, true, extra.clone()).unwrap();
    // Older reasoning dropped; the latest turn opens <think>.
    assert_eq!(
        thinking,
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜User｜>And?<｜Assistant｜><think>"
    );
    extra.insert("drop_thinking".into(), json!(false));
    let kept = t.render(&messages, None, true, extra.clone()).unwrap();
    assert_eq!(
        kept,
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>greet</think>Hi!<｜end▁of▁sentence｜><｜User｜>And?<｜Assistant｜><think>"
    );
    extra.insert("reasoning_effort".into(), json!("max"));
    let max = t.render(&messages, None, false, extra.clone()).unwrap();
    assert!(max.starts_with("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum"));
    assert!(
        max.ends_with("<｜User｜>And?"),
        "no generation prompt: {max}"
    );
    extra.insert("reasoning_effort".into(), json!("extreme"));
    assert!(t.render(&messages, None, true, extra).is_err());
    // Tools without a system message open the prompt on their own.
    let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
    let p = t
        .render(&[Message::new("user", "x")], Some(&tools), true, Map::new())
        .unwrap();
    assert!(p.starts_with("<｜begin▁of▁sentence｜>## Tools\n\n"), "{p}");
    assert!(
        p.ends_with("invoke tool calls.\n<｜User｜>x<｜Assistant｜></think>"),
        "{p}"
    );
    // render_context reads the same variables.
    let mut ctx = Map::new();
    ctx.insert(
        "messages".into(),
        json!([{"role": "user", "content": "Hello"}]),
    );
    ctx.insert("add_generation_prompt".into(), json!(true));
    assert_eq!(
        t.render_context(&ctx).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
    );
    assert!(
        t.render(&[Message::new("wizard", "x")], None, true, Map::new())
            .is_err()
    );
}

// --- properties -----------------------------------------------------------------------

use proptest::prelude::*;

/// Fragments that build well-formed, truncated and malformed blocks.
const PIECES: &[&str] = &[
    "text ",
    "\n\n",
    " ",
    "｜DSML｜",
    "<｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\n",
    "</｜DSML｜tool_calls>",
    "<｜DSML｜invoke name=\"f\">\n",
    "<｜DSML｜invoke name=\"g\">",
    "<｜DSML｜invoke",
    "</｜DSML｜invoke>\n",
    "<｜DSML｜parameter name=\"a\" string=\"true\">",
    "<｜DSML｜parameter name=\"b\" string=\"false\">",
    "<｜DSML｜parameter name=\"c\">",
    "</｜DSML｜parameter>\n",
    "[1, {\"x\": null}]",
    "北京\n",
    "\"q\"",
    "<",
    ">",
];

fn value_strategy() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        "\\PC{0,12}".prop_map(Value::String),
        any::<i64>().prop_map(|n| json!(n)),
        any::<bool>().prop_map(Value::Bool),
        Just(Value::Null),
        // Short binary fractions: serde_json (without `float_roundtrip`) may read long
        // decimals one ulp off, which is not the format's doing.
        (-1_000_000i64..1_000_000).prop_map(|n| json!(n as f64 / 8.0)),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,5}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    /// Any arguments object renders and parses back to itself, whatever the chunking.
    #[test]
    fn arbitrary_arguments_round_trip(
        args in prop::collection::btree_map("[a-z_]{1,8}", value_strategy(), 0..5),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        let args = Value::Object(args.into_iter().collect());
        let text = format!("ok\n\n{}", DsmlFormat::render_calls([("tool", &args), ("other", &args)]));
        let mut p = DsmlFormat.stream_parser();
        let mut events = Vec::new();
        let mut at = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
        points.sort_unstable();
        for c in points {
            if c > at && text.is_char_boundary(c) {
                events.extend(p.feed(&text[at..c]));
                at = c;
            }
        }
        events.extend(p.feed(&text[at..]));
        events.extend(p.finish());
        let out = ParsedOutput::from_events(&events);
        prop_assert!(out.errors.is_empty(), "{:?}", out.errors);
        prop_assert_eq!(out.content.as_str(), "ok");
        prop_assert_eq!(calls_of(&out), vec![("tool".to_string(), args.clone()), ("other".to_string(), args)]);
    }

    /// Any text (well-formed or not) parses the same however it is chunked, never panics,
    /// and every reported call has an object of arguments.
    #[test]
    fn any_chunking_gives_the_same_result(
        pieces in prop::collection::vec(prop::sample::select(PIECES), 0..14),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let text: String = pieces.concat();
        let whole = DsmlFormat.parse(&text);
        let mut p = DsmlFormat.stream_parser();
        let mut events = Vec::new();
        let mut at = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
        points.sort_unstable();
        for c in points {
            if c > at && text.is_char_boundary(c) {
                events.extend(p.feed(&text[at..c]));
                at = c;
            }
        }
        events.extend(p.feed(&text[at..]));
        events.extend(p.finish());
        let chunked = ParsedOutput::from_events(&events);
        prop_assert_eq!(&chunked, &whole, "text {:?}", text);
        for c in &whole.tool_calls {
            prop_assert!(c.arguments.is_object());
        }
    }
}
