//! Many clients at once: each stream equals the same request run alone; a client that
//! disconnects cancels its sequence.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::chat::stream_contents;
use crate::common::{client, post, post_stream, smol, smol_model};

fn request(i: usize) -> Value {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 12}}, "required": ["n", "w"]});
    let mut body = json!({
        "messages": [{"role": "user", "content": format!("Request {i}: write something about the number {i}.")}],
        "max_tokens": 14,
        "seed": 1000 + i,
        "temperature": if i.is_multiple_of(2) { 0.0 } else { 0.8 },
    });
    match i % 4 {
        1 => {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        }
        3 => body["response_format"] = json!({"type": "json_object"}),
        _ => {}
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_simultaneous_streams_equal_the_same_requests_run_alone() {
    let mut alone = Vec::new();
    for i in 0..16 {
        let (s, body) = post(smol(), "/v1/chat/completions", &request(i)).await;
        assert_eq!(s, 200, "{body}");
        alone.push(
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            tokio::spawn(async move {
                let mut body = request(i);
                body["stream"] = json!(true);
                let (s, _, events) = post_stream(smol(), "/v1/chat/completions", &body).await;
                assert_eq!(s, 200);
                stream_contents(&events, 1).remove(0)
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let together = t.await.unwrap();
        assert_eq!(together, alone[i], "request {i}");
    }
}

#[tokio::test]
async fn a_client_disconnect_cancels_its_sequence() {
    let model = smol_model();
    let before = model.engine().metrics().requests_cancelled;
    let body = json!({
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 1500, "ignore_eos": true, "stream": true
    });
    let resp = client()
        .post(smol().url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    drop(stream);
    // Generous: on a loaded 2-core CI machine the step loop may be slow to reach the next
    // token, which is when the bridge notices the closed stream.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let m = model.engine().metrics();
        if m.requests_cancelled > before {
            break;
        }
        assert!(Instant::now() < deadline, "no cancellation seen: {m:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_stream_finish_and_then_refuses_connections() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let model = smol_model();
    let handle = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            // A grace period no loaded machine runs out of: the in-flight stream must end
            // by finishing, not by being cancelled when the grace expires.
            let config = lockstep_server::ServerConfig {
                shutdown_grace: Duration::from_secs(600),
                ..lockstep_server::ServerConfig::default()
            };
            let server =
                lockstep_server::Server::bind("127.0.0.1:0".parse().unwrap(), model, config)
                    .await
                    .unwrap();
            addr_tx.send(server.local_addr().unwrap()).unwrap();
            server
                .serve(async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
    });
    let addr = addr_rx.recv().unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Tell a story."}],
                      "max_tokens": 40, "ignore_eos": true, "stream": true, "temperature": 0});
    let resp = client()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    tx.send(()).unwrap();
    let mut rest = String::from_utf8_lossy(&first).into_owned();
    while let Some(chunk) = stream.next().await {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(
        rest.trim_end().ends_with("data: [DONE]"),
        "the in-flight stream finished: {rest}"
    );
    handle.join().unwrap();
    let refused = client().get(format!("http://{addr}/health")).send().await;
    assert!(refused.is_err(), "no connections after shutdown");
}
