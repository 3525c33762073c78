//! The one harness for "speculation changes nothing" (G2): run requests, keep everything each
//! stream delivered, and compare a speculative run with plain decoding event for event. Every
//! speculation test of this binary (fake backend, DeepSeek V4 fixtures, DSpark, real models)
//! goes through [`assert_spec_equals_plain`].

use lockstep_engine::{
    Engine, Event, FinishReason, GenerateRequest, RequestHandle, SpecStats, Usage,
};

/// Everything a request's stream delivered, timings aside.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// Every event before the last: tokens (ids, text, logprobs, top logprobs, digests).
    pub tokens: Vec<Event>,
    /// The finish reason, the final text and the usage, if the stream finished.
    pub finish: Option<(FinishReason, String, Usage)>,
    /// The error, if the stream ended with one.
    pub error: Option<String>,
}

impl Run {
    /// The generated token ids.
    pub fn ids(&self) -> Vec<u32> {
        self.tokens
            .iter()
            .filter_map(|e| match e {
                Event::Token { token, .. } => Some(*token),
                _ => None,
            })
            .collect()
    }

    /// The streamed text, with the text the finish event flushed.
    pub fn text(&self) -> String {
        let mut s: String = self
            .tokens
            .iter()
            .filter_map(|e| match e {
                Event::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        if let Some(f) = &self.finish {
            s.push_str(&f.1);
        }
        s
    }

    /// The speculation counters of the usage (zero if there are none).
    pub fn spec(&self) -> SpecStats {
        self.finish
            .as_ref()
            .and_then(|f| f.2.spec)
            .unwrap_or_default()
    }

    /// The same run with `cached_tokens` zeroed, for comparisons where prompt reuse depends
    /// on timing rather than on speculation.
    pub fn without_cached_tokens(&self) -> Run {
        let mut r = self.clone();
        if let Some(f) = &mut r.finish {
            f.2.cached_tokens = 0;
        }
        r
    }
}

/// Drains a request's stream.
pub fn collect(h: RequestHandle) -> Run {
    let mut run = Run {
        tokens: Vec::new(),
        finish: None,
        error: None,
    };
    for e in &h {
        match e {
            Event::Finished {
                reason,
                text,
                usage,
                ..
            } => run.finish = Some((reason, text, *usage)),
            Event::Error(e) => run.error = Some(e),
            tok => run.tokens.push(tok),
        }
    }
    run
}

/// Submits every request to `e` at once, then drains the streams in order.
pub fn run_all(e: &Engine, reqs: Vec<GenerateRequest>) -> Vec<Run> {
    let hs: Vec<_> = reqs
        .into_iter()
        .map(|r| e.submit(r).expect("request accepted"))
        .collect();
    hs.into_iter().map(collect).collect()
}

/// Speculative runs equal plain ones: for each request, neither stream failed, the plain one
/// generated something and carries no speculation counters, the speculative one does, and
/// the token events (ids, text, logprobs, top logprobs, digests), the finish reason, the
/// final text and the usage (its speculation counters aside) are identical. Returns the sum
/// of the speculative runs' counters, for the caller's "drafts were proposed, accepted,
/// rejected" checks.
pub fn assert_spec_equals_plain(plain: &[Run], spec: &[Run], what: &str) -> SpecStats {
    assert_eq!(plain.len(), spec.len(), "{what}: one run per request");
    let mut total = SpecStats::default();
    for (i, (p, s)) in plain.iter().zip(spec).enumerate() {
        assert_eq!(p.error, None, "{what} {i}: plain run");
        assert_eq!(s.error, None, "{what} {i}: speculative run");
        assert!(!p.tokens.is_empty(), "{what} {i}: generated something");
        assert_eq!(p.tokens, s.tokens, "{what} {i}: token events");
        let strip = |r: &Run| {
            r.finish.clone().map(|(reason, text, mut usage)| {
                usage.spec = None;
                (reason, text, usage)
            })
        };
        assert_eq!(strip(p), strip(s), "{what} {i}: finish and usage");
        assert!(
            p.finish.as_ref().is_some_and(|f| f.2.spec.is_none()),
            "{what} {i}: the plain run did not speculate"
        );
        let st = s
            .finish
            .as_ref()
            .and_then(|f| f.2.spec)
            .unwrap_or_else(|| panic!("{what} {i}: the speculative run has counters"));
        total.add(&st);
    }
    total
}

/// Every token event of every run carries its logit digest (the requests asked for them, so
/// [`assert_spec_equals_plain`] compares the logits bit for bit, not only the ids).
pub fn assert_digested(runs: &[Run], what: &str) {
    for (i, r) in runs.iter().enumerate() {
        assert!(
            r.tokens.iter().all(|e| matches!(
                e,
                Event::Token {
                    logit_sha256: Some(_),
                    ..
                }
            )),
            "{what} {i}: digests requested"
        );
    }
}
