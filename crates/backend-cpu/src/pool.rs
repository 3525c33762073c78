//! A persistent thread pool with a low-overhead fork-join `run`.
//!
//! The calling thread takes part as thread 0; workers wait for a new job by spinning
//! briefly and then sleeping on a condition variable. Work is split statically into
//! contiguous ranges (thread `t` of `T` gets `[t*n/T, (t+1)*n/T)`), so the same call
//! always gives a thread the same tasks; [`ThreadPool::for_chunks_stealing`] starts from
//! that split and lets a thread that ran out take chunks left in the others' shares (for
//! the matmuls, where a preempted thread would otherwise stall the call). Kernels never let
//! a result depend on the split.
//!
//! Floating-point environment: no thread of the pool changes MXCSR; denormals are handled
//! per IEEE 754 (no flush-to-zero, no denormals-are-zero) on the caller and every worker.
//! [`ThreadPool::float_env_consistent`] checks it.

use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker, or the caller waiting for workers, spins before it sleeps.
/// Short: where the machine has more runnable threads than cores, a spinning thread holds
/// the core that the thread it waits for needs (2-thread decode on a loaded 2-core machine:
/// 100 µs gave 0.5b 29.9 t/s, 20 µs 36.5; on a quiet one the two are within noise).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

thread_local! {
    /// Set while this thread executes a pool job: a nested `run` then runs inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

type JobFn<'a> = dyn Fn(usize) + Sync + 'a;

/// Job word flag: workers may skip this job (the caller's `f(0)` does whatever they leave).
const OPTIONAL: u64 = 1 << 31;
/// Job word flag: an optional job still takes workers in.
const OPEN: u64 = 1 << 30;
/// Job word bits: workers inside the current optional job.
const COUNT: u64 = OPEN - 1;

fn epoch_of(state: u64) -> u32 {
    (state >> 32) as u32
}

/// A job pointer with its lifetime erased; valid until every worker that took the job has
/// left it (`remaining` at zero, or an optional job closed with a count of zero).
#[derive(Clone, Copy)]
struct JobPtr(*const JobFn<'static>);

struct Shared {
    n_threads: usize,
    /// How long idle workers and the waiting caller spin before they sleep, nanoseconds.
    spin_ns: AtomicU64,
    /// Whether [`ThreadPool::for_chunks_stealing`] shares out chunks dynamically.
    stealing: AtomicBool,
    /// The job word: epoch (bits 32..64, bumped per job), [`OPTIONAL`], [`OPEN`] and the
    /// number of workers inside an optional job ([`COUNT`]).
    state: AtomicU64,
    job: UnsafeCell<Option<JobPtr>>,
    remaining: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    worker_panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// Set while the dispatching thread sleeps on `done` waiting for the job's workers.
    caller_sleeps: AtomicBool,
    done: Condvar,
}

// SAFETY: `job` is written only by the dispatching thread while no worker reads it (before
// the epoch bump that publishes it, after the job's workers are done: `remaining` reached
// zero, or an optional job was closed and its count reached zero); workers read it only
// between seeing the new epoch (and, for an optional job, joining it) and leaving the job.
// The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A persistent pool of worker threads (the caller counts as one of them).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    dispatch: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.shared.n_threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool sized to the machine: `available_parallelism()`, capped by `max_threads`
    /// when given (at least one thread).
    pub fn for_machine(max_threads: Option<usize>) -> ThreadPool {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let n = max_threads.map_or(cores, |m| m.min(cores)).max(1);
        ThreadPool::new(n)
    }

    /// A pool of exactly `n_threads` threads (the caller plus `n_threads - 1` workers;
    /// 0 is treated as 1), with the default spin time.
    pub fn new(n_threads: usize) -> ThreadPool {
        ThreadPool::with_spin(n_threads, DEFAULT_SPIN)
    }

    /// As [`ThreadPool::new`], with idle workers spinning for `spin` before sleeping.
    pub fn with_spin(n_threads: usize, spin: Duration) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            spin_ns: AtomicU64::new(duration_ns(spin)),
            stealing: AtomicBool::new(true),
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            worker_panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            caller_sleeps: AtomicBool::new(false),
            done: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|t| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("lockstep-cpu-{t}"))
                    .spawn(move || worker_loop(&s, t))
                    .unwrap_or_else(|e| panic!("cannot spawn pool worker: {e}"))
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    /// Changes how long idle workers, and the caller waiting for workers, spin before they
    /// sleep (for measurements; [`DEFAULT_SPIN`] unless set).
    pub fn set_spin(&self, spin: Duration) {
        self.shared
            .spin_ns
            .store(duration_ns(spin), Ordering::Relaxed);
    }

    /// Turns the dynamic sharing of [`ThreadPool::for_chunks_stealing`] on (the default) or
    /// off (then each thread runs exactly its static share and every worker takes part),
    /// for measurements. Results never depend on it.
    pub fn set_stealing(&self, on: bool) {
        self.shared.stealing.store(on, Ordering::Relaxed);
    }

    /// Threads taking part in a job (including the caller).
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Calls `f(t)` once on each thread `t` in `0..n_threads()` (thread 0 is the caller) and
    /// returns when all calls have returned. A panic in any call is re-raised here after
    /// every thread has finished. Called from inside a job, it runs all calls inline.
    pub fn broadcast(&self, f: impl Fn(usize) + Sync) {
        let n = self.shared.n_threads;
        if n == 1 || IN_JOB.with(|c| c.get()) {
            for t in 0..n {
                f(t);
            }
            return;
        }
        self.dispatch(&f, false);
    }

    /// Runs `f(0)` on the caller and `f(t)` on every worker `t` that is ready for it: with
    /// `optional`, a worker that has not joined by the time `f(0)` returns skips the job
    /// (the caller does not wait for a worker that the OS has not scheduled); otherwise
    /// every worker runs it. Returns when every call that started has returned.
    fn dispatch(&self, f: &JobFn<'_>, optional: bool) {
        let _guard = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let n = s.n_threads;
        // SAFETY: erases the borrow's lifetime. The pointer is published to the workers
        // below and this function does not return (or unwind) before every worker that
        // took the job is done with it; it is cleared before returning.
        let job: *const JobFn<'static> =
            unsafe { std::mem::transmute::<&JobFn<'_>, &'static JobFn<'static>>(f) };
        // SAFETY: no worker reads `job` now: the previous job's workers are done and the
        // epoch has not been bumped yet.
        unsafe { *s.job.get() = Some(JobPtr(job)) };
        s.remaining
            .store(if optional { 0 } else { n - 1 }, Ordering::SeqCst);
        // Only the dispatcher (holding `dispatch`) changes the epoch.
        let epoch = epoch_of(s.state.load(Ordering::SeqCst)).wrapping_add(1);
        let flags = if optional { OPTIONAL | OPEN } else { 0 };
        s.state
            .store(((epoch as u64) << 32) | flags, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        IN_JOB.with(|c| c.set(false));
        if optional {
            s.state.fetch_and(!OPEN, Ordering::SeqCst);
            s.wait_for_workers(|| s.state.load(Ordering::SeqCst) & COUNT == 0);
        } else {
            s.wait_for_workers(|| s.remaining.load(Ordering::SeqCst) == 0);
        }
        // SAFETY: every worker that took the job is done with it.
        unsafe { *s.job.get() = None };
        if let Err(p) = own {
            resume_unwind(p);
        }
        if s.worker_panicked.swap(false, Ordering::SeqCst) {
            panic!("a thread-pool task panicked");
        }
    }

    /// Calls `f(thread, range)` for the static contiguous split of `0..n` over the threads
    /// (thread `t` of `T` gets `[t*n/T, (t+1)*n/T)`; empty ranges are skipped).
    pub fn for_ranges(&self, n: usize, f: impl Fn(usize, Range<usize>) + Sync) {
        let t_count = self.shared.n_threads;
        if n == 0 {
            return;
        }
        if n == 1 || t_count == 1 {
            f(0, 0..n);
            return;
        }
        self.broadcast(|t| {
            let r = split(n, t_count, t);
            if !r.is_empty() {
                f(t, r);
            }
        });
    }

    /// Calls `f(thread, chunk)` once for every chunk in `0..n_chunks`, on whichever thread
    /// gets to it first: each thread takes its static share (`[t·n/T, (t+1)·n/T)`) front to
    /// back, then takes what is left of the other threads' shares from their back ends.
    /// A thread that the OS preempts therefore holds up the others by at most the chunk it
    /// is in, not its whole share (on a shared machine the static split waits for the
    /// slowest thread at every call). Which thread runs a chunk varies from call to call:
    /// `f` must not let a result depend on `thread` (it is for per-thread scratch only).
    pub fn for_chunks_stealing(&self, n_chunks: usize, f: impl Fn(usize, usize) + Sync) {
        let t_count = self.shared.n_threads;
        if n_chunks == 0 {
            return;
        }
        if n_chunks == 1 || t_count == 1 || IN_JOB.with(|c| c.get()) {
            (0..n_chunks).for_each(|c| f(0, c));
            return;
        }
        let stealing = self.shared.stealing.load(Ordering::Relaxed);
        let (true, Ok(n32)) = (stealing, u32::try_from(n_chunks)) else {
            // Off, or beyond the packed counters' range: the static split.
            self.for_ranges(n_chunks, |t, r| r.for_each(|c| f(t, c)));
            return;
        };
        let shares: Vec<Share> = (0..t_count)
            .map(|t| {
                let r = split(n32 as usize, t_count, t);
                Share::new(r.start as u32, r.end as u32)
            })
            .collect();
        // Optional: a worker the OS has not run yet leaves its share to the others.
        self.dispatch(
            &|t| {
                while let Some(c) = shares[t].take_front() {
                    f(t, c);
                }
                // A share only shrinks, so one pass over the others drains everything.
                for k in 1..t_count {
                    let victim = &shares[(t + k) % t_count];
                    while let Some(c) = victim.take_back() {
                        f(t, c);
                    }
                }
            },
            true,
        );
    }

    /// Calls `f(task)` for every task in `0..n_tasks`, split statically over the threads.
    pub fn run(&self, n_tasks: usize, f: impl Fn(usize) + Sync) {
        self.for_ranges(n_tasks, |_, r| r.for_each(&f));
    }

    /// Splits `data` into chunks of `chunk_len` elements (the last one may be shorter) and
    /// calls `f(index, chunk)` for each, split statically over the threads.
    pub fn for_chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        if data.is_empty() {
            return;
        }
        let chunk_len = chunk_len.max(1);
        let n_chunks = data.len().div_ceil(chunk_len);
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.for_ranges(n_chunks, |_, r| {
            let base = &base;
            for c in r {
                let start = c * chunk_len;
                let end = (start + chunk_len).min(len);
                // SAFETY: chunk `c` is `[start, end)` inside `data`, which outlives this
                // call; every chunk index is handed to exactly one thread, so the mutable
                // slices never overlap.
                let chunk =
                    unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
                f(c, chunk);
            }
        });
    }

    /// Whether every thread of the pool runs with the caller's denormal handling, and that
    /// handling is IEEE (neither flush-to-zero nor denormals-are-zero set).
    pub fn float_env_consistent(&self) -> bool {
        let main = crate::fpenv::denormal_flags();
        let bad = AtomicBool::new(main != 0);
        self.broadcast(|_| {
            if crate::fpenv::denormal_flags() != main {
                bad.store(true, Ordering::SeqCst);
            }
        });
        !bad.load(Ordering::SeqCst)
    }
}

/// `[t*n/T, (t+1)*n/T)`.
fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn split(n: usize, threads: usize, t: usize) -> Range<usize> {
    (t * n / threads)..((t + 1) * n / threads)
}

/// One thread's remaining chunks `[lo, hi)`, packed into one word (`lo` in the high half)
/// so that the owner (taking `lo`) and thieves (taking `hi - 1`) never hand out a chunk
/// twice; on its own cache line.
#[repr(align(64))]
struct Share(AtomicU64);

impl Share {
    fn new(lo: u32, hi: u32) -> Share {
        Share(AtomicU64::new(((lo as u64) << 32) | hi as u64))
    }

    /// Takes the first remaining chunk.
    fn take_front(&self) -> Option<usize> {
        self.take(|lo, hi| (lo, (lo + 1, hi)))
    }

    /// Takes the last remaining chunk.
    fn take_back(&self) -> Option<usize> {
        self.take(|lo, hi| (hi - 1, (lo, hi - 1)))
    }

    fn take(&self, step: impl Fn(u32, u32) -> (u32, (u32, u32))) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let (lo, hi) = ((cur >> 32) as u32, cur as u32);
            if lo >= hi {
                return None;
            }
            let (got, (nlo, nhi)) = step(lo, hi);
            let next = ((nlo as u64) << 32) | nhi as u64;
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(got as usize),
                Err(seen) => cur = seen,
            }
        }
    }
}

impl Shared {
    /// The dispatcher's wait for the workers until `done()`: spin for `spin`, then sleep
    /// until a worker leaving the job wakes it. Sleeping matters when the machine has more
    /// runnable threads than cores: a spinning waiter holds the core that the worker it
    /// waits for needs.
    fn wait_for_workers(&self, done: impl Fn() -> bool) {
        let start = Instant::now();
        let spin = Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed));
        let mut spins = 0u32;
        while !done() {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.caller_sleeps.store(true, Ordering::SeqCst);
            while !done() {
                g = self.done.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            self.caller_sleeps.store(false, Ordering::SeqCst);
            return;
        }
    }

    /// A worker's exit from a job; `last` says whether it was the last one out.
    fn left_job(&self, last: bool) {
        if last && self.caller_sleeps.load(Ordering::SeqCst) {
            // Taking the lock orders this after the dispatcher's check of its condition:
            // it is either still before its check (and sees the job done) or waiting.
            let _l = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.done.notify_all();
        }
    }
}

struct SendPtr<T>(*mut T);
// SAFETY: used only to hand disjoint sub-slices of one `&mut [T]` (T: Send) to threads.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker_loop(s: &Shared, t: usize) {
    let mut seen = 0u32;
    loop {
        // Wait for a new epoch: spin, then sleep.
        let start = Instant::now();
        let spin = Duration::from_nanos(s.spin_ns.load(Ordering::Relaxed));
        let mut spins = 0u32;
        let state = loop {
            let st = s.state.load(Ordering::SeqCst);
            if epoch_of(st) != seen {
                break st;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while epoch_of(s.state.load(Ordering::SeqCst)) == seen
                && !s.shutdown.load(Ordering::SeqCst)
            {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        };
        seen = epoch_of(state);
        let optional = state & OPTIONAL != 0;
        if optional && !join(s, state) {
            // Closed (the caller did the work) or already replaced by a newer job, which
            // the next pass picks up.
            continue;
        }
        // SAFETY: the dispatcher published the job before bumping the epoch we just saw
        // and keeps it alive until every worker that took it has left (`remaining` needs
        // our decrement; an optional job's count needs our exit).
        let job = unsafe { *s.job.get() };
        if let Some(JobPtr(f)) = job {
            IN_JOB.with(|c| c.set(true));
            // SAFETY: see above; the pointee is a live `Fn(usize) + Sync`.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(t) }));
            IN_JOB.with(|c| c.set(false));
            if r.is_err() {
                s.worker_panicked.store(true, Ordering::SeqCst);
            }
        }
        if optional {
            let before = s.state.fetch_sub(1, Ordering::SeqCst);
            s.left_job(before & COUNT == 1);
        } else {
            let before = s.remaining.fetch_sub(1, Ordering::SeqCst);
            s.left_job(before == 1);
        }
    }
}

/// Joins the optional job published as `state` if it is still open (one more worker
/// inside, so the dispatcher waits for this one).
fn join(s: &Shared, mut state: u64) -> bool {
    let epoch = epoch_of(state);
    loop {
        if epoch_of(state) != epoch || state & OPEN == 0 {
            return false;
        }
        match s
            .state
            .compare_exchange_weak(state, state + 1, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => return true,
            Err(now) => state = now,
        }
    }
}
