//! The calls grammar of DeepSeek V4's DSML envelope ([`chat::DsmlFormat`]), built with
//! [`grammar::lark`] from the layout facts `chat` exposes (tags, the parameter header, the
//! separator): a block holding one invoke (several when parallel) of the function tools,
//! each parameter written as its schema allows.

use chat::DsmlFormat;
use grammar::lark::{Expr, Grammar, JsonLayout};
use serde_json::{Value, json};

/// Why the tools cannot be written as DSML calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolGrammarError {
    /// There is no function tool to call.
    #[error("no function tools to call")]
    NoTools,
    /// A tool name the envelope cannot hold (a quote or a newline).
    #[error("tool name {0:?} cannot be written in a DSML invoke")]
    ToolName(String),
    /// A parameter name the envelope cannot hold (a quote or a newline).
    #[error("parameter name {0:?} cannot be written in DSML")]
    ParameterName(String),
}

/// Rules defining `calls`: one block (starting with the start marker) holding one invoke,
/// or several when `parallel`, of the function tools `(name, parameters schema)`. Each
/// tool's parameters follow its schema's `properties` in schema order, required ones
/// mandatory, others optional; a parameter whose schema only admits strings is
/// `string="true"` raw text (an `enum`/`const` of strings restricts it to those values),
/// one that admits no string is `string="false"` JSON valid against its schema (`%json`,
/// the layout of `json.dumps`), one that admits both may be either. A schema without
/// `properties` allows any parameters.
pub fn calls_grammar(
    tools: &[(&str, &Value)],
    parallel: bool,
) -> Result<Grammar, ToolGrammarError> {
    if tools.is_empty() {
        return Err(ToolGrammarError::NoTools);
    }
    let sep = || Expr::lit(DsmlFormat::SEPARATOR);
    // The separator stays a lexeme of its own: a literal that is a prefix of another ("\n"
    // of "\n</…>") would need the lexer to backtrack.
    let mut body = vec![
        Expr::lit(format!(
            "{}{}",
            DsmlFormat::BLOCK_OPEN,
            DsmlFormat::SEPARATOR
        )),
        Expr::rule("dsml_invoke"),
    ];
    if parallel {
        body.push(Expr::seq([sep(), Expr::rule("dsml_invoke")]).star());
    }
    body.extend([sep(), Expr::lit(DsmlFormat::BLOCK_CLOSE)]);
    let mut g = Grammar::new();
    g.rule("calls", Expr::seq(body));
    g.rule(
        "dsml_invoke",
        Expr::alt((0..tools.len()).map(|i| Expr::rule(format!("dsml_call_{i}")))),
    );
    for (i, (name, schema)) in tools.iter().enumerate() {
        if !DsmlFormat::can_write_name(name) {
            return Err(ToolGrammarError::ToolName(name.to_string()));
        }
        g.rule(
            format!("dsml_call_{i}"),
            Expr::seq([
                Expr::lit(format!(
                    "{}{}",
                    DsmlFormat::invoke_open(name),
                    DsmlFormat::SEPARATOR
                )),
                Expr::rule(format!("dsml_params_{i}")),
                Expr::lit(DsmlFormat::INVOKE_CLOSE),
            ]),
        );
        params_rules(&mut g, i, schema)?;
    }
    g.lazy_rule("dsml_raw", Expr::text_through(DsmlFormat::PARAMETER_CLOSE));
    Ok(g)
}

/// `dsml_params_{i}`: the separator when no parameter is written, else each written
/// parameter followed by the separator.
fn params_rules(g: &mut Grammar, i: usize, schema: &Value) -> Result<(), ToolGrammarError> {
    let sep = || Expr::lit(DsmlFormat::SEPARATOR);
    // A parameter's opening tag around a name matching `[^"\n<>]+` (any parameters).
    let any_head = |raw: bool| {
        let (before, after) = DsmlFormat::parameter_open_parts(raw);
        Expr::seq([
            Expr::lit(before),
            Expr::regex("[^\"\\n<>]+"),
            Expr::lit(after),
        ])
    };
    let props = schema.get("properties").and_then(Value::as_object);
    let Some(props) = props.filter(|p| !p.is_empty()) else {
        // Any parameters.
        let any = format!("dsml_any_{i}");
        let any_json = format!("dsml_anyjson_{i}");
        g.rule(
            format!("dsml_params_{i}"),
            Expr::alt([sep(), Expr::seq([Expr::rule(&any), sep()]).plus()]),
        );
        g.rule(
            any,
            Expr::alt([
                Expr::seq([any_head(true), Expr::rule("dsml_raw")]),
                Expr::seq([
                    any_head(false),
                    Expr::rule(&any_json),
                    Expr::lit(DsmlFormat::PARAMETER_CLOSE),
                ]),
            ]),
        );
        g.rule(any_json, Expr::json(&json!({}), JsonLayout::PythonDumps));
        return Ok(());
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let defs: Vec<(&str, &Value)> = ["$defs", "definitions"]
        .into_iter()
        .filter_map(|k| schema.get(k).map(|v| (k, v)))
        .collect();
    let mut seq = Vec::new();
    for (j, (key, sub)) in props.iter().enumerate() {
        if !DsmlFormat::can_write_name(key) {
            return Err(ToolGrammarError::ParameterName(key.clone()));
        }
        let rule = format!("dsml_p_{i}_{j}");
        let json_rule = format!("{rule}_json");
        let item = Expr::seq([Expr::rule(&rule), sep()]);
        seq.push(if required.contains(&key.as_str()) {
            item
        } else {
            item.opt()
        });
        let head = |raw: bool| Expr::lit(DsmlFormat::parameter_open(key, raw));
        let as_json = || {
            Expr::seq([
                head(false),
                Expr::rule(&json_rule),
                Expr::lit(DsmlFormat::PARAMETER_CLOSE),
            ])
        };
        let kind = string_kind(sub);
        let body = match &kind {
            // Each value with the close tag, so no literal is a prefix of another.
            StringKind::Only(Some(values)) => Expr::seq([
                head(true),
                Expr::alt(
                    values
                        .iter()
                        .map(|v| Expr::lit(format!("{v}{}", DsmlFormat::PARAMETER_CLOSE))),
                ),
            ]),
            StringKind::Only(None) => Expr::seq([head(true), Expr::rule("dsml_raw")]),
            StringKind::Also => {
                Expr::alt([Expr::seq([head(true), Expr::rule("dsml_raw")]), as_json()])
            }
            StringKind::Never => as_json(),
        };
        g.rule(&rule, body);
        if !matches!(kind, StringKind::Only(_)) {
            let mut sub = sub.clone();
            if let Value::Object(m) = &mut sub {
                for (k, v) in &defs {
                    m.entry(k.to_string()).or_insert_with(|| (*v).clone());
                }
            }
            // The schema `true` (anything) as the object schema `{}`, which takes options.
            if sub == Value::Bool(true) {
                sub = json!({});
            }
            g.rule(json_rule, Expr::json(&sub, JsonLayout::PythonDumps));
        }
    }
    let params = Expr::seq(seq);
    if required.iter().any(|r| props.contains_key(*r)) {
        g.rule(format!("dsml_params_{i}"), params);
    } else {
        g.rule(format!("dsml_params_{i}"), Expr::alt([sep(), params]));
    }
    Ok(())
}

/// Which values of `string="…"` a parameter's schema admits.
enum StringKind {
    /// Only strings (`Some`: only these values).
    Only(Option<Vec<String>>),
    /// Strings and other values.
    Also,
    /// No strings.
    Never,
}

fn string_kind(schema: &Value) -> StringKind {
    let strings_of = |v: &Value| -> Option<Vec<String>> {
        let list = match v {
            Value::Array(a) => a.clone(),
            other => vec![other.clone()],
        };
        list.iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect()
    };
    if let Some(c) = schema.get("const") {
        return match c.as_str() {
            Some(s) => StringKind::Only(Some(vec![s.to_string()])),
            None => StringKind::Never,
        };
    }
    if let Some(e) = schema.get("enum") {
        return match strings_of(e) {
            Some(values) => StringKind::Only(Some(values)),
            None if e.as_array().is_some_and(|a| a.iter().any(Value::is_string)) => {
                StringKind::Also
            }
            None => StringKind::Never,
        };
    }
    match schema.get("type") {
        Some(Value::String(t)) if t == "string" => StringKind::Only(None),
        Some(Value::String(_)) => StringKind::Never,
        Some(Value::Array(types)) => {
            let has = types.iter().any(|t| t.as_str() == Some("string"));
            match (has, types.len()) {
                (true, 1) => StringKind::Only(None),
                (true, _) => StringKind::Also,
                (false, _) => StringKind::Never,
            }
        }
        _ => StringKind::Also,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lark(tools: &[(&str, Value)], parallel: bool) -> String {
        let refs: Vec<(&str, &Value)> = tools.iter().map(|(n, s)| (*n, s)).collect();
        calls_grammar(&refs, parallel).unwrap().to_lark().unwrap()
    }

    fn weather() -> Vec<(&'static str, Value)> {
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

    /// The grammar text, one snapshot per shape: required and optional parameters, an
    /// enum, a `$ref` with its `$defs`, no parameters, one call and several.
    #[test]
    fn the_calls_grammar_of_weather_tools() {
        insta::assert_snapshot!("weather_single", lark(&weather(), false));
        insta::assert_snapshot!("weather_parallel", lark(&weather(), true));
    }

    /// Any parameters, a string-or-integer parameter, a `const`, an enum of a string and a
    /// number, the schema `true`, none required.
    #[test]
    fn the_calls_grammar_of_loose_schemas() {
        let tools = vec![
            ("any", json!({"type": "object"})),
            (
                "mixed",
                json!({"type": "object", "properties": {"v": {"type": ["string", "integer"]}}, "required": ["v"]}),
            ),
            (
                "opts",
                json!({"type": "object", "properties": {"mode": {"const": "fast"}, "level": {"enum": ["low", 1]}, "anything": true, "n": {"type": "number"}}}),
            ),
        ];
        insta::assert_snapshot!("loose_parallel", lark(&tools, true));
    }

    #[test]
    fn names_the_envelope_cannot_hold_are_refused() {
        let any = json!({"type": "object"});
        assert_eq!(calls_grammar(&[], false), Err(ToolGrammarError::NoTools));
        assert_eq!(
            calls_grammar(&[("a\"b", &any)], false),
            Err(ToolGrammarError::ToolName("a\"b".into()))
        );
        let bad_key = json!({"type": "object", "properties": {"x\ny": {"type": "string"}}});
        assert_eq!(
            calls_grammar(&[("f", &bad_key)], false),
            Err(ToolGrammarError::ParameterName("x\ny".into()))
        );
    }
}
