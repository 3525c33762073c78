//! The `lockstep` binary's structured-output flags on SmolLM2-135M: `run` with each flag
//! gives an output that an independent checker accepts (the `jsonschema` crate, the `regex`
//! crate, a hand-written path parser) and ends with "stop"; bad constraints fail before
//! generation with a message naming the flag; `check` with a constraint is reproducible. The
//! engine-level cases (every schema, regex and Lark grammar on two models, batched) are the
//! engine's tests (`crates/engine/tests/engine/constrained.rs`).

use std::process::{Command, Output};

use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// An independent check of an output's text.
type Checker = fn(&str) -> Result<(), String>;

const SMOLLM: &str = "smollm2-135m";

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .expect("the jsonschema crate accepts the schema")
}

/// A path grammar: an optional root, then segments separated by `/`.
const PATH_GRAMMAR: &str = r#"
start: ROOT? segment ("/" segment){0,6}
ROOT: "/" | "./"
segment: SEGMENT
SEGMENT: /[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}/
"#;

/// An independent reading of [`PATH_GRAMMAR`].
fn check_path(text: &str) -> Result<(), String> {
    let rest = text
        .strip_prefix("./")
        .or_else(|| text.strip_prefix('/'))
        .unwrap_or(text);
    let segments: Vec<&str> = rest.split('/').collect();
    if segments.len() > 7 {
        return Err(format!("{} segments", segments.len()));
    }
    for s in segments {
        let mut chars = s.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        if !first_ok || !rest_ok || s.len() > 32 {
            return Err(format!("bad segment {s:?}"));
        }
    }
    Ok(())
}

fn lockstep(args: &[&str]) -> Result<Output, Box<dyn std::error::Error>> {
    hub::ensure_model(SMOLLM)?;
    Ok(Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .env("LOCKSTEP_HOME", hub::cache_root()?)
        .env_remove("RUST_LOG")
        .output()?)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `lockstep run` with each structured-output flag: the output satisfies the constraint
/// (checked independently) and ends with "stop".
#[test]
fn run_flags_constrain_the_output() -> TestResult {
    let dir = tempfile::tempdir()?;
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "born": {"type": "string", "format": "date"}},
      "required": ["name", "age", "born"], "additionalProperties": false});
    let schema_file = dir.path().join("person.json");
    std::fs::write(&schema_file, schema.to_string())?;
    let lark_file = dir.path().join("path.lark");
    std::fs::write(&lark_file, PATH_GRAMMAR)?;
    let schema_path = schema_file.to_string_lossy().into_owned();
    let inline = schema.to_string();
    let lark_path = lark_file.to_string_lossy().into_owned();
    let base = ["run", "-m", SMOLLM, "--chat", "-o", "json", "-n", "200"];
    let cases: Vec<(Vec<&str>, Checker)> = vec![
        (
            vec![
                "-p",
                "Describe Ada Lovelace.",
                "--json-schema",
                &schema_path,
            ],
            |t| {
                let v: Value = serde_json::from_str(t).map_err(|e| e.to_string())?;
                let schema: Value = json!({"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "born": {"type": "string", "format": "date"}},
                  "required": ["name", "age", "born"], "additionalProperties": false});
                let errors: Vec<String> = validator(&schema)
                    .iter_errors(&v)
                    .map(|e| e.to_string())
                    .collect();
                if errors.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{errors:?}"))
                }
            },
        ),
        (
            vec![
                "-p",
                "Describe Alan Turing.",
                "--json-schema",
                &inline,
                "--temp",
                "0.8",
                "-s",
                "7",
            ],
            |t| {
                let v: Value = serde_json::from_str(t).map_err(|e| e.to_string())?;
                v.get("born")
                    .and_then(Value::as_str)
                    .map(|_| ())
                    .ok_or("no born".into())
            },
        ),
        (vec!["-p", "Describe a cat.", "--json"], |t| {
            let v: Value = serde_json::from_str(t).map_err(|e| e.to_string())?;
            v.is_object().then_some(()).ok_or("not an object".into())
        }),
        (
            vec![
                "-p",
                "What year did World War II end?",
                "--regex",
                "[0-9]{4}",
            ],
            |t| {
                let ok = regex::Regex::new("^[0-9]{4}$")
                    .map_err(|e| e.to_string())?
                    .is_match(t);
                ok.then_some(()).ok_or(format!("{t:?}"))
            },
        ),
        (
            vec![
                "-p",
                "Where is the shell's config?",
                "--grammar",
                &lark_path,
            ],
            check_path,
        ),
        (
            vec![
                "-p",
                "Is the sky blue?",
                "--choice",
                "yes,no",
                "--choice",
                "maybe",
            ],
            |t| {
                ["yes", "no", "maybe"]
                    .contains(&t)
                    .then_some(())
                    .ok_or(format!("{t:?}"))
            },
        ),
    ];
    for (extra, check) in cases {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let out = lockstep(&args)?;
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report: Value = serde_json::from_str(stdout.lines().last().ok_or("no stdout")?)?;
        let text = report["text"].as_str().ok_or("no text")?;
        assert_eq!(report["finish_reason"], "stop", "{args:?}: {text:?}");
        assert!(report["grammar_compile_ms"].as_f64().is_some(), "{report}");
        if let Err(e) = check(text) {
            panic!("{args:?}: {e}: {text:?}");
        }
    }
    Ok(())
}

/// Bad constraints fail before any token is generated: nonzero exit, nothing on stdout,
/// and a message naming the flag and the problem.
#[test]
fn bad_constraints_fail_before_generation_with_a_clear_message() -> TestResult {
    let dir = tempfile::tempdir()?;
    let bad_lark = dir.path().join("bad.lark");
    std::fs::write(&bad_lark, "start: foo\nfoo: \"a\" |\n  bar\n")?;
    let bad_lark = bad_lark.to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["--json-schema", r#"{"type": "array", "uniqueItems": true}"#],
            &["--json-schema", "uniqueItems"],
        ),
        (
            vec!["--json-schema", r#"{"type": "strng"}"#],
            &["--json-schema", "invalid JSON Schema"],
        ),
        (
            vec!["--json-schema", r#"{"type": "#],
            &["--json-schema", "not valid JSON"],
        ),
        (
            vec!["--json-schema", "/nonexistent/person.json"],
            &["--json-schema", "/nonexistent/person.json"],
        ),
        (vec!["--regex", "(a"], &["--regex", "invalid regex"]),
        (vec!["--regex", "[a&&b]"], &["--regex", "matches nothing"]),
        (
            vec!["--grammar", &bad_lark],
            &["--grammar", "invalid Lark grammar"],
        ),
        (vec!["--choice", ","], &["--choice", "empty"]),
        (vec!["--json", "--regex", "a"], &["cannot be used with"]),
    ];
    for (extra, expected) in cases {
        for cmd in ["run", "check"] {
            let mut args = vec![cmd, "-m", SMOLLM, "-p", "Hello", "-n", "8"];
            args.extend(&extra);
            let out = lockstep(&args)?;
            let err = stderr(&out);
            assert!(!out.status.success(), "{args:?} succeeded");
            assert!(
                out.stdout.is_empty(),
                "{args:?} printed {:?}",
                String::from_utf8_lossy(&out.stdout)
            );
            for e in expected {
                assert!(err.contains(e), "{args:?}: {e:?} not in {err:?}");
            }
            assert!(!err.contains("panicked"), "{args:?}: {err}");
        }
    }
    Ok(())
}

/// `lockstep check` takes the same flags: the constrained run's digests are stable.
#[test]
fn check_with_a_constraint_is_reproducible() -> TestResult {
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["name", "legs"], "additionalProperties": false}"#;
    let args = [
        "check",
        "-m",
        SMOLLM,
        "--chat",
        "-p",
        "Describe a dog.",
        "--json-schema",
        schema,
        "--temp",
        "0.8",
        "-s",
        "3",
        "-n",
        "64",
    ];
    let a = lockstep(&args)?;
    let b = lockstep(&args)?;
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout);
    let lines = String::from_utf8_lossy(&a.stdout).lines().count();
    // `{"name":"…","legs":N}` takes more than five tokens, plus the digest line.
    assert!(lines > 6, "{lines} lines");
    Ok(())
}
