//! Parsing never allocates much more than the file holds: hostile counts and lengths are
//! rejected before allocating, so peak memory while parsing stays proportional to the
//! input. Measured with a counting global allocator (this binary holds one test only, so
//! nothing else allocates concurrently). That is why it is its own test binary rather than a
//! module of `tests/gguf/main.rs`: the global allocator is process-wide, and the other tests
//! of that binary would allocate on other threads while this one measures.

#[path = "gguf/common.rs"]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::{Raw, small_valid_file};
use lockstep_gguf::GgufFile;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

struct Counting;

static TRACKING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if TRACKING.load(Ordering::Relaxed) {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if TRACKING.load(Ordering::Relaxed) {
            LIVE.fetch_sub(
                layout.size().min(LIVE.load(Ordering::Relaxed)),
                Ordering::Relaxed,
            );
        }
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak bytes allocated (beyond the input itself) while parsing `bytes`.
fn peak_parse_bytes(bytes: Vec<u8>) -> usize {
    LIVE.store(0, Ordering::SeqCst);
    PEAK.store(0, Ordering::SeqCst);
    TRACKING.store(true, Ordering::SeqCst);
    let r = GgufFile::from_bytes(bytes);
    drop(r);
    TRACKING.store(false, Ordering::SeqCst);
    PEAK.load(Ordering::SeqCst)
}

/// Generous but linear: typed element vectors, a `String` header per string, the name
/// indexes, and error messages.
fn bound(len: usize) -> usize {
    8 * len + 64 * 1024
}

#[test]
fn parsing_allocates_at_most_linear_in_the_input() {
    // Hand-made hostile files first: absurd counts and lengths of every kind.
    let mut hostile = vec![
        Raw::header(3, u64::MAX, 0).0,
        Raw::header(3, 0, u64::MAX).0,
        Raw::header(3, 0, 1).u64(u64::MAX).0,
        Raw::header(3, 0, 1)
            .str(b"k")
            .u32(8)
            .u64(1 << 60)
            .data(100)
            .0,
    ];
    for elem in 0u32..=12 {
        hostile.push(
            Raw::header(3, 0, 1)
                .str(b"a")
                .u32(9)
                .u32(elem)
                .u64(1 << 40)
                .data(1000)
                .0,
        );
    }
    // Many empty strings and empty nested arrays: the densest legitimate expansions.
    let mut strings = Raw::header(3, 0, 1).str(b"s").u32(9).u32(8).u64(20_000);
    for _ in 0..20_000 {
        strings = strings.u64(0);
    }
    hostile.push(strings.0);
    let mut arrays = Raw::header(3, 0, 1).str(b"n").u32(9).u32(9).u64(20_000);
    for _ in 0..20_000 {
        arrays = arrays.u32(4).u64(0);
    }
    hostile.push(arrays.0);
    for bytes in hostile {
        let len = bytes.len();
        let peak = peak_parse_bytes(bytes);
        assert!(
            peak <= bound(len),
            "{peak} bytes allocated for a {len}-byte file"
        );
    }

    // Then random damage to a valid file.
    let base = small_valid_file();
    let mut runner = TestRunner::new(Config {
        cases: 3000,
        ..Config::default()
    });
    let damage = prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..12);
    runner
        .run(&damage, |writes| {
            let mut bytes = base.clone();
            for (i, b) in writes {
                let i = i.index(bytes.len());
                bytes[i] = b;
            }
            let len = bytes.len();
            let peak = peak_parse_bytes(bytes);
            prop_assert!(
                peak <= bound(len),
                "{} bytes allocated for a {}-byte file",
                peak,
                len
            );
            Ok(())
        })
        .unwrap();
}
