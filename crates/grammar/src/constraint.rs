//! Constraint sources (JSON Schema, any JSON object, regex, Lark, choice lists), the
//! reasoning-segment wrapper, and compilation against a [`TokenEnv`].

use std::sync::Arc;

use llguidance::api::{GrammarInit, GrammarWithLexer, ParserLimits, TopLevelGrammar};
use llguidance::{JsonCompileOptions, Logger, Matcher};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use toktrie::InferenceCapabilities;

use crate::GrammarLimits;
use crate::env::TokenEnv;
use crate::error::{GrammarError, SourceKind, classify_compile_error};
use crate::matcher::GrammarMatcher;
use crate::schema_check::{check_schema_keywords, rewrite_formats};

/// Where a constraint comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSource {
    /// A JSON Schema (llguidance's subset; anything else is refused, see
    /// [`GrammarError::UnsupportedSchemaKeyword`]).
    JsonSchema(Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// Exactly one of these literal strings.
    Choice(Vec<String>),
}

/// Whitespace allowed between JSON tokens (outside strings).
///
/// Unbounded whitespace lets a model loop on newlines forever while the grammar stays
/// satisfied; lockstep never allows it. The default, `Bounded { max_run: 16 }`, lets a model
/// write `{"a": 1}` or pretty-printed JSON (a newline plus up to 15 indentation bytes)
/// between any two JSON tokens, but never more than 16 whitespace bytes in a row, and no
/// whitespace before the first or after the last token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonWhitespace {
    /// No whitespace at all: exactly the compact form (`{"a":1,"b":[2,3]}`).
    Compact,
    /// Runs of 1..=`max_run` bytes of space, tab, CR or LF between JSON tokens.
    Bounded {
        /// The longest whitespace run (at least 1).
        max_run: u8,
    },
}

impl Default for JsonWhitespace {
    fn default() -> Self {
        JsonWhitespace::Bounded { max_run: 16 }
    }
}

/// A structured-output constraint: a source plus options. Compile it against a model's
/// [`TokenEnv`] with [`Constraint::compile`].
#[derive(Debug, Clone, PartialEq)]
pub struct Constraint {
    source: ConstraintSource,
    think: bool,
    /// The prompt already wrote the opening `<think>`: the output starts inside the block.
    think_opened: bool,
    json_whitespace: JsonWhitespace,
}

/// Lark text for a think block whose markers are special tokens of the vocabulary.
const THINK_SPECIAL: &str = r#"start: <think> THINK_TEXT </think> THINK_GAP? @constraint
THINK_TEXT: /(?s:.*)/
THINK_GAP: /\n{1,2}/
"#;

/// Lark text for a think block whose markers are plain text: the body ends at the first
/// `</think>` (a lazy lexeme), so the marker cannot appear inside the thoughts.
const THINK_TEXT: &str = r#"start: "<think>" think_text THINK_GAP? @constraint
think_text[lazy]: /(?s:.*)<\/think>/
THINK_GAP: /\n{1,2}/
"#;

/// [`THINK_SPECIAL`] for an output that starts inside the block (the prompt opened it).
const THINK_SPECIAL_OPENED: &str = r#"start: THINK_TEXT </think> THINK_GAP? @constraint
THINK_TEXT: /(?s:.*)/
THINK_GAP: /\n{1,2}/
"#;

/// [`THINK_TEXT`] for an output that starts inside the block (the prompt opened it).
const THINK_TEXT_OPENED: &str = r#"start: think_text THINK_GAP? @constraint
think_text[lazy]: /(?s:.*)<\/think>/
THINK_GAP: /\n{1,2}/
"#;

const CONSTRAINT_NAME: &str = "constraint";

impl Constraint {
    /// A constraint from `source` with default options (no think block, bounded JSON
    /// whitespace).
    pub fn new(source: ConstraintSource) -> Constraint {
        Constraint {
            source,
            think: false,
            think_opened: false,
            json_whitespace: JsonWhitespace::default(),
        }
    }

    /// Output valid against a JSON Schema.
    pub fn json_schema(schema: Value) -> Constraint {
        Constraint::new(ConstraintSource::JsonSchema(schema))
    }

    /// Any JSON object.
    pub fn json_object() -> Constraint {
        Constraint::new(ConstraintSource::JsonObject)
    }

    /// Output matching `regex` as a whole.
    pub fn regex(regex: impl Into<String>) -> Constraint {
        Constraint::new(ConstraintSource::Regex(regex.into()))
    }

    /// Output in the language of a Lark grammar.
    pub fn lark(grammar: impl Into<String>) -> Constraint {
        Constraint::new(ConstraintSource::Lark(grammar.into()))
    }

    /// Output equal to one of `choices`.
    pub fn choice<S: Into<String>>(choices: impl IntoIterator<Item = S>) -> Constraint {
        Constraint::new(ConstraintSource::Choice(
            choices.into_iter().map(Into::into).collect(),
        ))
    }

    /// With `think`, the output is a reasoning segment `<think>…</think>` of free text,
    /// then up to two newlines, then the constraint. The wrapper is part of the grammar (the
    /// constraint is a sub-grammar), so one matcher covers the whole output. Where the
    /// vocabulary has `<think>`/`</think>` as special tokens they are required as those
    /// tokens (and the free text cannot contain them); otherwise they are text and the
    /// thoughts end at the first `</think>`.
    pub fn with_think(mut self, think: bool) -> Constraint {
        self.think = think;
        self.think_opened = false;
        self
    }

    /// A reasoning segment as in [`Constraint::with_think`], for a prompt that already
    /// ends with the opening `<think>` (chat templates that write it into the generation
    /// prompt): the output starts inside the thoughts, then `</think>`, up to two newlines
    /// and the constraint.
    pub fn with_think_opened(mut self) -> Constraint {
        self.think = true;
        self.think_opened = true;
        self
    }

    /// Sets the whitespace policy for JSON sources (ignored by the others).
    pub fn with_json_whitespace(mut self, ws: JsonWhitespace) -> Constraint {
        self.json_whitespace = ws;
        self
    }

    /// The constraint's source.
    pub fn source(&self) -> &ConstraintSource {
        &self.source
    }

    /// Whether a think block precedes the constraint.
    pub fn think(&self) -> bool {
        self.think
    }

    /// Whether the output starts inside the think block ([`Constraint::with_think_opened`]).
    pub fn think_opened(&self) -> bool {
        self.think_opened
    }

    fn json_options(&self) -> Result<JsonCompileOptions, GrammarError> {
        let whitespace_pattern = match self.json_whitespace {
            JsonWhitespace::Compact => None,
            JsonWhitespace::Bounded { max_run: 0 } => {
                return Err(GrammarError::InvalidSchema(
                    "JSON whitespace max_run must be at least 1".to_string(),
                ));
            }
            JsonWhitespace::Bounded { max_run } => {
                Some(format!(r"[\x20\x0A\x0D\x09]{{1,{max_run}}}"))
            }
        };
        Ok(JsonCompileOptions {
            item_separator: ",".to_string(),
            key_separator: ":".to_string(),
            whitespace_flexible: false,
            whitespace_pattern,
            coerce_one_of: false,
            lenient: false,
            ..JsonCompileOptions::default()
        })
    }

    fn json_grammar(&self, schema: &Value) -> Result<GrammarWithLexer, GrammarError> {
        check_schema_keywords(schema)?;
        let mut schema = schema.clone();
        rewrite_formats(&mut schema);
        let opts = self.json_options()?;
        match &mut schema {
            Value::Object(obj) => {
                let opts = serde_json::to_value(&opts)
                    .map_err(|e| GrammarError::InvalidSchema(e.to_string()))?;
                obj.insert("x-guidance".to_string(), opts);
            }
            Value::Bool(true) => {
                let opts = serde_json::to_value(&opts)
                    .map_err(|e| GrammarError::InvalidSchema(e.to_string()))?;
                schema = json!({ "x-guidance": opts });
            }
            Value::Bool(false) => {
                return Err(GrammarError::EmptyLanguage(
                    "the schema `false` matches no value".to_string(),
                ));
            }
            other => {
                return Err(GrammarError::InvalidSchema(format!(
                    "a schema must be an object or a boolean, got {other}"
                )));
            }
        }
        Ok(GrammarWithLexer::from_json_schema(schema))
    }

    /// The constraint itself as one llguidance grammar, and which kind of source it is.
    fn inner_grammar(&self) -> Result<(GrammarWithLexer, SourceKind), GrammarError> {
        match &self.source {
            ConstraintSource::JsonSchema(schema) => {
                Ok((self.json_grammar(schema)?, SourceKind::Json))
            }
            ConstraintSource::JsonObject => Ok((
                self.json_grammar(&json!({ "type": "object" }))?,
                SourceKind::Json,
            )),
            ConstraintSource::Regex(rx) => {
                check_regex(rx)?;
                Ok((GrammarWithLexer::from_regex(rx), SourceKind::Regex))
            }
            ConstraintSource::Lark(text) => {
                check_lark_options(text)?;
                for rx in lark_regex_literals(text) {
                    // Syntax errors are left to the Lark compiler (Lark regexes have flags).
                    if let Err(e @ GrammarError::TooComplex(_)) = check_regex(rx) {
                        return Err(e);
                    }
                }
                Ok((GrammarWithLexer::from_lark(text.clone()), SourceKind::Lark))
            }
            ConstraintSource::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::InvalidChoice(
                        "the list of choices is empty".to_string(),
                    ));
                }
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                let rx = format!("(?:{})", alternatives.join("|"));
                Ok((GrammarWithLexer::from_regex(&rx), SourceKind::Regex))
            }
        }
    }

    /// The whole llguidance grammar (with the think wrapper when asked for).
    fn top_level(&self, env: &TokenEnv) -> Result<(TopLevelGrammar, SourceKind), GrammarError> {
        let (mut inner, kind) = self.inner_grammar()?;
        if !self.think {
            return Ok((TopLevelGrammar::from_grammar(inner), kind));
        }
        let special =
            env.special_token("<think>").is_some() && env.special_token("</think>").is_some();
        let wrapper = match (special, self.think_opened) {
            (true, false) => THINK_SPECIAL,
            (false, false) => THINK_TEXT,
            (true, true) => THINK_SPECIAL_OPENED,
            (false, true) => THINK_TEXT_OPENED,
        };
        inner.name = Some(CONSTRAINT_NAME.to_string());
        let mut outer = GrammarWithLexer::from_lark(wrapper.to_string());
        outer.name = Some("think".to_string());
        Ok((
            TopLevelGrammar {
                grammars: vec![outer, inner],
                max_tokens: None,
            },
            kind,
        ))
    }

    /// Compiles the constraint for a model. Fails with a typed error when the constraint
    /// is malformed, uses something unsupported, exceeds `limits`, or matches nothing.
    pub fn compile(
        &self,
        env: &Arc<TokenEnv>,
        limits: &GrammarLimits,
    ) -> Result<CompiledConstraint, GrammarError> {
        let (grammar, kind) = self.top_level(env)?;
        let factory = env.factory();
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_parser_from_init_ext(
                GrammarInit::Serialized(grammar),
                Logger::new(0, 0),
                InferenceCapabilities::default(),
                limits.to_parser_limits(),
            )
        }))
        .map_err(|_| classify_compile_error(kind, "the grammar compiler panicked".to_string()))?
        .map_err(|e| classify_compile_error(kind, format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(classify_compile_error(kind, e));
        }
        let allowed = Arc::new(self.allowed_words(env));
        let mut initial = GrammarMatcher::from_parts(env.clone(), allowed, matcher);
        // A constraint whose first step allows nothing (not even EOS) matches nothing.
        let mut mask = sampling::TokenMask::new(env.n_logits());
        match initial.compute_mask(&mut mask) {
            Ok(()) => {}
            Err(GrammarError::DeadEnd { .. }) => {
                return Err(GrammarError::EmptyLanguage(
                    "no token can start an output".to_string(),
                ));
            }
            Err(GrammarError::Matcher(msg)) => return Err(classify_compile_error(kind, msg)),
            Err(e) => return Err(e),
        }
        Ok(CompiledConstraint { initial })
    }
}

/// A constraint's identity for caches of compiled grammars: SHA-256 of the constraint's
/// canonical serialization ([`Constraint::key`]). Equal keys mean the same compiled grammar.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConstraintKey([u8; 32]);

impl ConstraintKey {
    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Display for ConstraintKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::fmt::Debug for ConstraintKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConstraintKey({self})")
    }
}

/// Version of the serialization [`Constraint::key`] hashes; bump it when it changes.
const KEY_VERSION: &[u8] = b"lockstep-constraint-key-v1";

impl Constraint {
    /// The constraint's cache key: SHA-256 over a canonical serialization — every field
    /// as a tag byte, a little-endian `u64` length and the bytes, so no two different
    /// constraints serialize alike. A JSON Schema is its compact JSON text with object
    /// members in the schema's own order (llguidance generates properties in that order,
    /// so a reordered schema is a different grammar). Cheap next to compiling: one pass
    /// over the source, no `Debug` formatting of the schema.
    pub fn key(&self) -> ConstraintKey {
        let mut h = Sha256::new();
        let mut field = |tag: u8, bytes: &[u8]| {
            h.update([tag]);
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b'V', KEY_VERSION);
        match &self.source {
            ConstraintSource::JsonSchema(schema) => {
                // Serializing a `Value` cannot fail (its map keys are strings).
                let text = serde_json::to_vec(schema).unwrap_or_default();
                field(b'S', &text);
            }
            ConstraintSource::JsonObject => field(b'O', &[]),
            ConstraintSource::Regex(rx) => field(b'R', rx.as_bytes()),
            ConstraintSource::Lark(text) => field(b'L', text.as_bytes()),
            ConstraintSource::Choice(choices) => {
                field(b'C', &(choices.len() as u64).to_le_bytes());
                for c in choices {
                    field(b'c', c.as_bytes());
                }
            }
        }
        field(b'T', &[u8::from(self.think), u8::from(self.think_opened)]);
        match self.json_whitespace {
            JsonWhitespace::Compact => field(b'W', &[]),
            JsonWhitespace::Bounded { max_run } => field(b'B', &[max_run]),
        }
        ConstraintKey(h.finalize().into())
    }
}

impl Constraint {
    /// The mask words of tokens this constraint may ever allow. Special tokens are kept
    /// only where the constraint names them: the think markers, and in Lark text every
    /// `<name>` that is a special token of the vocabulary (all of them once the text uses
    /// numeric `<[…]>` references). This closes the one gap in the `0xFF` marking: a Lark
    /// negation (`~/abc/`) may match non-UTF-8 bytes and so spell a special token.
    fn allowed_words(&self, env: &TokenEnv) -> Vec<u64> {
        let mut words = env.allowed_words().to_vec();
        let mut named: Vec<u32> = Vec::new();
        if self.think {
            if !self.think_opened {
                named.extend(env.special_token("<think>"));
            }
            named.extend(env.special_token("</think>"));
        }
        if let ConstraintSource::Lark(text) = &self.source {
            if text.contains("<[") {
                return words;
            }
            named.extend(special_names(text).filter_map(|name| env.special_token(name)));
        }
        for &t in env.special_ids() {
            if !named.contains(&t)
                && let Some(w) = words.get_mut(t as usize / 64)
            {
                *w &= !(1u64 << (t % 64));
            }
        }
        words
    }
}

/// Every `<…>` in `text` without whitespace or nested angle brackets (candidate special
/// token names in Lark syntax).
fn special_names(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices('<').filter_map(move |(start, _)| {
        let rest = &text[start + 1..];
        let end = rest.find(|c: char| c == '>' || c == '<' || c.is_whitespace())?;
        (rest.as_bytes().get(end) == Some(&b'>') && end > 0 && end <= 100)
            .then(|| &text[start..start + end + 2])
    })
}

/// The largest regex accepted, in expanded positions (a counted repetition multiplies its
/// body). Compiling a regex costs time linear in this size and a forced literal is
/// walked byte by byte (~6 µs per forced byte in llguidance), so `a{1000000}` is refused
/// instead of costing seconds; 20,000 positions stay near 0.1 s.
pub(crate) const MAX_REGEX_POSITIONS: u64 = 20_000;

/// The expanded size of a parsed regex, saturating.
fn regex_positions(hir: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) | HirKind::Class(_) => 1,
        HirKind::Literal(lit) => lit.0.len() as u64,
        HirKind::Capture(cap) => regex_positions(&cap.sub),
        HirKind::Repetition(rep) => {
            let count = u64::from(rep.max.unwrap_or(rep.min).max(rep.min)).max(1);
            regex_positions(&rep.sub).saturating_mul(count)
        }
        HirKind::Concat(subs) | HirKind::Alternation(subs) => subs
            .iter()
            .fold(0u64, |acc, h| acc.saturating_add(regex_positions(h))),
    }
}

/// Parses `rx` with the regex syntax llguidance uses, for a clear error up front, and
/// bounds its expanded size.
pub(crate) fn check_regex(rx: &str) -> Result<(), GrammarError> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(rx)
        .map_err(|e| GrammarError::InvalidRegex(e.to_string()))?;
    let size = regex_positions(&hir);
    if size > MAX_REGEX_POSITIONS {
        return Err(GrammarError::TooComplex(format!(
            "the regex expands to {size} positions (limit {MAX_REGEX_POSITIONS})"
        )));
    }
    Ok(())
}

/// The bodies of the `/…/` regex literals of a Lark grammar (string literals and comments
/// skipped).
fn lark_regex_literals(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'"' => {
                i += 1;
                while let Some(&c) = bytes.get(i) {
                    i += if c == b'\\' { 2 } else { 1 };
                    if c == b'"' {
                        break;
                    }
                }
            }
            b'#' => {
                while bytes.get(i).is_some_and(|&c| c != b'\n') {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while bytes.get(i).is_some_and(|&c| c != b'\n') {
                    i += 1;
                }
            }
            b'/' => {
                let start = i + 1;
                i = start;
                while let Some(&c) = bytes.get(i) {
                    if c == b'\\' {
                        i += 2;
                        continue;
                    }
                    if c == b'/' || c == b'\n' {
                        break;
                    }
                    i += 1;
                }
                if let Some(body) = text.get(start..i.min(text.len())) {
                    out.push(body);
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// Refuses `%llguidance` options that would break lockstep's guarantees:
/// `allow_invalid_utf8` (terminals could then spell the `0xFF` marker of special tokens)
/// and `no_forcing` (masks and `accepts` assume canonical forced tokens).
fn check_lark_options(text: &str) -> Result<(), GrammarError> {
    let mut rest = text;
    while let Some(pos) = rest.find("%llguidance") {
        rest = &rest[pos + "%llguidance".len()..];
        let body = directive_body(rest);
        for option in ["allow_invalid_utf8", "no_forcing"] {
            if body.contains(option) {
                return Err(GrammarError::InvalidLark(format!(
                    "the %llguidance option `{option}` is not supported"
                )));
            }
        }
    }
    Ok(())
}

/// The `{…}` JSON object following a `%llguidance` directive (braces balanced, strings
/// skipped), or the empty string.
fn directive_body(s: &str) -> &str {
    let trimmed = s.trim_start();
    let offset = s.len() - trimmed.len();
    if !trimmed.starts_with('{') {
        return "";
    }
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in trimmed.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return &s[offset..offset + i + 1];
                }
            }
            _ => {}
        }
    }
    &s[offset..]
}

/// A constraint compiled for one model: the start state, cloned for every request.
#[derive(Clone)]
pub struct CompiledConstraint {
    initial: GrammarMatcher,
}

impl std::fmt::Debug for CompiledConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledConstraint").finish_non_exhaustive()
    }
}

impl CompiledConstraint {
    /// A fresh verified matcher at the start of the output.
    pub fn matcher(&self) -> GrammarMatcher {
        self.initial.deep_fork()
    }
}

impl GrammarLimits {
    pub(crate) fn to_parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_items_in_row: self.max_items_in_row,
            initial_lexer_fuel: self.initial_lexer_fuel,
            step_lexer_fuel: self.step_lexer_fuel,
            step_max_items: self.step_max_items,
            max_lexer_states: self.max_lexer_states,
            max_grammar_size: self.max_grammar_size,
            precompute_large_lexemes: true,
            verbose_errors: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_equal_for_equal_constraints_and_differ_otherwise() {
        let schema = || json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            Constraint::json_schema(schema()).key(),
            Constraint::json_schema(schema()).key()
        );
        let c = Constraint::regex("[0-9]+").with_think(true);
        assert_eq!(c.clone().key(), c.key());
        let distinct = [
            Constraint::json_schema(schema()),
            Constraint::json_schema(
                json!({"type": "object", "properties": {"a": {"type": "number"}}}),
            ),
            Constraint::json_schema(schema()).with_think(true),
            Constraint::json_schema(schema()).with_think_opened(),
            Constraint::json_schema(schema()).with_json_whitespace(JsonWhitespace::Compact),
            Constraint::json_schema(schema())
                .with_json_whitespace(JsonWhitespace::Bounded { max_run: 4 }),
            Constraint::json_object(),
            Constraint::regex("a"),
            Constraint::lark("a"),
            Constraint::choice(["a"]),
            Constraint::choice(["a", "b"]),
            Constraint::choice(["a\u{0}b"]),
            Constraint::choice(["ab"]),
            Constraint::choice(Vec::<String>::new()),
        ];
        let keys: Vec<ConstraintKey> = distinct.iter().map(Constraint::key).collect();
        for (i, a) in keys.iter().enumerate() {
            for (j, b) in keys.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "{:?} and {:?}", distinct[i], distinct[j]);
            }
        }
        assert_eq!(keys[0].to_string().len(), 64);
    }

    #[test]
    fn lark_regex_literals_skip_strings_and_comments() {
        let text = "// a /comment/\nstart: \"/not/\" X # /nor/\nX: /a{3}\\/b/i | /c/\n";
        assert_eq!(lark_regex_literals(text), vec!["a{3}\\/b", "c"]);
    }

    #[test]
    fn special_names_finds_angle_bracket_names_only() {
        let names: Vec<&str> = special_names("start: <|im_end|> \"a < b\" <x y> <think>").collect();
        assert_eq!(names, vec!["<|im_end|>", "<think>"]);
    }

    #[test]
    fn llguidance_directives_with_forbidden_options_are_refused() {
        assert!(check_lark_options("%llguidance {}\nstart: \"no_forcing\"").is_ok());
        assert!(check_lark_options("%llguidance { \"no_forcing\": true }\nstart: \"a\"").is_err());
        assert!(check_lark_options("%llguidance {\"allow_invalid_utf8\": true}").is_err());
    }

    #[test]
    fn regex_size_counts_repetitions_multiplicatively() {
        assert!(check_regex("(a{100}){100}").is_ok());
        assert!(matches!(
            check_regex("(a{1000}){100}"),
            Err(GrammarError::TooComplex(_))
        ));
        assert!(matches!(
            check_regex("(a"),
            Err(GrammarError::InvalidRegex(_))
        ));
    }
}
