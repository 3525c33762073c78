//! Running a [`Job`]: one engine request per choice, their blocking event streams bridged
//! into one async stream of [`RunEvent`]s (text split into content and tool calls, token
//! log-probabilities, the finish). Dropping the [`Run`] drops the bridges' receivers; each
//! bridge then drops its engine handle, which cancels the sequence.

use std::sync::Arc;

use engine::{Event, FinishReason, StopCause, Usage};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::Job;
use crate::tools::{OutputEvent, OutputParser};
use runtime::Runtime;

/// One generated token's log-probability data.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy UTF-8 of its bytes).
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// The best alternatives: `(text, bytes, logprob)`.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// What a run reports, per choice.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    /// Reasoning text (the `<think>…</think>` segment of a job with
    /// [`Job::thinking`]), reported before any content.
    Thinking {
        /// Choice index.
        choice: usize,
        /// The text.
        text: String,
    },
    /// Content text.
    Content {
        /// Choice index.
        choice: usize,
        /// The text.
        text: String,
    },
    /// Log-probabilities of newly generated tokens (reported before the text they made).
    Logprobs {
        /// Choice index.
        choice: usize,
        /// Per token.
        tokens: Vec<TokenLogprob>,
    },
    /// A tool call began.
    CallStart {
        /// Choice index.
        choice: usize,
        /// Call index within the choice.
        index: usize,
        /// Tool name.
        name: String,
        /// A custom tool (raw input) rather than a function.
        custom: bool,
    },
    /// More of a call's arguments / input.
    CallDelta {
        /// Choice index.
        choice: usize,
        /// Call index.
        index: usize,
        /// The text.
        text: String,
    },
    /// A call is complete.
    CallEnd {
        /// Choice index.
        choice: usize,
        /// Call index.
        index: usize,
    },
    /// The choice ended.
    Done {
        /// Choice index.
        choice: usize,
        /// OpenAI finish reason (`tool_calls` when the reply holds calls).
        finish_reason: &'static str,
        /// Token counts.
        usage: Box<Usage>,
        /// The index of the stop string that ended the choice, if one did.
        stop_string: Option<usize>,
    },
    /// The choice failed.
    Failed {
        /// Choice index.
        choice: usize,
        /// Why.
        message: String,
    },
}

struct Bridged {
    choice: usize,
    event: Event,
}

/// A running job.
pub struct Run {
    rx: mpsc::Receiver<Bridged>,
    parsers: Vec<OutputParser>,
    thinkers: Vec<Option<ThinkSplitter>>,
    pending: std::collections::VecDeque<RunEvent>,
    open: usize,
    want_logprobs: bool,
    model: Arc<Runtime>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run").field("open", &self.open).finish()
    }
}

impl Run {
    /// Submits every choice of `job`, all or none (a refused group queues nothing). Must be called inside the tokio runtime.
    pub fn start(model: Arc<Runtime>, metrics: Arc<Metrics>, job: &Job) -> Result<Run, ApiError> {
        Run::start_with(model, metrics, job, false)
    }

    /// [`Run::start`], with plain decoding for every choice when `plain` (the request's
    /// `speculation: false` on a server that speculates).
    pub fn start_with(
        model: Arc<Runtime>,
        metrics: Arc<Metrics>,
        job: &Job,
        plain: bool,
    ) -> Result<Run, ApiError> {
        let mut requests = job.requests(&model);
        for r in &mut requests {
            r.no_spec |= plain;
        }
        let handles = model.engine().submit_group(requests)?;
        let (tx, rx) = mpsc::channel(1024);
        for (choice, handle) in handles.into_iter().enumerate() {
            let tx = tx.clone();
            tokio::task::spawn_blocking(move || {
                for event in &handle {
                    if tx.blocking_send(Bridged { choice, event }).is_err() {
                        // The client went away: dropping the handle cancels the sequence.
                        break;
                    }
                }
                drop(handle);
            });
        }
        let parsers = (0..job.n)
            .map(|_| match &job.tools {
                Some(setup) if setup.active() => OutputParser::tools(model.tool_format(), setup),
                _ => OutputParser::plain(),
            })
            .collect();
        Ok(Run {
            rx,
            parsers,
            thinkers: (0..job.n)
                .map(|_| job.thinking.map(ThinkSplitter::new))
                .collect(),
            pending: Default::default(),
            open: job.n,
            want_logprobs: job.logprobs.is_some(),
            model,
            metrics,
        })
    }

    /// The next event; `None` once every choice has ended.
    pub async fn next(&mut self) -> Option<RunEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.open == 0 {
                return None;
            }
            match self.rx.recv().await {
                Some(b) => self.absorb(b),
                None => {
                    // Every bridge ended without a final event (engine gone).
                    self.open = 0;
                    self.pending.push_back(RunEvent::Failed {
                        choice: 0,
                        message: "the engine stopped".into(),
                    });
                }
            }
        }
    }

    fn absorb(&mut self, b: Bridged) {
        let choice = b.choice;
        let Some(parser) = self.parsers.get_mut(choice) else {
            return;
        };
        match b.event {
            Event::Token {
                token,
                text,
                logprob,
                top_logprobs,
                ..
            } => {
                if self.want_logprobs {
                    let tok = self.model.tokenizer();
                    let piece = |id: u32| {
                        let bytes = tok.token_bytes(id).unwrap_or(&[]).to_vec();
                        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
                    };
                    let (t, bytes) = piece(token);
                    let top = top_logprobs
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(id, lp)| {
                            let (t, b) = piece(id);
                            (t, b, lp)
                        })
                        .collect();
                    self.pending.push_back(RunEvent::Logprobs {
                        choice,
                        tokens: vec![TokenLogprob {
                            token: t,
                            bytes,
                            logprob,
                            top,
                        }],
                    });
                }
                let answer = split_thinking(
                    self.thinkers.get_mut(choice).and_then(Option::as_mut),
                    &mut self.pending,
                    choice,
                    &text,
                    false,
                );
                let events = parser.feed(&answer);
                push_output(&mut self.pending, choice, events);
            }
            Event::Finished {
                reason,
                text,
                usage,
                timings,
            } => {
                let answer = split_thinking(
                    self.thinkers.get_mut(choice).and_then(Option::as_mut),
                    &mut self.pending,
                    choice,
                    &text,
                    true,
                );
                let mut events = parser.feed(&answer);
                events.extend(parser.finish());
                push_output(&mut self.pending, choice, events);
                // A reply cut off by a limit reports the limit, even inside a call.
                let finish_reason = match reason {
                    FinishReason::Stop(_) | FinishReason::ToolCalls if parser.calls() > 0 => {
                        "tool_calls"
                    }
                    other => finish_str(other),
                };
                self.metrics.observe_finished(&usage, &timings);
                self.open = self.open.saturating_sub(1);
                let stop_string = match reason {
                    FinishReason::Stop(StopCause::StopString { index }) => Some(index),
                    _ => None,
                };
                self.pending.push_back(RunEvent::Done {
                    choice,
                    finish_reason,
                    usage,
                    stop_string,
                });
            }
            Event::Error(message) => {
                self.open = self.open.saturating_sub(1);
                self.metrics.observe_failed();
                self.pending.push_back(RunEvent::Failed { choice, message });
            }
        }
    }
}

/// Feeds `text` through the choice's reasoning splitter (if any): reasoning becomes
/// [`RunEvent::Thinking`] events, the answer part is returned for the output parser.
fn split_thinking(
    splitter: Option<&mut ThinkSplitter>,
    pending: &mut std::collections::VecDeque<RunEvent>,
    choice: usize,
    text: &str,
    last: bool,
) -> String {
    let Some(s) = splitter else {
        return text.to_string();
    };
    let (thinking, answer) = s.feed(text, last);
    if !thinking.is_empty() {
        pending.push_back(RunEvent::Thinking {
            choice,
            text: thinking,
        });
    }
    answer
}

/// Splits a leading reasoning segment `<think>…</think>` off streamed text. The text after
/// `</think>` (leading newlines dropped) is the answer. A model that was not put inside
/// the segment by its prompt may open it itself; if its output does not start with
/// `<think>`, all of it is answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkSplitter {
    state: ThinkState,
    buf: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkState {
    /// Not yet known whether the output opens a segment.
    Start,
    /// Inside the segment.
    Thinking,
    /// After it: newlines right after `</think>` are still dropped.
    AnswerStart,
    /// The answer.
    Answer,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

impl ThinkSplitter {
    /// A splitter for an output that starts inside the segment (`opened`: the prompt
    /// ends with `<think>`) or may open one.
    pub fn new(opened: bool) -> ThinkSplitter {
        ThinkSplitter {
            state: if opened {
                ThinkState::Thinking
            } else {
                ThinkState::Start
            },
            buf: String::new(),
        }
    }

    /// Feeds a delta; returns `(reasoning, answer)` text that is now certain. `last`
    /// flushes what was held back (a possible partial marker).
    pub fn feed(&mut self, text: &str, last: bool) -> (String, String) {
        let mut thinking = String::new();
        let mut answer = String::new();
        self.buf.push_str(text);
        loop {
            match self.state {
                ThinkState::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.state = ThinkState::Thinking;
                    } else if THINK_OPEN.starts_with(t) && !last {
                        break;
                    } else {
                        self.state = ThinkState::Answer;
                    }
                }
                ThinkState::Thinking => {
                    if let Some(pos) = self.buf.find(THINK_CLOSE) {
                        thinking.push_str(&self.buf[..pos]);
                        self.buf = self.buf[pos + THINK_CLOSE.len()..].to_string();
                        self.state = ThinkState::AnswerStart;
                    } else {
                        // Hold back a tail that could be the start of `</think>`.
                        let keep = if last {
                            0
                        } else {
                            (1..THINK_CLOSE.len())
                                .rev()
                                .find(|&k| {
                                    self.buf.len() >= k
                                        && self.buf.is_char_boundary(self.buf.len() - k)
                                        && THINK_CLOSE.starts_with(&self.buf[self.buf.len() - k..])
                                })
                                .unwrap_or(0)
                        };
                        let cut = self.buf.len() - keep;
                        thinking.push_str(&self.buf[..cut]);
                        self.buf.drain(..cut);
                        break;
                    }
                }
                ThinkState::AnswerStart => {
                    let t = self.buf.trim_start_matches(['\n', '\r']);
                    if t.is_empty() {
                        self.buf.clear();
                        break;
                    }
                    self.buf = t.to_string();
                    self.state = ThinkState::Answer;
                }
                ThinkState::Answer => {
                    answer.push_str(&self.buf);
                    self.buf.clear();
                    break;
                }
            }
        }
        (thinking, answer)
    }
}

fn finish_str(reason: FinishReason) -> &'static str {
    reason.as_openai_str()
}

fn push_output(
    pending: &mut std::collections::VecDeque<RunEvent>,
    choice: usize,
    events: Vec<OutputEvent>,
) {
    for e in events {
        pending.push_back(match e {
            OutputEvent::Content(text) => RunEvent::Content { choice, text },
            OutputEvent::CallStart {
                index,
                name,
                custom,
            } => RunEvent::CallStart {
                choice,
                index,
                name,
                custom,
            },
            OutputEvent::CallDelta { index, text } => RunEvent::CallDelta {
                choice,
                index,
                text,
            },
            OutputEvent::CallEnd { index } => RunEvent::CallEnd { choice, index },
        });
    }
}

/// A whole choice, gathered from a run (for non-streaming responses).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceResult {
    /// Reasoning text (jobs with [`Job::thinking`]).
    pub thinking: String,
    /// Content text.
    pub content: String,
    /// Tool calls: `(name, arguments or input, custom)`.
    pub calls: Vec<(String, String, bool)>,
    /// Token log-probabilities (when asked).
    pub logprobs: Vec<TokenLogprob>,
    /// Finish reason.
    pub finish_reason: &'static str,
    /// Token counts.
    pub usage: Usage,
    /// The index of the stop string that ended the choice, if one did.
    pub stop_string: Option<usize>,
}

/// Runs to the end and gathers every choice. The first failed choice fails the whole run.
pub async fn collect(mut run: Run, n: usize) -> Result<Vec<ChoiceResult>, ApiError> {
    let mut out = vec![ChoiceResult::default(); n];
    while let Some(e) = run.next().await {
        match e {
            RunEvent::Thinking { choice, text } => {
                if let Some(c) = out.get_mut(choice) {
                    c.thinking.push_str(&text);
                }
            }
            RunEvent::Content { choice, text } => {
                if let Some(c) = out.get_mut(choice) {
                    c.content.push_str(&text);
                }
            }
            RunEvent::Logprobs { choice, tokens } => {
                if let Some(c) = out.get_mut(choice) {
                    c.logprobs.extend(tokens);
                }
            }
            RunEvent::CallStart {
                choice,
                name,
                custom,
                ..
            } => {
                if let Some(c) = out.get_mut(choice) {
                    c.calls.push((name, String::new(), custom));
                }
            }
            RunEvent::CallDelta {
                choice,
                index,
                text,
            } => {
                if let Some(call) = out.get_mut(choice).and_then(|c| c.calls.get_mut(index)) {
                    call.1.push_str(&text);
                }
            }
            RunEvent::CallEnd { .. } => {}
            RunEvent::Done {
                choice,
                finish_reason,
                usage,
                stop_string,
            } => {
                if let Some(c) = out.get_mut(choice) {
                    c.finish_reason = finish_reason;
                    c.usage = *usage;
                    c.stop_string = stop_string;
                }
            }
            RunEvent::Failed { message, .. } => {
                return Err(ApiError::Internal(format!("generation failed: {message}")));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and gathers `(reasoning, answer)`.
    fn split(opened: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ThinkSplitter::new(opened);
        let (mut t, mut a) = (String::new(), String::new());
        for (i, p) in pieces.iter().enumerate() {
            let (x, y) = s.feed(p, i + 1 == pieces.len());
            t.push_str(&x);
            a.push_str(&y);
        }
        (t, a)
    }

    #[test]
    fn reasoning_is_split_at_the_closing_marker_even_across_pieces() {
        assert_eq!(
            split(true, &["Let me", " think.</th", "ink>\n\nHello", "!"]),
            ("Let me think.".into(), "Hello!".into())
        );
        assert_eq!(
            split(false, &["<thi", "nk>\nhm</think>", "\n", "Yes"]),
            ("\nhm".into(), "Yes".into())
        );
        // A model that does not open the segment answers directly.
        assert_eq!(
            split(false, &["<b>", "bold</b>"]),
            (String::new(), "<b>bold</b>".into())
        );
        // Cut off while thinking: everything is reasoning, the held-back tail included.
        assert_eq!(
            split(true, &["still going </thi"]),
            ("still going </thi".into(), String::new())
        );
    }
}
