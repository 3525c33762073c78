//! The output side of tools: the parser that turns generated text back into content and
//! tool calls. The request-side model and the envelope grammars are the runtime's
//! ([`runtime::tools`]), re-exported here.

use chat::{ToolCallFormat, ToolStreamEvent, ToolStreamParser};
use serde_json::Value;

pub use runtime::tools::{
    CustomFormat, ToolKind, ToolMode, ToolSetup, ToolSpec, custom_header, dsml,
};

/// What the output parser reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// Assistant text.
    Content(String),
    /// A call began.
    CallStart {
        /// Index of the call in this reply.
        index: usize,
        /// Tool name.
        name: String,
        /// A custom (raw input) call rather than a function call.
        custom: bool,
    },
    /// More arguments (function: JSON text) or input (custom: raw text).
    CallDelta {
        /// Index of the call.
        index: usize,
        /// The text.
        text: String,
    },
    /// A call is complete.
    CallEnd {
        /// Index of the call.
        index: usize,
    },
}

/// Splits generated text into content and tool calls as it streams.
pub struct OutputParser {
    inner: Option<Box<dyn ToolStreamParser>>,
    start_marker: String,
    end_marker: String,
    /// Parser index → our index (custom calls are recovered from invalid envelopes).
    index_map: Vec<(usize, usize)>,
    next_index: usize,
    custom_names: Vec<String>,
}

impl std::fmt::Debug for OutputParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputParser")
            .field("tools", &self.inner.is_some())
            .field("calls", &self.next_index)
            .finish()
    }
}

impl OutputParser {
    /// Plain text: everything is content.
    pub fn plain() -> OutputParser {
        OutputParser {
            inner: None,
            start_marker: String::new(),
            end_marker: String::new(),
            index_map: Vec::new(),
            next_index: 0,
            custom_names: Vec::new(),
        }
    }

    /// Tool-call parsing in `format`; `setup` names the custom tools.
    pub fn tools(format: &dyn ToolCallFormat, setup: &ToolSetup) -> OutputParser {
        OutputParser {
            inner: Some(format.stream_parser()),
            start_marker: format.start_marker().to_string(),
            end_marker: format.end_marker().to_string(),
            index_map: Vec::new(),
            next_index: 0,
            custom_names: setup
                .tools
                .iter()
                .filter(|t| matches!(t.kind, ToolKind::Custom { .. }))
                .map(|t| t.name.clone())
                .collect(),
        }
    }

    /// Calls reported so far.
    pub fn calls(&self) -> usize {
        self.next_index
    }

    /// Feeds a delta of generated text.
    pub fn feed(&mut self, text: &str) -> Vec<OutputEvent> {
        match self.inner.as_mut() {
            None => {
                if text.is_empty() {
                    Vec::new()
                } else {
                    vec![OutputEvent::Content(text.to_string())]
                }
            }
            Some(p) => {
                let events = p.feed(text);
                self.translate(events)
            }
        }
    }

    /// Ends the text.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        match self.inner.as_mut() {
            None => Vec::new(),
            Some(p) => {
                let events = p.finish();
                self.translate(events)
            }
        }
    }

    fn map_index(&mut self, parser_index: usize) -> usize {
        if let Some(&(_, ours)) = self.index_map.iter().find(|(p, _)| *p == parser_index) {
            return ours;
        }
        let ours = self.next_index;
        self.next_index += 1;
        self.index_map.push((parser_index, ours));
        ours
    }

    fn translate(&mut self, events: Vec<ToolStreamEvent>) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolStreamEvent::ContentDelta(t) => {
                    if !t.is_empty() {
                        out.push(OutputEvent::Content(t));
                    }
                }
                ToolStreamEvent::ToolCallStart { index, name } => {
                    let index = self.map_index(index);
                    out.push(OutputEvent::CallStart {
                        index,
                        name,
                        custom: false,
                    });
                }
                ToolStreamEvent::ArgumentsDelta { index, text } => {
                    let index = self.map_index(index);
                    out.push(OutputEvent::CallDelta { index, text });
                }
                ToolStreamEvent::ToolCallEnd { index, .. } => {
                    let index = self.map_index(index);
                    out.push(OutputEvent::CallEnd { index });
                }
                ToolStreamEvent::Invalid {
                    index: None, raw, ..
                } => match self.parse_custom(&raw) {
                    Some((name, input)) => {
                        let index = self.next_index;
                        self.next_index += 1;
                        out.push(OutputEvent::CallStart {
                            index,
                            name,
                            custom: true,
                        });
                        out.push(OutputEvent::CallDelta { index, text: input });
                        out.push(OutputEvent::CallEnd { index });
                    }
                    None => out.push(OutputEvent::Content(raw)),
                },
                // A started call whose arguments turned out invalid: its end follows.
                ToolStreamEvent::Invalid { index: Some(_), .. } => {}
            }
        }
        out
    }

    /// A custom-call envelope: `(name, input)`.
    fn parse_custom(&self, raw: &str) -> Option<(String, String)> {
        let body = raw.strip_prefix(self.start_marker.as_str())?;
        let body = body.strip_prefix('\n').unwrap_or(body);
        let (header, rest) = body.split_once('\n')?;
        let header: Value = serde_json::from_str(header).ok()?;
        let name = header.get("name")?.as_str()?.to_string();
        if header.get("type").and_then(Value::as_str) != Some("custom")
            || !self.custom_names.contains(&name)
        {
            return None;
        }
        let input = rest.strip_suffix(self.end_marker.as_str()).unwrap_or(rest);
        let input = input.strip_suffix('\n').unwrap_or(input);
        Some((name, input.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn setup(mode: ToolMode, parallel: bool) -> ToolSetup {
        ToolSetup {
            tools: vec![
                ToolSpec {
                    name: "get_weather".into(),
                    description: Some("Weather".into()),
                    kind: ToolKind::Function {
                        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                    },
                },
                ToolSpec {
                    name: "shell".into(),
                    description: None,
                    kind: ToolKind::Custom {
                        format: CustomFormat::Lark("start: \"ls \" /[a-z]+/".into()),
                    },
                },
            ],
            mode,
            parallel,
        }
    }

    #[test]
    fn custom_calls_are_recovered_from_their_envelope() {
        let s = setup(ToolMode::Auto, true);
        let mut p = OutputParser::tools(&chat::HermesFormat, &s);
        let text = "Sure.\n<tool_call>\n{\"name\": \"shell\", \"type\": \"custom\"}\nls abc\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let mut events = Vec::new();
        for piece in text.as_bytes().chunks(5) {
            events.extend(p.feed(std::str::from_utf8(piece).unwrap()));
        }
        events.extend(p.finish());
        let content: String = events
            .iter()
            .filter_map(|e| match e {
                OutputEvent::Content(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(content, "Sure.");
        let starts: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                OutputEvent::CallStart {
                    index,
                    name,
                    custom,
                } => Some((*index, name.clone(), *custom)),
                _ => None,
            })
            .collect();
        assert_eq!(
            starts,
            vec![
                (0, "shell".to_string(), true),
                (1, "get_weather".to_string(), false)
            ]
        );
        let input: String = events
            .iter()
            .filter_map(|e| match e {
                OutputEvent::CallDelta { index: 0, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(input, "ls abc");
        let args: String = events
            .iter()
            .filter_map(|e| match e {
                OutputEvent::CallDelta { index: 1, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&args).unwrap(),
            json!({"city": "Paris"})
        );
    }
}
