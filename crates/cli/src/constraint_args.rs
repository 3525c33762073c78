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
    /// `</think>` (the runtime's rule, [`runtime::Runtime::constrain`], the same the
    /// server follows); `prompt` is the rendered prompt's tokens.
    pub fn compile(
        &self,
        session: &Session,
        chat: bool,
        prompt: &[u32],
    ) -> anyhow::Result<CompiledGrammar> {
        let mut constraint = self.constraint.clone();
        if chat {
            constraint = session.runtime.constrain(constraint, prompt);
        }
        compile_timed(&constraint, session.runtime.token_env())
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
}
