//! JSON Schema constraints on the Qwen vocabulary: valid instances are accepted token by
//! token and end accepting, invalid ones are rejected, and random walks through the mask
//! produce instances that an independent validator (the `jsonschema` crate, formats on)
//! accepts.

use lockstep_grammar::{Constraint, JsonWhitespace};
use serde_json::{Value, json};

use crate::common::*;

struct Case {
    name: &'static str,
    schema: Value,
    valid: Vec<Value>,
    invalid: Vec<&'static str>,
}

fn case(name: &'static str, schema: Value, valid: Vec<Value>, invalid: Vec<&'static str>) -> Case {
    Case {
        name,
        schema,
        valid,
        invalid,
    }
}

fn cases() -> Vec<Case> {
    let person = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    vec![
        case(
            "flat object with required fields",
            json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name", "age"], "additionalProperties": false}),
            vec![json!({"name": "Alice", "age": 30})],
            vec![
                r#"{"name":"Alice"}"#,
                r#"{"name":"Alice","age":"30"}"#,
                r#"{"name":"A","age":1,"x":2}"#,
            ],
        ),
        case(
            "nested objects",
            json!({"type": "object", "properties": {"user": {"type": "object", "properties": {
                "id": {"type": "integer"}, "profile": {"type": "object", "properties": {
                    "city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}},
                "required": ["id", "profile"], "additionalProperties": false}},
                "required": ["user"], "additionalProperties": false}),
            vec![json!({"user": {"id": 7, "profile": {"city": "Oslo"}}})],
            vec![
                r#"{"user":{"id":7,"profile":{}}}"#,
                r#"{"user":{"id":7.5,"profile":{"city":"x"}}}"#,
            ],
        ),
        case(
            "array with min and max items",
            json!({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}),
            vec![json!([1, 2]), json!([-4, 5, 6])],
            vec!["[1]", "[1,2,3,4]", "[]"],
        ),
        case(
            "string enum",
            json!({"enum": ["red", "green", "blue"]}),
            vec![json!("green")],
            vec![r#""yellow""#, r#""gree""#],
        ),
        case(
            "mixed enum",
            json!({"enum": [1, "one", null, true, {"k": [1]}]}),
            vec![json!(1), json!("one"), json!(null), json!({"k": [1]})],
            vec!["2", "false", r#"{"k":[2]}"#],
        ),
        case(
            "const object",
            json!({"const": {"a": 1, "b": [true, null]}}),
            vec![json!({"a": 1, "b": [true, null]})],
            vec![r#"{"a":2,"b":[true,null]}"#, r#"{"a":1}"#],
        ),
        case(
            "integer bounds",
            json!({"type": "integer", "minimum": 10, "maximum": 20}),
            vec![json!(10), json!(15), json!(20)],
            vec!["9", "21", "150", "-15", "1.5"],
        ),
        case(
            "number with exclusive bounds",
            json!({"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}),
            vec![json!(0.25), json!(1.5), json!(1)],
            vec!["0", "-0.5", "1.51", "2"],
        ),
        case(
            "integer multipleOf",
            json!({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
            vec![json!(35), json!(0), json!(100)],
            vec!["36", "105"],
        ),
        case(
            "unbounded number",
            json!({"type": "number"}),
            vec![json!(-1500.25), json!(0), json!(3e-7)],
            vec!["01", "1.", "+1", "\"1\""],
        ),
        case(
            "string length",
            json!({"type": "string", "minLength": 2, "maxLength": 5}),
            vec![json!("abc"), json!("ab"), json!("héllo")],
            vec![r#""a""#, r#""abcdef""#],
        ),
        case(
            "string pattern",
            json!({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
            vec![json!("ABC-12")],
            vec![r#""AB-12""#, r#""ABC-123""#, r#""abc-12""#],
        ),
        case(
            "format date",
            json!({"type": "string", "format": "date"}),
            vec![json!("2024-02-29"), json!("1999-12-31")],
            vec![r#""2024-13-01""#, r#""2024-04-31""#, r#""24-01-01""#],
        ),
        case(
            "format date-time",
            json!({"type": "string", "format": "date-time"}),
            vec![
                json!("2024-05-06T07:08:09Z"),
                json!("2024-05-06T07:08:09.5+02:00"),
            ],
            vec![r#""2024-05-06 07:08:09""#, r#""2024-05-06T25:00:00Z""#],
        ),
        case(
            "format time",
            json!({"type": "string", "format": "time"}),
            vec![json!("12:34:56Z")],
            vec![r#""12:34""#, r#""24:00:00Z""#],
        ),
        case(
            "format email",
            json!({"type": "string", "format": "email"}),
            vec![json!("a.b@example.com")],
            vec![r#""no-at-sign""#, r#""a@""#],
        ),
        case(
            "format hostname",
            json!({"type": "string", "format": "hostname"}),
            vec![json!("mail.example.co.uk"), json!("a-b.c")],
            vec![r#""-a.com""#, r#""a..b""#, r#""a_b.com""#],
        ),
        case(
            "format ipv4",
            json!({"type": "string", "format": "ipv4"}),
            vec![json!("192.168.0.1")],
            vec![r#""256.1.1.1""#, r#""1.2.3""#],
        ),
        case(
            "format uuid",
            json!({"type": "string", "format": "uuid"}),
            vec![json!("123e4567-e89b-12d3-a456-426614174000")],
            vec![
                r#""123e4567-e89b-12d3-a456""#,
                r#""zzze4567-e89b-12d3-a456-426614174000""#,
            ],
        ),
        case(
            "$defs and $ref",
            json!({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                   "required": ["x", "y"], "additionalProperties": false}},
                   "type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4}),
            vec![json!([{"x": 1, "y": 2}]), json!([])],
            vec![r#"[{"x":1}]"#, r#"[{"x":1,"y":"2"}]"#],
        ),
        case(
            "definitions (draft 7 style) and $ref",
            json!({"definitions": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
                   "type": "object", "properties": {"a": {"$ref": "#/definitions/id"}, "b": {"$ref": "#/definitions/id"}},
                   "required": ["a"], "additionalProperties": false}),
            vec![json!({"a": "beef"}), json!({"a": "0000", "b": "ffff"})],
            vec![r#"{"a":"BEEF"}"#, r#"{"b":"beef"}"#],
        ),
        case(
            "anyOf",
            json!({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}),
            vec![json!(5), json!("ab")],
            vec!["true", r#""abcd""#],
        ),
        case(
            "oneOf with discriminator",
            json!({"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind", "x"], "additionalProperties": false},
                {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}}, "required": ["kind", "y"], "additionalProperties": false}]}),
            vec![json!({"kind": "a", "x": 1}), json!({"kind": "b", "y": "q"})],
            vec![r#"{"kind":"a","y":"q"}"#, r#"{"kind":"c","x":1}"#],
        ),
        case(
            "allOf",
            json!({"allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}),
            vec![json!({"a": 1, "b": "x"})],
            vec![r#"{"a":1}"#, r#"{"a":1,"b":2}"#],
        ),
        case(
            "recursive tree",
            json!({"$defs": {"node": {"type": "object", "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                "required": ["value"], "additionalProperties": false}},
                "$ref": "#/$defs/node"}),
            vec![
                json!({"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4}]}]}),
            ],
            vec![r#"{"value":"x"}"#, r#"{"value":1,"children":[{}]}"#],
        ),
        case(
            "additionalProperties schema",
            json!({"type": "object", "additionalProperties": {"type": "integer"}}),
            vec![json!({"a": 1, "b": 2}), json!({})],
            vec![r#"{"a":"x"}"#],
        ),
        case(
            "boolean and null",
            json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
                   "required": ["ok", "n"], "additionalProperties": false}),
            vec![json!({"ok": true, "n": null})],
            vec![r#"{"ok":1,"n":null}"#, r#"{"ok":true,"n":0}"#],
        ),
        case(
            "type list",
            json!({"type": ["string", "null"], "maxLength": 4}),
            vec![json!(null), json!("abcd")],
            vec!["1", r#""abcde""#],
        ),
        case(
            "tuple with prefixItems",
            json!({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": false}),
            vec![json!(["a", 1])],
            vec![r#"["a","b"]"#, r#"["a",1,2]"#],
        ),
        case(
            "min and max properties",
            json!({"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1, "maxProperties": 2}),
            vec![json!({"a": true}), json!({"a": true, "b": false})],
            vec!["{}", r#"{"a":true,"b":true,"c":true}"#],
        ),
        case(
            "patternProperties",
            json!({"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}}, "additionalProperties": false}),
            vec![json!({"x-ab": 1})],
            vec![r#"{"y":1}"#, r#"{"x-ab":"1"}"#],
        ),
        case(
            "nested arrays",
            json!({"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 3}),
            vec![json!([[1], [2, 3]]), json!([[]])],
            vec!["[[1,2,3]]", "[[1],[2],[3],[4]]"],
        ),
        case(
            "enum with characters that need escaping",
            json!({"enum": ["a\"b", "c\\d", "line\nbreak"]}),
            vec![json!("a\"b"), json!("line\nbreak")],
            vec![r#""ab""#, r#""c\d""#],
        ),
        case(
            "optional properties",
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "additionalProperties": false}),
            vec![json!({"b": 2}), json!({}), json!({"a": 1, "b": 2})],
            vec![r#"{"c":1}"#],
        ),
        case(
            "const string",
            json!({"const": "fixed-value"}),
            vec![json!("fixed-value")],
            vec![r#""fixed""#],
        ),
        case(
            "any JSON (true schema)",
            json!({}),
            vec![json!([1, {"a": null}]), json!("s"), json!(2.5)],
            vec![r#"{"a":}"#, "[1,]"],
        ),
        case(
            "realistic nested record",
            json!({"type": "object", "properties": {
                "id": {"type": "string", "format": "uuid"},
                "created": {"type": "string", "format": "date-time"},
                "owner": person.clone(),
                "members": {"type": "array", "items": person, "minItems": 1, "maxItems": 2},
                "status": {"enum": ["open", "closed"]},
                "score": {"type": "number", "minimum": 0, "maximum": 10}},
                "required": ["id", "owner", "members", "status"], "additionalProperties": false}),
            vec![
                json!({"id": "123e4567-e89b-12d3-a456-426614174000", "created": "2024-01-02T03:04:05Z",
                        "owner": {"name": "Ann", "age": 40, "email": "ann@x.org", "tags": ["a", "b"]},
                        "members": [{"name": "Bob", "age": 3}], "status": "open", "score": 9.5}),
            ],
            vec![
                r#"{"id":"123e4567-e89b-12d3-a456-426614174000","owner":{"name":"Ann","age":40},"members":[],"status":"open"}"#,
            ],
        ),
    ]
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .expect("schema accepted by the jsonschema crate")
}

#[test]
fn at_least_thirty_schemas_are_covered() {
    assert!(cases().len() >= 30, "{}", cases().len());
}

#[test]
fn valid_instances_are_accepted_token_by_token_and_end_accepting() {
    let m = qwen();
    for c in cases() {
        let v = validator(&c.schema);
        for ws in [JsonWhitespace::Compact, JsonWhitespace::default()] {
            let compiled = compile(
                m,
                &Constraint::json_schema(c.schema.clone()).with_json_whitespace(ws),
            );
            for inst in &c.valid {
                assert!(v.is_valid(inst), "{}: fixture {inst} is invalid", c.name);
                let text = serde_json::to_string(inst).expect("serialize");
                let mut matcher = compiled.matcher();
                let rejected = feed_text(m, &mut matcher, &text);
                assert_eq!(rejected, None, "{} ({ws:?}): {text} rejected", c.name);
                assert!(
                    eos_allowed(m, &mut matcher),
                    "{}: EOS not allowed after {text}",
                    c.name
                );
                let eos = m.env.eos_ids()[0];
                matcher.consume(eos).expect("EOS consumed");
                assert!(matcher.is_finished());
            }
        }
    }
}

#[test]
fn pretty_printed_instances_are_accepted_with_bounded_whitespace() {
    let m = qwen();
    for c in cases() {
        let compiled = compile(m, &Constraint::json_schema(c.schema.clone()));
        for inst in &c.valid {
            let text = serde_json::to_string_pretty(inst).expect("serialize");
            if text.contains("\"\n") || c.name.contains("escaping") {
                continue;
            }
            let mut matcher = compiled.matcher();
            assert_eq!(
                feed_text(m, &mut matcher, &text),
                None,
                "{}: {text}",
                c.name
            );
            assert!(eos_allowed(m, &mut matcher), "{}: {text}", c.name);
        }
    }
}

#[test]
fn invalid_instances_are_rejected() {
    let m = qwen();
    for c in cases() {
        let v = validator(&c.schema);
        let compiled = compile(m, &Constraint::json_schema(c.schema.clone()));
        for text in &c.invalid {
            if let Ok(inst) = serde_json::from_str::<Value>(text) {
                assert!(!v.is_valid(&inst), "{}: fixture {text} is valid", c.name);
            }
            let mut matcher = compiled.matcher();
            let rejected =
                feed_text(m, &mut matcher, text).is_some() || !eos_allowed(m, &mut matcher);
            assert!(rejected, "{}: invalid {text} was accepted", c.name);
        }
    }
}

#[test]
fn json_whitespace_is_bounded() {
    let m = qwen();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let compact = compile(
        m,
        &Constraint::json_schema(schema.clone()).with_json_whitespace(JsonWhitespace::Compact),
    );
    let mut matcher = compact.matcher();
    assert!(
        feed_text(m, &mut matcher, "{ ").is_some(),
        "compact JSON allowed a space"
    );
    let bounded = compile(m, &Constraint::json_schema(schema));
    let mut matcher = bounded.matcher();
    assert_eq!(
        feed_text(m, &mut matcher, &format!("{{\n{}\"a\": 1", " ".repeat(15))),
        None
    );
    let mut matcher = bounded.matcher();
    assert!(
        feed_text(m, &mut matcher, &format!("{{{}", "\n".repeat(17))).is_some(),
        "17 newlines in a row were allowed"
    );
    let mut matcher = bounded.matcher();
    assert!(
        feed_text(m, &mut matcher, " {").is_some(),
        "leading whitespace allowed"
    );
}

#[test]
fn json_object_accepts_objects_only() {
    let m = qwen();
    let compiled = compile(m, &Constraint::json_object());
    let mut matcher = compiled.matcher();
    assert_eq!(
        feed_text(m, &mut matcher, r#"{"x":[1,2],"y":{"z":null}}"#),
        None
    );
    assert!(eos_allowed(m, &mut matcher));
    let mut matcher = compiled.matcher();
    assert!(feed_text(m, &mut matcher, "[1]").is_some());
}

#[test]
fn random_walks_produce_instances_the_independent_validator_accepts() {
    let m = qwen();
    let mut rng = Rng::new(0x5eed);
    let mut finished_total = 0;
    for (i, c) in cases().into_iter().enumerate() {
        let v = validator(&c.schema);
        let ws = if i % 2 == 0 {
            JsonWhitespace::Compact
        } else {
            JsonWhitespace::default()
        };
        let compiled = compile(
            m,
            &Constraint::json_schema(c.schema.clone()).with_json_whitespace(ws),
        );
        let mut finished = 0;
        for _ in 0..6 {
            let mut matcher = compiled.matcher();
            let walk = random_walk(m, &mut matcher, &mut rng, 160);
            if !walk.finished {
                continue;
            }
            finished += 1;
            let text = String::from_utf8(walk.bytes)
                .unwrap_or_else(|e| panic!("{}: not UTF-8: {e}", c.name));
            let inst: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: walk produced unparsable {text:?}: {e}", c.name));
            if let Err(e) = v.validate(&inst) {
                panic!("{}: walk produced invalid instance {text}: {e}", c.name);
            }
        }
        eprintln!("{}: {finished}/6 walks finished", c.name);
        finished_total += finished;
    }
    assert!(finished_total >= 60, "only {finished_total} walks finished");
}

#[test]
fn format_random_walks_agree_with_the_validators_format_checks() {
    let m = qwen();
    let mut rng = Rng::new(0xf0f0);
    for format in [
        "date",
        "time",
        "date-time",
        "email",
        "hostname",
        "ipv4",
        "uuid",
    ] {
        let schema = json!({"type": "array", "items": {"type": "string", "format": format}, "minItems": 4, "maxItems": 4});
        let v = validator(&schema);
        let compiled = compile(
            m,
            &Constraint::json_schema(schema).with_json_whitespace(JsonWhitespace::Compact),
        );
        let mut finished = 0;
        for _ in 0..8 {
            let mut matcher = compiled.matcher();
            let walk = random_walk(m, &mut matcher, &mut rng, 200);
            if !walk.finished {
                continue;
            }
            finished += 1;
            let text = String::from_utf8(walk.bytes).expect("utf-8");
            let inst: Value = serde_json::from_str(&text).expect("json");
            if let Err(e) = v.validate(&inst) {
                panic!("format {format}: walk produced {text}: {e}");
            }
        }
        assert!(
            finished >= 4,
            "format {format}: only {finished} walks finished"
        );
    }
}
