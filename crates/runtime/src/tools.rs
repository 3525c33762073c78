//! Tools: the request-side model (function tools with a JSON Schema, custom tools with a
//! free-text, Lark or regex input) and the grammars that force the model's envelope, for
//! every front end ([`crate::constraint::plan`] builds a request's constraint from them;
//! the server parses them from its APIs and turns the output back into tool calls).
//!
//! Envelopes (the model family's format from [`chat::ToolCallFormat`], Qwen/Hermes here):
//! - a function call is exactly what [`chat::ToolCallFormat::render_call`] renders, with the
//!   arguments constrained by the tool's schema (`%json` inside a Lark grammar);
//! - a custom tool call is the start marker, a header line `{"name": "NAME", "type":
//!   "custom"}`, the raw input (constrained by the tool's grammar), a newline and the end
//!   marker. It is lockstep's own convention: the raw input stays unescaped, so a Lark or
//!   regex grammar applies to it directly.
//!
//! DeepSeek V4's DSML envelope ([`chat::CallLayout::Dsml`]) writes each argument as a
//! parameter element; its calls grammar is [`dsml::calls_grammar`] (function tools only).

use chat::{CallLayout, ToolCallFormat};
use grammar::lark::{Expr, Grammar, JsonLayout};
use serde_json::{Value, json};

use crate::constraint::PlanError;

pub mod dsml;

/// A tool the client offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The tool's name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Function or custom.
    pub kind: ToolKind,
}

/// What kind of input a tool takes.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolKind {
    /// JSON arguments valid against `parameters` (a JSON Schema).
    Function {
        /// The arguments' schema.
        parameters: Value,
    },
    /// Raw text input.
    Custom {
        /// The language of the input.
        format: CustomFormat,
    },
}

/// The input language of a custom tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CustomFormat {
    /// Any text.
    Text,
    /// A Lark grammar (llguidance dialect).
    Lark(String),
    /// A regular expression the whole input matches.
    Regex(String),
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools: they are not even shown to the model.
    None,
    /// The model decides; a call, once opened, is constrained.
    Auto,
    /// At least one call of any tool.
    Required,
    /// A call of this tool.
    Named(String),
}

/// The tools of a request and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSetup {
    /// The offered tools.
    pub tools: Vec<ToolSpec>,
    /// `tool_choice`.
    pub mode: ToolMode,
    /// Several calls in one reply allowed.
    pub parallel: bool,
}

impl ToolSetup {
    /// Whether tools take part in this request at all.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.mode != ToolMode::None
    }

    /// Checks names and the named choice.
    pub fn validate(&self, param: &str) -> Result<(), PlanError> {
        for (i, t) in self.tools.iter().enumerate() {
            if t.name.is_empty()
                || t.name.len() > 128
                || !t
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            {
                return Err(PlanError::invalid(
                    format!("{param}[{i}].name"),
                    format!(
                        "invalid tool name {:?}: use 1-128 letters, digits, '_', '-' or '.'",
                        t.name
                    ),
                ));
            }
            if self.tools.iter().take(i).any(|o| o.name == t.name) {
                return Err(PlanError::invalid(
                    format!("{param}[{i}].name"),
                    format!("duplicate tool name {:?}", t.name),
                ));
            }
        }
        if let ToolMode::Named(name) = &self.mode
            && !self.tools.iter().any(|t| &t.name == name)
        {
            return Err(PlanError::invalid(
                "tool_choice",
                format!("tool_choice names the tool {name:?}, which is not in `tools`"),
            ));
        }
        if matches!(self.mode, ToolMode::Required | ToolMode::Named(_)) && self.tools.is_empty() {
            return Err(PlanError::invalid(
                "tool_choice",
                "tool_choice requires a tool call, but no tools were given",
            ));
        }
        Ok(())
    }

    /// The tools as the chat template's `tools` variable (OpenAI function shape; custom
    /// tools are described as functions whose input is raw text).
    pub fn template_tools(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| match &t.kind {
                ToolKind::Function { parameters } => json!({
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description.clone().unwrap_or_default(),
                        "parameters": parameters,
                    }
                }),
                ToolKind::Custom { format } => {
                    let mut desc = t.description.clone().unwrap_or_default();
                    desc.push_str(
                        "\n(Custom tool: its input is raw text, not JSON. Call it as \
                         <tool_call>\n{\"name\": \"",
                    );
                    desc.push_str(&t.name);
                    desc.push_str("\", \"type\": \"custom\"}\nINPUT\n</tool_call>");
                    match format {
                        CustomFormat::Text => desc.push(')'),
                        CustomFormat::Lark(g) => {
                            desc.push_str(" where INPUT follows this Lark grammar:\n");
                            desc.push_str(g);
                            desc.push(')');
                        }
                        CustomFormat::Regex(r) => {
                            desc.push_str(" where INPUT matches the regex ");
                            desc.push_str(r);
                            desc.push(')');
                        }
                    }
                    json!({
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": desc,
                            "parameters": {"type": "object", "properties": {}},
                        }
                    })
                }
            })
            .collect()
    }

    /// A system-prompt note describing the tools, for templates that do not render tools.
    pub fn system_note(&self, format: &dyn ToolCallFormat) -> String {
        let tools: Vec<String> = self
            .template_tools()
            .iter()
            .map(|t| t.to_string())
            .collect();
        format!(
            "You may call tools. Available tools:\n{}\nTo call a tool, reply with {}",
            tools.join("\n"),
            format.render_call("NAME", "{ARGUMENTS}")
        )
    }

    /// The tools the grammar may call (all, or the named one).
    fn callable(&self) -> Vec<&ToolSpec> {
        match &self.mode {
            ToolMode::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// The rules defining `calls` (one call, or several separated by a newline when
    /// parallel) for the callable tools, built with [`grammar::lark`].
    pub fn calls_grammar(&self, format: &dyn ToolCallFormat) -> Result<Grammar, PlanError> {
        let tools = self.callable();
        // Formats with their own calls grammar (DSML): function tools only.
        let functions: Vec<(&str, &Value)> = tools
            .iter()
            .filter_map(|t| match &t.kind {
                ToolKind::Function { parameters } => Some((t.name.as_str(), parameters)),
                ToolKind::Custom { .. } => None,
            })
            .collect();
        if format.call_layout() == CallLayout::Dsml {
            if functions.len() < tools.len() {
                return Err(PlanError::invalid(
                    "tools",
                    format!(
                        "custom tools are not supported with the {} tool-call format",
                        format.name()
                    ),
                ));
            }
            return dsml::calls_grammar(&functions, self.parallel)
                .map_err(|e| PlanError::invalid("tools", e.to_string()));
        }
        let mut g = Grammar::new();
        if self.parallel {
            g.rule(
                "calls",
                Expr::seq([
                    Expr::rule("call"),
                    Expr::seq([Expr::lit("\n"), Expr::rule("call")]).star(),
                ]),
            );
        } else {
            g.rule("calls", Expr::rule("call"));
        }
        g.rule(
            "call",
            Expr::alt((0..tools.len()).map(|i| Expr::rule(format!("call_{i}")))),
        );
        for (i, t) in tools.iter().enumerate() {
            let (call, input) = (format!("call_{i}"), format!("input_{i}"));
            match &t.kind {
                ToolKind::Function { parameters } => {
                    let envelope = format.render_call(&t.name, ARGS_SLOT);
                    let (prefix, suffix) = envelope.split_once(ARGS_SLOT).ok_or_else(|| {
                        PlanError::Internal("tool-call envelope has no argument slot".into())
                    })?;
                    let args = format!("args_{i}");
                    g.rule(
                        call,
                        Expr::seq([Expr::lit(prefix), Expr::rule(&args), Expr::lit(suffix)]),
                    );
                    g.rule(
                        args,
                        Expr::json(&arguments_schema(parameters), JsonLayout::PythonDumps),
                    );
                }
                ToolKind::Custom { format: kind } => {
                    let header = custom_header(format, &t.name);
                    let end = format!("\n{}", format.end_marker());
                    match kind {
                        CustomFormat::Text => {
                            g.rule(call, Expr::seq([Expr::lit(header), Expr::rule(&input)]));
                            g.lazy_rule(input, Expr::text_through(&end));
                        }
                        CustomFormat::Lark(text) => {
                            g.rule(
                                call,
                                Expr::seq([Expr::lit(header), Expr::rule(&input), Expr::lit(end)]),
                            );
                            g.rule(input, Expr::lark(text.clone()));
                        }
                        CustomFormat::Regex(rx) => {
                            g.rule(
                                call,
                                Expr::seq([Expr::lit(header), Expr::rule(&input), Expr::lit(end)]),
                            );
                            g.rule(input, Expr::regex(rx.clone()));
                        }
                    }
                }
            }
        }
        Ok(g)
    }

    /// [`ToolSetup::calls_grammar`] as Lark text.
    pub fn calls_lark(&self, format: &dyn ToolCallFormat) -> Result<String, PlanError> {
        self.calls_grammar(format)?
            .to_lark()
            .map_err(|e| PlanError::Internal(format!("the tools grammar: {e}")))
    }
}

const ARGS_SLOT: &str = "\u{FFFFF}ARGS\u{FFFFF}";

/// The first line of a custom tool call: start marker, newline, `{"name": …, "type":
/// "custom"}`, newline.
pub fn custom_header(format: &dyn ToolCallFormat, name: &str) -> String {
    format!(
        "{}\n{{\"name\": {}, \"type\": \"custom\"}}\n",
        format.start_marker(),
        Value::String(name.to_string())
    )
}

/// The arguments' schema of a function tool: its `parameters`, or any object where those
/// are missing or empty. Laid out as Qwen/Hermes models write arguments
/// ([`JsonLayout::PythonDumps`]).
fn arguments_schema(schema: &Value) -> Value {
    match schema {
        Value::Object(m) if !m.is_empty() => Value::Object(m.clone()),
        _ => json!({"type": "object"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(mode: ToolMode, parallel: bool) -> ToolSetup {
        ToolSetup {
            tools: vec![
                ToolSpec {
                    name: "get_weather".into(),
                    description: Some("Weather".into()),
                    kind: ToolKind::Function {
                        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                    },
                },
                ToolSpec {
                    name: "shell".into(),
                    description: None,
                    kind: ToolKind::Custom {
                        format: CustomFormat::Lark("start: \"ls \" /[a-z]+/".into()),
                    },
                },
            ],
            mode,
            parallel,
        }
    }

    #[test]
    fn the_calls_grammar_names_every_callable_tool_in_the_envelope() {
        let lark = setup(ToolMode::Required, true)
            .calls_lark(&chat::HermesFormat)
            .unwrap();
        insta::assert_snapshot!(lark);
        let named = setup(ToolMode::Named("shell".into()), false)
            .calls_lark(&chat::HermesFormat)
            .unwrap();
        assert!(!named.contains("get_weather"), "{named}");
        assert!(named.starts_with("calls: call\n"), "{named}");
    }

    #[test]
    fn custom_regex_and_text_inputs_are_escaped_for_lark() {
        let mut s = setup(ToolMode::Named("rx".into()), false);
        s.tools.push(ToolSpec {
            name: "rx".into(),
            description: None,
            kind: ToolKind::Custom {
                format: CustomFormat::Regex(r"a/b\/c".into()),
            },
        });
        let lark = s.calls_lark(&chat::HermesFormat).unwrap();
        assert!(lark.contains(r"input_0: /a\/b\/c/"), "{lark}");
        let mut s = setup(ToolMode::Named("free".into()), false);
        s.tools.push(ToolSpec {
            name: "free".into(),
            description: None,
            kind: ToolKind::Custom {
                format: CustomFormat::Text,
            },
        });
        let lark = s.calls_lark(&chat::HermesFormat).unwrap();
        assert!(
            lark.contains(r"input_0[lazy]: /(?s:.*)\n<\/tool_call>/"),
            "{lark}"
        );
    }
}
