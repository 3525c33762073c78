//! Server counters and the Prometheus text exposition of `/metrics` (server counters plus
//! a snapshot of the engine's).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use engine::{EngineMetrics, Timings, Usage};

/// Upper bounds (seconds) of the time-to-first-token histogram buckets.
const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; TTFT_BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// The server's counters. Cheap to update from any thread.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    sequences_finished: AtomicU64,
    sequences_failed: AtomicU64,
    /// Decode time in microseconds and the tokens generated in it.
    decode_us: AtomicU64,
    decode_tokens: AtomicU64,
    ttft: Mutex<Histogram>,
}

impl Metrics {
    /// Counts one answered request.
    pub fn observe_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// Counts a finished sequence.
    pub fn observe_finished(&self, usage: &Usage, timings: &Timings) {
        self.prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
        self.sequences_finished.fetch_add(1, Ordering::Relaxed);
        if usage.completion_tokens > 1 && timings.decode_ms > 0.0 {
            self.decode_us
                .fetch_add((timings.decode_ms * 1000.0) as u64, Ordering::Relaxed);
            self.decode_tokens
                .fetch_add(usage.completion_tokens as u64 - 1, Ordering::Relaxed);
        }
        if usage.completion_tokens > 0
            && let Ok(mut h) = self.ttft.lock()
        {
            let secs = timings.ttft_ms / 1000.0;
            for (i, &b) in TTFT_BUCKETS.iter().enumerate() {
                if secs <= b
                    && let Some(c) = h.counts.get_mut(i)
                {
                    *c += 1;
                }
            }
            h.count += 1;
            h.sum += secs;
        }
    }

    /// Counts a failed sequence.
    pub fn observe_failed(&self) {
        self.sequences_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self, engine: &EngineMetrics) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {value}");
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        metric(
            "lockstep_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished sequences.",
            load(&self.prompt_tokens).to_string(),
        );
        metric(
            "lockstep_completion_tokens_total",
            "counter",
            "Generated tokens of finished sequences.",
            load(&self.completion_tokens).to_string(),
        );
        metric(
            "lockstep_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished sequences served from the prefix cache.",
            load(&self.cached_tokens).to_string(),
        );
        metric(
            "lockstep_sequences_finished_total",
            "counter",
            "Sequences that finished normally.",
            load(&self.sequences_finished).to_string(),
        );
        metric(
            "lockstep_sequences_failed_total",
            "counter",
            "Sequences that ended with an error.",
            load(&self.sequences_failed).to_string(),
        );
        let us = load(&self.decode_us);
        let tps = if us > 0 {
            load(&self.decode_tokens) as f64 / (us as f64 / 1e6)
        } else {
            0.0
        };
        metric(
            "lockstep_decode_tokens_per_second",
            "gauge",
            "Mean decode speed of finished sequences (tokens after the first / decode time).",
            format!("{tps:.3}"),
        );
        metric(
            "lockstep_queue_depth",
            "gauge",
            "Requests waiting for admission.",
            engine.queue_depth.to_string(),
        );
        metric(
            "lockstep_running_sequences",
            "gauge",
            "Sequences running.",
            engine.running.to_string(),
        );
        metric(
            "lockstep_prefix_cache_hit_tokens_total",
            "counter",
            "Tokens whose KV came from the prefix cache.",
            engine.prefix_cache_hit_tokens.to_string(),
        );
        metric(
            "lockstep_preemptions_total",
            "counter",
            "Sequences preempted under KV pressure.",
            engine.preemptions.to_string(),
        );
        metric(
            "lockstep_engine_requests_cancelled_total",
            "counter",
            "Engine requests cancelled (client disconnects included).",
            engine.requests_cancelled.to_string(),
        );
        metric(
            "lockstep_engine_requests_finished_total",
            "counter",
            "Engine requests that finished normally.",
            engine.requests_finished.to_string(),
        );
        metric(
            "lockstep_engine_requests_failed_total",
            "counter",
            "Engine requests that ended with an error.",
            engine.requests_failed.to_string(),
        );
        metric(
            "lockstep_engine_steps_total",
            "counter",
            "Forward steps run.",
            engine.steps.to_string(),
        );
        metric(
            "lockstep_kv_free_blocks",
            "gauge",
            "Free KV cache blocks.",
            engine.kv_free_blocks.to_string(),
        );
        metric(
            "lockstep_kv_total_blocks",
            "gauge",
            "KV cache blocks in the pool.",
            engine.kv_total_blocks.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP lockstep_http_requests_total HTTP requests by endpoint and status."
        );
        let _ = writeln!(out, "# TYPE lockstep_http_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "lockstep_http_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                    endpoint.replace('\\', "\\\\").replace('"', "\\\"")
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP lockstep_time_to_first_token_seconds Submission to first token."
        );
        let _ = writeln!(out, "# TYPE lockstep_time_to_first_token_seconds histogram");
        if let Ok(h) = self.ttft.lock() {
            for (i, b) in TTFT_BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "lockstep_time_to_first_token_seconds_bucket{{le=\"{b}\"}} {}",
                    h.counts.get(i).copied().unwrap_or(0)
                );
            }
            let _ = writeln!(
                out,
                "lockstep_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(out, "lockstep_time_to_first_token_seconds_sum {}", h.sum);
            let _ = writeln!(
                out,
                "lockstep_time_to_first_token_seconds_count {}",
                h.count
            );
        }
        out
    }
}
