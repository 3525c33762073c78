//! The step loop: one thread owns the backend; each step it takes new requests (from
//! [`submit`](crate::submit)'s inbox), reaps cancellations, asks the
//! [scheduler](crate::scheduler) for a plan, carries it out on the KV pool (preempt, admit
//! with prefix reuse, evict, prepare), runs **one** batched forward over the rows of every
//! scheduled sequence, and chooses the next token of each sequence whose catch-up is
//! complete, with the sampling crate's one rule.
//!
//! Speculation (drafting before the plan, the verify block in the forward, acceptance after
//! it) is [`speculate`]: its rows go through the same [`Loop::choose_at`] plain decoding
//! uses.

mod speculate;

use crate::api::{
    BackendError, EngineConfig, EngineMetrics, Event, FinishReason, ForwardBackend, ForwardRow,
    KvSlot, StopCause, Timings, TokenConstraint, TokenMask, Usage,
};
use crate::disk::{ChainBlock, DiskTier};
use crate::prefix::{BlockHash, PrefixIndex, chain_hash};
use crate::scheduler::{KvBudget, RunningSeq, SchedLimits, StepPlan, WaitingSeq, plan_step};
use crate::submit::{Limits, Pending, Shared};
use sampling::{ChoiceContext, Sampler, SamplingParams, StopChecker, StopStep};
use sha2::{Digest, Sha256};
use spec::CostModel;
use speculate::{SeqSpec, top2_margin};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Instant;
use text::{DecodeOptions, StreamDecoder, Tokenizer};

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

impl Seq<'_> {
    /// Whether a row summary alone can make this sequence's choices (the full row is
    /// needed only when its argmax is not finite, never-sampled or refused by the
    /// constraint): plain greedy, no logprobs, digests or speculation margin asked.
    fn summary_decides(&self) -> bool {
        self.params.is_plain_greedy()
            && self.logprobs.is_none()
            && !self.digests
            && self.spec.as_ref().is_none_or(|sp| sp.cfg.margin_bar <= 0.0)
    }

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

/// The loop thread's body: runs steps until a shutdown is asked, then ends everything.
pub(crate) fn run(
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
        metrics: shared.published_metrics(),
        step_ms_total: 0.0,
        occupancy_total: 0.0,
        cost: CostModel::new(),
        disk,
    };
    loop {
        let has_work = lp.has_work();
        let incoming = shared.next_incoming(has_work);
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
        self.shared.dequeued();
    }

    /// A new request joins the waiting queue (or finishes at once for `max_tokens: 0`).
    fn accept(&mut self, p: Pending) {
        let mut req = p.req;
        let spec = SeqSpec::for_request(self, &mut req);
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
                    usage: Box::new(usage),
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
                    // Only a block that does not fit is the file's fault.
                    if matches!(e, BackendError::BadKvBlock(_)) {
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
        self.drop_ungranted_drafts(&plan);
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
        let on_device = self.summary_step(&grants);
        let ok = if on_device {
            self.backend.forward_summaries(&rows, &mut self.summaries)
        } else {
            self.backend.forward(&rows, &mut logits)
        };
        let mut forward_ms = t_fwd.elapsed().as_secs_f64() * 1e3;
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
                        let first = at;
                        at += k;
                        (at * n <= logits.len())
                            .then_some(StepRows::Batch { first, k })
                            .ok_or_else(short)
                    } else {
                        Ok(StepRows::Host(Vec::new()))
                    };
                    done.push((id, r, l));
                }
            }
            Err(_) => {
                // Isolate the fault: rerun each sequence alone (G1 makes the results the
                // same); only the sequences that fail alone end with an error.
                let t_iso = Instant::now();
                for &(id, r) in &grants {
                    let rows = self.rows_for(&[(id, r)]);
                    let l = match self.backend.forward(&rows, &mut logits) {
                        Ok(()) if self.logit_rows(id, r) > 0 => Ok(StepRows::Host(logits.clone())),
                        Ok(()) => Ok(StepRows::Host(Vec::new())),
                        Err(e) => Err(format!("forward failed: {e}")),
                    };
                    done.push((id, r, l));
                }
                forward_ms += t_iso.elapsed().as_secs_f64() * 1e3;
            }
        }
        // Step counters first, so they are visible before any event of this step.
        let n_seqs = done.len();
        let m = &mut self.metrics;
        m.forward_ms_total += forward_ms;
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
            let n = self.limits.n_vocab;
            match l {
                Err(msg) => {
                    let s = self.running.remove(at);
                    self.end(s, Exit::Failed(msg));
                }
                Ok(l) if l.rows(n) > 1 => {
                    if let Some(exit) = self.verify_at(at, l.resolve(&logits, n)) {
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
                    if l.rows(n) > 0
                        && let Some(exit) = self.choose_at(at, l.resolve(&logits, n))
                    {
                        let s = self.running.remove(at);
                        self.end(s, exit);
                    }
                }
            }
        }
        self.logits = logits;
        if decode_only {
            // A replaying backend's simulated time, so the policy's decisions do not
            // depend on the machine running the replay.
            let ms = self
                .backend
                .simulated_ms()
                .unwrap_or_else(|| t_fwd.elapsed().as_secs_f64() * 1e3);
            self.cost.observe_step(rows_total, ms);
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let m = &mut self.metrics;
        m.last_step_ms = ms;
        self.step_ms_total += ms;
        m.step_ms_total = self.step_ms_total;
        m.mean_step_ms = self.step_ms_total / m.steps as f64;
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

    /// Whether this step takes row summaries instead of reading its logit rows back: the
    /// backend makes them, at least the backend's [`ForwardBackend::summary_min_rows`] of
    /// the step's logit rows belong to sequences whose choices a summary can decide (plain
    /// greedy, no logprobs, digests or speculation margin: decode rows and the rows of
    /// their verify blocks alike; the constraint's `accepts` is checked per token later,
    /// falling back to the row), and no more rows than those need to be fetched one by one
    /// afterwards (sampled rows, logprobs, ...).
    fn summary_step(&self, grants: &[(u64, usize)]) -> bool {
        if !self.backend.summarizes() {
            return false;
        }
        let (mut plain, mut other) = (0usize, 0usize);
        for &(id, r) in grants {
            let k = self.logit_rows(id, r);
            // Each row of a verify block is chosen as a single row is (`choose_at`).
            let decidable = self
                .running
                .iter()
                .find(|s| s.id == id)
                .is_some_and(Seq::summary_decides);
            if decidable {
                plain += k;
            } else {
                other += k;
            }
        }
        plain >= self.backend.summary_min_rows().max(1) && other <= plain
    }

    /// The plain greedy choice of sequence `at` from summary `i` alone, when it is exactly
    /// what the full row would give: temperature 0 without penalties or bias, no
    /// top logprobs, digests or speculation margin asked, a finite row, and the argmax
    /// neither never-sampled nor rejected by the constraint (an allowed unmasked argmax
    /// is the masked argmax too, ties included: it is the lowest id among the maxima).
    fn greedy_from_summary(&mut self, at: usize, i: usize) -> Option<(u32, f32)> {
        let s = &mut self.running[at];
        let (token, logprob) = self.summaries.get(i)?.greedy()?;
        let plain =
            s.summary_decides() && (token as usize) < self.limits.n_vocab && !self.never.get(token);
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

    fn publish_metrics(&mut self) {
        self.metrics.running = self.running.len();
        self.metrics.kv_free_blocks = self.backend.free_blocks();
        self.metrics.kv_total_blocks = self.backend.total_blocks();
        self.metrics.prefix_cached_blocks = self.index.len();
        if let Some(ix) = &self.cfg.spec.drafters.suffix {
            self.metrics.spec_suffix_stored_tokens = ix.counters().stored_tokens;
        }
        self.shared.publish_metrics(self.metrics.clone());
    }

    /// Ends everything: queued and running requests get an error, all KV is given back.
    fn shutdown(&mut self) {
        for p in self.shared.close() {
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
        self.shared.clear_queued();
        self.publish_metrics();
    }
}

/// A grant's logit rows after its forward.
enum StepRows {
    /// Copied to the host, `n_vocab` values a row.
    Host(Vec<f32>),
    /// Rows `first..first + k` of the step's batched logits (on the host, not copied).
    Batch { first: usize, k: usize },
    /// Left in the backend: summaries `first..first + k` of the forward.
    Device { first: usize, k: usize },
}

impl StepRows {
    /// Rows held.
    fn rows(&self, n_vocab: usize) -> usize {
        match self {
            StepRows::Host(l) => l.len() / n_vocab.max(1),
            StepRows::Batch { k, .. } | StepRows::Device { k, .. } => *k,
        }
    }

    /// These rows as [`Logits`]: a batch range becomes its slice of `batch` (the step's
    /// logits, `n_vocab` values a row; the range was checked against it when made).
    fn resolve<'a>(&'a self, batch: &'a [f32], n_vocab: usize) -> Logits<'a> {
        match self {
            StepRows::Host(l) => Logits::Host(l),
            StepRows::Batch { first, k } => Logits::Host(
                batch
                    .get(first * n_vocab..(first + k) * n_vocab)
                    .unwrap_or(&[]),
            ),
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

/// SHA-256 of a logit row's little-endian f32 bytes.
pub fn logit_digest(logits: &[f32]) -> [u8; 32] {
    let mut h = Sha256::new();
    for l in logits {
        h.update(l.to_le_bytes());
    }
    h.finalize().into()
}
