//! The public interface of the engine — the single source of truth for callers (`lockstep
//! run`, the server, speculation): configuration, requests, the event stream, metrics, and
//! the two narrow traits the step loop stands on ([`ForwardBackend`], [`TokenConstraint`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::thread::JoinHandle;

pub use model::{BackendError, ForwardBackend, ForwardRow, KvSlot};
/// The constraint interface the step loop drives (defined next to [`TokenMask`] in
/// `sampling`, implemented by the grammar crate's matcher). The engine asks for the mask
/// (or, where one token decides, `accepts`) before each choice of a constrained sequence,
/// consumes the chosen token, and stops with [`StopCause::GrammarEnd`] once
/// `is_finished`. An `Err` from any method ends only that request, with [`Event::Error`].
pub use sampling::{ConstraintError, TokenConstraint};
pub use sampling::{FinishReason, SamplingParams, StopCause, TokenMask};
pub use spec::{DrafterKind, KindCounts, SpecStats};

use crate::submit::{self, Shared};

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// How the engine schedules, how big its KV pool is, and how it speculates.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Sequences running at once (decoding or prefilling), at least 1.
    pub max_seqs: usize,
    /// Size of the KV block pool in token slots (rounded up to whole blocks by the
    /// backend). Shared by every sequence and by the prefix cache.
    pub kv_tokens: usize,
    /// Rows per forward (the step's token budget): decode rows, prefill chunks and (later)
    /// verify blocks of all scheduled sequences together. At least 1.
    pub step_token_budget: usize,
    /// Largest prefill chunk one sequence gets in one step, so a long prompt never stalls
    /// the others for more than one chunk. At least 1.
    pub prefill_chunk: usize,
    /// Requests waiting for admission (submitted, not yet running) before
    /// [`Engine::submit`] answers [`SubmitError::Busy`]. At least 1.
    pub queue_capacity: usize,
    /// Context length: positions `0..context_len`. `0` = the backend's maximum
    /// ([`ForwardBackend::max_context`]); larger than that is refused at start.
    pub context_len: usize,
    /// Reuse the KV of repeated prompt prefixes (prefix cache). On by default; off gives
    /// the reference behaviour that tests compare against (the output is identical).
    pub prefix_cache: bool,
    /// The prefix cache's disk tier: full committed blocks saved under a directory and
    /// read back on a RAM miss, so long prompts survive restarts (off by default; needs
    /// [`EngineConfig::prefix_cache`] and a backend that can save its KV,
    /// [`ForwardBackend::kv_block_format`]). [`Engine::disk_cache_state`] says whether it
    /// works.
    pub disk_cache: Option<crate::disk::DiskCacheConfig>,
    /// Speculative decoding (off by default; output is identical either way, G2).
    pub spec: SpecConfig,
}

/// Whether the engine speculates for requests that bring no drafter of their own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecMode {
    /// Plain decoding: one forward and one choice per token.
    #[default]
    Off,
    /// Draft with [`SpecConfig::drafters`] under the adaptive policy.
    Auto,
}

/// Speculative decoding settings: which drafters each new sequence gets and the adaptive
/// policy that decides when and how far they draft.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecConfig {
    /// Off, or automatic with the drafters below.
    pub mode: SpecMode,
    /// Drafters of each new sequence (fast-forward, n-gram, draft model).
    pub drafters: spec::DrafterSet,
    /// The adaptive policy (draft length, confidence bars, back-off, margin gate, cost
    /// model).
    pub policy: spec::PolicyConfig,
}

impl SpecConfig {
    /// Automatic speculation with `drafters` and the default policy.
    pub fn auto(drafters: spec::DrafterSet) -> SpecConfig {
        SpecConfig {
            mode: SpecMode::Auto,
            drafters,
            policy: spec::PolicyConfig::default(),
        }
    }

    /// Whether new sequences speculate by default.
    pub fn is_on(&self) -> bool {
        self.mode == SpecMode::Auto && !self.drafters.is_empty()
    }
}

impl Default for EngineConfig {
    /// 8 sequences, 16,384 KV token slots, 512 rows per step, 256-row prefill chunks, a
    /// queue of 64, the backend's context, prefix cache on, no disk tier, speculation off.
    fn default() -> Self {
        EngineConfig {
            max_seqs: 8,
            kv_tokens: 16_384,
            step_token_budget: 512,
            prefill_chunk: 256,
            queue_capacity: 64,
            context_len: 0,
            prefix_cache: true,
            disk_cache: None,
            spec: SpecConfig::default(),
        }
    }
}

/// The engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A configuration value is out of its domain.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// The backend failed to set up (e.g. the KV pool could not be allocated).
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    /// The step-loop thread could not be spawned.
    #[error("could not start the engine thread: {0}")]
    Thread(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The admission queue is full ([`EngineConfig::queue_capacity`]); try again later
    /// (HTTP 429/503).
    #[error(
        "the engine is busy: {queued} requests are already waiting and {wanted} more do not \
         fit (capacity {capacity})"
    )]
    Busy {
        /// Requests waiting.
        queued: usize,
        /// Requests this submission asked to queue (the group size, 1 for `submit`).
        wanted: usize,
        /// The queue capacity.
        capacity: usize,
    },
    /// The request can never run as given (HTTP 400); the message names the numbers, e.g.
    /// a prompt of 5,000 tokens for a context of 4,096.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The engine has shut down or its loop ended.
    #[error("the engine has shut down")]
    ShutDown,
}

// ---------------------------------------------------------------------------------------
// Requests and the event stream
// ---------------------------------------------------------------------------------------

/// One generation request: a tokenized prompt and how to continue it.
pub struct GenerateRequest {
    /// Prompt token ids (non-empty, every id below the backend's `n_vocab`, shorter than
    /// the context).
    pub prompt: Vec<u32>,
    /// The sampling rule's parameters (the seed included; the caller picks a random seed
    /// for requests without one and reports it).
    pub sampling: SamplingParams,
    /// Generated tokens at most (`None` = until another stop; the context end always
    /// stops). `Some(0)` finishes at once with [`FinishReason::Length`].
    pub max_tokens: Option<usize>,
    /// Stop strings: generation ends where the output text first contains one; it and
    /// what follows are not emitted. Text that might begin one is held back.
    pub stop_strings: Vec<String>,
    /// Keep generating after an end-of-generation token (it is then an ordinary token).
    pub ignore_eos: bool,
    /// Report the top-N alternatives (log-probabilities of the raw logits) per position.
    pub logprobs: Option<usize>,
    /// Report the SHA-256 of each generated position's full-vocabulary f32 logits
    /// (little-endian bytes, the raw logits before penalties and masks) — the G1/G2 gate.
    pub logit_digests: bool,
    /// A constraint (grammar) every generated token must satisfy.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// This request's own drafter (tests: an oracle or an adversary); it speculates with
    /// it whatever [`SpecConfig::mode`] says. `None` = the engine's drafters when
    /// speculation is on.
    pub drafter: Option<Box<dyn spec::Drafter>>,
    /// This request's own adaptive policy (`None` = [`SpecConfig::policy`]).
    pub spec_policy: Option<spec::PolicyConfig>,
    /// Plain decoding for this request even when the engine speculates.
    pub no_spec: bool,
    /// The cross-request suffix index's partition this request reads and feeds (the
    /// server gives each API key its own; 0 = the shared one).
    pub spec_partition: u64,
}

impl GenerateRequest {
    /// A request for `prompt` with `sampling` and everything else off.
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams) -> GenerateRequest {
        GenerateRequest {
            prompt,
            sampling,
            max_tokens: None,
            stop_strings: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_digests: false,
            constraint: None,
            drafter: None,
            spec_policy: None,
            no_spec: false,
            spec_partition: 0,
        }
    }
}

impl std::fmt::Debug for GenerateRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateRequest")
            .field("prompt_tokens", &self.prompt.len())
            .field("sampling", &self.sampling)
            .field("max_tokens", &self.max_tokens)
            .field("stop_strings", &self.stop_strings)
            .field("ignore_eos", &self.ignore_eos)
            .field("logprobs", &self.logprobs)
            .field("logit_digests", &self.logit_digests)
            .field("constraint", &self.constraint.is_some())
            .field("drafter", &self.drafter.as_ref().map(|d| d.kind()))
            .field("spec_policy", &self.spec_policy)
            .field("no_spec", &self.no_spec)
            .field("spec_partition", &self.spec_partition)
            .finish()
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (an end-of-generation token that ended the sequence counts).
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (RAM, or read back from its disk
    /// tier) instead of being computed.
    pub cached_tokens: usize,
    /// Speculation counters, when the request speculated (`None` in plain decoding).
    pub spec: Option<SpecStats>,
}

/// Wall-clock phases of a request, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// Submission → first scheduled (admitted).
    pub queue_ms: f64,
    /// First admitted → first token chosen (the prompt's forward).
    pub prefill_ms: f64,
    /// First token → finish.
    pub decode_ms: f64,
    /// Submission → first token (time to first token).
    pub ttft_ms: f64,
}

/// What a request's stream delivers, in order: zero or more `Token`s, then exactly one
/// `Finished` or `Error`, then nothing.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One generated token.
    Token {
        /// Absolute position of the token (the prompt occupies `0..prompt_len`).
        position: usize,
        /// Token id.
        token: u32,
        /// Output text that became safe to emit with this token: complete UTF-8, with
        /// anything that could begin a stop string held back (may be empty). Control tokens
        /// render as nothing. The concatenation of every `text` and the final
        /// `Finished::text` is the output.
        text: String,
        /// Log-probability of `token` under softmax of the raw logits (T = 1).
        logprob: f32,
        /// The top-N alternatives (best first) when [`GenerateRequest::logprobs`] asked.
        top_logprobs: Option<Vec<(u32, f32)>>,
        /// SHA-256 of this position's full-vocabulary logits when
        /// [`GenerateRequest::logit_digests`] asked.
        logit_sha256: Option<[u8; 32]>,
    },
    /// The request ended normally.
    Finished {
        /// Why (EOS, stop string, grammar end, `max_tokens`, context end).
        reason: FinishReason,
        /// Held-back text released at the end (never part of a stop string).
        text: String,
        /// Token counts.
        usage: Box<Usage>,
        /// Phase timings.
        timings: Timings,
    },
    /// The request failed (a constraint error, a sampling error, a backend fault, engine
    /// shutdown). Only this request is affected.
    Error(String),
}

/// The caller's end of one request: the event stream and cancellation. Dropping the handle
/// cancels the request (its KV is freed at the next step).
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) id: u64,
    pub(crate) events: Receiver<Event>,
    pub(crate) cancelled: Arc<AtomicBool>,
    pub(crate) shared: Arc<Shared>,
}

impl RequestHandle {
    /// The request id (unique per engine, increasing with submission order).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event, blocking; `None` once the stream has ended (after `Finished` or
    /// `Error`).
    pub fn recv(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    /// The next event if one is ready; `None` when none is ready now or the stream ended
    /// (see [`RequestHandle::is_closed`]).
    pub fn try_recv(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }

    /// Whether the stream has ended and every event was received.
    pub fn is_closed(&self) -> bool {
        matches!(self.events.try_recv(), Err(TryRecvError::Disconnected))
    }

    /// Cancels the request: the engine ends it at the next step and frees its KV blocks
    /// at once; no further events are sent. Idempotent.
    pub fn cancel(&self) {
        if !self.cancelled.swap(true, Ordering::SeqCst) {
            self.shared.wake();
        }
    }

    /// Blocks until the request ends and collects it (a convenience for tests and batch
    /// use).
    pub fn collect(self) -> Completion {
        let mut out = Completion::default();
        for event in &self {
            match event {
                Event::Token {
                    token,
                    text,
                    logprob,
                    logit_sha256,
                    ..
                } => {
                    out.tokens.push(token);
                    out.text.push_str(&text);
                    out.logprobs.push(logprob);
                    if let Some(d) = logit_sha256 {
                        out.logit_sha256.push(d);
                    }
                }
                Event::Finished {
                    reason,
                    text,
                    usage,
                    timings,
                } => {
                    out.text.push_str(&text);
                    out.finish = Some(reason);
                    out.usage = *usage;
                    out.timings = timings;
                }
                Event::Error(e) => out.error = Some(e),
            }
        }
        out
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl<'a> IntoIterator for &'a RequestHandle {
    type Item = Event;
    type IntoIter = EventIter<'a>;
    fn into_iter(self) -> EventIter<'a> {
        EventIter { handle: self }
    }
}

/// Blocking iterator over a request's events (ends after `Finished` or `Error`).
#[derive(Debug)]
pub struct EventIter<'a> {
    handle: &'a RequestHandle,
}

impl Iterator for EventIter<'_> {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.handle.recv()
    }
}

/// A whole request's result, gathered by [`RequestHandle::collect`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// The output text.
    pub text: String,
    /// Log-probability of each generated token.
    pub logprobs: Vec<f32>,
    /// Logit digests (when requested).
    pub logit_sha256: Vec<[u8; 32]>,
    /// The finish reason (`None` after an error).
    pub finish: Option<FinishReason>,
    /// Token counts.
    pub usage: Usage,
    /// Phase timings.
    pub timings: Timings,
    /// The error that ended the request, if any.
    pub error: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------

/// A snapshot of the engine's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineMetrics {
    /// Forward steps run.
    pub steps: u64,
    /// Rows computed over all steps.
    pub rows_total: u64,
    /// Rows of the last step.
    pub last_step_rows: usize,
    /// Mean rows per step.
    pub mean_rows_per_step: f64,
    /// Sequences in the last step's batch.
    pub last_step_seqs: usize,
    /// Mean of (sequences in the batch / `max_seqs`) over steps.
    pub mean_batch_occupancy: f64,
    /// Wall time of the last step (schedule + forward + sampling), ms.
    pub last_step_ms: f64,
    /// Mean wall time per step, ms.
    pub mean_step_ms: f64,
    /// Total wall time of all steps, ms.
    pub step_ms_total: f64,
    /// Total time inside the backend's forward calls (the batched forward of each step,
    /// and the per-sequence reruns that isolate a failing one), ms: `step_ms_total` minus
    /// this is the engine's own work (scheduling, sampling, grammar, speculation).
    pub forward_ms_total: f64,
    /// Tokens whose KV came from the prefix cache (all admissions, re-admissions after
    /// preemption included).
    pub prefix_cache_hit_tokens: u64,
    /// Sequences preempted (KV freed, recomputed later) under KV pressure.
    pub preemptions: u64,
    /// Cached prefix blocks evicted (LRU) under KV pressure.
    pub evictions: u64,
    /// Requests waiting for admission.
    pub queue_depth: usize,
    /// Sequences running.
    pub running: usize,
    /// Free KV blocks.
    pub kv_free_blocks: usize,
    /// KV blocks in the pool.
    pub kv_total_blocks: usize,
    /// Blocks published in the prefix index.
    pub prefix_cached_blocks: usize,
    /// Requests that finished normally.
    pub requests_finished: u64,
    /// Requests cancelled by the caller.
    pub requests_cancelled: u64,
    /// Requests that ended with an error.
    pub requests_failed: u64,
    /// Speculation counters over all requests (finished or not).
    pub spec: SpecStats,
    /// Whether the cost model currently lets the draft model run.
    pub spec_draft_model_on: bool,
    /// Tokens held by the cross-request suffix index (0 without one).
    pub spec_suffix_stored_tokens: u64,
    /// The prefix cache's disk tier (all zero and `enabled: false` without one).
    pub disk: crate::disk::DiskCacheMetrics,
}

// ---------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------

/// The engine: owns the step-loop thread, the backend and the KV pool. `submit` may be
/// called from any thread.
#[derive(Debug)]
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
    pub(crate) thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Sets up the backend's KV pool (`cfg.kv_tokens`) and starts the step loop.
    pub fn start(
        backend: Box<dyn ForwardBackend>,
        text: Arc<text::Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        submit::start(backend, text, cfg)
    }

    /// Queues a request. Checked at once: empty prompt, token ids outside the vocabulary,
    /// a prompt that leaves no room in the context or cannot fit the KV pool, invalid
    /// sampling parameters or stop strings ([`SubmitError::Invalid`]), and a full queue
    /// ([`SubmitError::Busy`]).
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, SubmitError> {
        submit::submit(&self.shared, req)
    }

    /// Queues a group of requests (the `n` choices of one API call) all or none: each is
    /// checked as by [`Engine::submit`], and the queue must have room for the whole group,
    /// so a refused group leaves nothing queued behind it.
    pub fn submit_group(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestHandle>, SubmitError> {
        submit::submit_group(&self.shared, reqs)
    }

    /// A snapshot of the counters.
    pub fn metrics(&self) -> EngineMetrics {
        self.shared.metrics()
    }

    /// The context length in effect (positions `0..context_len`).
    pub fn context_len(&self) -> usize {
        self.shared.limits.context_len
    }

    /// The logit width of the backend.
    pub fn n_vocab(&self) -> usize {
        self.shared.limits.n_vocab
    }

    /// Whether the prefix cache's disk tier works, as decided at start (and why not).
    pub fn disk_cache_state(&self) -> &crate::disk::DiskCacheState {
        self.shared.disk_state()
    }

    /// Stops the loop: requests still queued or running end with
    /// `Event::Error("engine shut down")`; every KV block is given back.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.request_shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}
