//! Qwen/Hermes envelope: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`.
//!
//! Streaming: once `{"name": "<name>", "arguments":` has been read the call starts and the
//! arguments object streams as it is generated, holding back trailing `}`/whitespace (the
//! closing brace of the outer object) and any partial end marker. Bodies in another shape
//! (keys in another order, `parameters`, arguments as a JSON string) are buffered to the end
//! marker and parsed whole.

use serde_json::Value;

use super::{ToolCallFormat, ToolStreamEvent, ToolStreamParser};
use crate::pyjson::json_string;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// The Qwen2.5 / Hermes `<tool_call>` JSON envelope.
#[derive(Debug, Clone, Copy, Default)]
pub struct HermesFormat;

impl ToolCallFormat for HermesFormat {
    fn name(&self) -> &str {
        "hermes"
    }

    fn start_marker(&self) -> &str {
        START
    }

    fn end_marker(&self) -> &str {
        END
    }

    fn stream_parser(&self) -> Box<dyn ToolStreamParser> {
        Box::new(HermesStreamParser::default())
    }

    fn render_call(&self, name: &str, arguments_json: &str) -> String {
        format!(
            "{START}\n{{\"name\": {}, \"arguments\": {arguments_json}}}\n{END}",
            json_string(name)
        )
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Ordinary text.
    #[default]
    Content,
    /// After the start marker, reading `{"name": …, "arguments":`.
    Header,
    /// Streaming the arguments object.
    Arguments,
    /// Body in another shape: buffered to the end marker.
    Buffered,
}

/// Streaming parser for [`HermesFormat`].
#[derive(Debug, Default)]
struct HermesStreamParser {
    state: State,
    /// Received, not yet processed text.
    buf: String,
    /// Content whitespace held until it is known not to border an envelope.
    pending_ws: String,
    /// The last thing processed was an envelope: following whitespace is dropped.
    after_call: bool,
    /// Index of the next call.
    next_index: usize,
    /// The current envelope as generated so far.
    raw: String,
    /// Arguments text already emitted for the current call.
    args: String,
}

enum Header {
    /// `name` and the byte length consumed, up to (excluding) the `{` of the arguments.
    Matched(String, usize),
    Incomplete,
    Mismatch,
}

impl ToolStreamParser for HermesStreamParser {
    fn feed(&mut self, delta: &str) -> Vec<ToolStreamEvent> {
        self.buf.push_str(delta);
        let mut events = Vec::new();
        self.process(&mut events, false);
        events
    }

    fn finish(&mut self) -> Vec<ToolStreamEvent> {
        let mut events = Vec::new();
        self.process(&mut events, true);
        match self.state {
            State::Content => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_content(&rest, &mut events);
                let ws = std::mem::take(&mut self.pending_ws);
                if !self.after_call && !ws.is_empty() {
                    events.push(ToolStreamEvent::ContentDelta(ws));
                }
            }
            State::Header | State::Buffered => {
                let body = std::mem::take(&mut self.buf);
                self.raw.push_str(&body);
                self.finish_buffered(&body, &mut events);
            }
            State::Arguments => {
                let body = std::mem::take(&mut self.buf);
                self.raw.push_str(&body);
                self.finish_arguments(&body, &mut events);
            }
        }
        self.state = State::Content;
        events
    }
}

impl HermesStreamParser {
    fn process(&mut self, events: &mut Vec<ToolStreamEvent>, at_end: bool) {
        loop {
            match self.state {
                State::Content => {
                    if let Some(pos) = self.buf.find(START) {
                        let text: String = self.buf.drain(..pos).collect();
                        self.emit_content(&text, events);
                        self.pending_ws.clear();
                        self.buf.drain(..START.len());
                        self.raw = START.to_string();
                        self.args.clear();
                        self.state = State::Header;
                        continue;
                    }
                    if at_end {
                        return;
                    }
                    let keep = partial_marker_suffix(&self.buf, START);
                    let emit_len = self.buf.len() - keep;
                    let text: String = self.buf.drain(..emit_len).collect();
                    self.emit_content(&text, events);
                    return;
                }
                // The header is read only up to the first end marker, so that a marker
                // inside the name ends the envelope however the text was chunked.
                State::Header => match parse_header(match self.buf.find(END) {
                    Some(end) => &self.buf[..end],
                    None => &self.buf,
                }) {
                    Header::Matched(name, consumed) => {
                        let head: String = self.buf.drain(..consumed).collect();
                        self.raw.push_str(&head);
                        events.push(ToolStreamEvent::ToolCallStart {
                            index: self.next_index,
                            name,
                        });
                        self.state = State::Arguments;
                    }
                    Header::Incomplete if !self.buf.contains(END) => return,
                    Header::Incomplete | Header::Mismatch => self.state = State::Buffered,
                },
                State::Arguments => {
                    if let Some(pos) = self.buf.find(END) {
                        let body: String = self.buf.drain(..pos).collect();
                        self.buf.drain(..END.len());
                        self.raw.push_str(&body);
                        self.raw.push_str(END);
                        self.finish_arguments(&body, events);
                        continue;
                    }
                    if at_end {
                        return;
                    }
                    let keep = partial_marker_suffix(&self.buf, END);
                    let safe = &self.buf[..self.buf.len() - keep];
                    let emit_len = safe
                        .trim_end_matches(|c: char| c.is_whitespace() || c == '}')
                        .len();
                    if emit_len > 0 {
                        let text: String = self.buf.drain(..emit_len).collect();
                        self.raw.push_str(&text);
                        self.args.push_str(&text);
                        events.push(ToolStreamEvent::ArgumentsDelta {
                            index: self.next_index,
                            text,
                        });
                    }
                    return;
                }
                State::Buffered => {
                    let Some(pos) = self.buf.find(END) else {
                        return;
                    };
                    let body: String = self.buf.drain(..pos).collect();
                    self.buf.drain(..END.len());
                    self.raw.push_str(&body);
                    self.raw.push_str(END);
                    self.finish_buffered(&body, events);
                }
            }
        }
    }

    /// Emits content, holding trailing whitespace and dropping whitespace after a call.
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

    /// Closes a streamed call: `rest` is the not yet emitted arguments text up to the end
    /// marker (or the end of the stream).
    fn finish_arguments(&mut self, rest: &str, events: &mut Vec<ToolStreamEvent>) {
        let index = self.next_index;
        let mut full = std::mem::take(&mut self.args);
        full.push_str(rest);
        let trimmed = full.trim_end();
        // The text normally ends with the outer object's `}`; tolerate a missing one.
        let candidates = [trimmed.strip_suffix('}').map(str::trim_end), Some(trimmed)];
        let valid = candidates
            .into_iter()
            .flatten()
            .find(|c| matches!(serde_json::from_str::<Value>(c), Ok(Value::Object(_))));
        let (args_text, error) = match valid {
            Some(a) => (a, None),
            None => (
                trimmed,
                Some(
                    match serde_json::from_str::<Value>(&format!("{{\"a\":{trimmed}")) {
                        Err(e) => format!("arguments are not a valid JSON object: {e}"),
                        Ok(_) => "arguments are not a valid JSON object".to_string(),
                    },
                ),
            ),
        };
        let emitted = full.len() - rest.len();
        if args_text.len() > emitted {
            events.push(ToolStreamEvent::ArgumentsDelta {
                index,
                text: args_text[emitted..].to_string(),
            });
        }
        let raw = std::mem::take(&mut self.raw);
        if let Some(message) = error {
            events.push(ToolStreamEvent::Invalid {
                index: Some(index),
                message,
                raw: raw.clone(),
            });
        }
        events.push(ToolStreamEvent::ToolCallEnd { index, raw });
        self.close_call();
    }

    /// Parses a buffered body whole.
    fn finish_buffered(&mut self, body: &str, events: &mut Vec<ToolStreamEvent>) {
        let raw = std::mem::take(&mut self.raw);
        match parse_body(body) {
            Ok((name, arguments)) => {
                let index = self.next_index;
                events.push(ToolStreamEvent::ToolCallStart { index, name });
                events.push(ToolStreamEvent::ArgumentsDelta {
                    index,
                    text: arguments.to_string(),
                });
                events.push(ToolStreamEvent::ToolCallEnd { index, raw });
                self.close_call();
            }
            Err(message) => {
                events.push(ToolStreamEvent::Invalid {
                    index: None,
                    message,
                    raw,
                });
                self.state = State::Content;
                self.after_call = true;
            }
        }
    }

    fn close_call(&mut self) {
        self.next_index += 1;
        self.state = State::Content;
        self.after_call = true;
        self.pending_ws.clear();
        self.args.clear();
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

/// Reads `{"name": "<string>", "arguments":` (whitespace anywhere between tokens) up to
/// the `{` that opens the arguments.
fn parse_header(s: &str) -> Header {
    let mut pos = 0;
    let steps: [&str; 3] = ["{", "\"name\"", ":"];
    for lit in steps {
        pos = skip_ws(s, pos);
        match expect(s, pos, lit) {
            Some(Some(p)) => pos = p,
            Some(None) => return Header::Mismatch,
            None => return Header::Incomplete,
        }
    }
    pos = skip_ws(s, pos);
    let (name, after) = match json_string_at(s, pos) {
        StringScan::Done(name, after) => (name, after),
        StringScan::Incomplete => return Header::Incomplete,
        StringScan::Invalid => return Header::Mismatch,
    };
    pos = after;
    for lit in [",", "\"arguments\"", ":"] {
        pos = skip_ws(s, pos);
        match expect(s, pos, lit) {
            Some(Some(p)) => pos = p,
            Some(None) => return Header::Mismatch,
            None => return Header::Incomplete,
        }
    }
    pos = skip_ws(s, pos);
    match s.as_bytes().get(pos) {
        None => Header::Incomplete,
        Some(b'{') => Header::Matched(name, pos),
        Some(_) => Header::Mismatch,
    }
}

fn skip_ws(s: &str, pos: usize) -> usize {
    let rest = s.get(pos..).unwrap_or("");
    pos + (rest.len() - rest.trim_start().len())
}

/// `None`: text ends inside the literal; `Some(None)`: mismatch; `Some(Some(p))`: matched.
fn expect(s: &str, pos: usize, lit: &str) -> Option<Option<usize>> {
    let rest = s.as_bytes().get(pos..).unwrap_or(&[]);
    if rest.starts_with(lit.as_bytes()) {
        Some(Some(pos + lit.len()))
    } else if lit.as_bytes().starts_with(rest) {
        None
    } else {
        Some(None)
    }
}

enum StringScan {
    Done(String, usize),
    Incomplete,
    Invalid,
}

/// A JSON string literal starting at `pos`.
fn json_string_at(s: &str, pos: usize) -> StringScan {
    let bytes = s.as_bytes();
    match bytes.get(pos) {
        None => return StringScan::Incomplete,
        Some(b'"') => {}
        Some(_) => return StringScan::Invalid,
    }
    let mut i = pos + 1;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' => i += 2,
            b'"' => {
                return match s
                    .get(pos..=i)
                    .and_then(|lit| serde_json::from_str::<String>(lit).ok())
                {
                    Some(name) => StringScan::Done(name, i + 1),
                    None => StringScan::Invalid,
                };
            }
            _ => i += 1,
        }
    }
    StringScan::Incomplete
}

/// A whole body: a JSON object with a string `name` and `arguments` (or `parameters`)
/// that is an object or a string holding one.
fn parse_body(body: &str) -> Result<(String, Value), String> {
    let trimmed = body.trim();
    if trimmed.is_empty() {
        return Err("empty tool call".to_string());
    }
    let value = match serde_json::from_str::<Value>(trimmed) {
        Ok(v) => v,
        // A missing closing brace is a common slip of small models.
        Err(e) => serde_json::from_str::<Value>(&format!("{trimmed}}}"))
            .map_err(|_| format!("tool call is not valid JSON: {e}"))?,
    };
    let Value::Object(mut obj) = value else {
        return Err("tool call is not a JSON object".to_string());
    };
    let name = match obj.remove("name") {
        Some(Value::String(n)) => n,
        Some(_) => return Err("tool call 'name' is not a string".to_string()),
        None => return Err("tool call has no 'name'".to_string()),
    };
    let arguments = obj
        .remove("arguments")
        .or_else(|| obj.remove("parameters"))
        .unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match arguments {
        Value::String(s) => serde_json::from_str::<Value>(&s)
            .map_err(|e| format!("tool call 'arguments' string is not JSON: {e}"))?,
        other => other,
    };
    if !arguments.is_object() {
        return Err("tool call 'arguments' is not a JSON object".to_string());
    }
    Ok((name, arguments))
}
