//! The step loop: one thread owns the backend; each step it takes new requests, reaps
//! cancellations, asks the [scheduler](crate::scheduler) for a plan, carries it out on the
//! KV pool (preempt, admit with prefix reuse, evict, prepare), runs **one** batched forward
//! over the rows of every scheduled sequence, and chooses the next token of each sequence
//! whose catch-up is complete, with the sampling crate's one rule.
//!
//! Speculation: before planning, each speculating sequence in the decode phase asks its
//! drafter for a proposal ([`Loop::propose_drafts`], masked by a fork of its constraint);
//! the drafts become the sequence's `extra_rows`, and [`Loop::rows_for`] puts the verify
//! block `[t, d1..dk]` into the step's one batched forward. [`Loop::verify_at`] walks the
//! rows with the verified constraint through the same [`Loop::choose_at`] plain decoding
//! uses (so events, stops and usage are exactly plain decoding's), accepts while the
//! target's choice equals the draft, and rolls the KV back with
//! `ForwardBackend::kv_truncate` to the committed length.

use crate::api::{
    BackendError, EngineConfig, EngineError, EngineMetrics, Event, FinishReason, ForwardBackend,
    ForwardRow, GenerateRequest, KvSlot, RequestHandle, StopCause, SubmitError, Timings,
    TokenConstraint, TokenMask, Usage,
};
use crate::disk::{ChainBlock, DiskCacheState, DiskShared, DiskTier};
use crate::prefix::{BlockHash, PrefixIndex, chain_hash};
use crate::scheduler::{KvBudget, RunningSeq, SchedLimits, StepPlan, WaitingSeq, plan_step};
use sampling::{ChoiceContext, Sampler, SamplingParams, StopChecker, StopStep};
use sha2::{Digest, Sha256};
use spec::{
    CostModel, DraftContext, Drafter, DrafterKind, Mirror, PolicyConfig, SeqPolicy, SpecStats,
};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;
use text::{DecodeOptions, StreamDecoder, Tokenizer};

/// Fixed facts the submitting side checks requests against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) context_len: usize,
    pub(crate) n_vocab: usize,
    pub(crate) block_size: usize,
    pub(crate) total_blocks: usize,
    pub(crate) queue_capacity: usize,
}

/// A submitted request on its way to the loop.
struct Pending {
    id: u64,
    req: GenerateRequest,
    stop: StopChecker,
    events: Sender<Event>,
    cancelled: Arc<AtomicBool>,
    submitted: Instant,
}

#[derive(Default)]
struct Inbox {
    incoming: VecDeque<Pending>,
    /// Requests submitted and not yet admitted (incoming + waiting in the loop).
    queued: usize,
    shutdown: bool,
    /// The loop has ended: no more submissions.
    closed: bool,
}

/// State shared by the engine handle, request handles and the loop.
pub(crate) struct Shared {
    pub(crate) limits: Limits,
    inbox: Mutex<Inbox>,
    cv: Condvar,
    metrics: Mutex<EngineMetrics>,
    next_id: AtomicU64,
    /// The disk tier's live counters (when it is on).
    disk: Option<Arc<DiskShared>>,
    disk_state: DiskCacheState,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("limits", &self.limits)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Wakes the loop (a cancellation or new work).
    pub(crate) fn wake(&self) {
        let _g = lock(&self.inbox);
        self.cv.notify_all();
    }

    pub(crate) fn request_shutdown(&self) {
        let mut g = lock(&self.inbox);
        g.shutdown = true;
        self.cv.notify_all();
    }

    pub(crate) fn metrics(&self) -> EngineMetrics {
        let mut m = lock(&self.metrics).clone();
        m.queue_depth = lock(&self.inbox).queued;
        if let Some(d) = &self.disk {
            m.disk = d.metrics();
        }
        m
    }

    pub(crate) fn disk_state(&self) -> &DiskCacheState {
        &self.disk_state
    }
}

pub(crate) fn start(
    mut backend: Box<dyn ForwardBackend>,
    text: Arc<Tokenizer>,
    cfg: EngineConfig,
) -> Result<crate::Engine, EngineError> {
    for (name, v) in [
        ("max_seqs", cfg.max_seqs),
        ("kv_tokens", cfg.kv_tokens),
        ("step_token_budget", cfg.step_token_budget),
        ("prefill_chunk", cfg.prefill_chunk),
        ("queue_capacity", cfg.queue_capacity),
    ] {
        if v == 0 {
            return Err(EngineError::Config(format!("{name} must be at least 1")));
        }
    }
    let max_ctx = backend.max_context();
    let context_len = match cfg.context_len {
        0 => max_ctx,
        n if n > max_ctx => {
            return Err(EngineError::Config(format!(
                "context_len {n} exceeds the backend's maximum context of {max_ctx} tokens"
            )));
        }
        n => n,
    };
    backend.init_kv(cfg.kv_tokens)?;
    let (disk, disk_state) = open_disk(&cfg, backend.as_ref());
    let limits = Limits {
        context_len,
        n_vocab: backend.n_vocab(),
        block_size: backend.block_size().max(1),
        total_blocks: backend.total_blocks(),
        queue_capacity: cfg.queue_capacity,
    };
    let shared = Arc::new(Shared {
        limits,
        inbox: Mutex::new(Inbox::default()),
        cv: Condvar::new(),
        metrics: Mutex::new(EngineMetrics {
            kv_total_blocks: limits.total_blocks,
            kv_free_blocks: backend.free_blocks(),
            ..EngineMetrics::default()
        }),
        next_id: AtomicU64::new(1),
        disk: disk.as_ref().map(DiskTier::shared),
        disk_state,
    });
    let loop_shared = shared.clone();
    let thread = std::thread::Builder::new()
        .name("lockstep-engine".into())
        .spawn(move || run(loop_shared, backend, text, cfg, disk))
        .map_err(|e| EngineError::Thread(e.to_string()))?;
    Ok(crate::Engine {
        shared,
        thread: Some(thread),
    })
}

/// The disk tier `cfg` asks for, when it can work with `backend`, and what to report.
fn open_disk(
    cfg: &EngineConfig,
    backend: &dyn ForwardBackend,
) -> (Option<DiskTier>, DiskCacheState) {
    let Some(dc) = &cfg.disk_cache else {
        return (None, DiskCacheState::Off);
    };
    let why = if !cfg.prefix_cache {
        Some("the prefix cache is off".to_string())
    } else if !backend.shares_prefixes() {
        Some(
            "this model's sequences share no prefixes (DeepSeek V4 keeps compressor and \
             indexer state that is not saved at block boundaries), so nothing is cached"
                .to_string(),
        )
    } else {
        None
    };
    if let Some(why) = why {
        return (None, DiskCacheState::Unavailable(why));
    }
    let Some(layout) = backend.kv_block_format() else {
        return (
            None,
            DiskCacheState::Unavailable(
                "this backend's KV cache cannot be saved and restored".into(),
            ),
        );
    };
    match DiskTier::open(dc, &layout, backend.kv_block_bytes()) {
        Ok(tier) => (
            Some(tier),
            DiskCacheState::On {
                dir: dc.dir.clone(),
                max_bytes: dc.max_bytes,
            },
        ),
        Err(e) => (
            None,
            DiskCacheState::Unavailable(format!("opening {}: {e}", dc.dir.display())),
        ),
    }
}

pub(crate) fn submit(
    shared: &Arc<Shared>,
    req: GenerateRequest,
) -> Result<RequestHandle, SubmitError> {
    let mut handles = submit_group(shared, vec![req])?;
    Ok(handles.remove(0))
}

/// Checks one request before it is queued; returns its stop-string matcher.
fn check(l: &Limits, req: &GenerateRequest) -> Result<StopChecker, SubmitError> {
    if req.prompt.is_empty() {
        return Err(SubmitError::Invalid("the prompt is empty".into()));
    }
    if let Some((i, &t)) = req
        .prompt
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= l.n_vocab)
    {
        return Err(SubmitError::Invalid(format!(
            "prompt token {i} has id {t}, outside the vocabulary of {} ids",
            l.n_vocab
        )));
    }
    if req.prompt.len() >= l.context_len {
        return Err(SubmitError::Invalid(format!(
            "the prompt has {} tokens but the context is {} tokens: no room to generate \
             (the prompt must be shorter than the context)",
            req.prompt.len(),
            l.context_len
        )));
    }
    let blocks = (req.prompt.len() + 1).div_ceil(l.block_size);
    if blocks > l.total_blocks {
        return Err(SubmitError::Invalid(format!(
            "the prompt has {} tokens but the KV pool holds {} tokens ({} blocks of {})",
            req.prompt.len(),
            l.total_blocks * l.block_size,
            l.total_blocks,
            l.block_size
        )));
    }
    req.sampling
        .validate()
        .map_err(|e| SubmitError::Invalid(e.to_string()))?;
    StopChecker::new(req.stop_strings.iter().cloned())
        .map_err(|e| SubmitError::Invalid(e.to_string()))
}

/// Queues every request of `reqs` or none of them: each is checked, then the queue's
/// room is checked for all of them together under one lock, so a refused group leaves
/// nothing behind.
pub(crate) fn submit_group(
    shared: &Arc<Shared>,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<RequestHandle>, SubmitError> {
    let l = shared.limits;
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    let stops = reqs
        .iter()
        .map(|r| check(&l, r))
        .collect::<Result<Vec<_>, _>>()?;
    let mut inbox = lock(&shared.inbox);
    if inbox.closed || inbox.shutdown {
        return Err(SubmitError::ShutDown);
    }
    if inbox.queued + reqs.len() > l.queue_capacity {
        return Err(SubmitError::Busy {
            queued: inbox.queued,
            wanted: reqs.len(),
            capacity: l.queue_capacity,
        });
    }
    let mut handles = Vec::with_capacity(reqs.len());
    for (req, stop) in reqs.into_iter().zip(stops) {
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        inbox.incoming.push_back(Pending {
            id,
            req,
            stop,
            events: tx,
            cancelled: cancelled.clone(),
            submitted: Instant::now(),
        });
        inbox.queued += 1;
        handles.push(RequestHandle {
            id,
            events: rx,
            cancelled,
            shared: shared.clone(),
        });
    }
    shared.cv.notify_all();
    drop(inbox);
    Ok(handles)
}

/// One sequence: its request, its committed tokens and how far its KV is computed.
struct Seq<'t> {
    id: u64,
    events: Sender<Event>,
    cancelled: Arc<AtomicBool>,
    /// Prompt followed by the generated tokens (all committed).
    tokens: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    max_tokens: Option<usize>,
    ignore_eos: bool,
    logprobs: Option<usize>,
    digests: bool,
    constraint: Option<Box<dyn TokenConstraint>>,
    decoder: StreamDecoder<'t>,
    stop: StopChecker,
    /// The KV sequence while running.
    slot: Option<KvSlot>,
    /// Positions `0..computed` have their KV written.
    computed: usize,
    /// A shared, partly reused block will be copied at the next write.
    cow_pending: bool,
    /// Chained hashes of the full blocks of `tokens`.
    hashes: Vec<BlockHash>,
    /// Prefix-index entries this sequence holds a use of.
    used: Vec<BlockHash>,
    /// Blocks of the chain already considered for publishing.
    published: usize,
    /// Prompt tokens reused at the first admission.
    cached_tokens: Option<usize>,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// Speculation state (`None` = plain decoding).
    spec: Option<SeqSpec>,
}

/// One sequence's speculation state.
struct SeqSpec {
    drafter: Box<dyn Drafter>,
    policy: SeqPolicy,
    cfg: PolicyConfig,
    stats: SpecStats,
    /// This step's drafts (verified after the forward, then cleared).
    drafts: Vec<u32>,
    /// Of the drafts, how many were grammar-forced.
    forced: usize,
    /// The drafter kind of the non-forced drafts.
    source: Option<DrafterKind>,
    /// Which drafter proposed which of the drafts (`(kind, run)` in order).
    segments: Vec<(DrafterKind, usize)>,
    /// Drafting time of this step's proposal (costly drafters), µs.
    cost_us: u64,
    /// The top1 − top2 margin of the logits that chose the last committed token.
    margin: Option<f32>,
}

impl Seq<'_> {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn extend_hashes(&mut self, bs: usize) {
        while (self.hashes.len() + 1) * bs <= self.tokens.len() {
            let d = self.hashes.len();
            let h = chain_hash(self.hashes.last(), &self.tokens[d * bs..(d + 1) * bs]);
            self.hashes.push(h);
        }
    }

    fn send(&self, e: Event) -> bool {
        self.events.send(e).is_ok()
    }
}

/// How a sequence leaves the engine.
enum Exit {
    Finished(FinishReason),
    Failed(String),
    Cancelled,
}

/// The loop's state (lives on the engine thread).
struct Loop<'t> {
    shared: Arc<Shared>,
    backend: Box<dyn ForwardBackend>,
    tok: &'t Tokenizer,
    /// The same tokenizer, shared with the drafters that work in text space.
    tok_arc: Arc<Tokenizer>,
    cfg: EngineConfig,
    limits: Limits,
    running: Vec<Seq<'t>>,
    waiting: VecDeque<Seq<'t>>,
    index: PrefixIndex,
    sampler: Sampler,
    never: TokenMask,
    mask: TokenMask,
    /// The speculative mirror's mask buffer, reused by every proposal.
    draft_mask: TokenMask,
    logits: Vec<f32>,
    /// The last forward's row summaries when the backend summarizes.
    summaries: Vec<sampling::RowSummary>,
    /// A logit row fetched from the backend for a choice that needs it.
    row_buf: Vec<f32>,
    metrics: EngineMetrics,
    step_ms_total: f64,
    occupancy_total: f64,
    /// Engine-wide speculation cost measurements.
    cost: CostModel,
    /// The prefix cache's disk tier.
    disk: Option<DiskTier>,
}

fn run(
    shared: Arc<Shared>,
    backend: Box<dyn ForwardBackend>,
    tok: Arc<Tokenizer>,
    cfg: EngineConfig,
    disk: Option<DiskTier>,
) {
    let tok_ref: &Tokenizer = &tok;
    let limits = shared.limits;
    let mut cfg = cfg;
    cfg.prefix_cache &= backend.shares_prefixes();
    let mut never = TokenMask::new(limits.n_vocab);
    for &t in tok_ref.never_sample_ids() {
        let _ = never.set(t, true);
    }
    for t in tok_ref.vocab_size()..limits.n_vocab {
        let _ = never.set(t as u32, true);
    }
    let mut lp = Loop {
        shared: shared.clone(),
        backend,
        tok: tok_ref,
        tok_arc: Arc::clone(&tok),
        cfg,
        limits,
        running: Vec::new(),
        waiting: VecDeque::new(),
        index: PrefixIndex::new(),
        sampler: Sampler::new(),
        never,
        mask: TokenMask::new(limits.n_vocab),
        draft_mask: TokenMask::new(limits.n_vocab),
        logits: Vec::new(),
        summaries: Vec::new(),
        row_buf: Vec::new(),
        metrics: lock(&shared.metrics).clone(),
        step_ms_total: 0.0,
        occupancy_total: 0.0,
        cost: CostModel::new(),
        disk,
    };
    loop {
        let incoming = {
            let mut inbox = lock(&shared.inbox);
            loop {
                if inbox.shutdown {
                    inbox.closed = true;
                    break None;
                }
                if !inbox.incoming.is_empty() || lp.has_work() {
                    break Some(std::mem::take(&mut inbox.incoming));
                }
                inbox = shared.cv.wait(inbox).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(incoming) = incoming else { break };
        for p in incoming {
            lp.accept(p);
        }
        lp.reap_cancelled();
        if !lp.running.is_empty() || !lp.waiting.is_empty() {
            lp.step();
        }
        lp.publish_metrics();
    }
    lp.shutdown();
}

impl<'t> Loop<'t> {
    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn dequeue(&self) {
        let mut inbox = lock(&self.shared.inbox);
        inbox.queued = inbox.queued.saturating_sub(1);
    }

    /// A new request joins the waiting queue (or finishes at once for `max_tokens: 0`).
    fn accept(&mut self, p: Pending) {
        let req = p.req;
        let spec_cfg = &self.cfg.spec;
        let drafter: Option<Box<dyn Drafter>> = match req.drafter {
            Some(d) if !req.no_spec => Some(d),
            None if !req.no_spec && spec_cfg.is_on() => Some(Box::new(
                spec_cfg
                    .drafters
                    .build_for(Some(&self.tok_arc), req.spec_partition),
            )),
            _ => None,
        };
        let spec = drafter.map(|drafter| SeqSpec {
            drafter,
            policy: SeqPolicy::new(),
            cfg: req
                .spec_policy
                .clone()
                .unwrap_or_else(|| spec_cfg.policy.clone()),
            stats: SpecStats::default(),
            drafts: Vec::new(),
            forced: 0,
            source: None,
            segments: Vec::new(),
            cost_us: 0,
            margin: None,
        });
        let seq = Seq {
            id: p.id,
            events: p.events,
            cancelled: p.cancelled,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            params: req.sampling,
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            digests: req.logit_digests,
            constraint: req.constraint,
            decoder: self
                .tok
                .stream_decoder(DecodeOptions { skip_special: true }),
            stop: p.stop,
            slot: None,
            computed: 0,
            cow_pending: false,
            hashes: Vec::new(),
            used: Vec::new(),
            published: 0,
            cached_tokens: None,
            submitted: p.submitted,
            admitted: None,
            first_token: None,
            spec,
        };
        if seq.max_tokens == Some(0) {
            self.dequeue();
            self.end(seq, Exit::Finished(FinishReason::Length));
            return;
        }
        self.waiting.push_back(seq);
    }

    /// Gives back a sequence's KV and prefix-index uses.
    fn free_kv(&mut self, seq: &mut Seq<'t>) {
        if let Some(slot) = seq.slot.take() {
            self.backend.kv_release(slot);
        }
        self.index.release(&seq.used);
        seq.used.clear();
        seq.computed = 0;
        seq.cow_pending = false;
        seq.published = 0;
        if let Some(sp) = seq.spec.as_mut() {
            sp.drafts.clear();
        }
    }

    /// Ends a sequence: frees everything, updates the counters, sends the last event
    /// (after the counters are published, so a caller that saw it sees them).
    fn end(&mut self, mut seq: Seq<'t>, exit: Exit) {
        if let (Exit::Finished(_), Some(sp)) = (&exit, seq.spec.as_mut()) {
            // Drafters that learn across requests record the finished sequence.
            sp.drafter.finish(&seq.tokens);
        }
        self.free_kv(&mut seq);
        if seq.admitted.is_none() && !matches!(exit, Exit::Finished(_)) {
            // Left before ever being admitted.
            self.dequeue();
        }
        match exit {
            Exit::Finished(_) => self.metrics.requests_finished += 1,
            Exit::Failed(_) => self.metrics.requests_failed += 1,
            Exit::Cancelled => self.metrics.requests_cancelled += 1,
        }
        self.publish_metrics();
        match exit {
            Exit::Finished(reason) => {
                let text = final_text(&mut seq, reason);
                let now = Instant::now();
                let ms =
                    |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
                let admitted = seq.admitted.unwrap_or(now);
                let first = seq.first_token.unwrap_or(now);
                let timings = Timings {
                    queue_ms: ms(seq.submitted, admitted),
                    prefill_ms: ms(admitted, first),
                    decode_ms: ms(first, now),
                    ttft_ms: ms(seq.submitted, first),
                };
                let usage = Usage {
                    prompt_tokens: seq.prompt_len,
                    completion_tokens: seq.generated(),
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    spec: seq.spec.as_ref().map(|sp| sp.stats),
                };
                seq.send(Event::Finished {
                    reason,
                    text,
                    usage,
                    timings,
                });
            }
            Exit::Failed(msg) => {
                seq.send(Event::Error(msg));
            }
            Exit::Cancelled => {}
        }
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled.load(Ordering::SeqCst) {
                let s = self.running.remove(i);
                self.end(s, Exit::Cancelled);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancelled.load(Ordering::SeqCst) {
                if let Some(s) = self.waiting.remove(i) {
                    self.end(s, Exit::Cancelled);
                }
            } else {
                i += 1;
            }
        }
    }

    /// The prefix reuse a waiting sequence would get: (cached tokens, match).
    fn prefix_match(&self, seq: &Seq<'t>) -> (usize, crate::prefix::PrefixMatch) {
        if !self.cfg.prefix_cache {
            return (0, Default::default());
        }
        let m = self
            .index
            .lookup(&seq.hashes, &seq.tokens, self.limits.block_size);
        // The last token is always computed: its row gives the logits of the next choice.
        let cached = (m.blocks * self.limits.block_size).min(seq.tokens.len().saturating_sub(1));
        if cached == 0 {
            return (0, Default::default());
        }
        (cached, m)
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        self.propose_drafts();
        let bs = self.limits.block_size;
        let sched_limits = SchedLimits {
            max_seqs: self.cfg.max_seqs,
            step_token_budget: self.cfg.step_token_budget,
            prefill_chunk: self.cfg.prefill_chunk,
            block_size: bs,
        };
        let running: Vec<RunningSeq> = self
            .running
            .iter()
            .map(|s| RunningSeq {
                id: s.id,
                computed: s.computed,
                total: s.tokens.len(),
                extra_rows: s.spec.as_ref().map_or(0, |sp| sp.drafts.len()),
                cow_blocks: usize::from(s.cow_pending),
            })
            .collect();
        let look = self.cfg.max_seqs.saturating_sub(self.running.len()) + 1;
        let mut waiting = Vec::new();
        for s in self.waiting.iter_mut().take(look) {
            s.extend_hashes(bs);
        }
        if self.disk.is_some() {
            for i in 0..self.waiting.len().min(look) {
                self.restore_from_disk(i);
            }
        }
        for s in self.waiting.iter().take(look) {
            let (cached, m) = self.prefix_match(s);
            waiting.push(WaitingSeq {
                id: s.id,
                total: s.tokens.len(),
                cached_tokens: cached,
                cached_blocks: if cached > 0 { m.blocks } else { 0 },
                cached_idle_blocks: if cached > 0 { m.idle } else { 0 },
                cow_blocks: usize::from(cached > 0 && cached < m.blocks * bs),
            });
        }
        let kv = KvBudget {
            free_blocks: self.backend.free_blocks(),
            evictable_blocks: self.index.idle_count(),
            total_blocks: self.backend.total_blocks(),
        };
        let plan = plan_step(&sched_limits, &running, &waiting, kv);
        self.apply(plan, t0);
    }

    /// Reads back from disk the blocks of waiting sequence `i` that follow its longest
    /// prefix in RAM, as idle prefix-cache entries (so the scheduler sees them as cached
    /// and admission forks them like any cached prefix). The chain of blocks on disk is
    /// read ahead by the disk tier's reader threads while this thread copies the blocks
    /// already read into the KV pool. Stops at the first block not on disk or rejected,
    /// and while fewer than two blocks are free (restoring never evicts).
    fn restore_from_disk(&mut self, i: usize) {
        let Some(disk) = self.disk.as_ref() else {
            return;
        };
        if !self.cfg.prefix_cache {
            return;
        }
        let bs = self.limits.block_size;
        let Some(s) = self.waiting.get(i) else { return };
        let m = self.index.lookup(&s.hashes, &s.tokens, bs);
        let (mut d, mut holder) = (m.blocks, m.holder);
        // The blocks on disk after the prefix in RAM, as many as could be restored now.
        let room = self.backend.free_blocks().saturating_sub(1);
        let chain: Vec<ChainBlock> = (d..s.hashes.len())
            .take(room)
            .take_while(|&k| disk.contains(&s.hashes[k]))
            .map(|k| ChainBlock {
                hash: s.hashes[k],
                parent: k.checked_sub(1).map(|p| s.hashes[p]),
                tokens: s.tokens[k * bs..(k + 1) * bs].to_vec(),
            })
            .collect();
        if chain.is_empty() {
            return;
        }
        let t0 = Instant::now();
        let mut reads = disk.read_chain(chain);
        let (mut restored, mut bytes) = (0u64, 0u64);
        while d < s.hashes.len() && self.backend.free_blocks() >= 2 {
            let Some(block) = reads.next() else {
                break;
            };
            let h = s.hashes[d];
            let parent = d.checked_sub(1).map(|p| s.hashes[p]);
            let tokens = &s.tokens[d * bs..(d + 1) * bs];
            let slot = match holder {
                Some(src) => match self.backend.kv_fork(src, d * bs) {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
                None => self.backend.kv_new(),
            };
            match self.backend.kv_restore_block(slot, block.payload()) {
                Ok(()) => {}
                Err(e) => {
                    self.backend.kv_release(slot);
                    if !matches!(e, BackendError::OutOfBlocks { .. }) {
                        disk.reject(&h, &e.to_string());
                    }
                    break;
                }
            }
            if !self.index.publish(h, parent, tokens, slot) {
                self.backend.kv_release(slot);
                break;
            }
            // Published as idle: no sequence uses it until one is admitted.
            self.index.release(&[h]);
            holder = Some(slot);
            restored += 1;
            bytes += block.file_bytes();
            d += 1;
        }
        drop(reads);
        if restored > 0 {
            disk.count_hits(restored);
            disk.count_restore(restored, bytes, t0.elapsed());
        }
    }

    fn position_running(&self, id: u64) -> Option<usize> {
        self.running.iter().position(|s| s.id == id)
    }

    /// Preempts a running sequence: its KV is freed, it goes back to the queue front and
    /// is recomputed (prompt + generated) when readmitted — with identical results (G1).
    fn preempt(&mut self, id: u64) -> Option<Seq<'t>> {
        let at = self.position_running(id)?;
        let mut s = self.running.remove(at);
        self.free_kv(&mut s);
        self.metrics.preemptions += 1;
        Some(s)
    }

    fn requeue(&mut self, mut back: Vec<Seq<'t>>) {
        back.sort_by_key(|s| s.id);
        for s in back.into_iter().rev() {
            self.waiting.push_front(s);
        }
    }

    /// Admits the waiting sequence `id`: a new KV sequence, forked from the prefix cache
    /// where a prefix matches.
    fn admit(&mut self, id: u64) -> Result<(), ()> {
        let at = self.waiting.iter().position(|s| s.id == id).ok_or(())?;
        let mut s = self.waiting.remove(at).ok_or(())?;
        let bs = self.limits.block_size;
        s.extend_hashes(bs);
        let (cached, m) = self.prefix_match(&s);
        let mut matched = 0;
        let slot = match m.holder {
            Some(holder) if cached > 0 => match self.backend.kv_fork(holder, m.blocks * bs) {
                Ok(slot) => {
                    self.index.acquire(&s.hashes[..m.blocks]);
                    s.used = s.hashes[..m.blocks].to_vec();
                    s.computed = cached;
                    s.cow_pending = cached < m.blocks * bs;
                    s.published = m.blocks;
                    matched = m.blocks;
                    self.metrics.prefix_cache_hit_tokens += cached as u64;
                    slot
                }
                Err(_) => self.backend.kv_new(),
            },
            _ => self.backend.kv_new(),
        };
        s.slot = Some(slot);
        if s.admitted.is_none() {
            if let Some(disk) = &self.disk {
                let full = (s.prompt_len / bs) as u64;
                disk.count_misses(full.saturating_sub(matched as u64));
            }
            s.admitted = Some(Instant::now());
            s.cached_tokens = Some(s.computed.min(s.prompt_len));
            self.dequeue();
        }
        self.running.push(s);
        Ok(())
    }

    /// Frees blocks from the prefix cache (LRU) until `needed` are free.
    fn evict_for(&mut self, needed: usize) {
        while self.backend.free_blocks() < needed {
            match self.index.evict_one() {
                Some(holder) => {
                    self.backend.kv_release(holder);
                    self.metrics.evictions += 1;
                }
                None => break,
            }
        }
    }

    fn apply(&mut self, plan: StepPlan, t0: Instant) {
        let mut back = Vec::new();
        for &id in &plan.preempt {
            if let Some(s) = self.preempt(id) {
                back.push(s);
            }
        }
        for &id in &plan.too_large {
            let seq = match self.position_running(id) {
                Some(at) => Some(self.running.remove(at)),
                None => self
                    .waiting
                    .iter()
                    .position(|s| s.id == id)
                    .and_then(|at| self.waiting.remove(at)),
            };
            if let Some(s) = seq {
                let msg = format!(
                    "the KV pool ({} blocks of {} tokens) cannot hold this sequence of {} tokens",
                    self.limits.total_blocks,
                    self.limits.block_size,
                    s.tokens.len() + 1
                );
                self.end(s, Exit::Failed(msg));
            }
        }
        for &id in &plan.admit {
            let _ = self.admit(id);
        }
        // Drafts the scheduler did not grant rows for are dropped (a scheduler skip).
        for s in self.running.iter_mut() {
            let Some(sp) = s.spec.as_mut() else { continue };
            if sp.drafts.is_empty() {
                continue;
            }
            let granted = plan
                .grants
                .iter()
                .find(|g| g.id == s.id)
                .map_or(0, |g| g.rows.saturating_sub(1));
            if granted < sp.drafts.len() {
                sp.drafts.truncate(granted);
                sp.forced = sp.forced.min(granted);
                sp.stats.sched_skips += 1;
                self.metrics.spec.sched_skips += 1;
            }
        }
        // Prepare every granted sequence's KV, evicting cached blocks on demand.
        let mut grants: Vec<(u64, usize)> = Vec::new();
        for g in &plan.grants {
            let Some(at) = self.position_running(g.id) else {
                continue;
            };
            let (slot, from) = match self.running[at].slot {
                Some(slot) => (slot, self.running[at].computed),
                None => continue,
            };
            let to = from + g.rows;
            let needed = self.backend.kv_blocks_needed(slot, from, to);
            self.evict_for(needed);
            match self.backend.kv_prepare(slot, from, to) {
                Ok(()) => {
                    self.running[at].cow_pending = false;
                    grants.push((g.id, g.rows));
                }
                Err(BackendError::OutOfBlocks { .. }) => {
                    // The plan and the pool disagree (should not happen): wait, recompute.
                    if let Some(s) = self.preempt(g.id) {
                        back.push(s);
                    }
                }
                Err(e) => {
                    let s = self.running.remove(at);
                    self.end(s, Exit::Failed(format!("KV cache: {e}")));
                }
            }
        }
        self.requeue(back);
        if grants.is_empty() {
            return;
        }
        let rows_total: usize = grants.iter().map(|g| g.1).sum();
        // A step of decode and verify rows only (no prefill) measures the cost model.
        let decode_only = grants.iter().all(|&(id, r)| self.logit_rows(id, r) == r);
        let t_fwd = Instant::now();
        let rows = self.rows_for(&grants);
        let mut logits = std::mem::take(&mut self.logits);
        let on_device = self.backend.summarizes();
        let ok = if on_device {
            self.backend.forward_summaries(&rows, &mut self.summaries)
        } else {
            self.backend.forward(&rows, &mut logits)
        };
        let mut done: Vec<(u64, usize, Result<StepRows, String>)> = Vec::new();
        match ok {
            Ok(()) => {
                let n = self.limits.n_vocab;
                let mut at = 0;
                for &(id, r) in &grants {
                    let k = self.logit_rows(id, r);
                    let short = || "the backend returned too few logit rows".to_string();
                    let l = if on_device {
                        let first = at;
                        at += k;
                        (at <= self.summaries.len())
                            .then_some(StepRows::Device { first, k })
                            .ok_or_else(short)
                    } else if k > 0 {
                        let row = logits.get(at * n..(at + k) * n).map(<[f32]>::to_vec);
                        at += k;
                        row.map(StepRows::Host).ok_or_else(short)
                    } else {
                        Ok(StepRows::Host(Vec::new()))
                    };
                    done.push((id, r, l));
                }
            }
            Err(_) => {
                // Isolate the fault: rerun each sequence alone (G1 makes the results the
                // same); only the sequences that fail alone end with an error.
                for &(id, r) in &grants {
                    let rows = self.rows_for(&[(id, r)]);
                    let l = match self.backend.forward(&rows, &mut logits) {
                        Ok(()) if self.logit_rows(id, r) > 0 => Ok(StepRows::Host(logits.clone())),
                        Ok(()) => Ok(StepRows::Host(Vec::new())),
                        Err(e) => Err(format!("forward failed: {e}")),
                    };
                    done.push((id, r, l));
                }
            }
        }
        self.logits = logits;
        // Step counters first, so they are visible before any event of this step.
        let n_seqs = done.len();
        let m = &mut self.metrics;
        m.steps += 1;
        m.rows_total += rows_total as u64;
        m.last_step_rows = rows_total;
        m.last_step_seqs = n_seqs;
        m.mean_rows_per_step = m.rows_total as f64 / m.steps as f64;
        self.occupancy_total += n_seqs as f64 / self.cfg.max_seqs as f64;
        m.mean_batch_occupancy = self.occupancy_total / m.steps as f64;
        for (id, r, l) in done {
            let Some(at) = self.position_running(id) else {
                continue;
            };
            match l {
                Err(msg) => {
                    let s = self.running.remove(at);
                    self.end(s, Exit::Failed(msg));
                }
                Ok(l) if l.rows(self.limits.n_vocab) > 1 => {
                    if let Some(exit) = self.verify_at(at, l.as_ref()) {
                        let s = self.running.remove(at);
                        self.end(s, exit);
                    }
                }
                Ok(l) => {
                    self.running[at].computed += r;
                    self.publish_blocks(at);
                    if let Some(sp) = self.running[at].spec.as_mut() {
                        sp.drafts.clear();
                    }
                    if l.rows(self.limits.n_vocab) > 0
                        && let Some(exit) = self.choose_at(at, l.as_ref())
                    {
                        let s = self.running.remove(at);
                        self.end(s, exit);
                    }
                }
            }
        }
        if decode_only {
            self.cost
                .observe_step(rows_total, t_fwd.elapsed().as_secs_f64() * 1e3);
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let m = &mut self.metrics;
        m.last_step_ms = ms;
        self.step_ms_total += ms;
        m.mean_step_ms = self.step_ms_total / m.steps as f64;
    }

    /// The sequence's drafts this step when a grant of `rows` is its verify block
    /// `[t, d1..dk]` (the committed token's row plus every draft).
    fn verify_drafts<'a>(s: &'a Seq<'_>, rows: usize) -> Option<&'a [u32]> {
        let sp = s.spec.as_ref()?;
        (!sp.drafts.is_empty() && s.computed + 1 == s.tokens.len() && rows == 1 + sp.drafts.len())
            .then_some(&sp.drafts[..])
    }

    /// How many rows of a grant of `rows` want logits: every row of a verify block, the
    /// last row of a grant that completes the catch-up, none otherwise.
    fn logit_rows(&self, id: u64, rows: usize) -> usize {
        self.position_running(id)
            .map(|at| {
                let s = &self.running[at];
                if Self::verify_drafts(s, rows).is_some() {
                    rows
                } else {
                    usize::from(s.computed + rows == s.tokens.len())
                }
            })
            .unwrap_or(0)
    }

    /// The forward rows of the grants: committed catch-up rows, and for a verify block the
    /// draft rows after the committed token (every row with logits).
    fn rows_for(&self, grants: &[(u64, usize)]) -> Vec<ForwardRow> {
        let mut rows = Vec::new();
        for &(id, r) in grants {
            let Some(at) = self.position_running(id) else {
                continue;
            };
            let s = &self.running[at];
            let Some(slot) = s.slot else { continue };
            if let Some(drafts) = Self::verify_drafts(s, r) {
                let t = s.computed;
                rows.push(ForwardRow {
                    slot,
                    token: s.tokens[t],
                    pos: t,
                    wants_logits: true,
                });
                for (j, &d) in drafts.iter().enumerate() {
                    rows.push(ForwardRow {
                        slot,
                        token: d,
                        pos: t + 1 + j,
                        wants_logits: true,
                    });
                }
                continue;
            }
            let to = s.computed + r;
            for pos in s.computed..to {
                rows.push(ForwardRow {
                    slot,
                    token: s.tokens[pos],
                    pos,
                    wants_logits: pos + 1 == to && to == s.tokens.len(),
                });
            }
        }
        rows
    }

    /// Publishes the sequence's full, committed, computed blocks to the prefix index.
    fn publish_blocks(&mut self, at: usize) {
        if !self.cfg.prefix_cache {
            return;
        }
        let bs = self.limits.block_size;
        let s = &mut self.running[at];
        s.extend_hashes(bs);
        let Some(slot) = s.slot else { return };
        let limit = s.computed.min(s.tokens.len()) / bs;
        while s.published < limit.min(s.hashes.len()) {
            let d = s.published;
            s.published += 1;
            let h = s.hashes[d];
            if self.index.contains(&h) {
                continue;
            }
            let Ok(holder) = self.backend.kv_fork(slot, (d + 1) * bs) else {
                break;
            };
            let parent = if d > 0 { Some(s.hashes[d - 1]) } else { None };
            if self
                .index
                .publish(h, parent, &s.tokens[d * bs..(d + 1) * bs], holder)
            {
                s.used.push(h);
                if let Some(disk) = &self.disk
                    && disk.writing()
                    && !disk.contains(&h)
                {
                    let mut payload = Vec::new();
                    if self
                        .backend
                        .kv_export_block(holder, d, &mut payload)
                        .is_ok()
                    {
                        let tokens = s.tokens[d * bs..(d + 1) * bs].to_vec();
                        disk.submit(h, parent, tokens, payload);
                    }
                }
            } else {
                self.backend.kv_release(holder);
            }
        }
    }

    /// Chooses the next token of running sequence `at` from its logit row, emits it, and
    /// says whether the sequence ends. A verifier walks several rows here.
    fn choose_at(&mut self, at: usize, row: Logits<'_>) -> Option<Exit> {
        let mut buf = std::mem::take(&mut self.row_buf);
        let exit = self.choose_row(at, row, &mut buf);
        self.row_buf = buf;
        exit
    }

    /// The plain greedy choice of sequence `at` from summary `i` alone, when it is exactly
    /// what the full row would give: temperature 0 without penalties or bias, no
    /// top logprobs, digests or speculation margin asked, a finite row, and the argmax
    /// neither never-sampled nor rejected by the constraint (an allowed unmasked argmax
    /// is the masked argmax too, ties included: it is the lowest id among the maxima).
    fn greedy_from_summary(&mut self, at: usize, i: usize) -> Option<(u32, f32)> {
        let s = &mut self.running[at];
        let (token, logprob) = self.summaries.get(i)?.greedy()?;
        let plain = s.params.is_plain_greedy()
            && s.logprobs.is_none()
            && !s.digests
            && s.spec.as_ref().is_none_or(|sp| sp.cfg.margin_bar <= 0.0)
            && (token as usize) < self.limits.n_vocab
            && !self.never.get(token);
        (plain && s.constraint.as_mut().is_none_or(|c| c.accepts(token)))
            .then_some((token, logprob))
    }

    fn choose_row(&mut self, at: usize, row: Logits<'_>, buf: &mut Vec<f32>) -> Option<Exit> {
        let fast = match row {
            Logits::Device { first } => self.greedy_from_summary(at, first),
            Logits::Host(_) => None,
        };
        let (token, logprob, top_logprobs, logit_sha256) = match fast {
            Some((token, logprob)) => {
                let s = &mut self.running[at];
                if let Some(sp) = s.spec.as_mut() {
                    sp.margin = None;
                }
                if let Some(c) = s.constraint.as_mut()
                    && let Err(e) = c.consume(token)
                {
                    return Some(Exit::Failed(format!("constraint: {e}")));
                }
                (token, logprob, None, None)
            }
            None => {
                let logits: &[f32] = match row {
                    Logits::Host(l) => l,
                    Logits::Device { first } => {
                        if let Err(e) = self.backend.logit_row(first, buf) {
                            return Some(Exit::Failed(format!("forward failed: {e}")));
                        }
                        buf
                    }
                };
                match self.choose_full(at, logits) {
                    Ok(c) => c,
                    Err(exit) => return Some(exit),
                }
            }
        };
        self.emit(at, token, logprob, top_logprobs, logit_sha256)
    }

    /// The choice from a full logit row: token, logprob, top logprobs, digest.
    #[allow(clippy::type_complexity)]
    fn choose_full(
        &mut self,
        at: usize,
        logits: &[f32],
    ) -> Result<(u32, f32, Option<Vec<(u32, f32)>>, Option<[u8; 32]>), Exit> {
        let s = &mut self.running[at];
        let position = s.tokens.len();
        let allowed = match s.constraint.as_mut() {
            Some(c) => match c.compute_mask(&mut self.mask) {
                Ok(()) => Some(&self.mask),
                Err(e) => return Err(Exit::Failed(format!("constraint: {e}"))),
            },
            None => None,
        };
        let ctx = ChoiceContext {
            prompt_tokens: &s.tokens[..s.prompt_len],
            generated_tokens: &s.tokens[s.prompt_len..],
            position: position as u64,
        };
        let choice = match self
            .sampler
            .choose(logits, &ctx, &s.params, allowed, &self.never)
        {
            Ok(c) => c,
            Err(e) => return Err(Exit::Failed(format!("sampling: {e}"))),
        };
        let token = choice.token;
        if let Some(sp) = s.spec.as_mut() {
            sp.margin =
                (sp.cfg.margin_bar > 0.0).then(|| top2_margin(logits, allowed, &self.never));
        }
        if let Some(c) = s.constraint.as_mut()
            && let Err(e) = c.consume(token)
        {
            return Err(Exit::Failed(format!("constraint: {e}")));
        }
        let top_logprobs = match s.logprobs {
            Some(n) => match sampling::top_logprobs(logits, n) {
                Ok(v) => Some(v.into_iter().map(|t| (t.token, t.logprob)).collect()),
                Err(e) => return Err(Exit::Failed(format!("logprobs: {e}"))),
            },
            None => None,
        };
        let logit_sha256 = s.digests.then(|| logit_digest(logits));
        Ok((token, choice.logprob, top_logprobs, logit_sha256))
    }

    /// Appends the chosen `token` to sequence `at`, sends its event and checks every stop.
    fn emit(
        &mut self,
        at: usize,
        token: u32,
        logprob: f32,
        top_logprobs: Option<Vec<(u32, f32)>>,
        logit_sha256: Option<[u8; 32]>,
    ) -> Option<Exit> {
        let s = &mut self.running[at];
        let position = s.tokens.len();
        s.tokens.push(token);
        if s.first_token.is_none() {
            s.first_token = Some(Instant::now());
        }
        let delta = match s.decoder.push(token) {
            Ok(d) => d,
            Err(e) => return Some(Exit::Failed(format!("detokenize: {e}"))),
        };
        let (text, stopped) = match s.stop.push(&delta) {
            StopStep::Continue { emit } => (emit, None),
            StopStep::Stopped { emit, stop_index } => (emit, Some(stop_index)),
        };
        let delivered = s.send(Event::Token {
            position,
            token,
            text,
            logprob,
            top_logprobs,
            logit_sha256,
        });
        if !delivered {
            return Some(Exit::Cancelled);
        }
        if let Some(index) = stopped {
            return Some(Exit::Finished(FinishReason::Stop(StopCause::StopString {
                index,
            })));
        }
        if !s.ignore_eos && self.tok.is_eos(token) {
            return Some(Exit::Finished(FinishReason::Stop(StopCause::Eos)));
        }
        if s.constraint.as_ref().is_some_and(|c| c.is_finished()) {
            return Some(Exit::Finished(FinishReason::Stop(StopCause::GrammarEnd)));
        }
        if s.max_tokens.is_some_and(|m| s.generated() >= m) {
            return Some(Exit::Finished(FinishReason::Length));
        }
        if s.tokens.len() >= self.limits.context_len {
            return Some(Exit::Finished(FinishReason::ContextLength));
        }
        None
    }

    /// Asks each speculating sequence in the decode phase for a proposal under its
    /// adaptive policy, masked by a fresh fork of its constraint (the speculative mirror;
    /// dropped afterwards, so the verified constraint never sees a draft).
    fn propose_drafts(&mut self) {
        let n_vocab = self.limits.n_vocab;
        let context_len = self.limits.context_len;
        let eos = self.tok.eos_ids();
        for s in self.running.iter_mut() {
            let Some(sp) = s.spec.as_mut() else { continue };
            sp.drafts.clear();
            sp.forced = 0;
            sp.source = None;
            sp.segments.clear();
            sp.cost_us = 0;
            if s.slot.is_none() || s.computed + 1 != s.tokens.len() {
                continue;
            }
            // Room: up to k drafts commit k + 1 tokens; the last row stays in the context.
            let generated = s.tokens.len() - s.prompt_len;
            let by_max = s
                .max_tokens
                .map_or(usize::MAX, |m| m.saturating_sub(generated + 1));
            let by_ctx = context_len.saturating_sub(s.tokens.len() + 1);
            let room = by_max.min(by_ctx).min(sp.cfg.max_draft);
            let plan = sp.policy.plan(&sp.cfg, &self.cost, room, sp.margin);
            if room == 0 || (plan.max_draft == 0 && s.constraint.is_none()) {
                sp.stats.record_no_draft(plan.gate);
                self.metrics.spec.record_no_draft(plan.gate);
                continue;
            }
            let allow_costly = !sp.cfg.cost_model || self.cost.costly_pays(room);
            self.metrics.spec_draft_model_on = allow_costly;
            let mut fork = s.constraint.as_ref().map(|c| c.fork());
            let mut mirror = match fork.as_mut() {
                Some(f) => Mirror::with_scratch(f.as_mut(), &mut self.draft_mask),
                None => Mirror::unconstrained(),
            };
            let ctx = DraftContext {
                tokens: &s.tokens,
                prompt_len: s.prompt_len,
                params: &s.params,
                never: &self.never,
                max_tokens: room,
                max_draft: plan.max_draft.min(room),
                kind_caps: &plan.caps,
                allow_costly,
                bars: &plan.bars,
                eos_ends: !s.ignore_eos,
                eos,
                target: s.slot.and_then(|slot| self.backend.target_rows(slot)),
            };
            let mut prop = sp.drafter.propose(&ctx, &mut mirror);
            // Never more than the room, never a token outside the logits.
            prop.tokens.truncate(room);
            if let Some(bad) = prop.tokens.iter().position(|&t| t as usize >= n_vocab) {
                prop.tokens.truncate(bad);
            }
            if let Some(kind) = prop.source {
                self.cost.observe_draft(
                    kind,
                    prop.tokens.len() - prop.forced.min(prop.tokens.len()),
                    prop.cost_us,
                );
            }
            if prop.tokens.is_empty() {
                sp.stats.record_no_draft(plan.gate);
                self.metrics.spec.record_no_draft(plan.gate);
                continue;
            }
            sp.forced = prop.forced.min(prop.tokens.len());
            sp.source = prop.source;
            sp.segments = prop.segments();
            sp.cost_us = prop.cost_us;
            sp.drafts = prop.tokens;
        }
    }

    /// Verifies sequence `at`'s block `[t, d1..dk]` from its `k + 1` logit rows: walks the
    /// rows with the plain choice ([`Loop::choose_at`], which emits each token exactly as
    /// plain decoding does and checks every stop), accepting while the target's choice
    /// equals the draft; the first mismatch is the target's own (bonus) token. Then the KV
    /// is truncated to the committed length and the drafter told what was committed.
    fn verify_at(&mut self, at: usize, logits: Logits<'_>) -> Option<Exit> {
        let n = self.limits.n_vocab;
        let (drafts, forced, source, segments, cost_us) = {
            let s = &mut self.running[at];
            let sp = s.spec.as_mut()?;
            (
                std::mem::take(&mut sp.drafts),
                sp.forced,
                sp.source,
                std::mem::take(&mut sp.segments),
                sp.cost_us,
            )
        };
        let k = drafts.len();
        let start = self.running[at].tokens.len();
        // Row 0 is the committed token `t`: its KV is now written.
        self.running[at].computed = start;
        self.publish_blocks(at);
        let mut accepted = 0usize;
        let mut exit = None;
        for i in 0..=k {
            let row = logits.row(i, n);
            let before = self.running[at].tokens.len();
            let e = self.choose_at(at, row);
            let s = &self.running[at];
            let chose = (s.tokens.len() > before).then(|| s.tokens[before]);
            let matched = chose.is_some() && drafts.get(i).copied() == chose;
            if matched {
                accepted += 1;
            }
            if e.is_some() {
                exit = e;
                break;
            }
            if !matched {
                break;
            }
        }
        // Statistics: the cycle, the policy, the cost model, time saved.
        let free = k - forced.min(k);
        let free_accepted = accepted.saturating_sub(forced.min(k));
        // Against the measured verify-cost curve: the accepted tokens' plain steps minus
        // the extra time of the k draft rows and the drafting.
        let t1 = self.cost.step_ms(1);
        let extra = self.cost.step_ms(1 + k) - t1;
        let saved_ms = accepted as f64 * t1 - extra - cost_us as f64 / 1e3;
        let saved_us = (saved_ms * 1e3).round() as i64;
        if let Some(kind) = source {
            self.cost.observe_cycle(kind, free, free_accepted);
        }
        self.metrics
            .spec
            .record_cycle(k, forced.min(k), accepted, saved_us);
        self.metrics.spec.record_segments(&segments, k, accepted);
        let s = &mut self.running[at];
        if let Some(sp) = s.spec.as_mut() {
            sp.stats.record_cycle(k, forced.min(k), accepted, saved_us);
            sp.stats.record_segments(&segments, k, accepted);
            sp.policy.record(source, free, free_accepted);
        }
        if exit.is_some() {
            return exit;
        }
        // Committed: t, the accepted drafts and the bonus; KV holds t and the accepted.
        let committed = start + accepted;
        s.computed = committed;
        if let Some(slot) = s.slot {
            self.backend.kv_truncate(slot, committed);
        }
        if let Some(sp) = s.spec.as_mut() {
            sp.drafter.observe(&s.tokens);
        }
        self.publish_blocks(at);
        None
    }

    fn publish_metrics(&mut self) {
        self.metrics.running = self.running.len();
        self.metrics.kv_free_blocks = self.backend.free_blocks();
        self.metrics.kv_total_blocks = self.backend.total_blocks();
        self.metrics.prefix_cached_blocks = self.index.len();
        if let Some(ix) = &self.cfg.spec.drafters.suffix {
            self.metrics.spec_suffix_stored_tokens = ix.counters().stored_tokens;
        }
        *lock(&self.shared.metrics) = self.metrics.clone();
    }

    /// Ends everything: queued and running requests get an error, all KV is given back.
    fn shutdown(&mut self) {
        let pending: Vec<Pending> = {
            let mut inbox = lock(&self.shared.inbox);
            inbox.closed = true;
            inbox.incoming.drain(..).collect()
        };
        for p in pending {
            let _ = p.events.send(Event::Error("engine shut down".into()));
        }
        let all: Vec<Seq<'t>> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for s in all {
            self.end(s, Exit::Failed("engine shut down".into()));
        }
        for holder in self.index.drain() {
            self.backend.kv_release(holder);
        }
        {
            let mut inbox = lock(&self.shared.inbox);
            inbox.queued = 0;
        }
        self.publish_metrics();
    }
}

/// A grant's logit rows after its forward.
enum StepRows {
    /// Copied to the host, `n_vocab` values a row.
    Host(Vec<f32>),
    /// Left in the backend: summaries `first..first + k` of the forward.
    Device { first: usize, k: usize },
}

impl StepRows {
    /// Rows held.
    fn rows(&self, n_vocab: usize) -> usize {
        match self {
            StepRows::Host(l) => l.len() / n_vocab.max(1),
            StepRows::Device { k, .. } => *k,
        }
    }

    fn as_ref(&self) -> Logits<'_> {
        match self {
            StepRows::Host(l) => Logits::Host(l),
            StepRows::Device { first, .. } => Logits::Device { first: *first },
        }
    }
}

/// One or more consecutive logit rows of a sequence, on the host or in the backend.
#[derive(Clone, Copy)]
enum Logits<'a> {
    /// The rows themselves.
    Host(&'a [f32]),
    /// Starting at the backend's summary (and row) `first`.
    Device { first: usize },
}

impl<'a> Logits<'a> {
    /// Row `i` (of `n` logits) of these rows.
    fn row(self, i: usize, n: usize) -> Logits<'a> {
        match self {
            Logits::Host(l) => Logits::Host(&l[i * n..(i + 1) * n]),
            Logits::Device { first } => Logits::Device { first: first + i },
        }
    }
}

/// The text released at the end: what the decoder and the stop checker held back (nothing
/// after a stop string).
fn final_text(seq: &mut Seq<'_>, reason: FinishReason) -> String {
    if matches!(reason, FinishReason::Stop(StopCause::StopString { .. })) {
        return String::new();
    }
    let tail = seq.decoder.finish();
    match seq.stop.push(&tail) {
        StopStep::Continue { mut emit } => {
            emit.push_str(&seq.stop.finish());
            emit
        }
        StopStep::Stopped { emit, .. } => emit,
    }
}

/// The top1 − top2 margin of `logits` over the tokens that may be chosen (`allowed`, or
/// all, minus `never`); 0 when fewer than two may be chosen.
fn top2_margin(logits: &[f32], allowed: Option<&TokenMask>, never: &TokenMask) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (t, &v) in logits.iter().enumerate() {
        let t = t as u32;
        if never.get(t) || allowed.is_some_and(|m| !m.get(t)) {
            continue;
        }
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    if b.is_finite() { a - b } else { 0.0 }
}

/// SHA-256 of a logit row's little-endian f32 bytes.
pub fn logit_digest(logits: &[f32]) -> [u8; 32] {
    let mut h = Sha256::new();
    for l in logits {
        h.update(l.to_le_bytes());
    }
    h.finalize().into()
}
