//! Strict keyword check for JSON Schemas.
//!
//! llguidance refuses keywords that its schema draft knows but it does not implement
//! (`uniqueItems`, `not`, `if`…), yet it silently ignores keywords outside the draft — a
//! typo such as `maxLenght` or an OpenAPI-only `nullable` would vanish and the output could
//! break what the user meant. This walk visits every subschema and refuses any keyword that
//! is neither enforced nor a pure annotation, naming it and its location.

use serde_json::Value;

use crate::error::GrammarError;

/// Keywords llguidance enforces.
const ENFORCED: &[&str] = &[
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "const",
    "enum",
    "type",
    "items",
    "additionalItems",
    "prefixItems",
    "minItems",
    "maxItems",
    "properties",
    "additionalProperties",
    "patternProperties",
    "required",
    "minProperties",
    "maxProperties",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];

/// Keywords that carry no constraint on the instance (metadata, annotations, containers of
/// definitions that are checked where referenced).
const ANNOTATIONS: &[&str] = &[
    "$anchor",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "id",
    "$comment",
    "title",
    "description",
    "default",
    "readOnly",
    "writeOnly",
    "deprecated",
    "examples",
    "contentMediaType",
    "contentEncoding",
];

/// Escapes a key for a JSON Pointer segment.
fn pointer_segment(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// A `pattern` must parse and stay within the regex size limit.
fn check_pattern(rx: &str, path: &str) -> Result<(), GrammarError> {
    crate::constraint::check_regex(rx).map_err(|e| match e {
        GrammarError::InvalidRegex(msg) => {
            GrammarError::InvalidSchema(format!("bad pattern at {path}: {msg}"))
        }
        GrammarError::TooComplex(msg) => {
            GrammarError::TooComplex(format!("pattern at {path}: {msg}"))
        }
        other => other,
    })
}

/// Checks every subschema of `schema`; the first unsupported keyword is the error.
pub(crate) fn check_schema_keywords(schema: &Value) -> Result<(), GrammarError> {
    // Explicit stack: hostile schemas may nest deeper than the thread stack allows.
    let mut stack: Vec<(&Value, String)> = vec![(schema, "#".to_string())];
    while let Some((node, path)) = stack.pop() {
        let obj = match node {
            Value::Bool(_) => continue,
            Value::Object(obj) => obj,
            other => {
                return Err(GrammarError::InvalidSchema(format!(
                    "schema at {path} must be an object or a boolean, got {other}"
                )));
            }
        };
        for (key, value) in obj {
            let here = format!("{path}/{}", pointer_segment(key));
            if key == "x-guidance" {
                return Err(GrammarError::UnsupportedSchemaKeyword {
                    keyword: key.clone(),
                    path,
                });
            }
            if key.starts_with("x-") || ANNOTATIONS.contains(&key.as_str()) {
                // `$defs`/`definitions` hold schemas: check them too.
                if (key == "$defs" || key == "definitions")
                    && let Value::Object(defs) = value
                {
                    for (name, sub) in defs {
                        stack.push((sub, format!("{here}/{}", pointer_segment(name))));
                    }
                }
                continue;
            }
            if key == "pattern"
                && let Value::String(rx) = value
            {
                check_pattern(rx, &here)?;
            }
            if key == "patternProperties"
                && let Value::Object(props) = value
            {
                for name in props.keys() {
                    check_pattern(name, &here)?;
                }
            }
            if !ENFORCED.contains(&key.as_str()) {
                return Err(GrammarError::UnsupportedSchemaKeyword {
                    keyword: key.clone(),
                    path,
                });
            }
            match key.as_str() {
                "properties" | "patternProperties" => {
                    if let Value::Object(props) = value {
                        for (name, sub) in props {
                            stack.push((sub, format!("{here}/{}", pointer_segment(name))));
                        }
                    }
                }
                "additionalProperties" | "additionalItems" => stack.push((value, here)),
                "items" => match value {
                    Value::Array(items) => {
                        for (i, sub) in items.iter().enumerate() {
                            stack.push((sub, format!("{here}/{i}")));
                        }
                    }
                    other => stack.push((other, here)),
                },
                "prefixItems" | "anyOf" | "oneOf" | "allOf" => {
                    if let Value::Array(items) = value {
                        for (i, sub) in items.iter().enumerate() {
                            stack.push((sub, format!("{here}/{i}")));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// RFC 3339 `full-date` with the real calendar: month lengths and leap years.
const DATE_RX: &str = concat!(
    r"(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])",
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)",
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))",
    r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)"
);

/// RFC 3339 `full-time`. A leap second (`:60`) is only allowed as `23:59:60` in UTC: a
/// leap second is valid only when its UTC time is 23:59, and the offsets that make other
/// local times valid are not worth the grammar size. Fractional seconds stop at nine
/// digits (nanoseconds), so a model cannot loop on digits, as JSON whitespace is bounded.
const TIME_RX: &str = concat!(
    r"(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?",
    r"(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    r"|23:59:60(?:\.[0-9]{1,9})?(?:[zZ]|[+-]00:00))"
);

/// One hostname label (RFC 1123): 1–62 letters, digits or hyphens, not starting or ending
/// with a hyphen, and never `--` at positions 3–4 (reserved for `xn--` punycode, which is
/// left out rather than validated). 62, not 63, keeps four labels within 253 bytes.
const LABEL_RX: &str = concat!(
    r"(?:[a-zA-Z0-9]|[a-zA-Z0-9]{2}",
    r"|[a-zA-Z0-9][a-zA-Z0-9-][a-zA-Z0-9](?:[a-zA-Z0-9-]{0,58}[a-zA-Z0-9])?",
    r"|[a-zA-Z0-9][a-zA-Z0-9-]-[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,57}[a-zA-Z0-9])?)"
);

/// An RFC 5322 `atext` character.
const ATEXT: &str = r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]";

/// A hostname of one to four labels (at most 251 bytes).
fn hostname_rx() -> String {
    format!(r"{LABEL_RX}(?:\.{LABEL_RX}){{0,3}}")
}

/// An e-mail address: a dot-atom local part of at most 64 bytes (up to three dots), `@`, a
/// hostname.
fn email_rx() -> String {
    format!(
        r"{ATEXT}{{1,16}}(?:\.{ATEXT}{{1,15}}){{0,3}}@{}",
        hostname_rx()
    )
}

/// The strict pattern replacing a `format`, where llguidance's own is looser than the
/// format's definition: its `date` allows 29 February in every year, its `time` a leap
/// second at any minute, its `email` and `hostname` unbounded lengths.
fn strict_format(format: &str) -> Option<String> {
    match format {
        "hostname" => Some(format!("^{}$", hostname_rx())),
        "email" => Some(format!("^{}$", email_rx())),
        "date" => Some(format!("^{DATE_RX}$")),
        "time" => Some(format!("^{TIME_RX}$")),
        "date-time" => Some(format!("^{DATE_RX}[tT]{TIME_RX}$")),
        _ => None,
    }
}

/// Replaces the `format`s llguidance enforces too loosely with exact patterns (an extra
/// `allOf` member when the schema already has a `pattern`).
pub(crate) fn rewrite_formats(schema: &mut Value) {
    let mut stack: Vec<&mut Value> = vec![schema];
    while let Some(node) = stack.pop() {
        let Value::Object(obj) = node else {
            continue;
        };
        let strict = match obj.get("format") {
            Some(Value::String(f)) => strict_format(f),
            _ => None,
        };
        if let Some(rx) = strict {
            obj.remove("format");
            if obj.contains_key("pattern") {
                let extra = serde_json::json!({ "pattern": rx });
                match obj.get_mut("allOf") {
                    Some(Value::Array(all)) => all.push(extra),
                    _ => {
                        obj.insert("allOf".to_string(), Value::Array(vec![extra]));
                    }
                }
            } else {
                obj.insert("pattern".to_string(), Value::String(rx));
            }
        }
        for (key, value) in obj.iter_mut() {
            match key.as_str() {
                "properties" | "patternProperties" | "$defs" | "definitions" => {
                    if let Value::Object(map) = value {
                        stack.extend(map.values_mut());
                    }
                }
                "additionalProperties" | "additionalItems" => stack.push(value),
                "items" => match value {
                    Value::Array(items) => stack.extend(items.iter_mut()),
                    other => stack.push(other),
                },
                "prefixItems" | "anyOf" | "oneOf" | "allOf" => {
                    if let Value::Array(items) = value {
                        stack.extend(items.iter_mut());
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_formats_become_patterns_or_extra_all_of_members() {
        let mut schema = json!({"properties": {
            "d": {"type": "string", "format": "date"},
            "t": {"type": "string", "format": "time", "pattern": "^1"},
            "u": {"type": "string", "format": "uuid"}}});
        rewrite_formats(&mut schema);
        let d = &schema["properties"]["d"];
        assert!(d.get("format").is_none() && d["pattern"].is_string());
        let t = &schema["properties"]["t"];
        assert_eq!(t["pattern"], "^1");
        assert!(t["allOf"][0]["pattern"].is_string());
        assert_eq!(schema["properties"]["u"]["format"], "uuid");
    }

    #[test]
    fn strict_date_pattern_knows_leap_years() {
        let rx = regex::Regex::new(&format!("^{DATE_RX}$")).expect("regex");
        for ok in [
            "2024-02-29",
            "2000-02-29",
            "0000-02-29",
            "2023-02-28",
            "2023-12-31",
        ] {
            assert!(rx.is_match(ok), "{ok}");
        }
        for bad in [
            "2023-02-29",
            "1900-02-29",
            "2023-04-31",
            "2023-13-01",
            "2023-00-10",
        ] {
            assert!(!rx.is_match(bad), "{bad}");
        }
        let time = regex::Regex::new(&format!("^{TIME_RX}$")).expect("regex");
        assert!(time.is_match("23:59:60Z") && !time.is_match("12:30:60Z"));
        assert!(time.is_match("12:00:00.123456789Z") && !time.is_match("12:00:00.1234567890Z"));
    }

    #[test]
    fn unknown_keyword_path_is_a_json_pointer() {
        let schema = json!({"properties": {"a/b": {"items": [{"typo": 1}]}}});
        assert_eq!(
            check_schema_keywords(&schema),
            Err(GrammarError::UnsupportedSchemaKeyword {
                keyword: "typo".to_string(),
                path: "#/properties/a~1b/items/0".to_string()
            })
        );
    }
}
