//! The `usage` objects of every endpoint: token counts of a request (the prompt once, the
//! completions of its choices summed) and lockstep's extension field `speculative`, the
//! request's speculative-decoding counters, present only when the request speculated.

use engine::DrafterKind;
use engine::{SpecStats, Usage};
use serde_json::{Value, json};

/// Token counts of a request's choices: the prompt (and its cached part) once, completion
/// tokens summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Prompt tokens.
    pub prompt: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached: usize,
    /// Generated tokens over all choices.
    pub completion: usize,
}

impl Totals {
    /// The totals of `usages` (one per choice).
    pub fn of(usages: &[Usage]) -> Totals {
        Totals {
            prompt: usages.first().map_or(0, |u| u.prompt_tokens),
            cached: usages.first().map_or(0, |u| u.cached_tokens),
            completion: usages.iter().map(|u| u.completion_tokens).sum(),
        }
    }
}

/// The speculation counters of a request, summed over its choices; `None` when no choice
/// speculated.
pub fn speculative_stats(usages: &[Usage]) -> Option<SpecStats> {
    let mut total: Option<SpecStats> = None;
    for s in usages.iter().filter_map(|u| u.spec.as_ref()) {
        total.get_or_insert_with(SpecStats::default).add(s);
    }
    total
}

/// The `speculative` extension object of `usage` (the same fields as the `spec` object of
/// `lockstep run --output json`): verify cycles, drafted and accepted draft tokens, the
/// accept rate, mean accepted drafts per cycle, full / partial / miss cycles, decode steps
/// without a draft, scheduler skips, grammar-forced drafts, the estimated time saved and
/// the cross-request suffix drafter's own cycles, drafted and accepted tokens.
pub fn speculative_json(s: &SpecStats) -> Value {
    json!({
        "cycles": s.cycles,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "accept_rate": s.accept_rate(),
        "mean_accepted": s.mean_accepted(),
        "full": s.full,
        "partial": s.partial,
        "miss": s.miss,
        "no_draft": s.no_draft,
        "sched_skips": s.sched_skips,
        "forced": s.forced,
        "time_saved_ms": s.time_saved_us as f64 / 1e3,
        "no_draft_reasons": {
            "room": s.no_draft_room,
            "backoff": s.no_draft_backoff,
            "margin": s.no_draft_margin,
            "cost": s.no_draft_cost,
            "nothing": s.no_draft_nothing,
        },
        "suffix": {
            "cycles": s.kind(DrafterKind::Suffix).cycles,
            "drafted": s.kind(DrafterKind::Suffix).drafted,
            "accepted": s.kind(DrafterKind::Suffix).accepted,
        },
        "by_drafter": crate::metrics::reported_kinds(s)
            .map(|k| {
                let c = s.kind(k);
                (
                    k.name().to_string(),
                    json!({"cycles": c.cycles, "drafted": c.drafted, "accepted": c.accepted}),
                )
            })
            .collect::<serde_json::Map<String, Value>>(),
    })
}

/// Adds `speculative` to a `usage` object when the request speculated.
fn with_speculative(mut usage: Value, usages: &[Usage]) -> Value {
    if let Some(s) = speculative_stats(usages) {
        usage["speculative"] = speculative_json(&s);
    }
    usage
}

/// `usage` of a chat completion.
pub fn chat_usage(usages: &[Usage]) -> Value {
    let t = Totals::of(usages);
    with_speculative(
        json!({
            "prompt_tokens": t.prompt,
            "completion_tokens": t.completion,
            "total_tokens": t.prompt + t.completion,
            "prompt_tokens_details": {"cached_tokens": t.cached},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }),
        usages,
    )
}

/// `usage` of a (legacy) completion.
pub fn completion_usage(usages: &[Usage]) -> Value {
    let t = Totals::of(usages);
    with_speculative(
        json!({
            "prompt_tokens": t.prompt,
            "completion_tokens": t.completion,
            "total_tokens": t.prompt + t.completion,
            "prompt_tokens_details": {"cached_tokens": t.cached},
        }),
        usages,
    )
}

/// `usage` of a response (Responses API names).
pub fn response_usage(usages: &[Usage]) -> Value {
    let t = Totals::of(usages);
    with_speculative(
        json!({
            "input_tokens": t.prompt,
            "input_tokens_details": {"cached_tokens": t.cached},
            "output_tokens": t.completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": t.prompt + t.completion,
        }),
        usages,
    )
}

/// `usage` of an Anthropic message: `input_tokens` are the prompt tokens computed for this
/// request, `cache_read_input_tokens` those served from the prefix cache (Anthropic's
/// split: the prompt is their sum), nothing is ever written to a cache on request.
pub fn messages_usage(usages: &[Usage]) -> Value {
    let t = Totals::of(usages);
    with_speculative(
        json!({
            "input_tokens": t.prompt.saturating_sub(t.cached),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": t.cached,
            "output_tokens": t.completion,
        }),
        usages,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(completion: usize, spec: Option<SpecStats>) -> Usage {
        Usage {
            prompt_tokens: 10,
            completion_tokens: completion,
            cached_tokens: 4,
            spec,
        }
    }

    #[test]
    fn plain_requests_have_no_speculative_field() {
        let u = chat_usage(&[usage(3, None), usage(5, None)]);
        assert_eq!(u["prompt_tokens"], 10);
        assert_eq!(u["completion_tokens"], 8);
        assert_eq!(u["total_tokens"], 18);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 4);
        assert!(u.get("speculative").is_none(), "{u}");
    }

    #[test]
    fn speculative_counters_are_summed_over_choices() {
        let mut a = SpecStats::default();
        a.record_cycle(4, 1, 3, 500);
        let mut b = SpecStats::default();
        b.record_cycle(2, 0, 2, 1500);
        b.no_draft = 3;
        for u in [
            chat_usage(&[usage(3, Some(a)), usage(5, Some(b))]),
            completion_usage(&[usage(3, Some(a)), usage(5, Some(b))]),
            response_usage(&[usage(3, Some(a)), usage(5, Some(b))]),
            messages_usage(&[usage(3, Some(a)), usage(5, Some(b))]),
        ] {
            let s = &u["speculative"];
            assert_eq!(s["cycles"], 2, "{u}");
            assert_eq!(s["drafted"], 6);
            assert_eq!(s["accepted"], 5);
            assert_eq!(s["forced"], 1);
            assert_eq!(
                (&s["full"], &s["partial"], &s["miss"]),
                (&json!(1), &json!(1), &json!(0))
            );
            assert_eq!(s["no_draft"], 3);
            assert!((s["accept_rate"].as_f64().unwrap() - 5.0 / 6.0).abs() < 1e-12);
            assert!((s["mean_accepted"].as_f64().unwrap() - 2.5).abs() < 1e-12);
            assert!((s["time_saved_ms"].as_f64().unwrap() - 2.0).abs() < 1e-12);
        }
    }
}
