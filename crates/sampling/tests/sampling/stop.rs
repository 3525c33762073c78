//! Stop strings over streamed text: held-back prefixes, the first-ending stop wins, and any
//! chunking gives the same emitted text and the same decision as the whole text.

use lockstep_sampling::{FinishReason, StopCause, StopChecker, StopError, StopStep};
use proptest::prelude::*;

/// Feed `chunks`; return (all emitted text, the stop index if one fired).
fn run(stops: &[String], chunks: &[&str]) -> (String, Option<usize>) {
    let mut c = StopChecker::new(stops.iter().cloned()).unwrap();
    let mut out = String::new();
    for chunk in chunks {
        match c.push(chunk) {
            StopStep::Continue { emit } => out.push_str(&emit),
            StopStep::Stopped { emit, stop_index } => {
                out.push_str(&emit);
                return (out, Some(stop_index));
            }
        }
    }
    out.push_str(&c.finish());
    (out, None)
}

/// The definition, char by char: stop at the first end position where some stop string ends
/// (the longest such, then the lowest index); emit the text before it.
fn reference(stops: &[String], text: &str) -> (String, Option<usize>) {
    let ends: Vec<usize> = text
        .char_indices()
        .map(|(i, ch)| i + ch.len_utf8())
        .collect();
    for end in ends {
        let mut best: Option<(usize, usize)> = None; // (start, index)
        for (i, s) in stops.iter().enumerate() {
            if end >= s.len()
                && text.is_char_boundary(end - s.len())
                && text[..end].ends_with(s.as_str())
            {
                let cand = (end - s.len(), i);
                if best.is_none_or(|b| cand < b) {
                    best = Some(cand);
                }
            }
        }
        if let Some((start, i)) = best {
            return (text[..start].to_string(), Some(i));
        }
    }
    (text.to_string(), None)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[test]
fn a_stop_spanning_deltas_is_held_back_then_dropped() {
    let stops = s(&["</end>"]);
    let mut c = StopChecker::new(stops.iter().cloned()).unwrap();
    assert_eq!(
        c.push("hello </"),
        StopStep::Continue {
            emit: "hello ".into()
        }
    );
    assert_eq!(c.held(), "</");
    assert_eq!(
        c.push("en"),
        StopStep::Continue {
            emit: String::new()
        }
    );
    assert_eq!(
        c.push("d> tail"),
        StopStep::Stopped {
            emit: String::new(),
            stop_index: 0
        }
    );
    assert_eq!(c.stopped(), Some(0));
    assert_eq!(c.finish(), "");
    // A false start is released as soon as it can no longer be a stop.
    let mut c = StopChecker::new(stops.iter().cloned()).unwrap();
    assert_eq!(c.push("a </e"), StopStep::Continue { emit: "a ".into() });
    assert_eq!(
        c.push("x"),
        StopStep::Continue {
            emit: "</ex".into()
        }
    );
    assert_eq!(
        c.push("</"),
        StopStep::Continue {
            emit: String::new()
        }
    );
    assert_eq!(c.finish(), "</");
}

#[test]
fn the_stop_that_ends_first_wins() {
    // "abc" ends at 3, "bcd" at 4: token-by-token generation stops at "abc".
    assert_eq!(run(&s(&["bcd", "abc"]), &["xabcd"]), ("x".into(), Some(1)));
    // Same end: the longer (earlier-starting) one, so less text is emitted.
    assert_eq!(run(&s(&["bc", "abc"]), &["xabc"]), ("x".into(), Some(1)));
    // A stop that is a prefix of another fires first.
    assert_eq!(
        run(&s(&["abc", "ab"]), &["xab", "c"]),
        ("x".into(), Some(1))
    );
    assert_eq!(run(&s(&["abc", "ab"]), &["xabc"]), ("x".into(), Some(1)));
}

#[test]
fn no_stops_pass_text_through_and_empty_stops_are_rejected() {
    assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
    assert_eq!(
        StopChecker::new(["ok", ""]).err(),
        Some(StopError::EmptyStopString { index: 1 })
    );
}

#[test]
fn multibyte_text_is_only_cut_at_char_boundaries() {
    let stops = s(&["é!", "ü"]);
    assert_eq!(
        run(&stops, &["caf", "é", "!", "x"]),
        ("caf".into(), Some(0))
    );
    assert_eq!(run(&stops, &["éé", "x"]), ("ééx".into(), None));
    assert_eq!(run(&stops, &["aüb"]), ("a".into(), Some(1)));
}

#[test]
fn finish_reasons_map_to_openai_strings() {
    assert_eq!(FinishReason::Stop(StopCause::Eos).as_openai_str(), "stop");
    assert_eq!(
        FinishReason::Stop(StopCause::StopString { index: 2 }).as_openai_str(),
        "stop"
    );
    assert_eq!(
        FinishReason::Stop(StopCause::GrammarEnd).as_openai_str(),
        "stop"
    );
    assert_eq!(FinishReason::Length.as_openai_str(), "length");
    assert_eq!(FinishReason::ContextLength.as_openai_str(), "length");
    assert_eq!(FinishReason::ToolCalls.as_openai_str(), "tool_calls");
    assert_eq!(FinishReason::Length.to_string(), "length");
    assert_eq!(
        serde_json::to_string(&FinishReason::ToolCalls).unwrap(),
        "\"tool_calls\""
    );
}

/// Text over a small alphabet (with a multibyte char) so stops occur often.
fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![Just('a'), Just('b'), Just('c'), Just('é')],
        0..40,
    )
    .prop_map(|v| v.into_iter().collect())
}

fn stop_list() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(
        proptest::collection::vec(
            prop_oneof![Just('a'), Just('b'), Just('c'), Just('é')],
            1..5,
        )
        .prop_map(|v| v.into_iter().collect::<String>()),
        0..4,
    )
}

/// Split `text` at the char boundaries selected by `cuts`.
fn chunk<'a>(text: &'a str, cuts: &[bool]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut last = 0;
    for (k, (i, _)) in text.char_indices().enumerate().skip(1) {
        if cuts.get(k).copied().unwrap_or(false) {
            out.push(&text[last..i]);
            last = i;
        }
    }
    out.push(&text[last..]);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn any_chunking_gives_the_same_emitted_text_and_decision_as_the_whole(
        t in text(),
        stops in stop_list(),
        cuts in proptest::collection::vec(any::<bool>(), 40),
    ) {
        let whole = run(&stops, &[t.as_str()]);
        prop_assert_eq!(&whole, &reference(&stops, &t));
        let chunks = chunk(&t, &cuts);
        prop_assert_eq!(&run(&stops, &chunks), &whole);
        let chars: Vec<String> = t.chars().map(String::from).collect();
        let singles: Vec<&str> = chars.iter().map(String::as_str).collect();
        prop_assert_eq!(&run(&stops, &singles), &whole);
    }

    #[test]
    fn emitted_text_never_contains_a_stop_and_held_text_could_start_one(
        t in text(),
        stops in stop_list(),
        cuts in proptest::collection::vec(any::<bool>(), 40),
    ) {
        let mut c = StopChecker::new(stops.iter().cloned()).unwrap();
        let mut out = String::new();
        for piece in chunk(&t, &cuts) {
            let step = c.push(piece);
            let (StopStep::Continue { emit } | StopStep::Stopped { emit, .. }) = &step;
            out.push_str(emit);
            for s in &stops {
                prop_assert!(!out.contains(s.as_str()));
            }
            let held = c.held();
            prop_assert!(held.is_empty() || stops.iter().any(|s| s.len() > held.len() && s.starts_with(held)));
            if matches!(step, StopStep::Stopped { .. }) {
                break;
            }
        }
    }
}
