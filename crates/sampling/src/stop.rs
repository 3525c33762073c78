//! Stop strings over streamed text, and why a sequence finished.
//!
//! A stop string may span tokens, so text that could be the start of one is held back until
//! it is decided. Generation stops at the first point where the text contains a stop string;
//! the stop string itself and everything after it are not emitted (as OpenAI does).

use serde::{Serialize, Serializer};
use thiserror::Error;

/// Invalid stop strings.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StopError {
    /// An empty stop string would match before any text.
    #[error("stop string {index} is empty")]
    EmptyStopString {
        /// Its index in the list.
        index: usize,
    },
}

/// What one text delta produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// No stop string completed; `emit` is safe to send now (it may be empty while a
    /// possible stop prefix is held back).
    Continue {
        /// Text to emit.
        emit: String,
    },
    /// A stop string completed; `emit` is the rest of the text before it. Generation ends.
    Stopped {
        /// Text to emit before finishing.
        emit: String,
        /// Index of the stop string in the list given to [`StopChecker::new`].
        stop_index: usize,
    },
}

/// Detects stop strings in streamed text deltas.
///
/// The stop is the occurrence that ends first in the text (ties: the one starting first,
/// then the lowest index), which is where token-by-token generation would notice it, so any
/// chunking of a text gives the same emitted text and the same decision as the whole.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    /// Text received but not yet emitted (a possible stop prefix).
    pending: String,
    stopped: Option<usize>,
}

impl StopChecker {
    /// A checker for `stops` (none is fine: then it only passes text through).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Result<Self, StopError> {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        if let Some(index) = stops.iter().position(String::is_empty) {
            return Err(StopError::EmptyStopString { index });
        }
        Ok(StopChecker {
            stops,
            pending: String::new(),
            stopped: None,
        })
    }

    /// Feed the next text delta. After a `Stopped`, further deltas are ignored and the same
    /// stop is reported with nothing to emit.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if let Some(stop_index) = self.stopped {
            return StopStep::Stopped {
                emit: String::new(),
                stop_index,
            };
        }
        self.pending.push_str(delta);
        // (end, start, index) of the occurrence that ends first.
        let mut first: Option<(usize, usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(start) = self.pending.find(s.as_str()) {
                let cand = (start + s.len(), start, i);
                if first.is_none_or(|f| cand < f) {
                    first = Some(cand);
                }
            }
        }
        if let Some((_, start, stop_index)) = first {
            self.stopped = Some(stop_index);
            let mut emit = std::mem::take(&mut self.pending);
            emit.truncate(start);
            return StopStep::Stopped { emit, stop_index };
        }
        let keep = self.held_suffix_len();
        let rest = self.pending.split_off(self.pending.len() - keep);
        let emit = std::mem::replace(&mut self.pending, rest);
        StopStep::Continue { emit }
    }

    /// The longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let len = self.pending.len();
        for k in (1..longest.min(len + 1)).rev() {
            let at = len - k;
            if self.pending.is_char_boundary(at) {
                let suffix = &self.pending[at..];
                if self
                    .stops
                    .iter()
                    .any(|s| s.len() > k && s.starts_with(suffix))
                {
                    return k;
                }
            }
        }
        0
    }

    /// The generation ended for another reason: the held-back text is emitted after all.
    /// Empty after a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Text received but held back because it could begin a stop string.
    pub fn held(&self) -> &str {
        &self.pending
    }

    /// The stop that ended the text, if any.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }
}

/// What ended a sequence with `FinishReason::Stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopCause {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string completed (index into the request's list).
    StopString {
        /// Index of the stop string.
        index: usize,
    },
    /// The grammar reached an accepting end and allows nothing more.
    GrammarEnd,
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A natural stop: EOS, a stop string or the end of the grammar.
    Stop(StopCause),
    /// `max_tokens` reached.
    Length,
    /// The context window is full.
    ContextLength,
    /// The model called tools (the reply is a tool-call envelope).
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string. The context end maps to `"length"`, as OpenAI
    /// reports running out of context.
    pub fn as_openai_str(self) -> &'static str {
        match self {
            FinishReason::Stop(_) => "stop",
            FinishReason::Length | FinishReason::ContextLength => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_openai_str())
    }
}

impl Serialize for FinishReason {
    /// Serialises as the OpenAI string.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_openai_str())
    }
}
