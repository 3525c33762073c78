//! Bad constraints fail at compile time with a typed, clear error; hostile grammars fail
//! (or finish) within seconds instead of hanging.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use lockstep_grammar::{Constraint, GrammarError, GrammarLimits};
use serde_json::json;

use crate::common::*;

fn compile_err(c: Constraint) -> GrammarError {
    match c.compile(&smollm().env, &GrammarLimits::default()) {
        Ok(_) => panic!("{c:?} compiled"),
        Err(e) => e,
    }
}

#[test]
fn unsupported_or_unknown_schema_keywords_are_named_with_their_location() {
    let cases = [
        (
            json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true}),
            "uniqueItems",
            "#",
        ),
        (
            json!({"type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}),
            "maxLenght",
            "#/properties/a",
        ),
        (json!({"not": {"type": "string"}}), "not", "#"),
        (
            json!({"if": {"type": "string"}, "then": {"minLength": 1}}),
            "if",
            "#",
        ),
        (
            json!({"type": "object", "dependentRequired": {"a": ["b"]}}),
            "dependentRequired",
            "#",
        ),
        (
            json!({"type": "array", "contains": {"const": 1}}),
            "contains",
            "#",
        ),
        (
            json!({"type": "object", "propertyNames": {"maxLength": 3}}),
            "propertyNames",
            "#",
        ),
        (
            json!({"type": "object", "unevaluatedProperties": false}),
            "unevaluatedProperties",
            "#",
        ),
        (
            json!({"type": ["string", "null"], "nullable": true}),
            "nullable",
            "#",
        ),
        (
            json!({"$defs": {"a": {"type": "string", "contentSchema": {}}}, "$ref": "#/$defs/a"}),
            "contentSchema",
            "#/$defs/a",
        ),
        (
            json!({"anyOf": [{"type": "string"}, {"type": "integer", "exclusiveMax": 3}]}),
            "exclusiveMax",
            "#/anyOf/1",
        ),
        (
            json!({"type": "object", "x-guidance": {"whitespace_flexible": true}}),
            "x-guidance",
            "#",
        ),
    ];
    for (schema, keyword, path) in cases {
        let e = compile_err(Constraint::json_schema(schema.clone()));
        match &e {
            GrammarError::UnsupportedSchemaKeyword {
                keyword: k,
                path: p,
            } => {
                assert_eq!((k.as_str(), p.as_str()), (keyword, path), "{schema}");
            }
            other => panic!("{schema}: expected unsupported keyword, got {other:?}"),
        }
        assert!(e.to_string().contains(keyword), "{e}");
    }
}

#[test]
fn annotations_and_extension_keywords_are_accepted() {
    let schema = json!({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t",
        "description": "d", "x-vendor": 1, "type": "object", "examples": [{}],
        "properties": {"a": {"type": "string", "default": "x", "deprecated": true, "$comment": "c"}}});
    Constraint::json_schema(schema)
        .compile(&smollm().env, &GrammarLimits::default())
        .expect("annotations only");
}

#[test]
fn invalid_schemas_are_errors() {
    for schema in [
        json!({"type": "strin"}),
        json!({"$ref": "#/$defs/missing"}),
        json!({"type": "string", "format": "color"}),
        json!({"type": "integer", "minimum": "three"}),
        json!(42),
    ] {
        let e = compile_err(Constraint::json_schema(schema.clone()));
        assert!(
            matches!(e, GrammarError::InvalidSchema(_)),
            "{schema}: {e:?}"
        );
    }
    let e = compile_err(Constraint::json_schema(
        json!({"type": "string", "format": "color"}),
    ));
    assert!(e.to_string().contains("color"), "{e}");
}

#[test]
fn empty_languages_are_errors_at_compile_time() {
    for c in [
        Constraint::regex("[a&&b]"),
        Constraint::json_schema(json!(false)),
        Constraint::json_schema(json!({"type": "string", "minLength": 5, "maxLength": 2})),
        Constraint::json_schema(json!({"allOf": [{"type": "string"}, {"type": "integer"}]})),
        Constraint::json_schema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
        Constraint::lark("start: X\nX: /a/ & /b/\n"),
    ] {
        let e = compile_err(c.clone());
        assert!(matches!(e, GrammarError::EmptyLanguage(_)), "{c:?}: {e:?}");
    }
}

#[test]
fn malformed_regex_lark_and_choices_are_errors() {
    for rx in ["(abc", "a{2,1}", "[z-a]", "\\"] {
        let e = compile_err(Constraint::regex(rx));
        assert!(matches!(e, GrammarError::InvalidRegex(_)), "{rx}: {e:?}");
    }
    for lark in [
        "start: (",
        "start: undefined_rule",
        "start: \"a",
        "%llguidance {\"no_forcing\": true}\nstart: \"a\"",
        "%llguidance {\"allow_invalid_utf8\": true}\nstart: \"a\"",
        "",
    ] {
        let e = compile_err(Constraint::lark(lark));
        assert!(matches!(e, GrammarError::InvalidLark(_)), "{lark:?}: {e:?}");
    }
    let e = compile_err(Constraint::choice(Vec::<String>::new()));
    assert!(matches!(e, GrammarError::InvalidChoice(_)), "{e:?}");
}

/// Compiles on another thread and returns the outcome, failing the test if it takes longer
/// than `limit`.
fn compile_within(c: Constraint, limit: Duration) -> (Result<(), GrammarError>, Duration) {
    let (tx, rx) = mpsc::channel();
    let env = smollm().env.clone();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c.compile(&env, &GrammarLimits::default()).map(|compiled| {
            // Also drive a few steps: a mask may be where the cost hides.
            let mut m = compiled.matcher();
            let mut mask = sampling::TokenMask::new(env.n_logits());
            for _ in 0..4 {
                if m.compute_mask(&mut mask).is_err() {
                    break;
                }
                let Some(t) = mask.iter().find(|&t| !env.is_eos(t)) else {
                    break;
                };
                if m.consume(t).is_err() {
                    break;
                }
            }
        });
        let _ = tx.send((r, t0.elapsed()));
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("compilation did not finish within {limit:?}"))
}

#[test]
fn hostile_grammars_finish_quickly_and_limit_errors_are_clear() {
    let limit = Duration::from_secs(5);
    let deep = (0..300).fold(
        json!({"type": "integer"}),
        |acc, _| json!({"type": "object", "properties": {"a": acc}, "required": ["a"]}),
    );
    let hostile: Vec<(&str, Constraint, bool)> = vec![
        ("huge repetition", Constraint::regex("a{1000000}"), true),
        (
            "nested huge repetition",
            Constraint::regex("(a{1000}){1000}b"),
            true,
        ),
        (
            "exponential alternation",
            Constraint::regex("(a|aa|aaa)*(b|bb)*(x+x+)+y"),
            false,
        ),
        ("nested stars", Constraint::regex("((((a*)*)*)*)*b"), false),
        ("long any-run", Constraint::regex("[\\s\\S]{20000}"), false),
        (
            "counted classes",
            Constraint::regex("(.{0,100}x.{0,100}){50}"),
            false,
        ),
        (
            "huge Lark terminal",
            Constraint::lark("start: /a{1000000}/ \"b\"\n"),
            true,
        ),
        (
            "left recursion",
            Constraint::lark("start: start \"a\" | \"a\"\n"),
            false,
        ),
        (
            "ambiguous",
            Constraint::lark("start: s\ns: s s | s s s | \"a\" | \n"),
            false,
        ),
        ("deep schema", Constraint::json_schema(deep), false),
        (
            "huge pattern",
            Constraint::json_schema(json!({"type": "string", "pattern": "^(ab){100000}$"})),
            true,
        ),
    ];
    for (what, c, must_fail) in hostile {
        let (r, took) = compile_within(c, limit);
        eprintln!("{what}: {took:?} -> {r:?}");
        if let Err(e) = &r {
            assert!(
                matches!(
                    e,
                    GrammarError::TooComplex(_)
                        | GrammarError::InvalidRegex(_)
                        | GrammarError::InvalidLark(_)
                        | GrammarError::InvalidSchema(_)
                        | GrammarError::EmptyLanguage(_)
                ),
                "{what}: unexpected error kind {e:?}"
            );
            assert!(!e.to_string().is_empty());
        }
        if must_fail {
            assert!(
                matches!(r, Err(GrammarError::TooComplex(_))),
                "{what}: {r:?}"
            );
        }
    }
}

#[test]
fn tight_limits_turn_expensive_grammars_into_too_complex_errors() {
    let limits = GrammarLimits {
        initial_lexer_fuel: 2_000,
        max_grammar_size: 2_000,
        ..GrammarLimits::default()
    };
    let big_enum: Vec<String> = (0..2000).map(|i| format!("value-{i}")).collect();
    let schema = json!({"type": "object", "properties": {"a": {"enum": big_enum}, "b": {"type": "string", "pattern": "^[a-z]{10,40}(-[0-9]{3}){2,5}$"}}});
    let e = Constraint::json_schema(schema)
        .compile(&smollm().env, &limits)
        .expect_err("over the limits");
    assert!(matches!(e, GrammarError::TooComplex(_)), "{e:?}");
}
