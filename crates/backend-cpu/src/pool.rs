//! A persistent thread pool with a low-overhead fork-join `run`.
//!
//! The calling thread takes part as thread 0; workers wait for a new job by spinning
//! briefly and then sleeping on a condition variable. Work is split statically into
//! contiguous ranges (thread `t` of `T` gets `[t*n/T, (t+1)*n/T)`), so the same call
//! always gives a thread the same tasks. Kernels never let a result depend on the split.
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

/// How long an idle worker spins before it sleeps.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

thread_local! {
    /// Set while this thread executes a pool job: a nested `run` then runs inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

type JobFn<'a> = dyn Fn(usize) + Sync + 'a;

/// A job pointer with its lifetime erased; valid until `remaining` drops to zero.
#[derive(Clone, Copy)]
struct JobPtr(*const JobFn<'static>);

struct Shared {
    n_threads: usize,
    spin: Duration,
    epoch: AtomicU64,
    job: UnsafeCell<Option<JobPtr>>,
    remaining: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    worker_panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the dispatching thread while no worker reads it (before
// the epoch bump that publishes it, after `remaining` reached zero); workers read it only
// between seeing the new epoch and decrementing `remaining`. The pointee is `Sync`.
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
            spin,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            worker_panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
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
        let _guard = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: &JobFn<'_> = &f;
        // SAFETY: erases the borrow's lifetime. The pointer is published to the workers
        // below and this function does not return (or unwind) before `remaining` is zero,
        // i.e. before every worker is done with it; it is cleared before returning.
        let job: *const JobFn<'static> =
            unsafe { std::mem::transmute::<&JobFn<'_>, &'static JobFn<'static>>(job) };
        // SAFETY: no worker reads `job` now: the previous job's `remaining` reached zero
        // and the epoch has not been bumped yet.
        unsafe { *s.job.get() = Some(JobPtr(job)) };
        s.remaining.store(n - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        IN_JOB.with(|c| c.set(false));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.saturating_add(1);
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job (`remaining` is zero).
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
fn split(n: usize, threads: usize, t: usize) -> Range<usize> {
    (t * n / threads)..((t + 1) * n / threads)
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
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin, then sleep.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the dispatcher published the job before bumping the epoch we just saw
        // and keeps it alive until `remaining` reaches zero, which needs our decrement.
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
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}
