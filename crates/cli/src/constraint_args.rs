//! Structured-output flags of `run` and `check` (`--json-schema`, `--json`, `--regex`,
//! `--grammar`, `--choice`) and their conversion into a compiled grammar constraint for
//! the engine. Sources are read and parsed before the model loads; the grammar is compiled
//! against the model's vocabulary before any token is generated, so a bad constraint is
//! an error naming the flag and the problem, never a broken output.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use grammar::{CompiledConstraint, Constraint, GrammarLimits, TokenEnv};

use crate::session::Session;

/// The structured-output flags (at most one of them).
#[derive(Debug, Clone, Default, Args)]
#[group(id = "constraint", multiple = false)]
#[command(next_help_heading = "Structured output (at most one; the output always satisfies it)")]
pub struct ConstraintArgs {
    /// JSON valid against this JSON Schema: a file, or the schema itself when the argument
    /// starts with `{`. An unsupported keyword is an error, never silently ignored. (With
    /// --chat, a model that thinks first keeps its `<think>…</think>` block free and any
    /// of these flags applies after `</think>`)
    #[arg(long = "json-schema", value_name = "FILE|JSON")]
    pub json_schema: Option<String>,

    /// Any JSON object
    #[arg(long = "json")]
    pub json: bool,

    /// Text matching this regular expression as a whole (Rust regex syntax)
    #[arg(long = "regex", value_name = "R")]
    pub regex: Option<String>,

    /// Text in the language of this Lark grammar file (llguidance's Lark dialect: a
    /// `start:` rule, `/regex/` and "literal" terminals, `%json {schema}`)
    #[arg(long = "grammar", value_name = "FILE.lark")]
    pub grammar: Option<String>,

    /// Exactly one of these strings (comma-separated or repeated)
    #[arg(long = "choice", value_name = "A,B,C", value_delimiter = ',')]
    pub choice: Vec<String>,
}

/// Where a chat reply's reasoning segment stands, as the rendered prompt shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// The model does not think first (or the template turned thinking off).
    None,
    /// The model opens a `<think>…</think>` block before its answer.
    Block,
    /// The prompt ends with `<think>`: the output starts inside the thoughts.
    Opened,
}

/// How a chat reply begins for a model whose template is `template_source`, given the
/// rendered prompt text: templates that know `<think>` make the model think first,
/// unless the generation prompt already closed an (empty) block — thinking turned off —
/// or opened one.
pub fn reasoning_segment(template_source: &str, prompt_text: &str) -> Reasoning {
    if !template_source.contains("<think>") {
        return Reasoning::None;
    }
    let tail = prompt_text.trim_end();
    if tail.ends_with("<think>") {
        Reasoning::Opened
    } else if tail.ends_with("</think>") {
        Reasoning::None
    } else {
        Reasoning::Block
    }
}

impl ConstraintArgs {
    /// The constraint the flags ask for (files read, JSON parsed), without a reasoning
    /// segment; `None` when no flag is given.
    pub fn constraint(&self) -> anyhow::Result<Option<Constraint>> {
        if let Some(arg) = &self.json_schema {
            let (text, origin) = if arg.trim_start().starts_with('{') {
                (arg.clone(), "the inline schema".to_string())
            } else {
                (read_file(arg, "--json-schema")?, arg.clone())
            };
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("--json-schema: {origin} is not valid JSON"))?;
            return Ok(Some(Constraint::json_schema(schema)));
        }
        if self.json {
            return Ok(Some(Constraint::json_object()));
        }
        if let Some(rx) = &self.regex {
            return Ok(Some(Constraint::regex(rx.clone())));
        }
        if let Some(path) = &self.grammar {
            return Ok(Some(Constraint::lark(read_file(path, "--grammar")?)));
        }
        if !self.choice.is_empty() {
            if let Some(i) = self.choice.iter().position(String::is_empty) {
                bail!("--choice: choice {} is empty", i + 1);
            }
            return Ok(Some(Constraint::choice(self.choice.iter().cloned())));
        }
        Ok(None)
    }

    /// The flag that set the constraint, for error messages.
    fn flag(&self) -> &'static str {
        if self.json_schema.is_some() {
            "--json-schema"
        } else if self.json {
            "--json"
        } else if self.regex.is_some() {
            "--regex"
        } else if self.grammar.is_some() {
            "--grammar"
        } else {
            "--choice"
        }
    }

    /// The flags' constraint, read and parsed (do this before loading the model, so a
    /// missing file or malformed schema fails at once); `None` when no flag is given.
    pub fn prepare(&self) -> anyhow::Result<Option<RequestedConstraint>> {
        Ok(self.constraint()?.map(|constraint| RequestedConstraint {
            constraint,
            flag: self.flag(),
        }))
    }
}

/// A constraint asked for on the command line, not compiled yet.
#[derive(Debug, Clone)]
pub struct RequestedConstraint {
    /// The constraint.
    pub constraint: Constraint,
    /// The flag that asked for it.
    pub flag: &'static str,
}

impl RequestedConstraint {
    /// Compiles the constraint for `session`'s model. With `chat`, a model that thinks
    /// first keeps its reasoning segment free and the constraint applies after
    /// `</think>` (see [`reasoning_segment`]); `prompt` is the rendered prompt's tokens.
    pub fn compile(
        &self,
        session: &Session,
        chat: bool,
        prompt: &[u32],
    ) -> anyhow::Result<CompiledGrammar> {
        let mut constraint = self.constraint.clone();
        if chat && let Some(template) = &session.template {
            let text = prompt_text(session, prompt);
            constraint = match reasoning_segment(template.source(), &text) {
                Reasoning::None => constraint,
                Reasoning::Block => constraint.with_think(true),
                Reasoning::Opened => constraint.with_think_opened(),
            };
        }
        let env = TokenEnv::with_logit_width(session.tokenizer.clone(), session.engine.n_vocab())
            .context("building the grammar's token environment")?;
        compile_timed(&constraint, &env)
            .with_context(|| format!("{} is not a usable constraint", self.flag))
    }
}

/// A compiled constraint and what compiling it cost.
#[derive(Debug, Clone)]
pub struct CompiledGrammar {
    /// The compiled constraint (one fresh matcher per request).
    pub compiled: CompiledConstraint,
    /// Wall time of [`Constraint::compile`], in milliseconds.
    pub compile_ms: f64,
}

impl CompiledGrammar {
    /// A fresh matcher for one request, as the engine takes it.
    pub fn request_constraint(&self) -> Box<dyn engine::TokenConstraint> {
        Box::new(self.compiled.matcher())
    }
}

/// Compiles `constraint` against `env` with the default limits, timing it.
pub fn compile_timed(
    constraint: &Constraint,
    env: &Arc<TokenEnv>,
) -> anyhow::Result<CompiledGrammar> {
    let start = Instant::now();
    let compiled = constraint.compile(env, &GrammarLimits::default())?;
    Ok(CompiledGrammar {
        compiled,
        compile_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// The text of the prompt's last tokens (enough to see how the generation prompt ends),
/// special tokens spelled as their text.
fn prompt_text(session: &Session, prompt: &[u32]) -> String {
    let from = prompt.len().saturating_sub(16);
    let mut bytes = Vec::new();
    for &t in prompt.get(from..).unwrap_or_default() {
        bytes.extend_from_slice(session.tokenizer.token_bytes(t).unwrap_or_default());
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn read_file(path: &str, flag: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(Path::new(path)).with_context(|| format!("{flag}: reading {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use grammar::ConstraintSource;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        c: ConstraintArgs,
    }

    fn parse(args: &[&str]) -> Result<ConstraintArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.c)
    }

    #[test]
    fn flags_are_mutually_exclusive() {
        let e = parse(&["--json", "--regex", "a"]).expect_err("two constraints accepted");
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert!(parse(&["--choice", "a", "--grammar", "g.lark"]).is_err());
        assert!(
            parse(&[])
                .expect("no flags")
                .constraint()
                .expect("none")
                .is_none()
        );
    }

    #[test]
    fn each_flag_gives_its_source() -> anyhow::Result<()> {
        let src = |args: &[&str]| -> anyhow::Result<ConstraintSource> {
            let c = parse(args)?.constraint()?.context("no constraint")?;
            Ok(c.source().clone())
        };
        assert_eq!(
            src(&["--json-schema", r#"{"type": "integer"}"#])?,
            ConstraintSource::JsonSchema(serde_json::json!({"type": "integer"}))
        );
        assert_eq!(src(&["--json"])?, ConstraintSource::JsonObject);
        assert_eq!(
            src(&["--regex", "[0-9]+"])?,
            ConstraintSource::Regex("[0-9]+".into())
        );
        assert_eq!(
            src(&["--choice", "yes,no", "--choice", "maybe"])?,
            ConstraintSource::Choice(vec!["yes".into(), "no".into(), "maybe".into()])
        );
        let dir = tempfile::tempdir()?;
        let schema = dir.path().join("s.json");
        std::fs::write(&schema, r#" {"type": "boolean"} "#)?;
        let lark = dir.path().join("g.lark");
        std::fs::write(&lark, "start: \"a\"\n")?;
        assert_eq!(
            src(&["--json-schema", &schema.to_string_lossy()])?,
            ConstraintSource::JsonSchema(serde_json::json!({"type": "boolean"}))
        );
        assert_eq!(
            src(&["--grammar", &lark.to_string_lossy()])?,
            ConstraintSource::Lark("start: \"a\"\n".into())
        );
        Ok(())
    }

    #[test]
    fn unreadable_or_malformed_sources_are_clear_errors() {
        let err = |args: &[&str]| {
            format!(
                "{:#}",
                parse(args)
                    .expect("parses")
                    .constraint()
                    .expect_err("accepted")
            )
        };
        let e = err(&["--json-schema", "/nonexistent/person.json"]);
        assert!(
            e.contains("--json-schema") && e.contains("/nonexistent/person.json"),
            "{e}"
        );
        let e = err(&["--json-schema", "{\"type\": "]);
        assert!(e.contains("not valid JSON"), "{e}");
        let e = err(&["--grammar", "/nonexistent/g.lark"]);
        assert!(e.contains("--grammar"), "{e}");
        let e = err(&["--choice", "a,,b"]);
        assert!(e.contains("choice 2 is empty"), "{e}");
    }

    #[test]
    fn reasoning_segment_follows_the_generation_prompt() {
        let plain = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}";
        let thinking =
            "{{ '<think>' }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(reasoning_segment(plain, prompt), Reasoning::None);
        assert_eq!(reasoning_segment(thinking, prompt), Reasoning::Block);
        assert_eq!(
            reasoning_segment(thinking, &format!("{prompt}<think>\n")),
            Reasoning::Opened
        );
        assert_eq!(
            reasoning_segment(thinking, &format!("{prompt}<think>\n\n</think>\n\n")),
            Reasoning::None
        );
    }
}
