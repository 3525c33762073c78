//! `/v1/completions`, `/health` and `/metrics`.

use serde_json::json;

use crate::common::{client, post, post_stream, smol, smol_model};

#[tokio::test]
async fn text_and_token_prompts_complete_alike_and_stream_alike() {
    let prompt = "The capital of France is";
    let (s, a) = post(
        smol(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["object"], "text_completion");
    let ids = smol_model()
        .tokenizer()
        .encode(prompt, text::EncodeOptions::raw_prompt());
    let (_, b) = post(
        smol(),
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 6, "temperature": 0}),
    )
    .await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(
        a["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        ids.len()
    );
    let (s, _, events) = post_stream(
        smol(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let text: String = events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| e.json()["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, a["choices"][0]["text"].as_str().unwrap());
    assert_eq!(
        events[events.len() - 2].json()["usage"]["completion_tokens"],
        a["usage"]["completion_tokens"]
    );
}

#[tokio::test]
async fn echo_and_logprobs_follow_the_legacy_shape() {
    let (s, r) = post(
        smol(),
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 2}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let c = &r["choices"][0];
    assert!(c["text"].as_str().unwrap().starts_with("Once upon a time"));
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"][0], 16);
}

#[tokio::test]
async fn health_and_prometheus_metrics_are_served() {
    let _ = post(
        smol(),
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    let h: serde_json::Value = client()
        .get(smol().url("/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
    let r = client().get(smol().url("/metrics")).send().await.unwrap();
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = r.text().await.unwrap();
    for name in [
        "lockstep_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
        "lockstep_prompt_tokens_total",
        "lockstep_completion_tokens_total",
        "lockstep_queue_depth",
        "lockstep_running_sequences",
        "lockstep_time_to_first_token_seconds_bucket",
        "lockstep_decode_tokens_per_second",
        "lockstep_prefix_cache_hit_tokens_total",
        "lockstep_preemptions_total",
        "lockstep_disk_cache_enabled 0",
        "lockstep_disk_cache_hit_blocks_total",
        "lockstep_disk_cache_restored_bytes_total 0",
        "lockstep_disk_cache_restore_seconds_total 0",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}
