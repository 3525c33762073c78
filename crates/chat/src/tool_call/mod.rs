//! Tool-call envelope formats: how a model family wraps a function call in its output.
//!
//! A format parses whole outputs ([`ToolCallFormat::parse`]) and streams
//! ([`ToolCallFormat::stream_parser`]), and renders the envelope for a call
//! ([`ToolCallFormat::render_call`]); [`ToolCallFormat::call_layout`] and the formats'
//! layout facts let the crate that builds constraints write grammars forcing the envelope.
//! Arguments travel as raw JSON text while streaming; ids are the caller's business.

mod dsml;
mod hermes;

pub(crate) use dsml::encode_arguments as dsml_encode_arguments;
pub use dsml::{DSML_TOKEN, DsmlFormat};
pub use hermes::HermesFormat;

use serde_json::Value;

/// How a format lays out a call's arguments, which decides how a grammar forcing its
/// calls is built ([`ToolCallFormat::call_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallLayout {
    /// The arguments as one JSON object in the envelope of
    /// [`ToolCallFormat::render_call`] (Hermes).
    JsonArguments,
    /// One DSML parameter element per argument ([`DsmlFormat`]'s layout).
    Dsml,
}

/// One model family's tool-call envelope.
pub trait ToolCallFormat: Send + Sync + std::fmt::Debug {
    /// A short name (`hermes`).
    fn name(&self) -> &str;
    /// The text that opens a tool call (or a section of calls).
    fn start_marker(&self) -> &str;
    /// The text that closes it.
    fn end_marker(&self) -> &str;
    /// A fresh streaming parser for one completion.
    fn stream_parser(&self) -> Box<dyn ToolStreamParser>;
    /// The envelope text for one call, exactly as the model is expected to write it.
    /// `arguments_json` is inserted verbatim.
    fn render_call(&self, name: &str, arguments_json: &str) -> String;
    /// How this format lays out a call's arguments: [`CallLayout::JsonArguments`] (the
    /// default) is [`Self::render_call`] around a JSON arguments slot.
    fn call_layout(&self) -> CallLayout {
        CallLayout::JsonArguments
    }
    /// Splits a whole completion into content and tool calls. Equivalent to feeding the
    /// text to [`Self::stream_parser`] in one piece and collecting the events.
    fn parse(&self, text: &str) -> ParsedOutput {
        let mut parser = self.stream_parser();
        let mut events = parser.feed(text);
        events.extend(parser.finish());
        ParsedOutput::from_events(&events)
    }
}

/// Incremental parser: text deltas in, events out.
///
/// Text that could be the start of a marker is held back until it is decided, so content
/// deltas never contain a partial envelope. Whitespace directly around envelopes is not
/// content.
pub trait ToolStreamParser: Send {
    /// Feeds the next piece of generated text.
    fn feed(&mut self, delta: &str) -> Vec<ToolStreamEvent>;
    /// Ends the stream: flushes held text, closes or reports an unterminated call.
    fn finish(&mut self) -> Vec<ToolStreamEvent>;
}

/// What a streaming parser reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolStreamEvent {
    /// Ordinary assistant text.
    ContentDelta(String),
    /// A call began; `index` counts calls of this completion from 0.
    ToolCallStart {
        /// Call index.
        index: usize,
        /// Function name.
        name: String,
    },
    /// More of a call's arguments (JSON text).
    ArgumentsDelta {
        /// Call index.
        index: usize,
        /// Raw JSON text.
        text: String,
    },
    /// A started call is complete.
    ToolCallEnd {
        /// Call index.
        index: usize,
        /// The whole envelope as generated.
        raw: String,
    },
    /// An envelope whose body is not a valid call. `index` is set when the call had already
    /// been started (its name streamed); a [`ToolStreamEvent::ToolCallEnd`] follows then.
    Invalid {
        /// Index of the started call, if any.
        index: Option<usize>,
        /// Why it is invalid.
        message: String,
        /// The envelope as generated.
        raw: String,
    },
}

/// A parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedToolCall {
    /// Function name.
    pub name: String,
    /// Arguments, a JSON object.
    pub arguments: Value,
    /// The whole envelope as generated.
    pub raw: String,
}

/// An envelope that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallError {
    /// Why.
    pub message: String,
    /// The envelope as generated.
    pub raw: String,
}

/// A whole completion split into content and calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    /// Assistant text outside the envelopes.
    pub content: String,
    /// Valid calls in order.
    pub tool_calls: Vec<ParsedToolCall>,
    /// Envelopes that were not valid calls.
    pub errors: Vec<ToolCallError>,
}

impl ParsedOutput {
    /// Collects a complete event sequence (from `feed`s and `finish`).
    pub fn from_events(events: &[ToolStreamEvent]) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        // (index, name, arguments text, invalid)
        let mut current: Option<(usize, String, String, bool)> = None;
        for event in events {
            match event {
                ToolStreamEvent::ContentDelta(t) => out.content.push_str(t),
                ToolStreamEvent::ToolCallStart { index, name } => {
                    current = Some((*index, name.clone(), String::new(), false));
                }
                ToolStreamEvent::ArgumentsDelta { index, text } => {
                    if let Some(c) = current.as_mut().filter(|c| c.0 == *index) {
                        c.2.push_str(text);
                    }
                }
                ToolStreamEvent::Invalid {
                    index,
                    message,
                    raw,
                } => {
                    if let Some(c) = current.as_mut().filter(|c| Some(c.0) == *index) {
                        c.3 = true;
                    }
                    out.errors.push(ToolCallError {
                        message: message.clone(),
                        raw: raw.clone(),
                    });
                }
                ToolStreamEvent::ToolCallEnd { index, raw } => {
                    if let Some((i, name, args, invalid)) = current.take() {
                        if i != *index || invalid {
                            continue;
                        }
                        match serde_json::from_str::<Value>(&args) {
                            Ok(arguments) => out.tool_calls.push(ParsedToolCall {
                                name,
                                arguments,
                                raw: raw.clone(),
                            }),
                            Err(e) => out.errors.push(ToolCallError {
                                message: format!("arguments are not valid JSON: {e}"),
                                raw: raw.clone(),
                            }),
                        }
                    }
                }
            }
        }
        out
    }
}

/// The tool-call format a chat template teaches its model, if any is known: DSML for
/// DeepSeek V4 (`｜DSML｜` without V3.2's `function_calls`), Hermes for `<tool_call>`.
pub fn detect_format(template_source: &str) -> Option<Box<dyn ToolCallFormat>> {
    // V3.2 templates also mention the DSML token but name the block `function_calls`,
    // which this format does not read.
    if template_source.contains(DSML_TOKEN) && !template_source.contains("function_calls") {
        return Some(Box::new(DsmlFormat));
    }
    if template_source.contains("<tool_call>") {
        return Some(Box::new(HermesFormat));
    }
    None
}
