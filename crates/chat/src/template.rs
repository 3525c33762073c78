//! Rendering `tokenizer.chat_template` with minijinja, configured like HF transformers'
//! `apply_chat_template` (jinja2 sandbox, `trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a `json.dumps`-compatible `tojson`).

use std::fmt;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Map;

use crate::message::message_to_template_value;
use crate::pyjson::{self, DumpOptions};
use crate::{ChatError, Message};

const TEMPLATE_NAME: &str = "chat_template";
const SNIPPET_MAX_CHARS: usize = 80;

/// A compiled chat template, ready to render conversations.
///
/// ```
/// use lockstep_chat::{ChatTemplate, Message};
///
/// let source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
///               {% if add_generation_prompt %}<|assistant|>{% endif %}";
/// let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
/// let prompt = template
///     .render(&[Message::new("user", "Hi")], None, true, Default::default())
///     .unwrap();
/// assert_eq!(prompt, "<|user|>Hi\n<|assistant|>");
/// ```
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Rendered by [`crate::deepseek_v4`] rather than by Jinja.
    deepseek_v4: bool,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// The marker error behind `raise_exception`, recognised when errors are converted.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Compiles `source` (a GGUF's `tokenizer.chat_template`); `bos_token` and `eos_token`
    /// are the token strings the template sees as `bos_token` / `eos_token`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(format_value);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let prepared = strip_generation_tags(source);
        env.add_template_owned(TEMPLATE_NAME, prepared)
            .map_err(|e| convert_error(&e, source))?;
        Ok(ChatTemplate {
            env,
            deepseek_v4: false,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// DeepSeek V4's chat encoding (DSML tool calls), which DeepSeek ships as Python
    /// rather than as a Jinja template: rendered in Rust (see [`crate::deepseek_v4`]). Its
    /// [`Self::source`] is a description that names the DSML envelope and the tools
    /// section, so [`crate::detect_format`] picks [`crate::DsmlFormat`] for it.
    pub fn deepseek_v4() -> ChatTemplate {
        ChatTemplate {
            env: Environment::new(),
            deepseek_v4: true,
            source: format!(
                "{{# built-in: DeepSeek V4 encoding (encoding_dsv4.py), rendered in Rust #}}\n{}",
                crate::deepseek_v4::TOOLS_TEMPLATE
            ),
            bos_token: crate::deepseek_v4::BOS.to_string(),
            eos_token: crate::deepseek_v4::EOS.to_string(),
        }
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation as HF transformers' `apply_chat_template(..., tokenize=False)`.
    ///
    /// The template sees `messages`, `tools` (`None` when absent), `documents` (`None`),
    /// `add_generation_prompt`, `bos_token`, `eos_token`, and every entry of `extra`
    /// (e.g. `enable_thinking`); `extra` cannot override the named variables.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        if self.deepseek_v4 {
            return crate::deepseek_v4::render(messages, tools, add_generation_prompt, &extra);
        }
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| message_to_template_value(m, i))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ctx: Vec<(String, Value)> = Vec::with_capacity(extra.len() + 6);
        let fixed = [
            "messages",
            "tools",
            "documents",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        for (k, v) in &extra {
            if !fixed.contains(&k.as_str()) {
                ctx.push((k.clone(), Value::from_serialize(v)));
            }
        }
        if !extra.contains_key("documents") {
            ctx.push(("documents".into(), Value::from(())));
        }
        ctx.push(("messages".into(), Value::from_serialize(&msgs)));
        ctx.push((
            "tools".into(),
            match tools {
                Some(t) => Value::from_serialize(t),
                None => Value::from(()),
            },
        ));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        ctx.push(("bos_token".into(), Value::from(self.bos_token.as_str())));
        ctx.push(("eos_token".into(), Value::from(self.eos_token.as_str())));
        self.render_values(ctx)
    }

    /// Renders with exactly the variables of `context` (plus `bos_token` / `eos_token`
    /// unless `context` sets them): for templates that need a conversation shape
    /// [`Message`] does not model, and for cross-checking the Jinja semantics.
    pub fn render_context(
        &self,
        context: &Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        if self.deepseek_v4 {
            return self.render_context_builtin(context);
        }
        let mut ctx: Vec<(String, Value)> = context
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if !context.contains_key(key) {
                ctx.push((key.to_string(), Value::from(token.as_str())));
            }
        }
        self.render_values(ctx)
    }

    /// [`Self::render_context`] for the built-in DeepSeek V4 renderer: `messages`,
    /// `tools` and `add_generation_prompt` are read, every other key is an option.
    fn render_context_builtin(
        &self,
        context: &Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        let bad = |what: &str, e: String| ChatError::Render {
            line: None,
            snippet: None,
            message: format!("{what}: {e}"),
        };
        let messages: Vec<Message> = match context.get("messages") {
            Some(m) => {
                serde_json::from_value(m.clone()).map_err(|e| bad("messages", e.to_string()))?
            }
            None => Vec::new(),
        };
        let tools: Option<Vec<serde_json::Value>> = match context.get("tools") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Array(t)) => Some(t.clone()),
            Some(_) => return Err(bad("tools", "not a list".to_string())),
        };
        let agp = context
            .get("add_generation_prompt")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        crate::deepseek_v4::render(&messages, tools.as_deref(), agp, context)
    }

    fn render_values(&self, ctx: Vec<(String, Value)>) -> Result<String, ChatError> {
        let ctx: Value = ctx.into_iter().collect();
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| convert_error(&e, &self.source))?;
        template
            .render(ctx)
            .map_err(|e| convert_error(&e, &self.source))
    }
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments",
        ));
    }
    let mut opts = DumpOptions::default();
    for (i, name) in names.iter().enumerate() {
        let v = match args.get(i) {
            Some(v) => {
                if kwargs.has(name) {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson got multiple values for argument '{name}'"),
                    ));
                }
                v.clone()
            }
            None => match kwargs.get::<Option<Value>>(name)? {
                Some(v) => v,
                None => continue,
            },
        };
        match *name {
            "ensure_ascii" => opts.ensure_ascii = v.is_true(),
            "sort_keys" => opts.sort_keys = v.is_true(),
            "indent" => opts.indent = indent_string(&v)?,
            _ => opts.separators = separators(&v)?,
        }
    }
    kwargs.assert_all_used()?;
    pyjson::dumps(value, &opts).map(Value::from)
}

fn indent_string(v: &Value) -> Result<Option<String>, Error> {
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => Ok(None),
        ValueKind::String => Ok(Some(v.as_str().unwrap_or_default().to_string())),
        ValueKind::Number if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).clamp(0, 1024) as usize;
            Ok(Some(" ".repeat(n)))
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: indent must be an integer, a string or None",
        )),
    }
}

fn separators(v: &Value) -> Result<Option<(String, String)>, Error> {
    if v.is_none() || v.is_undefined() {
        return Ok(None);
    }
    let parts: Vec<Value> = v.try_iter()?.collect();
    match parts.as_slice() {
        [a, b] => match (a.as_str(), b.as_str()) {
            (Some(a), Some(b)) => Ok(Some((a.to_string(), b.to_string()))),
            _ => Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            )),
        },
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: separators must be a pair (item_separator, key_separator)",
        )),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

/// Python's `datetime.now().strftime(fmt)` (local time).
fn strftime_now(format: String) -> Result<Value, Error> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // An unknown conversion makes chrono's formatter fail: report it rather than panic.
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// Printing a value as Python's `str()` would (lists and dicts as their `repr`).
fn format_value(
    out: &mut minijinja::Output<'_>,
    _state: &minijinja::State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            pyjson::python_repr(&mut s, value);
            s
        }
        ValueKind::Number if !value.is_integer() => {
            pyjson::float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN))
        }
        _ => value.to_string(),
    };
    out.write_str(&text).map_err(Error::from)
}

/// transformers' `{% generation %}…{% endgeneration %}` only marks assistant spans for
/// training masks; it renders its body unchanged. minijinja has no such tag, so it becomes
/// an always-true `if` with the same whitespace control.
fn strip_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_string();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.get(2..).and_then(|t| t.find("%}")).map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => {
                out.push_str(&format!("{{%{lead} if true {trail}%}}"));
            }
            "endgeneration" => {
                out.push_str(&format!("{{%{lead} endif {trail}%}}"));
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn convert_error(err: &Error, source: &str) -> ChatError {
    let line = err.line();
    let snippet = line.and_then(|l| source_line(source, l));
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return ChatError::Raised {
                line,
                snippet,
                message: raised.0.clone(),
            };
        }
        cause = e.source();
    }
    let message = match err.detail() {
        Some(d) => format!("{}: {d}", err.kind()),
        None => err.kind().to_string(),
    };
    if err.kind() == ErrorKind::SyntaxError {
        ChatError::Syntax {
            line,
            snippet,
            message,
        }
    } else {
        ChatError::Render {
            line,
            snippet,
            message,
        }
    }
}

fn source_line(source: &str, line: usize) -> Option<String> {
    let text = source.lines().nth(line.checked_sub(1)?)?.trim();
    if text.is_empty() {
        return None;
    }
    let mut s: String = text.chars().take(SNIPPET_MAX_CHARS).collect();
    if text.chars().count() > SNIPPET_MAX_CHARS {
        s.push('…');
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_transparent_blocks() {
        assert_eq!(
            strip_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}{% endif %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}{% endif %}"
        );
        // Degenerate tags are left to the parser, never sliced out of bounds.
        assert_eq!(strip_generation_tags("{%}generation"), "{%}generation");
        assert_eq!(strip_generation_tags("generation {%"), "generation {%");
    }
}
