//! Machine measurements `lockstep bench` reports beside its speeds: memory read bandwidth
//! (the bound of a memory-bound decode), the last-level cache size (whether that bound
//! applies) and the process's peak resident memory.

use std::time::Instant;

/// Bytes each bandwidth pass reads: far larger than any last-level cache.
const BUFFER_BYTES: usize = 512 << 20;
/// Passes; the fastest counts (the machine is shared and noisy).
const PASSES: usize = 5;

/// Memory read bandwidth in GB/s (10⁹ bytes per second) with `threads` threads each
/// summing its own contiguous part of a 512 MiB buffer: the best of 5 passes. The buffer is
/// freed before returning, and the peak-RSS mark is reset afterwards where the kernel allows
/// (so [`peak_rss_bytes`] reports the model's footprint, not this buffer's).
pub fn read_bandwidth(threads: usize) -> f64 {
    let threads = threads.max(1);
    let words = BUFFER_BYTES / 8;
    // Distinct non-zero values so no page is shared or compressed.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        .collect();
    let chunk = words.div_ceil(threads);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..PASSES {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|part| s.spawn(move || sum_words(part)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let secs = start.elapsed().as_secs_f64();
        sink = sums.iter().fold(sink, |a, &b| a.wrapping_add(b));
        best = best.max(BUFFER_BYTES as f64 / secs.max(1e-9) / 1e9);
    }
    std::hint::black_box(sink);
    drop(buf);
    reset_peak_rss();
    best
}

/// Sums 8 independent lanes so the loop is bound by loads, not by one add chain.
fn sum_words(part: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = part.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &x| a.wrapping_add(x));
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

/// Peak resident set size of this process (`VmHWM`), if the platform reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib_field(&status, "VmHWM:").map(|kib| kib * 1024)
}

/// Resets the peak-RSS mark to the current RSS (Linux `clear_refs` value 5); ignored
/// where unsupported.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The last-level cache size in bytes (largest `cache/index*/size` of CPU 0), if known.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
}

fn parse_kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// `"32768K"`, `"1M"`, `"512"` → bytes.
fn parse_size(s: &str) -> Option<u64> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1024),
        b'M' | b'm' => (&s[..s.len() - 1], 1024 * 1024),
        b'G' | b'g' => (&s[..s.len() - 1], 1024 * 1024 * 1024),
        _ => (s, 1),
    };
    num.parse::<u64>().ok().map(|n| n * mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_status_fields_parse() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("x"), None);
        let status = "Name:\tlockstep\nVmPeak:\t  100 kB\nVmHWM:\t   2048 kB\n";
        assert_eq!(parse_kib_field(status, "VmHWM:"), Some(2048));
        assert_eq!(parse_kib_field(status, "VmRSS:"), None);
    }

    #[test]
    fn the_lane_sum_equals_the_plain_sum() {
        let v: Vec<u64> = (0..1003u64).map(|i| i * 7 + 1).collect();
        assert_eq!(sum_words(&v), v.iter().sum::<u64>());
    }

    #[test]
    fn peak_rss_is_reported_on_linux() {
        let rss = peak_rss_bytes().expect("VmHWM in /proc/self/status");
        assert!(rss > 1 << 20, "{rss}");
    }
}
