//! Server counters and the Prometheus text exposition of `/metrics` (server counters plus
//! a snapshot of the engine's).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use engine::DrafterKind;
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

/// How the served model speculates, for the `lockstep_spec_*` gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecSetup {
    /// Requests speculate.
    pub enabled: bool,
    /// A draft model is among the drafters.
    pub draft_model: bool,
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

    /// The Prometheus text exposition: these counters plus `engine`'s snapshot; `spec` says
    /// how the served model speculates.
    pub fn render(&self, engine: &EngineMetrics, spec: SpecSetup) -> String {
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
            "lockstep_decode_tokens_total",
            "counter",
            "Tokens after the first of finished sequences (the numerator of the decode speed).",
            load(&self.decode_tokens).to_string(),
        );
        metric(
            "lockstep_decode_seconds_total",
            "counter",
            "Decode time of finished sequences (rate(decode_tokens) / rate(decode_seconds) is \
             the recent decode speed).",
            format!("{:.6}", us as f64 / 1e6),
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
        render_spec(&mut metric, engine, spec);
        render_disk_cache(&mut metric, engine);
        render_spec_labelled(&mut out, engine);
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

/// The prefix cache's disk tier (`--disk-cache`): all zero when it is off.
fn render_disk_cache(metric: &mut impl FnMut(&str, &str, &str, String), engine: &EngineMetrics) {
    let d = &engine.disk;
    metric(
        "lockstep_disk_cache_enabled",
        "gauge",
        "1 when KV blocks are saved to and read back from disk, else 0.",
        u8::from(d.enabled).to_string(),
    );
    for (name, help, value) in [
        (
            "lockstep_disk_cache_hit_blocks_total",
            "KV blocks read back from disk instead of being computed.",
            d.hit_blocks,
        ),
        (
            "lockstep_disk_cache_miss_blocks_total",
            "Full prompt blocks found neither in RAM nor on disk at admission.",
            d.miss_blocks,
        ),
        (
            "lockstep_disk_cache_read_bytes_total",
            "Bytes of block files read and checked (blocks read ahead and then not needed \
             included).",
            d.bytes_read,
        ),
        (
            "lockstep_disk_cache_written_bytes_total",
            "Bytes of block files written.",
            d.bytes_written,
        ),
        (
            "lockstep_disk_cache_evictions_total",
            "Block files removed to stay under --disk-cache-gib (least recently used first).",
            d.evictions,
        ),
        (
            "lockstep_disk_cache_dropped_writes_total",
            "Block writes dropped because the writer's queue was full.",
            d.dropped_writes,
        ),
        (
            "lockstep_disk_cache_rejected_files_total",
            "Truncated, corrupt or foreign block files found and removed.",
            d.rejected_files,
        ),
        (
            "lockstep_disk_cache_write_errors_total",
            "Failed block writes (after one, writing stops).",
            d.write_errors,
        ),
    ] {
        metric(name, "counter", help, value.to_string());
    }
    metric(
        "lockstep_disk_cache_read_seconds_total",
        "counter",
        "Time the reader threads spent reading and checking block files, summed over the \
         threads (they read in parallel; see lockstep_disk_cache_restore_seconds_total).",
        format!("{:.6}", d.read_micros as f64 / 1e6),
    );
    metric(
        "lockstep_disk_cache_restores_total",
        "counter",
        "Chains of KV blocks restored from disk (one per request that found blocks there).",
        d.restores.to_string(),
    );
    metric(
        "lockstep_disk_cache_restored_bytes_total",
        "counter",
        "Bytes of block files restored into the KV pool.",
        d.restored_bytes.to_string(),
    );
    metric(
        "lockstep_disk_cache_restore_seconds_total",
        "counter",
        "Wall time of the restores: reading (several files in parallel), checking and \
         copying into the KV pool (restored bytes over it is the restore rate).",
        format!("{:.6}", d.restore_micros as f64 / 1e6),
    );
    metric(
        "lockstep_disk_cache_bytes",
        "gauge",
        "Bytes of block files in the disk cache directory.",
        d.bytes.to_string(),
    );
    metric(
        "lockstep_disk_cache_files",
        "gauge",
        "Block files in the disk cache directory.",
        d.files.to_string(),
    );
}

/// The speculative-decoding counters of the engine (all requests, finished or not).
fn render_spec(
    metric: &mut impl FnMut(&str, &str, &str, String),
    engine: &EngineMetrics,
    setup: SpecSetup,
) {
    let s = &engine.spec;
    metric(
        "lockstep_spec_enabled",
        "gauge",
        "1 when requests speculate (--ngram, --draft or --spec auto), else 0.",
        u8::from(setup.enabled).to_string(),
    );
    metric(
        "lockstep_spec_draft_model_active",
        "gauge",
        "1 while a draft model is configured and the cost model lets it run.",
        u8::from(setup.draft_model && engine.spec_draft_model_on).to_string(),
    );
    for (name, help, value) in [
        (
            "lockstep_spec_cycles_total",
            "Speculative verify cycles (steps of a sequence with at least one draft row).",
            s.cycles,
        ),
        (
            "lockstep_spec_full_cycles_total",
            "Verify cycles that accepted every draft.",
            s.full,
        ),
        (
            "lockstep_spec_partial_cycles_total",
            "Verify cycles that accepted some but not all drafts.",
            s.partial,
        ),
        (
            "lockstep_spec_miss_cycles_total",
            "Verify cycles that accepted no draft.",
            s.miss,
        ),
        (
            "lockstep_spec_drafted_tokens_total",
            "Draft tokens verified.",
            s.drafted,
        ),
        (
            "lockstep_spec_accepted_tokens_total",
            "Draft tokens accepted (the target chose them).",
            s.accepted,
        ),
        (
            "lockstep_spec_forced_tokens_total",
            "Draft tokens forced by the grammar (fast-forward).",
            s.forced,
        ),
        (
            "lockstep_spec_no_draft_steps_total",
            "Decode steps with speculation on in which nothing was proposed.",
            s.no_draft,
        ),
        (
            "lockstep_spec_scheduler_skips_total",
            "Steps whose drafts were dropped for lack of row budget or KV blocks.",
            s.sched_skips,
        ),
        (
            "lockstep_spec_suffix_cycles_total",
            "Verify cycles drafted by the cross-request suffix index.",
            s.kind(DrafterKind::Suffix).cycles,
        ),
        (
            "lockstep_spec_suffix_drafted_tokens_total",
            "Draft tokens of the cross-request suffix index verified.",
            s.kind(DrafterKind::Suffix).drafted,
        ),
        (
            "lockstep_spec_suffix_accepted_tokens_total",
            "Draft tokens of the cross-request suffix index accepted.",
            s.kind(DrafterKind::Suffix).accepted,
        ),
    ] {
        metric(name, "counter", help, value.to_string());
    }
    metric(
        "lockstep_spec_suffix_stored_tokens",
        "gauge",
        "Tokens held by the cross-request suffix index (earlier requests' sequences).",
        engine.spec_suffix_stored_tokens.to_string(),
    );
    metric(
        "lockstep_spec_accept_rate",
        "gauge",
        "Accepted / drafted tokens since start (0 before any draft).",
        format!("{:.6}", s.accept_rate()),
    );
    metric(
        "lockstep_spec_time_saved_seconds",
        "gauge",
        "Estimated wall time saved against plain decoding since start (may be negative; \
         method in the engine's SpecStats docs).",
        format!("{:.6}", s.time_saved_us as f64 / 1e6),
    );
}

/// The drafter kinds `/metrics` and `usage.speculative` itemise (the test drafters only
/// when they drafted).
pub(crate) fn reported_kinds(s: &engine::SpecStats) -> impl Iterator<Item = DrafterKind> + '_ {
    DrafterKind::ALL.into_iter().filter(|&k| {
        !matches!(k, DrafterKind::Oracle | DrafterKind::Adversary) || s.kind(k).cycles > 0
    })
}

/// The labelled speculation families: no-draft steps by reason, and cycles, drafted and
/// accepted tokens by drafter.
fn render_spec_labelled(out: &mut String, engine: &EngineMetrics) {
    let s = &engine.spec;
    let _ = writeln!(
        out,
        "# HELP lockstep_spec_no_draft_reason_steps_total Decode steps with speculation on and \
         nothing proposed, by reason (room, backoff, margin, cost: the policy withheld drafts; \
         nothing: no drafter had a proposal)."
    );
    let _ = writeln!(
        out,
        "# TYPE lockstep_spec_no_draft_reason_steps_total counter"
    );
    for (reason, n) in [
        ("room", s.no_draft_room),
        ("backoff", s.no_draft_backoff),
        ("margin", s.no_draft_margin),
        ("cost", s.no_draft_cost),
        ("nothing", s.no_draft_nothing),
    ] {
        let _ = writeln!(
            out,
            "lockstep_spec_no_draft_reason_steps_total{{reason=\"{reason}\"}} {n}"
        );
    }
    for (name, help, get) in [
        (
            "lockstep_spec_drafter_cycles_total",
            "Verify cycles with draft tokens of each drafter.",
            (|c: engine::KindCounts| c.cycles) as fn(engine::KindCounts) -> u64,
        ),
        (
            "lockstep_spec_drafter_drafted_tokens_total",
            "Draft tokens verified, by the drafter that proposed them.",
            |c| c.drafted,
        ),
        (
            "lockstep_spec_drafter_accepted_tokens_total",
            "Draft tokens accepted, by the drafter that proposed them.",
            |c| c.accepted,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for k in reported_kinds(s) {
            let _ = writeln!(out, "{name}{{drafter=\"{}\"}} {}", k.name(), get(s.kind(k)));
        }
    }
}
