//! Speculative decoding behind the HTTP API: smollm2-135m served with the free drafters
//! (cross-request suffix index, n-gram, grammar fast-forward) answers every endpoint token for token as the plain server
//! does, each response's `usage.speculative` carries the request's counters (absent on the
//! plain server), and `/metrics` exposes the engine's counters.

use std::sync::{Arc, OnceLock};

use serde_json::{Value, json};

use crate::chat::stream_contents;
use crate::common::{TestServer, client, load_with, post, post_stream, smol, spawn};

static NGRAM: OnceLock<TestServer> = OnceLock::new();

/// smollm2-135m with the suffix index, n-gram (keys up to 3 tokens) and grammar
/// fast-forward drafting. The
/// policy drafts whenever the n-gram drafter has a match: the default policy's cost model
/// and back-off depend on measured step times and on other requests' acceptance, which
/// would make "drafts were proposed" depend on the machine's load.
fn ngram() -> &'static TestServer {
    NGRAM.get_or_init(|| {
        let spec = engine::SpecConfig {
            mode: engine::SpecMode::Auto,
            drafters: spec::DrafterSet::free_with_suffix(3, spec::SuffixConfig::default()),
            policy: spec::PolicyConfig::always(8),
        };
        let model: Arc<_> = load_with("smollm2-135m", 8, 64, spec);
        assert!(model.speculates());
        spawn(model, lockstep_server::ServerConfig::default())
    })
}

/// A prompt whose answer repeats text of the prompt, so the n-gram drafter has matches.
const REPEAT: &str = "Repeat this sentence three times, one per line: the quick brown fox \
                      jumps over the lazy dog.";

const RAW_REPEAT: &str = "the quick brown fox jumps over the lazy dog. the quick brown fox \
                          jumps over the lazy dog. the quick brown fox jumps over the";

/// The `speculative` object of a usage, checked for consistency.
fn counters(usage: &Value) -> &Value {
    let s = usage
        .get("speculative")
        .unwrap_or_else(|| panic!("no usage.speculative: {usage}"));
    let n = |k: &str| {
        s[k].as_u64()
            .unwrap_or_else(|| panic!("speculative.{k} is not a count: {s}"))
    };
    let (cycles, drafted, accepted) = (n("cycles"), n("drafted"), n("accepted"));
    assert!(accepted <= drafted && cycles <= drafted, "{s}");
    assert_eq!(n("full") + n("partial") + n("miss"), cycles, "{s}");
    let rate = s["accept_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate), "{s}");
    for k in ["no_draft", "sched_skips", "forced"] {
        n(k);
    }
    assert!(s["mean_accepted"].as_f64().is_some() && s["time_saved_ms"].as_f64().is_some());
    let suffix = |k: &str| {
        s["suffix"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("speculative.suffix.{k} is not a count: {s}"))
    };
    assert!(
        suffix("accepted") <= suffix("drafted") && suffix("drafted") <= drafted,
        "{s}"
    );
    assert!(suffix("cycles") <= cycles, "{s}");
    s
}

fn drafted(usage: &Value) -> u64 {
    counters(usage)["drafted"].as_u64().unwrap()
}

fn assert_plain_usage(usage: &Value) {
    assert!(
        usage.is_object() && usage.get("speculative").is_none(),
        "the plain server reports no speculative counters: {usage}"
    );
}

#[tokio::test]
async fn chat_completions_with_speculation_equal_plain_decoding_token_for_token() {
    for (temperature, seed) in [(0.0, 1), (0.8, 42)] {
        let body = json!({
            "messages": [{"role": "user", "content": REPEAT}],
            "max_tokens": 48, "temperature": temperature, "seed": seed,
            "logprobs": true, "top_logprobs": 2,
        });
        let (s, plain) = post(smol(), "/v1/chat/completions", &body).await;
        assert_eq!(s, 200, "{plain}");
        let (s, spec) = post(ngram(), "/v1/chat/completions", &body).await;
        assert_eq!(s, 200, "{spec}");
        let (p, q) = (&plain["choices"][0], &spec["choices"][0]);
        // Every token's text, bytes and log-probability (and the alternatives) agree.
        assert_eq!(p["logprobs"], q["logprobs"], "T={temperature}");
        assert!(!p["logprobs"]["content"].as_array().unwrap().is_empty());
        assert_eq!(p["message"], q["message"], "T={temperature}");
        assert_eq!(p["finish_reason"], q["finish_reason"]);
        assert_eq!(
            plain["usage"]["completion_tokens"],
            spec["usage"]["completion_tokens"]
        );
        assert_plain_usage(&plain["usage"]);
        let d = drafted(&spec["usage"]);
        if temperature == 0.0 {
            assert!(
                d > 0,
                "the repetitive answer gets n-gram drafts: {}",
                spec["usage"]
            );
        }
    }
}

#[tokio::test]
async fn a_speculative_chat_stream_equals_plain_and_its_usage_chunk_has_the_counters() {
    let body = json!({
        "messages": [{"role": "user", "content": REPEAT}],
        "max_tokens": 40, "temperature": 0, "n": 2,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let (s, _, plain) = post_stream(smol(), "/v1/chat/completions", &body).await;
    assert_eq!(s, 200);
    let (s, _, spec) = post_stream(ngram(), "/v1/chat/completions", &body).await;
    assert_eq!(s, 200);
    let text = stream_contents(&spec, 2);
    assert_eq!(stream_contents(&plain, 2), text);
    assert_eq!(text[0], text[1], "both choices are greedy");
    assert_eq!(spec.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let usage_of = |events: &[crate::common::Sse]| events[events.len() - 2].json()["usage"].clone();
    assert_plain_usage(&usage_of(&plain));
    let u = usage_of(&spec);
    assert_eq!(
        u["completion_tokens"],
        usage_of(&plain)["completion_tokens"]
    );
    // Summed over the two choices: each drafted on its own.
    assert!(drafted(&u) > 0, "{u}");
    assert!(counters(&u)["cycles"].as_u64().unwrap() >= 2, "{u}");
    // Only the usage chunk carries usage; the content chunks have `usage: null`.
    assert!(
        spec[..spec.len() - 2]
            .iter()
            .all(|e| e.json()["usage"].is_null())
    );
}

#[tokio::test]
async fn completions_with_speculation_equal_plain_streamed_or_not() {
    let body = json!({"prompt": RAW_REPEAT, "max_tokens": 32, "temperature": 0, "logprobs": 2});
    let (s, plain) = post(smol(), "/v1/completions", &body).await;
    assert_eq!(s, 200, "{plain}");
    let (s, spec) = post(ngram(), "/v1/completions", &body).await;
    assert_eq!(s, 200, "{spec}");
    assert_eq!(plain["choices"], spec["choices"]);
    assert_plain_usage(&plain["usage"]);
    assert!(drafted(&spec["usage"]) > 0, "{}", spec["usage"]);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (s, _, events) = post_stream(ngram(), "/v1/completions", &sbody).await;
    assert_eq!(s, 200);
    let streamed: String = events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| e.json()["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(streamed, plain["choices"][0]["text"].as_str().unwrap());
    let usage = events[events.len() - 2].json()["usage"].clone();
    assert_eq!(
        usage["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    assert!(drafted(&usage) > 0, "{usage}");
}

fn output_text(resp: &Value) -> String {
    resp["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter())
        .filter_map(|c| c["text"].as_str())
        .collect()
}

#[tokio::test]
async fn responses_with_speculation_equal_plain_streamed_or_not() {
    let body = json!({"input": REPEAT, "max_output_tokens": 40, "temperature": 0});
    let (s, plain) = post(smol(), "/v1/responses", &body).await;
    assert_eq!(s, 200, "{plain}");
    let (s, spec) = post(ngram(), "/v1/responses", &body).await;
    assert_eq!(s, 200, "{spec}");
    assert_eq!(output_text(&plain), output_text(&spec));
    assert_eq!(plain["status"], spec["status"]);
    assert_eq!(
        plain["usage"]["output_tokens"],
        spec["usage"]["output_tokens"]
    );
    assert_plain_usage(&plain["usage"]);
    assert!(drafted(&spec["usage"]) > 0, "{}", spec["usage"]);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, _, events) = post_stream(ngram(), "/v1/responses", &sbody).await;
    assert_eq!(s, 200);
    let deltas: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.output_text.delta"))
        .map(|e| e.json()["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, output_text(&plain));
    let last = events.last().unwrap().json();
    assert!(
        ["response.completed", "response.incomplete"].contains(&last["type"].as_str().unwrap()),
        "{last}"
    );
    assert!(drafted(&last["response"]["usage"]) > 0, "{last}");
    // The response created event has no usage yet.
    assert!(events[0].json()["response"]["usage"].is_null());
}

/// The value of an unlabelled sample in a Prometheus exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn metrics(server: &TestServer) -> String {
    let r = client().get(server.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.text().await.unwrap()
}

#[tokio::test]
async fn metrics_expose_the_speculative_counters() {
    let body = json!({"prompt": RAW_REPEAT, "max_tokens": 24, "temperature": 0});
    let (s, r) = post(ngram(), "/v1/completions", &body).await;
    assert_eq!(s, 200, "{r}");
    let used = counters(&r["usage"]).clone();
    // Counters only grow (other tests add to them): at least this request's.
    let text = metrics(ngram()).await;
    assert_eq!(sample(&text, "lockstep_spec_enabled"), 1.0);
    for (metric, field) in [
        ("lockstep_spec_cycles_total", "cycles"),
        ("lockstep_spec_drafted_tokens_total", "drafted"),
        ("lockstep_spec_accepted_tokens_total", "accepted"),
        ("lockstep_spec_full_cycles_total", "full"),
        ("lockstep_spec_partial_cycles_total", "partial"),
        ("lockstep_spec_miss_cycles_total", "miss"),
        ("lockstep_spec_forced_tokens_total", "forced"),
        ("lockstep_spec_no_draft_steps_total", "no_draft"),
        ("lockstep_spec_scheduler_skips_total", "sched_skips"),
    ] {
        assert!(
            sample(&text, metric) >= used[field].as_u64().unwrap() as f64,
            "{metric} below the request's {field}: {used}\n{text}"
        );
    }
    for (metric, field) in [
        ("lockstep_spec_suffix_cycles_total", "cycles"),
        ("lockstep_spec_suffix_drafted_tokens_total", "drafted"),
        ("lockstep_spec_suffix_accepted_tokens_total", "accepted"),
    ] {
        assert!(
            sample(&text, metric) >= used["suffix"][field].as_u64().unwrap() as f64,
            "{metric} below the request's suffix {field}: {used}\n{text}"
        );
    }
    // The prompt repeats itself: the suffix drafter proposed from the sequence itself,
    // and the finished request is in the index.
    assert!(
        used["suffix"]["drafted"].as_u64().unwrap() > 0,
        "suffix drafts: {used}"
    );
    assert!(sample(&text, "lockstep_spec_suffix_stored_tokens") > 0.0);
    assert!(sample(&text, "lockstep_spec_drafted_tokens_total") > 0.0);
    let rate = sample(&text, "lockstep_spec_accept_rate");
    assert!((0.0..=1.0).contains(&rate), "{rate}");
    sample(&text, "lockstep_spec_time_saved_seconds");
    assert!(sample(&text, "lockstep_decode_tokens_total") > 0.0);
    assert!(sample(&text, "lockstep_decode_seconds_total") > 0.0);
    assert_eq!(sample(&text, "lockstep_spec_draft_model_active"), 0.0);

    let plain = metrics(smol()).await;
    assert_eq!(sample(&plain, "lockstep_spec_enabled"), 0.0);
    assert_eq!(sample(&plain, "lockstep_spec_drafted_tokens_total"), 0.0);
}

#[tokio::test]
async fn speculation_false_decodes_plainly_with_the_same_output() {
    let base = json!({
        "messages": [{"role": "user", "content": REPEAT}],
        "max_tokens": 40, "temperature": 0.8, "seed": 9,
    });
    let (s, spec) = post(ngram(), "/v1/chat/completions", &base).await;
    assert_eq!(s, 200, "{spec}");
    drafted(&spec["usage"]);
    let mut off = base.clone();
    off["speculation"] = json!(false);
    let (s, plain) = post(ngram(), "/v1/chat/completions", &off).await;
    assert_eq!(s, 200, "{plain}");
    assert_plain_usage(&plain["usage"]);
    assert_eq!(
        spec["choices"][0]["message"],
        plain["choices"][0]["message"]
    );
    assert_eq!(spec["seed"], plain["seed"]);
    // `true` on a speculating server is its default.
    let mut on = base.clone();
    on["speculation"] = json!(true);
    let (s, again) = post(ngram(), "/v1/chat/completions", &on).await;
    assert_eq!(s, 200, "{again}");
    drafted(&again["usage"]);
    assert_eq!(
        spec["choices"][0]["message"],
        again["choices"][0]["message"]
    );
}

#[tokio::test]
async fn speculation_true_on_a_plain_server_is_a_400_naming_the_field() {
    let body = json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "speculation": true,
    });
    let (s, err) = post(smol(), "/v1/chat/completions", &body).await;
    let e = crate::common::assert_error(s, &err, 400);
    assert_eq!(e["param"], "speculation", "{err}");
    assert!(
        e["message"].as_str().unwrap().contains("on by default"),
        "the message says speculation is on unless the server was started with --spec off: {err}"
    );
    let (s, _) = post(
        smol(),
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "speculation": false,
        }),
    )
    .await;
    assert_eq!(
        s, 200,
        "`false` is plain decoding, which the plain server does"
    );
}

#[tokio::test]
async fn health_says_whether_the_server_speculates() {
    for (server, speculates) in [(smol(), false), (ngram(), true)] {
        let v: Value = client()
            .get(server.url("/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["speculation"], json!(speculates), "{v}");
    }
}

#[tokio::test]
async fn messages_with_speculation_equal_plain_and_carry_the_counters() {
    let body = json!({
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": REPEAT}],
        "max_tokens": 40, "temperature": 0,
    });
    let (s, plain) = post(smol(), "/v1/messages", &body).await;
    assert_eq!(s, 200, "{plain}");
    let (s, spec) = post(ngram(), "/v1/messages", &body).await;
    assert_eq!(s, 200, "{spec}");
    assert_eq!(plain["content"], spec["content"]);
    assert_eq!(plain["stop_reason"], spec["stop_reason"]);
    assert_eq!(
        plain["usage"]["output_tokens"],
        spec["usage"]["output_tokens"]
    );
    assert_plain_usage(&plain["usage"]);
    assert!(drafted(&spec["usage"]) > 0, "{}", spec["usage"]);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (s, _, events) = post_stream(ngram(), "/v1/messages", &sbody).await;
    assert_eq!(s, 200);
    let delta = events
        .iter()
        .find(|e| e.event.as_deref() == Some("message_delta"))
        .expect("a message_delta event")
        .json();
    assert_eq!(
        delta["usage"]["output_tokens"],
        plain["usage"]["output_tokens"]
    );
    assert!(drafted(&delta["usage"]) > 0, "{delta}");
}
