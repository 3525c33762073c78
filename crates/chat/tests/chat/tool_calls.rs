//! The Qwen/Hermes `<tool_call>` format: whole-text parsing, streaming in any chunking,
//! and the rendered envelope.

use lockstep_chat::{HermesFormat, ParsedOutput, ToolCallFormat, ToolStreamEvent, detect_format};
use proptest::prelude::*;
use serde_json::json;

fn parse(text: &str) -> ParsedOutput {
    HermesFormat.parse(text)
}

#[test]
fn plain_text_is_all_content() {
    let out = parse("Hello, world!\n\nNo tools here. a < b and <tool> is not a marker.");
    assert_eq!(
        out.content,
        "Hello, world!\n\nNo tools here. a < b and <tool> is not a marker."
    );
    assert!(out.tool_calls.is_empty() && out.errors.is_empty());
}

#[test]
fn single_call_as_qwen_writes_it() {
    let out = parse(
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>",
    );
    assert_eq!(out.content, "");
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.tool_calls.len(), 1);
    let call = &out.tool_calls[0];
    assert_eq!(call.name, "get_weather");
    assert_eq!(call.arguments, json!({"city": "Oslo", "unit": "c"}));
    assert!(call.raw.starts_with("<tool_call>") && call.raw.ends_with("</tool_call>"));
}

#[test]
fn text_before_the_call_is_content_without_the_bordering_whitespace() {
    let out = parse(
        "Let me check the weather.\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>",
    );
    assert_eq!(out.content, "Let me check the weather.");
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].arguments, json!({}));
}

#[test]
fn several_calls_in_a_row() {
    let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"y\": [1, {\"z\": \"}\"}]}}\n</tool_call>\n";
    let out = parse(text);
    assert_eq!(out.content, "");
    let names: Vec<&str> = out.tool_calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(out.tool_calls[1].arguments, json!({"y": [1, {"z": "}"}]}));
}

#[test]
fn whitespace_variants_are_accepted() {
    for text in [
        "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1}}</tool_call>",
        "<tool_call>\n  {\n    \"name\" : \"f\" ,\n    \"arguments\" :\n {\"a\": 1}\n  }\n\n</tool_call>",
        "<tool_call> {\"name\": \"f\", \"arguments\": {\"a\": 1}} </tool_call>",
    ] {
        let out = parse(text);
        assert!(out.errors.is_empty(), "{text:?}: {:?}", out.errors);
        assert_eq!(out.tool_calls.len(), 1, "{text:?}");
        assert_eq!(out.tool_calls[0].name, "f");
        assert_eq!(out.tool_calls[0].arguments, json!({"a": 1}));
    }
}

#[test]
fn other_body_shapes_are_parsed_whole() {
    for text in [
        "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"f\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"parameters\": {\"a\": 1}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>",
        // The outer object's closing brace is missing.
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",
    ] {
        let out = parse(text);
        assert!(out.errors.is_empty(), "{text:?}: {:?}", out.errors);
        assert_eq!(out.tool_calls.len(), 1, "{text:?}");
        assert_eq!(out.tool_calls[0].arguments, json!({"a": 1}), "{text:?}");
    }
}

#[test]
fn invalid_json_is_reported_not_panicked_and_parsing_goes_on() {
    let text = "<tool_call>\nnot json at all\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    let out = parse(text);
    assert_eq!(out.errors.len(), 2, "{:?}", out.errors);
    assert!(out.errors[0].raw.contains("not json at all"));
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "g");
}

#[test]
fn unterminated_call_at_end_of_stream() {
    // Complete JSON but no end marker (EOS came first): accepted.
    let out = parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n");
    assert_eq!(out.tool_calls.len(), 1, "{:?}", out);
    // Cut off inside the arguments: an error.
    let out = parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": ");
    assert!(out.tool_calls.is_empty());
    assert_eq!(out.errors.len(), 1);
    // Cut off inside the header: an error.
    let out = parse("ok <tool_call>\n{\"na");
    assert_eq!(out.content, "ok");
    assert!(out.tool_calls.is_empty());
    assert_eq!(out.errors.len(), 1);
}

#[test]
fn partial_marker_at_the_end_is_content() {
    let out = parse("compare a <tool_ca");
    assert_eq!(out.content, "compare a <tool_ca");
}

#[test]
fn streaming_holds_back_a_possible_marker_and_streams_arguments() {
    let mut p = HermesFormat.stream_parser();
    let mut events = Vec::new();
    for piece in [
        "Hi <tool",
        "_call>\n{\"name\": \"f\", \"argu",
        "ments\": {\"q\": \"a",
        "b\"}",
        "}\n</tool_",
        "call>",
    ] {
        events.extend(p.feed(piece));
    }
    events.extend(p.finish());
    assert_eq!(
        events,
        vec![
            ToolStreamEvent::ContentDelta("Hi".into()),
            ToolStreamEvent::ToolCallStart {
                index: 0,
                name: "f".into()
            },
            ToolStreamEvent::ArgumentsDelta {
                index: 0,
                text: "{\"q\": \"a".into()
            },
            ToolStreamEvent::ArgumentsDelta {
                index: 0,
                text: "b\"".into()
            },
            ToolStreamEvent::ArgumentsDelta {
                index: 0,
                text: "}".into()
            },
            ToolStreamEvent::ToolCallEnd {
                index: 0,
                raw: "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"ab\"}}\n</tool_call>"
                    .into()
            },
        ]
    );
}

#[test]
fn render_call_produces_the_envelope_the_parser_accepts() {
    let envelope = HermesFormat.render_call("get_weather", r#"{"city": "Oslo"}"#);
    insta::assert_snapshot!("hermes_render_call", envelope);
    let out = parse(&envelope);
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "get_weather");
    assert_eq!(out.tool_calls[0].arguments, json!({"city": "Oslo"}));
    assert_eq!(out.tool_calls[0].raw, envelope);
}

#[test]
fn end_marker_inside_a_name_ends_the_envelope_however_chunked() {
    let text = "<tool_call>{\"name\": \"a</tool_call>b\", \"arguments\": {}}</tool_call>";
    let whole = normalize(stream(text, &[]));
    let cut = text.find("b\"").expect("cut point");
    assert_eq!(normalize(stream(text, &[cut])), whole);
    assert!(
        matches!(
            whole.first(),
            Some(ToolStreamEvent::Invalid { index: None, .. })
        ),
        "{whole:?}"
    );
}

#[test]
fn render_call_escapes_the_name_as_json() {
    let envelope = HermesFormat.render_call("we\"ird", "{}");
    assert!(envelope.contains(r#""name": "we\"ird""#), "{envelope}");
}

#[test]
fn detect_format_finds_hermes_by_its_marker() {
    let f = detect_format("... <tool_call>\n{\"name\": ...} ...").expect("hermes");
    assert_eq!(
        (f.name(), f.start_marker(), f.end_marker()),
        ("hermes", "<tool_call>", "</tool_call>")
    );
    assert!(detect_format("{{ messages }}").is_none());
}

/// Merges adjacent content and same-call argument deltas: chunking only splits them.
fn normalize(events: Vec<ToolStreamEvent>) -> Vec<ToolStreamEvent> {
    let mut out: Vec<ToolStreamEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolStreamEvent::ContentDelta(a)), ToolStreamEvent::ContentDelta(b)) => {
                a.push_str(&b)
            }
            (
                Some(ToolStreamEvent::ArgumentsDelta { index: i, text: a }),
                ToolStreamEvent::ArgumentsDelta { index: j, text: b },
            ) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn stream(text: &str, cuts: &[usize]) -> Vec<ToolStreamEvent> {
    let mut p = HermesFormat.stream_parser();
    let mut events = Vec::new();
    let mut boundaries: Vec<usize> = cuts
        .iter()
        .map(|c| c % (text.len() + 1))
        .filter(|c| text.is_char_boundary(*c))
        .collect();
    boundaries.sort_unstable();
    boundaries.dedup();
    let mut start = 0;
    for b in boundaries {
        events.extend(p.feed(&text[start..b]));
        start = b;
    }
    events.extend(p.feed(&text[start..]));
    events.extend(p.finish());
    events
}

const PIECES: &[&str] = &[
    "Sure",
    " ",
    "\n",
    "\n\n",
    "é🚀",
    "<",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "</tool",
    "{",
    "}",
    "}}",
    "\"name\": \"f\", ",
    "{\"name\": \"get_weather\", \"arguments\": ",
    "\"arguments\": ",
    "{\"city\": \"Oslo\"}",
    "{\"a\": [1, {\"b\": \"}\"}]}",
    "not json",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": \"y }\"}}\n</tool_call>",
    "<tool_call>{\"arguments\": {}, \"name\": \"g\"}</tool_call>",
    "{\"name\": \"",
    "\"",
    "\\",
    "\", ",
];

const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "{",
    "}",
    "\"name\"",
    "\"arguments\"",
    ":",
    ",",
    " ",
    "\n",
    "\"",
    "\\",
    "f",
    "1",
];

/// One slot of an envelope: usually `literal`, sometimes nothing or a fragment.
fn slot(literal: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        8 => Just(literal.to_string()),
        1 => Just(String::new()),
        1 => prop::sample::select(FRAGMENTS).prop_map(str::to_string),
    ]
}

fn fragments(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..max).prop_map(|v| v.concat())
}

fn near_envelope() -> impl Strategy<Value = String> {
    (
        fragments(3),
        prop::collection::vec(
            (
                slot("<tool_call>"),
                slot("\n{"),
                slot("\"name\""),
                slot(": \""),
                fragments(3),
                slot("\", "),
                slot("\"arguments\""),
                slot(": "),
            ),
            1..2,
        ),
        fragments(6),
        (slot("}"), slot("\n"), slot("</tool_call>"), fragments(2)),
    )
        .prop_map(|(pre, heads, args, (close, nl, end, post))| {
            let (a, b, c, d, name, e, f, g) = &heads[0];
            format!("{pre}{a}{b}{c}{d}{name}{e}{f}{g}{{{args}}}{close}{nl}{end}{post}")
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    /// Any chunking of the text gives the same events as feeding it whole.
    #[test]
    fn any_chunking_gives_the_same_events_as_the_whole_text(
        pieces in prop::collection::vec(prop::sample::select(PIECES), 0..14),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let text: String = pieces.concat();
        let whole = normalize(stream(&text, &[]));
        let chunked = normalize(stream(&text, &cuts));
        prop_assert_eq!(&chunked, &whole, "text {:?}", text);
        // One-byte-at-a-time (per char) feeding as the extreme chunking.
        let all_cuts: Vec<usize> = (0..=text.len()).collect();
        prop_assert_eq!(normalize(stream(&text, &all_cuts)), whole);
    }

    /// The same, over token-like pieces of the envelope grammar (markers inside names,
    /// escapes, truncated headers).
    #[test]
    fn any_chunking_of_envelope_fragments_gives_the_same_events(
        pieces in prop::collection::vec(prop::sample::select(FRAGMENTS), 0..28),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let text: String = pieces.concat();
        let whole = normalize(stream(&text, &[]));
        prop_assert_eq!(normalize(stream(&text, &cuts)), whole.clone(), "text {:?}", text);
        let all_cuts: Vec<usize> = (0..=text.len()).collect();
        prop_assert_eq!(normalize(stream(&text, &all_cuts)), whole, "text {:?}", text);
    }

    /// The same, over mostly well-formed envelopes whose every slot may be dropped or
    /// replaced by a fragment, with names and arguments built from fragments.
    #[test]
    fn any_chunking_of_near_envelopes_gives_the_same_events(
        envelopes in prop::collection::vec(near_envelope(), 1..4),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
    ) {
        let text: String = envelopes.concat();
        let whole = normalize(stream(&text, &[]));
        prop_assert_eq!(normalize(stream(&text, &cuts)), whole.clone(), "text {:?}", text);
        let all_cuts: Vec<usize> = (0..=text.len()).collect();
        prop_assert_eq!(normalize(stream(&text, &all_cuts)), whole, "text {:?}", text);
    }

    /// Parsing never panics and content never contains a complete marker.
    #[test]
    fn content_never_contains_a_marker(text in "(Hi|<tool_call>|</tool_call>|\\{|\\}|\"name\": \"f\"|, \"arguments\": |\\{\"a\": 1\\}| |\n){0,16}") {
        let out = HermesFormat.parse(&text);
        prop_assert!(!out.content.contains("<tool_call>"), "{:?}", out);
        for call in &out.tool_calls {
            prop_assert!(call.arguments.is_object());
        }
    }

    /// A rendered call parses back to the same name and arguments.
    #[test]
    fn rendered_calls_round_trip(name in "[a-zA-Z_][a-zA-Z0-9_.\\-\"]{0,12}", key in "[a-z\"\\\\ ]{0,6}", val in any::<i64>()) {
        let args = json!({ key: val });
        let envelope = HermesFormat.render_call(&name, &lockstep_chat::python_json(&args));
        let out = HermesFormat.parse(&envelope);
        prop_assert_eq!(out.tool_calls.len(), 1);
        prop_assert_eq!(&out.tool_calls[0].name, &name);
        prop_assert_eq!(&out.tool_calls[0].arguments, &args);
    }
}
