//! The crate's one error type: what went wrong building a token environment, compiling a
//! constraint, or driving a matcher.

use sampling::ConstraintError;
use thiserror::Error;

/// Errors of the grammar crate. Compile-time errors say which part of the constraint is at
/// fault; matcher errors say which token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GrammarError {
    /// The tokenizer cannot be turned into a token environment.
    #[error("token environment: {0}")]
    Vocabulary(String),

    /// The JSON Schema uses a keyword lockstep cannot enforce (or does not know). Such a
    /// keyword is never silently ignored: output could violate it.
    #[error("unsupported JSON Schema keyword `{keyword}` at {path}")]
    UnsupportedSchemaKeyword {
        /// The keyword as written.
        keyword: String,
        /// JSON Pointer to the schema object holding it (`#` is the root).
        path: String,
    },

    /// The JSON Schema is malformed (wrong value types, dangling `$ref`, unknown `format`…).
    #[error("invalid JSON Schema: {0}")]
    InvalidSchema(String),

    /// The regular expression does not parse.
    #[error("invalid regex: {0}")]
    InvalidRegex(String),

    /// The Lark grammar does not parse or does not compile.
    #[error("invalid Lark grammar: {0}")]
    InvalidLark(String),

    /// The choice list is unusable (empty).
    #[error("invalid choice list: {0}")]
    InvalidChoice(String),

    /// The constraint admits no output at all (e.g. `[a&&b]`, an unsatisfiable schema).
    #[error("the constraint matches nothing: {0}")]
    EmptyLanguage(String),

    /// The constraint is too expensive: it exceeded a parser or lexer limit
    /// ([`crate::GrammarLimits`]).
    #[error("the constraint is too complex: {0}")]
    TooComplex(String),

    /// A token id at or beyond the logit width.
    #[error("token id {token} is outside the vocabulary of {n_logits} logits")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// The logit width of the token environment.
        n_logits: usize,
    },

    /// The constraint does not allow `token` here. The matcher state is unchanged.
    #[error("token {token} ({text:?}) is not allowed by the constraint after {position} tokens")]
    TokenRejected {
        /// The rejected id.
        token: u32,
        /// The token's bytes, lossily decoded, for the message.
        text: String,
        /// How many tokens the matcher had consumed.
        position: usize,
    },

    /// No token is allowed in this state (the grammar reached a dead end).
    #[error("no token is allowed after {position} tokens")]
    DeadEnd {
        /// How many tokens the matcher had consumed.
        position: usize,
    },

    /// A rollback of more tokens than were consumed.
    #[error("cannot roll back {requested} tokens, only {available} consumed")]
    Rollback {
        /// Tokens asked to roll back.
        requested: usize,
        /// Tokens consumed.
        available: usize,
    },

    /// The matcher is in an error state (a limit was hit while computing a mask, or an
    /// internal failure); it cannot continue.
    #[error("matcher failed: {0}")]
    Matcher(String),
}

impl From<GrammarError> for ConstraintError {
    /// The same condition in the constraint interface's terms (the message is kept):
    /// matcher conditions map one to one, compile-time faults are
    /// [`ConstraintError::Invalid`], budget overruns [`ConstraintError::TooComplex`].
    fn from(e: GrammarError) -> ConstraintError {
        match e {
            GrammarError::TokenOutOfRange { token, n_logits } => {
                ConstraintError::TokenOutOfRange { token, n_logits }
            }
            GrammarError::TokenRejected {
                token,
                text,
                position,
            } => ConstraintError::TokenRejected {
                token,
                text,
                position,
            },
            GrammarError::DeadEnd { position } => ConstraintError::DeadEnd { position },
            GrammarError::Rollback {
                requested,
                available,
            } => ConstraintError::Rollback {
                requested,
                available,
            },
            GrammarError::TooComplex(msg) => ConstraintError::TooComplex(msg),
            e @ GrammarError::Matcher(_) => ConstraintError::Failed(e.to_string()),
            e @ (GrammarError::Vocabulary(_)
            | GrammarError::UnsupportedSchemaKeyword { .. }
            | GrammarError::InvalidSchema(_)
            | GrammarError::InvalidRegex(_)
            | GrammarError::InvalidLark(_)
            | GrammarError::InvalidChoice(_)
            | GrammarError::EmptyLanguage(_)) => ConstraintError::Invalid(e.to_string()),
        }
    }
}

/// Which kind of source an llguidance compile error came from, to pick the variant.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SourceKind {
    Json,
    Regex,
    Lark,
}

/// Maps an llguidance compile error message to a typed error.
pub(crate) fn classify_compile_error(kind: SourceKind, msg: String) -> GrammarError {
    let lower = msg.to_ascii_lowercase();
    let limit_markers = [
        "fuel",
        "too many",
        "too large",
        "too complex",
        "grammar size",
        "max_items",
        "lexer states",
        "limit",
        "stack level",
    ];
    if limit_markers.iter().any(|m| lower.contains(m)) {
        return GrammarError::TooComplex(msg);
    }
    if lower.contains("unsatisfiable") {
        return GrammarError::EmptyLanguage(msg);
    }
    match kind {
        SourceKind::Json => GrammarError::InvalidSchema(msg),
        SourceKind::Regex => GrammarError::InvalidRegex(msg),
        SourceKind::Lark => GrammarError::InvalidLark(msg),
    }
}
