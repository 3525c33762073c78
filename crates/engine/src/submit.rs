//! The submitting side of the engine: starting it ([`start`]: the backend's KV pool, the
//! disk tier, the loop thread), the state the engine handle, the request handles and the
//! loop share ([`Shared`]: the inbox of pending requests, the published counters), and
//! queueing requests ([`submit`], [`submit_group`]: each checked against the engine's
//! [`Limits`] before it is queued, a group all or none). The loop itself is `step`.

use crate::api::{
    EngineConfig, EngineError, EngineMetrics, Event, ForwardBackend, GenerateRequest,
    RequestHandle, SubmitError,
};
use crate::disk::{DiskCacheState, DiskShared, DiskTier};
use sampling::StopChecker;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;
use text::Tokenizer;

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
pub(crate) struct Pending {
    pub(crate) id: u64,
    pub(crate) req: GenerateRequest,
    pub(crate) stop: StopChecker,
    pub(crate) events: Sender<Event>,
    pub(crate) cancelled: Arc<AtomicBool>,
    pub(crate) submitted: Instant,
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

    /// For the loop: the requests submitted since the last call, waiting for one unless
    /// `has_work`; `None` once a shutdown was asked (the inbox is then closed).
    pub(crate) fn next_incoming(&self, has_work: bool) -> Option<VecDeque<Pending>> {
        let mut inbox = lock(&self.inbox);
        loop {
            if inbox.shutdown {
                inbox.closed = true;
                return None;
            }
            if !inbox.incoming.is_empty() || has_work {
                return Some(std::mem::take(&mut inbox.incoming));
            }
            inbox = self.cv.wait(inbox).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// For the loop: one queued request was admitted or left before admission.
    pub(crate) fn dequeued(&self) {
        let mut inbox = lock(&self.inbox);
        inbox.queued = inbox.queued.saturating_sub(1);
    }

    /// For the loop at shutdown: closes the inbox and hands back what was still in it.
    pub(crate) fn close(&self) -> Vec<Pending> {
        let mut inbox = lock(&self.inbox);
        inbox.closed = true;
        inbox.incoming.drain(..).collect()
    }

    /// For the loop at shutdown, once every request has ended: nothing is queued.
    pub(crate) fn clear_queued(&self) {
        lock(&self.inbox).queued = 0;
    }

    /// The counters as the loop last published them.
    pub(crate) fn published_metrics(&self) -> EngineMetrics {
        lock(&self.metrics).clone()
    }

    /// For the loop: publishes its counters.
    pub(crate) fn publish_metrics(&self, m: EngineMetrics) {
        *lock(&self.metrics) = m;
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
        .spawn(move || crate::step::run(loop_shared, backend, text, cfg, disk))
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
