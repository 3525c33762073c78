//! Typed builders for llguidance Lark grammars, so no crate outside this one writes Lark
//! text by hand: rules are [`Expr`]essions (literals, regexes, rule references,
//! sequences, alternatives, repetitions, `%json` schemas, nested `%lark` grammars) added to
//! a [`Grammar`], which renders them with the escaping Lark needs and checks rule names.
//!
//! ```
//! use lockstep_grammar::lark::{Expr, Grammar, JsonLayout};
//! let mut g = Grammar::new();
//! g.rule("start", Expr::seq([Expr::lit("n = "), Expr::rule("value")]));
//! g.rule("value", Expr::json(&serde_json::json!({"type": "integer"}), JsonLayout::Llguidance));
//! assert_eq!(g.to_lark().unwrap(), "start: \"n = \" value\nvalue: %json {\"type\":\"integer\"}\n");
//! ```

use serde_json::{Value, json};
use thiserror::Error;

/// A grammar that cannot be written as Lark.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LarkError {
    /// A rule name outside `[a-z_][a-z0-9_]*`.
    #[error("{0:?} is not a Lark rule name (lowercase letters, digits, `_`)")]
    InvalidRuleName(String),
    /// Two rules of one grammar share a name.
    #[error("the rule {0:?} is defined twice")]
    DuplicateRule(String),
}

/// How a `%json` value is laid out (llguidance's `x-guidance` options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonLayout {
    /// llguidance's own defaults (the schema is written as given).
    Llguidance,
    /// Python's `json.dumps` layout: `", "` between items, `": "` after keys, no other
    /// whitespace (what chat models write in tool-call arguments).
    PythonDumps,
}

/// How often a repeated expression occurs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// `x?`
    Optional,
    /// `x*`
    ZeroOrMore,
    /// `x+`
    OneOrMore,
}

/// One Lark expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A literal string.
    Lit(String),
    /// A regular expression (Rust `regex` syntax; `/` and raw line breaks are escaped
    /// when written).
    Regex(String),
    /// A reference to a rule.
    Rule(String),
    /// Expressions one after another.
    Seq(Vec<Expr>),
    /// One of several expressions.
    Alt(Vec<Expr>),
    /// An expression repeated.
    Repeat(Box<Expr>, Repeat),
    /// A JSON value valid against a schema (`%json`), already carrying its layout.
    Json(Value),
    /// A nested grammar in Lark text (`%lark { … }`), such as a user's custom-tool grammar.
    Lark(String),
}

impl Expr {
    /// The literal `text`.
    pub fn lit(text: impl Into<String>) -> Expr {
        Expr::Lit(text.into())
    }

    /// The regular expression `rx`.
    pub fn regex(rx: impl Into<String>) -> Expr {
        Expr::Regex(rx.into())
    }

    /// Any text up to and including the first occurrence of `end` (use it as the whole
    /// body of a [`Grammar::lazy_rule`], so the match ends at the first `end`).
    pub fn text_through(end: &str) -> Expr {
        Expr::Regex(format!("(?s:.*){}", regex_syntax::escape(end)))
    }

    /// A reference to the rule `name`.
    pub fn rule(name: impl Into<String>) -> Expr {
        Expr::Rule(name.into())
    }

    /// `items` in order.
    pub fn seq(items: impl IntoIterator<Item = Expr>) -> Expr {
        Expr::Seq(items.into_iter().collect())
    }

    /// One of `items`.
    pub fn alt(items: impl IntoIterator<Item = Expr>) -> Expr {
        Expr::Alt(items.into_iter().collect())
    }

    /// This expression or nothing.
    pub fn opt(self) -> Expr {
        Expr::Repeat(Box::new(self), Repeat::Optional)
    }

    /// This expression any number of times.
    pub fn star(self) -> Expr {
        Expr::Repeat(Box::new(self), Repeat::ZeroOrMore)
    }

    /// This expression at least once.
    pub fn plus(self) -> Expr {
        Expr::Repeat(Box::new(self), Repeat::OneOrMore)
    }

    /// A JSON value valid against `schema`, laid out as `layout` says (the layout is
    /// added to an object schema as its `x-guidance` options).
    pub fn json(schema: &Value, layout: JsonLayout) -> Expr {
        let mut schema = schema.clone();
        if let (JsonLayout::PythonDumps, Value::Object(m)) = (layout, &mut schema) {
            m.insert(
                "x-guidance".into(),
                json!({
                    "item_separator": ", ",
                    "key_separator": ": ",
                    "whitespace_flexible": false,
                    "coerce_one_of": false,
                    "lenient": false
                }),
            );
        }
        Expr::Json(schema)
    }

    /// A nested grammar given as Lark text (its own `start` rule).
    pub fn lark(text: impl Into<String>) -> Expr {
        Expr::Lark(text.into())
    }

    /// Writes the expression; `nested`: inside a sequence or a repetition, where an
    /// alternative needs parentheses.
    fn write(&self, out: &mut String, nested: bool) {
        match self {
            Expr::Lit(s) => out.push_str(&Value::String(s.clone()).to_string()),
            Expr::Regex(rx) => {
                out.push('/');
                out.push_str(&regex_literal(rx));
                out.push('/');
            }
            Expr::Rule(name) => out.push_str(name),
            Expr::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(' ');
                    }
                    item.write(out, true);
                }
            }
            Expr::Alt(items) => {
                if nested {
                    out.push('(');
                }
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" | ");
                    }
                    item.write(out, false);
                }
                if nested {
                    out.push(')');
                }
            }
            Expr::Repeat(inner, how) => {
                let group = matches!(&**inner, Expr::Seq(v) if v.len() > 1);
                if group {
                    out.push('(');
                }
                inner.write(out, true);
                if group {
                    out.push(')');
                }
                out.push(match how {
                    Repeat::Optional => '?',
                    Repeat::ZeroOrMore => '*',
                    Repeat::OneOrMore => '+',
                });
            }
            Expr::Json(schema) => {
                out.push_str("%json ");
                out.push_str(&schema.to_string());
            }
            Expr::Lark(text) => {
                out.push_str("%lark {\n");
                out.push_str(text);
                out.push_str("\n}");
            }
        }
    }
}

/// `rx` with unescaped `/` and raw line breaks escaped for a Lark `/…/` literal.
fn regex_literal(rx: &str) -> String {
    let mut out = String::with_capacity(rx.len() + 8);
    let mut escaped = false;
    for c in rx.chars() {
        match (escaped, c) {
            (true, _) => {
                out.push(c);
                escaped = false;
            }
            (false, '\\') => {
                out.push(c);
                escaped = true;
            }
            (false, '/') => out.push_str("\\/"),
            (false, '\n') => out.push_str("\\n"),
            (false, '\r') => out.push_str("\\r"),
            (false, _) => out.push(c),
        }
    }
    out
}

/// A set of Lark rules, written in the order they were added.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grammar {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq)]
struct Rule {
    name: String,
    lazy: bool,
    body: Expr,
}

impl Grammar {
    /// No rules yet.
    pub fn new() -> Grammar {
        Grammar::default()
    }

    /// Adds the rule `name: body`.
    pub fn rule(&mut self, name: impl Into<String>, body: Expr) -> &mut Grammar {
        self.rules.push(Rule {
            name: name.into(),
            lazy: false,
            body,
        });
        self
    }

    /// Adds the lazy rule `name[lazy]: body` (its match ends as early as it can).
    pub fn lazy_rule(&mut self, name: impl Into<String>, body: Expr) -> &mut Grammar {
        self.rules.push(Rule {
            name: name.into(),
            lazy: true,
            body,
        });
        self
    }

    /// Adds every rule of `other`, after these.
    pub fn extend(&mut self, other: Grammar) -> &mut Grammar {
        self.rules.extend(other.rules);
        self
    }

    /// The grammar as Lark text, one rule a line. Fails on a rule name that is not
    /// `[a-z_][a-z0-9_]*` or defined twice.
    pub fn to_lark(&self) -> Result<String, LarkError> {
        let mut out = String::new();
        let mut names: Vec<&str> = Vec::new();
        for Rule { name, lazy, body } in &self.rules {
            let valid = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !valid {
                return Err(LarkError::InvalidRuleName(name.clone()));
            }
            if names.contains(&name.as_str()) {
                return Err(LarkError::DuplicateRule(name.clone()));
            }
            names.push(name);
            out.push_str(name);
            if *lazy {
                out.push_str("[lazy]");
            }
            out.push_str(": ");
            body.write(&mut out, false);
            out.push('\n');
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expressions_are_written_with_lark_escaping_and_grouping() {
        let mut g = Grammar::new();
        g.rule(
            "calls",
            Expr::seq([
                Expr::rule("call"),
                Expr::seq([Expr::lit("\n"), Expr::rule("call")]).star(),
            ]),
        );
        g.rule(
            "call",
            Expr::alt([
                Expr::seq([Expr::lit("say \"hi\""), Expr::rule("x").opt()]),
                Expr::seq([Expr::lit("a"), Expr::alt([Expr::lit("b")])]),
            ]),
        );
        g.lazy_rule("x", Expr::text_through("</end>\n"));
        g.rule("y", Expr::regex("a/b\\/c\nd"));
        assert_eq!(
            g.to_lark().unwrap(),
            "calls: call (\"\\n\" call)*\n\
             call: \"say \\\"hi\\\"\" x? | \"a\" (\"b\")\n\
             x[lazy]: /(?s:.*)<\\/end>\\n/\n\
             y: /a\\/b\\/c\\nd/\n"
        );
    }

    #[test]
    fn json_layout_becomes_the_schemas_guidance_options() {
        let schema = json!({"type": "object"});
        let mut g = Grammar::new();
        g.rule("a", Expr::json(&schema, JsonLayout::PythonDumps));
        g.rule("b", Expr::json(&schema, JsonLayout::Llguidance));
        g.rule("c", Expr::lark("start: \"x\""));
        let text = g.to_lark().unwrap();
        assert!(text.starts_with("a: %json {\"type\":\"object\",\"x-guidance\":{"));
        assert!(text.contains("\"item_separator\":\", \""));
        assert!(text.contains("b: %json {\"type\":\"object\"}\n"));
        assert!(text.ends_with("c: %lark {\nstart: \"x\"\n}\n"));
    }

    #[test]
    fn bad_or_duplicate_rule_names_are_errors() {
        let mut g = Grammar::new();
        g.rule("Start", Expr::lit("a"));
        assert_eq!(g.to_lark(), Err(LarkError::InvalidRuleName("Start".into())));
        let mut g = Grammar::new();
        g.rule("a", Expr::lit("a")).rule("a", Expr::lit("b"));
        assert_eq!(g.to_lark(), Err(LarkError::DuplicateRule("a".into())));
    }
}
