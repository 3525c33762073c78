//! The thread pool runs every task exactly once, splits statically, survives panics and
//! nested calls, and keeps one floating-point environment on all threads.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use lockstep_backend_cpu::ThreadPool;

#[test]
fn run_visits_every_task_exactly_once_for_any_thread_count() {
    for threads in 1..=4 {
        let pool = ThreadPool::new(threads);
        assert_eq!(pool.n_threads(), threads);
        for n in [0usize, 1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, |t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "threads={threads} n={n}"
            );
        }
    }
}

#[test]
fn ranges_are_the_static_contiguous_split() {
    let pool = ThreadPool::new(3);
    for n in [1usize, 2, 3, 10, 11] {
        let seen = Mutex::new(Vec::new());
        pool.for_ranges(n, |t, r| seen.lock().unwrap().push((t, r)));
        let mut seen = seen.into_inner().unwrap();
        seen.sort_by_key(|(t, _)| *t);
        let want: Vec<_> = (0..3)
            .map(|t| (t, t * n / 3..(t + 1) * n / 3))
            .filter(|(_, r)| !r.is_empty())
            .collect();
        if n == 1 {
            assert_eq!(seen, vec![(0, 0..1)]);
        } else {
            assert_eq!(seen, want, "n={n}");
        }
    }
}

#[test]
fn chunks_mut_hands_out_each_chunk_once() {
    let pool = ThreadPool::new(3);
    let mut data = vec![0u32; 1001];
    pool.for_chunks_mut(&mut data, 10, |c, chunk| {
        for (i, v) in chunk.iter_mut().enumerate() {
            *v += (c * 10 + i) as u32 + 1;
        }
    });
    assert!(data.iter().enumerate().all(|(i, &v)| v == i as u32 + 1));
}

#[test]
fn nested_run_executes_inline_without_deadlock() {
    let pool = ThreadPool::new(2);
    let total = AtomicUsize::new(0);
    pool.run(4, |_| {
        pool.run(5, |_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 20);
}

#[test]
fn a_panicking_task_is_reported_and_the_pool_stays_usable() {
    let pool = ThreadPool::new(2);
    for bad in [0usize, 1] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.broadcast(|t| {
                if t == bad {
                    panic!("task failure on purpose");
                }
            });
        }));
        assert!(r.is_err(), "panic on thread {bad} must propagate");
        let n = AtomicUsize::new(0);
        pool.run(10, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}

#[test]
fn every_thread_keeps_ieee_denormals() {
    for threads in [1, 2, 3] {
        assert!(ThreadPool::new(threads).float_env_consistent());
    }
    assert_eq!(lockstep_backend_cpu::fpenv::denormal_flags(), 0);
    // Denormal arithmetic really is IEEE on a worker.
    let pool = ThreadPool::new(2);
    let tiny = std::hint::black_box(f32::MIN_POSITIVE);
    let out = Mutex::new(Vec::new());
    pool.broadcast(|t| out.lock().unwrap().push((t, tiny / 4.0)));
    for (_, v) in out.into_inner().unwrap() {
        assert_eq!(v, f32::MIN_POSITIVE / 4.0);
        assert!(v > 0.0);
    }
}

#[test]
fn sleeping_workers_wake_up_for_the_next_job() {
    let pool = ThreadPool::with_spin(2, std::time::Duration::from_micros(10));
    let n = AtomicUsize::new(0);
    for _ in 0..3 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        let start = Instant::now();
        pool.broadcast(|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert!(start.elapsed().as_secs() < 5);
    }
    assert_eq!(n.load(Ordering::Relaxed), 6);
}

#[test]
fn for_machine_is_capped_by_the_request_and_the_cores() {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    assert_eq!(ThreadPool::for_machine(None).n_threads(), cores);
    assert_eq!(ThreadPool::for_machine(Some(1)).n_threads(), 1);
    assert_eq!(ThreadPool::for_machine(Some(cores + 5)).n_threads(), cores);
}

#[test]
fn stealing_runs_every_chunk_exactly_once() {
    for threads in 1..=4 {
        let pool = ThreadPool::new(threads);
        for n in [0usize, 1, 2, 3, 5, 8, 64, 1001] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_chunks_stealing(n, |t, c| {
                assert!(t < threads, "thread index in range");
                hits[c].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "threads={threads} n={n}"
            );
        }
    }
}

#[test]
fn stealing_lets_idle_threads_take_a_stalled_threads_chunks() {
    // The calling thread stalls in the first chunk it runs: the other threads finish their
    // own shares and then take the rest of its share from the back end.
    let pool = ThreadPool::new(3);
    let n = 30;
    let stalled = std::sync::atomic::AtomicBool::new(false);
    let by_caller = AtomicUsize::new(0);
    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
    pool.for_chunks_stealing(n, |t, c| {
        if t == 0 {
            by_caller.fetch_add(1, Ordering::Relaxed);
            if !stalled.swap(true, Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        hits[c].fetch_add(1, Ordering::Relaxed);
    });
    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    let own = by_caller.load(Ordering::Relaxed);
    assert!(
        own < 5,
        "the stalled thread's share was taken over (it ran {own} of its 10)"
    );
}

#[test]
fn nested_stealing_runs_inline() {
    let pool = ThreadPool::new(2);
    let total = AtomicUsize::new(0);
    pool.run(2, |_| {
        pool.for_chunks_stealing(10, |t, _| {
            assert_eq!(t, 0, "inline on the calling thread");
            total.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 20);
}

#[test]
fn stealing_and_broadcast_jobs_interleave_without_losing_or_repeating_work() {
    // Optional (stealing) jobs that workers may skip, then jobs every worker must run:
    // a worker late for one must neither run it after it closed nor miss the next.
    for spin_us in [0u64, 20] {
        let pool = ThreadPool::with_spin(3, std::time::Duration::from_micros(spin_us));
        let chunk_hits: Vec<AtomicUsize> = (0..7).map(|_| AtomicUsize::new(0)).collect();
        let per_thread: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let rounds = 2000;
        for _ in 0..rounds {
            pool.for_chunks_stealing(7, |_, c| {
                chunk_hits[c].fetch_add(1, Ordering::Relaxed);
            });
            pool.broadcast(|t| {
                per_thread[t].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(
            chunk_hits
                .iter()
                .all(|h| h.load(Ordering::Relaxed) == rounds)
        );
        assert!(
            per_thread
                .iter()
                .all(|h| h.load(Ordering::Relaxed) == rounds)
        );
    }
}

#[test]
fn stealing_off_gives_each_thread_its_static_share() {
    let pool = ThreadPool::new(3);
    pool.set_stealing(false);
    let n = 11;
    let by: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(usize::MAX)).collect();
    pool.for_chunks_stealing(n, |t, c| by[c].store(t, Ordering::Relaxed));
    for (c, b) in by.iter().enumerate() {
        let t = (0..3).find(|&t| (t * n / 3..(t + 1) * n / 3).contains(&c));
        assert_eq!(Some(b.load(Ordering::Relaxed)), t, "chunk {c}");
    }
}
