//! The crate's one error type.

/// Errors from building or rendering a chat template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// The template source does not parse.
    #[error("chat template syntax error{}: {message}", at_line(*line, snippet))]
    Syntax {
        /// 1-based template line, when known.
        line: Option<usize>,
        /// The offending template line's text (trimmed, shortened), when known.
        snippet: Option<String>,
        /// What went wrong.
        message: String,
    },
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception{}: {message}", at_line(*line, snippet))]
    Raised {
        /// 1-based template line of the `raise_exception` call, when known.
        line: Option<usize>,
        /// The offending template line's text (trimmed, shortened), when known.
        snippet: Option<String>,
        /// The message the template passed to `raise_exception`.
        message: String,
    },
    /// Rendering failed (undefined operation, bad filter argument, value not serializable…).
    #[error("chat template error{}: {message}", at_line(*line, snippet))]
    Render {
        /// 1-based template line, when known.
        line: Option<usize>,
        /// The offending template line's text (trimmed, shortened), when known.
        snippet: Option<String>,
        /// What went wrong.
        message: String,
    },
    /// A message carries a content part that is not text (images, audio…).
    #[error(
        "message {message_index}: content part of type '{part_type}' is not supported (only 'text')"
    )]
    UnsupportedContentPart {
        /// Index of the message in the conversation.
        message_index: usize,
        /// The part's `type`.
        part_type: String,
    },
    /// A text content part has no `text` string.
    #[error("message {message_index}: text content part without a 'text' string")]
    MissingPartText {
        /// Index of the message in the conversation.
        message_index: usize,
    },
}

/// `" at line N (`snippet`)"`, or nothing when the line is unknown.
fn at_line(line: Option<usize>, snippet: &Option<String>) -> String {
    match (line, snippet) {
        (Some(l), Some(s)) => format!(" at line {l} (`{s}`)"),
        (Some(l), None) => format!(" at line {l}"),
        (None, _) => String::new(),
    }
}
