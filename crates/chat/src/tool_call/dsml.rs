//! DeepSeek V4 (V3.2-style) DSML envelope:
//!
//! ```text
//! <｜DSML｜tool_calls>
//! <｜DSML｜invoke name="get_weather">
//! <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
//! <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! The bars are full-width (`｜`, U+FF5C). One block holds every call of a reply, one
//! `invoke` per call, parameters joined by `\n`. A `string="true"` value is the raw string
//! (no quotes, no escaping); a `string="false"` value is JSON (`json.dumps(v,
//! ensure_ascii=False)`: numbers, booleans, null, arrays, objects). Decoding rebuilds the
//! arguments object `{"key": value, …}`, JSON-encoding the string values and inserting the
//! others verbatim; a parameter name may appear once per call. An invoke without
//! parameters is `<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>`.
//!
//! Sources followed (the reference is DeepSeek's own encoder):
//! - `encoding/encoding_dsv4.py` of the DeepSeek-V4-Flash release, as vendored in
//!   `supermy/ds4rs` (`encoding/encoding_dsv4.py`) and
//!   `sfxnz/DeepSeek-V4-Flash-Vision-Exp-vLLM-2x-DGX-Spark` (`encoding/encoding_dsv4.py`):
//!   `encode_arguments_to_dsml`, `decode_dsml_to_arguments`, `tool_call_template`,
//!   `tool_calls_template` (block name `tool_calls`), `parse_tool_calls`,
//!   `parse_message_from_completion_text` (the block follows the content after `"\n\n"`).
//! - V3.2 used the block name `function_calls` with the same invoke/parameter grammar
//!   (llama.cpp `models/templates/DeepSeek-V3.2.jinja`; sglang
//!   `python/sglang/srt/function_call/deepseekv32_detector.py`); this format reads V4's
//!   `tool_calls` only.
//!
//! Deviations, all on the lenient side: whitespace between elements is not checked
//! (the reference wants exactly `>\n`), a parameter without `string=` is JSON when it parses
//! and a string otherwise, and content after the block is kept as content.

use serde_json::{Map, Value};

use super::{CallLayout, ToolCallFormat, ToolStreamEvent, ToolStreamParser};
use crate::pyjson::json_string;
use crate::python_json;

/// The DSML marker inside every tag.
pub const DSML_TOKEN: &str = "｜DSML｜";
const START: &str = "<｜DSML｜tool_calls>";
const END: &str = "</｜DSML｜tool_calls>";
const INVOKE_OPEN: &str = "<｜DSML｜invoke";
const INVOKE_CLOSE: &str = "</｜DSML｜invoke>";
const PARAM_OPEN: &str = "<｜DSML｜parameter";
const PARAM_CLOSE: &str = "</｜DSML｜parameter>";
/// A parameter's opening tag before its name.
const PARAM_NAME_OPEN: &str = "<｜DSML｜parameter name=\"";
/// A parameter's opening tag after its name: a raw string value, a JSON value.
const PARAM_AFTER_NAME: [&str; 2] = ["\" string=\"true\">", "\" string=\"false\">"];
/// Longest tag header (`name="…" string="…">`) read before the tag counts as malformed.
const HEADER_LIMIT: usize = 512;

/// The DeepSeek V4 DSML envelope (`<｜DSML｜tool_calls>` … `</｜DSML｜tool_calls>`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DsmlFormat;

/// The layout of a block, as the renderers write it and a grammar builder (the server's
/// calls grammar) needs it: `BLOCK_OPEN`, then each invoke (`invoke_open(name)`, each
/// parameter `parameter_open(key, raw)` + value + `PARAMETER_CLOSE`, `INVOKE_CLOSE`), then
/// `BLOCK_CLOSE`, every two neighbours of these separated by `SEPARATOR` (an invoke without
/// parameters holds two separators).
impl DsmlFormat {
    /// The tag that opens the block (the start marker).
    pub const BLOCK_OPEN: &'static str = START;
    /// The tag that closes the block (the end marker).
    pub const BLOCK_CLOSE: &'static str = END;
    /// The tag that closes an invoke.
    pub const INVOKE_CLOSE: &'static str = INVOKE_CLOSE;
    /// The tag that closes a parameter's value.
    pub const PARAMETER_CLOSE: &'static str = PARAM_CLOSE;
    /// What separates the elements of a block.
    pub const SEPARATOR: &'static str = "\n";

    /// The tag that opens the invoke of the function `name`.
    pub fn invoke_open(name: &str) -> String {
        format!("{INVOKE_OPEN} name=\"{name}\">")
    }

    /// The tag that opens the parameter `name`: `raw`, a raw string value
    /// (`string="true"`), else JSON (`string="false"`).
    pub fn parameter_open(name: &str, raw: bool) -> String {
        let (before, after) = Self::parameter_open_parts(raw);
        format!("{before}{name}{after}")
    }

    /// [`DsmlFormat::parameter_open`] without the name: the text before and after it.
    pub fn parameter_open_parts(raw: bool) -> (&'static str, &'static str) {
        (PARAM_NAME_OPEN, PARAM_AFTER_NAME[usize::from(!raw)])
    }

    /// Whether `name` can be written as a function or parameter name (no quote, no line
    /// break).
    pub fn can_write_name(name: &str) -> bool {
        !name.contains('"') && !name.contains('\n')
    }

    /// One `<｜DSML｜invoke>` element (no block around it). `arguments` is the arguments
    /// object; anything else is passed as a single string parameter `arguments`, as the
    /// reference encoder does with arguments that are not a JSON object.
    pub fn render_invoke(name: &str, arguments: &Value) -> String {
        let sep = Self::SEPARATOR;
        format!(
            "{}{sep}{}{sep}{INVOKE_CLOSE}",
            Self::invoke_open(name),
            encode_arguments(arguments)
        )
    }

    /// A whole block holding `calls` (name, arguments object) in order.
    pub fn render_calls<'a>(calls: impl IntoIterator<Item = (&'a str, &'a Value)>) -> String {
        let sep = Self::SEPARATOR;
        let invokes: Vec<String> = calls
            .into_iter()
            .map(|(name, args)| Self::render_invoke(name, args))
            .collect();
        format!("{START}{sep}{}{sep}{END}", invokes.join(sep))
    }
}

/// The parameters of one invoke, joined by `\n` (`encode_arguments_to_dsml`).
pub(crate) fn encode_arguments(arguments: &Value) -> String {
    let wrapped;
    let map = match arguments {
        Value::Object(m) => m,
        other => {
            let mut m = Map::new();
            let raw = match other {
                Value::String(s) => Value::String(s.clone()),
                v => Value::String(v.to_string()),
            };
            m.insert("arguments".into(), raw);
            wrapped = m;
            &wrapped
        }
    };
    map.iter()
        .map(|(k, v)| {
            let (is_str, text) = match v {
                Value::String(s) => (true, s.clone()),
                other => (false, python_json(other)),
            };
            format!(
                "{}{text}{PARAM_CLOSE}",
                DsmlFormat::parameter_open(k, is_str)
            )
        })
        .collect::<Vec<_>>()
        .join(DsmlFormat::SEPARATOR)
}

impl ToolCallFormat for DsmlFormat {
    fn name(&self) -> &str {
        "dsml"
    }

    fn start_marker(&self) -> &str {
        START
    }

    fn end_marker(&self) -> &str {
        END
    }

    fn stream_parser(&self) -> Box<dyn ToolStreamParser> {
        Box::new(DsmlStreamParser::default())
    }

    /// The block for one call. `arguments_json` is parsed; text that is not a JSON object
    /// (e.g. a placeholder) becomes the single string parameter `arguments`.
    fn render_call(&self, name: &str, arguments_json: &str) -> String {
        let args = match serde_json::from_str::<Value>(arguments_json) {
            Ok(v @ Value::Object(_)) => v,
            _ => Value::String(arguments_json.to_string()),
        };
        Self::render_calls([(name, &args)])
    }

    fn call_layout(&self) -> CallLayout {
        CallLayout::Dsml
    }
}

// ---------------------------------------------------------------------------------------
// Streaming parser
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum State {
    /// Ordinary text.
    #[default]
    Content,
    /// Inside the block, between invokes.
    Block,
    /// After `<｜DSML｜invoke`, reading ` name="…">`.
    InvokeHeader,
    /// Inside an invoke, between parameters.
    Params,
    /// After `<｜DSML｜parameter`, reading ` name="…" string="…">`.
    ParamHeader,
    /// A parameter's value, up to `</｜DSML｜parameter>`; `Some(true)`: a raw string.
    ParamValue(Option<bool>),
    /// A malformed block, discarded up to the end marker; reported then.
    Skip(String),
}

/// Streaming parser for [`DsmlFormat`].
#[derive(Debug, Default)]
struct DsmlStreamParser {
    state: State,
    /// Received, not yet processed text.
    buf: String,
    /// Content whitespace held until it is known not to border a block.
    pending_ws: String,
    /// The last thing processed was a block: following whitespace is dropped.
    after_call: bool,
    /// Index of the next call.
    next_index: usize,
    /// The current block as generated since the last completed invoke.
    raw: String,
    /// A call is open (its start was reported).
    open: bool,
    /// Parameter names of the open call.
    names: Vec<String>,
    /// The open parameter's `"key": ` prefix, for values emitted whole.
    prefix: String,
    /// Calls completed in the current block.
    block_calls: usize,
}

impl ToolStreamParser for DsmlStreamParser {
    fn feed(&mut self, delta: &str) -> Vec<ToolStreamEvent> {
        self.buf.push_str(delta);
        let mut events = Vec::new();
        self.process(&mut events, false);
        events
    }

    fn finish(&mut self) -> Vec<ToolStreamEvent> {
        let mut events = Vec::new();
        self.process(&mut events, true);
        let rest = std::mem::take(&mut self.buf);
        match std::mem::take(&mut self.state) {
            State::Content => {
                self.emit_content(&rest, &mut events);
                let ws = std::mem::take(&mut self.pending_ws);
                if !self.after_call && !ws.is_empty() {
                    events.push(ToolStreamEvent::ContentDelta(ws));
                }
            }
            State::Skip(message) => {
                self.raw.push_str(&rest);
                self.report(message, &mut events);
            }
            State::Block if self.block_calls > 0 => {
                // Calls are complete; only the end marker (or part of it) is missing.
                self.raw.clear();
            }
            _ => {
                self.raw.push_str(&rest);
                let what = if self.open {
                    "unterminated tool call"
                } else {
                    "unterminated tool-call block"
                };
                self.report(what.to_string(), &mut events);
            }
        }
        self.state = State::Content;
        events
    }
}

enum Step {
    /// Consumed this many bytes.
    Take(usize),
    /// Need more text.
    Wait,
    /// Malformed.
    Bad,
}

impl DsmlStreamParser {
    fn process(&mut self, events: &mut Vec<ToolStreamEvent>, at_end: bool) {
        loop {
            match self.state.clone() {
                State::Content => {
                    if let Some(pos) = self.buf.find(START) {
                        let text: String = self.buf.drain(..pos).collect();
                        self.emit_content(&text, events);
                        self.pending_ws.clear();
                        self.buf.drain(..START.len());
                        self.raw = START.to_string();
                        self.block_calls = 0;
                        self.state = State::Block;
                        continue;
                    }
                    if at_end {
                        return;
                    }
                    let keep = partial_marker_suffix(&self.buf, START);
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.emit_content(&text, events);
                    return;
                }
                State::Block => {
                    self.skip_ws();
                    match self.expect_one(&[INVOKE_OPEN, END], at_end) {
                        Step::Take(_) if self.buf.starts_with(END) => {
                            self.take(END.len());
                            self.raw.clear();
                            self.state = State::Content;
                            self.after_call = true;
                            self.pending_ws.clear();
                        }
                        Step::Take(n) => {
                            self.take(n);
                            self.state = State::InvokeHeader;
                        }
                        Step::Wait => return,
                        // The stream ended inside the end marker (or an invoke tag) after
                        // complete calls: `finish` keeps the calls.
                        Step::Bad
                            if at_end
                                && self.block_calls > 0
                                && (END.starts_with(self.buf.as_str())
                                    || INVOKE_OPEN.starts_with(self.buf.as_str())) =>
                        {
                            return;
                        }
                        Step::Bad => {
                            self.state = State::Skip(format!(
                                "expected {INVOKE_OPEN} or {END} in the tool-call block"
                            ));
                        }
                    }
                }
                State::InvokeHeader => match self.header(at_end) {
                    Step::Take(n) => {
                        let header: String = self.buf[..n].to_string();
                        self.take(n);
                        match parse_attrs(&header) {
                            Some(attrs) if attrs.len() == 1 && attrs[0].0 == "name" => {
                                let name = attrs[0].1.clone();
                                if name.is_empty() {
                                    self.state = State::Skip("empty tool name".into());
                                    continue;
                                }
                                events.push(ToolStreamEvent::ToolCallStart {
                                    index: self.next_index,
                                    name,
                                });
                                self.open = true;
                                self.names.clear();
                                self.state = State::Params;
                            }
                            _ => {
                                self.state =
                                    State::Skip(format!("malformed {INVOKE_OPEN}> header"));
                            }
                        }
                    }
                    Step::Wait => return,
                    Step::Bad => {
                        self.state = State::Skip(format!("malformed {INVOKE_OPEN}> header"));
                    }
                },
                State::Params => {
                    self.skip_ws();
                    match self.expect_one(&[PARAM_OPEN, INVOKE_CLOSE], at_end) {
                        Step::Take(_) if self.buf.starts_with(INVOKE_CLOSE) => {
                            self.take(INVOKE_CLOSE.len());
                            let index = self.next_index;
                            let text = if self.names.is_empty() { "{}" } else { "}" };
                            events.push(ToolStreamEvent::ArgumentsDelta {
                                index,
                                text: text.to_string(),
                            });
                            let raw = std::mem::take(&mut self.raw);
                            events.push(ToolStreamEvent::ToolCallEnd { index, raw });
                            self.next_index += 1;
                            self.block_calls += 1;
                            self.open = false;
                            self.state = State::Block;
                        }
                        Step::Take(n) => {
                            self.take(n);
                            self.state = State::ParamHeader;
                        }
                        Step::Wait => return,
                        Step::Bad => {
                            self.state = State::Skip(format!(
                                "expected {PARAM_OPEN} or {INVOKE_CLOSE} in an invoke"
                            ));
                        }
                    }
                }
                State::ParamHeader => match self.header(at_end) {
                    Step::Take(n) => {
                        let header: String = self.buf[..n].to_string();
                        self.take(n);
                        let attrs = parse_attrs(&header).unwrap_or_default();
                        let name = attrs.iter().find(|a| a.0 == "name").map(|a| a.1.clone());
                        let string = attrs.iter().find(|a| a.0 == "string").map(|a| a.1.as_str());
                        let string = match string {
                            None => Ok(None),
                            Some("true") => Ok(Some(true)),
                            Some("false") => Ok(Some(false)),
                            Some(other) => Err(other.to_string()),
                        };
                        let known = attrs.iter().all(|a| a.0 == "name" || a.0 == "string");
                        match (name, string) {
                            (Some(name), Ok(string)) if known && !attrs.is_empty() => {
                                if self.names.contains(&name) {
                                    self.state =
                                        State::Skip(format!("duplicate parameter name {name:?}"));
                                    continue;
                                }
                                let mut prefix =
                                    if self.names.is_empty() { "{" } else { ", " }.to_string();
                                prefix.push_str(&json_string(&name));
                                prefix.push_str(": ");
                                self.names.push(name);
                                if string == Some(true) {
                                    prefix.push('"');
                                    events.push(ToolStreamEvent::ArgumentsDelta {
                                        index: self.next_index,
                                        text: prefix,
                                    });
                                } else {
                                    self.prefix = prefix;
                                }
                                self.state = State::ParamValue(string);
                            }
                            (_, Err(v)) => {
                                self.state = State::Skip(format!(
                                    "parameter attribute string={v:?} is neither \"true\" nor \"false\""
                                ));
                            }
                            _ => {
                                self.state = State::Skip(format!("malformed {PARAM_OPEN}> header"));
                            }
                        }
                    }
                    Step::Wait => return,
                    Step::Bad => {
                        self.state = State::Skip(format!("malformed {PARAM_OPEN}> header"));
                    }
                },
                State::ParamValue(string) => {
                    let index = self.next_index;
                    match self.buf.find(PARAM_CLOSE) {
                        Some(pos) => {
                            let value: String = self.buf[..pos].to_string();
                            self.take(pos + PARAM_CLOSE.len());
                            let name = self.names.last().cloned().unwrap_or_default();
                            match string {
                                Some(true) => {
                                    let mut text = escaped(&value);
                                    text.push('"');
                                    events.push(ToolStreamEvent::ArgumentsDelta { index, text });
                                }
                                _ => {
                                    let trimmed = value.trim();
                                    let mut text = std::mem::take(&mut self.prefix);
                                    match serde_json::from_str::<Value>(trimmed) {
                                        Ok(_) => text.push_str(trimmed),
                                        Err(_) if string.is_none() => {
                                            text.push_str(&json_string(&value))
                                        }
                                        Err(e) => {
                                            self.state = State::Skip(format!(
                                                "parameter {name:?} has string=\"false\" but its value is not JSON: {e}"
                                            ));
                                            continue;
                                        }
                                    }
                                    events.push(ToolStreamEvent::ArgumentsDelta { index, text });
                                }
                            }
                            self.state = State::Params;
                        }
                        None if at_end => return,
                        None => {
                            if string == Some(true) {
                                let keep = partial_marker_suffix(&self.buf, PARAM_CLOSE);
                                let n = self.buf.len() - keep;
                                if n > 0 {
                                    let text = escaped(&self.buf[..n]);
                                    self.take(n);
                                    events.push(ToolStreamEvent::ArgumentsDelta { index, text });
                                }
                            }
                            return;
                        }
                    }
                }
                State::Skip(message) => {
                    let Some(pos) = self.buf.find(END) else {
                        return;
                    };
                    self.take(pos + END.len());
                    self.report(message, events);
                    self.state = State::Content;
                    self.after_call = true;
                    self.pending_ws.clear();
                }
            }
        }
    }

    /// Moves `n` bytes of the buffer into the raw envelope text.
    fn take(&mut self, n: usize) {
        let head: String = self.buf.drain(..n).collect();
        self.raw.push_str(&head);
    }

    fn skip_ws(&mut self) {
        let n = self.buf.len() - self.buf.trim_start().len();
        self.take(n);
    }

    /// Which of `options` the buffer starts with.
    fn expect_one(&self, options: &[&str], at_end: bool) -> Step {
        if self.buf.is_empty() {
            return if at_end { Step::Bad } else { Step::Wait };
        }
        if let Some(o) = options.iter().find(|o| self.buf.starts_with(**o)) {
            return Step::Take(o.len());
        }
        if !at_end && options.iter().any(|o| o.starts_with(self.buf.as_str())) {
            return Step::Wait;
        }
        Step::Bad
    }

    /// A tag header up to and including its `>` (within [`HEADER_LIMIT`] bytes).
    fn header(&self, at_end: bool) -> Step {
        let window = &self.buf.as_bytes()[..self.buf.len().min(HEADER_LIMIT)];
        if let Some(pos) = window.iter().position(|&b| b == b'>') {
            return Step::Take(pos + 1);
        }
        if at_end || self.buf.len() >= HEADER_LIMIT {
            Step::Bad
        } else {
            Step::Wait
        }
    }

    /// Reports the current envelope as invalid (and ends the open call, if any).
    fn report(&mut self, message: String, events: &mut Vec<ToolStreamEvent>) {
        let raw = std::mem::take(&mut self.raw);
        if self.open {
            let index = self.next_index;
            events.push(ToolStreamEvent::Invalid {
                index: Some(index),
                message,
                raw: raw.clone(),
            });
            events.push(ToolStreamEvent::ToolCallEnd { index, raw });
            self.next_index += 1;
            self.open = false;
        } else {
            events.push(ToolStreamEvent::Invalid {
                index: None,
                message,
                raw,
            });
        }
        self.names.clear();
        self.prefix.clear();
        self.after_call = true;
        self.pending_ws.clear();
    }

    /// Emits content, holding trailing whitespace and dropping whitespace after a block.
    fn emit_content(&mut self, text: &str, events: &mut Vec<ToolStreamEvent>) {
        if text.is_empty() {
            return;
        }
        let body_end = text.trim_end().len();
        if body_end == 0 {
            self.pending_ws.push_str(text);
            return;
        }
        let mut out = String::new();
        let body = if self.after_call {
            text[..body_end].trim_start()
        } else {
            out.push_str(&self.pending_ws);
            &text[..body_end]
        };
        out.push_str(body);
        self.pending_ws.clear();
        self.pending_ws.push_str(&text[body_end..]);
        self.after_call = false;
        events.push(ToolStreamEvent::ContentDelta(out));
    }
}

/// `s` JSON-escaped, without the quotes.
fn escaped(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
}

/// ` name="a" string="true">` → `[("name", "a"), ("string", "true")]`; `None` when
/// malformed. Values are taken verbatim up to the next `"`.
fn parse_attrs(header: &str) -> Option<Vec<(String, String)>> {
    let mut rest = header.strip_suffix('>')?;
    let mut out = Vec::new();
    loop {
        let trimmed = rest.trim_start();
        if trimmed.is_empty() {
            return Some(out);
        }
        if trimmed.len() == rest.len() && !out.is_empty() {
            return None; // attributes must be separated by whitespace
        }
        let (key, after) = trimmed.split_once('=')?;
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        let after = after.strip_prefix('"')?;
        let (value, after) = after.split_once('"')?;
        out.push((key.to_string(), value.to_string()));
        rest = after;
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_marker_suffix(text: &str, marker: &str) -> usize {
    let t = text.as_bytes();
    let m = marker.as_bytes();
    (1..m.len().min(t.len() + 1))
        .rev()
        .find(|&n| t.get(t.len() - n..).is_some_and(|s| m.starts_with(s)))
        .unwrap_or(0)
}
