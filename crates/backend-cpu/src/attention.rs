//! The one attention kernel (prefill, verify and decode alike): per (row, query head),
//! an online softmax over the row's keys, visited in chunks whose boundaries sit at
//! absolute KV positions (multiples of the block size), in position order. K and V are
//! always read from the cache. See the crate docs for the exact arithmetic.

use crate::error::{Error, Result, check_len};
use crate::isa::Isa;
use crate::kernels;
use crate::kv::{BlockSlice, KvCache, MAX_BLOCK_SIZE, SeqKv};
use crate::pool::ThreadPool;

/// One query row of a batch: the sequence it belongs to and its absolute position.
/// The same slice of rows serves [`KvCache::write_rows`] and [`attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttnRow<'a> {
    /// The row's sequence (its block tables).
    pub seq: &'a SeqKv,
    /// Absolute position of the row's token; the row sees keys up to and including it.
    pub pos: usize,
}

/// Per-call attention parameters (the KV shape and windows come from the cache).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads per row (a multiple of the cache's `n_kv_head`; query head `h` uses KV
    /// head `h / (n_head / n_kv_head)`).
    pub n_head: usize,
    /// Score scale, usually `1/sqrt(head_dim)` (see [`AttnParams::new`]).
    pub scale: f32,
}

impl AttnParams {
    /// `n_head` query heads with the scale `1/sqrt(head_dim)` (computed in f64, rounded
    /// once to f32).
    pub fn new(n_head: usize, head_dim: usize) -> AttnParams {
        AttnParams {
            n_head,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
        }
    }
}

/// Attention with the process-wide kernel set; see [`attention_with`].
pub fn attention(
    pool: &ThreadPool,
    kv: &KvCache,
    layer: usize,
    rows: &[AttnRow<'_>],
    q: &[f32],
    out: &mut [f32],
    params: AttnParams,
) -> Result<()> {
    attention_with(Isa::selected(), pool, kv, layer, rows, q, out, params)
}

/// Causal (and, for sliding-window layers, windowed) attention of `rows.len()` query rows
/// against `layer` of the cache.
///
/// `q` and `out` hold `rows.len()` rows of `n_head * head_dim` f32 (head-major). Every
/// row's K/V, including its own position, must already be written to the cache. Work is
/// split over (row, head) pairs, in contiguous ranges (a few per thread, balanced by keys
/// visited) that the threads share out; each pair is computed entirely by one thread with
/// the canonical order, so results do not depend on the batch, the thread count or which
/// thread ran it.
#[allow(clippy::too_many_arguments)]
pub fn attention_with(
    isa: Isa,
    pool: &ThreadPool,
    kv: &KvCache,
    layer: usize,
    rows: &[AttnRow<'_>],
    q: &[f32],
    out: &mut [f32],
    params: AttnParams,
) -> Result<()> {
    let cfg = kv.config();
    let (n_kv, d, bsz) = (cfg.n_kv_head, cfg.head_dim, cfg.block_size);
    let n_head = params.n_head;
    if n_head == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(Error::Config(format!(
            "n_head {n_head} must be a positive multiple of n_kv_head {n_kv}"
        )));
    }
    check_len("attention q", rows.len() * n_head * d, q.len())?;
    check_len("attention out", rows.len() * n_head * d, out.len())?;
    let (g, li) = kv.layer_slot(layer)?;
    let window = kv.group_window(g);
    // Validate every row up front so the parallel part cannot fail.
    for row in rows {
        let lo = first_key(row.pos, window);
        if row.pos >= row.seq.len() {
            return Err(Error::NotReserved {
                pos: row.pos,
                len: row.seq.len(),
            });
        }
        let table = row.seq.table(g).ok_or(Error::Shape {
            what: "sequence tables (one per layer group)",
            expected: kv.n_groups(),
            got: 0,
        })?;
        for b in lo / bsz..=row.pos / bsz {
            if table.block(b).is_none() {
                return Err(Error::Released {
                    pos: (b * bsz).max(lo),
                    group: g,
                });
            }
        }
    }
    let isa = isa.checked();
    let group_size = n_head / n_kv;
    // Contiguous ranges of (row, head) tasks, a few per thread, balanced by the number of
    // keys the tasks visit (a later row of a causal prefill costs more than an earlier
    // one), shared out with work stealing so a preempted thread holds up little.
    let threads = pool.n_threads().max(1);
    let chunks = if threads == 1 {
        1
    } else {
        threads * CHUNKS_PER_THREAD
    };
    let row_costs: Vec<u64> = rows
        .iter()
        .map(|r| (r.pos + 1 - first_key(r.pos, window)) as u64 + TASK_OVERHEAD_KEYS)
        .collect();
    let bounds = balanced_bounds(&row_costs, n_head, chunks);
    let mut shares: Vec<std::sync::Mutex<&mut [f32]>> = Vec::with_capacity(chunks);
    let mut rest: &mut [f32] = out;
    for c in 0..chunks {
        let (mine, tail) = rest.split_at_mut((bounds[c + 1] - bounds[c]) * d);
        shares.push(std::sync::Mutex::new(mine));
        rest = tail;
    }
    pool.for_chunks_stealing(chunks, |_, c| {
        let (Some(share), Some(&first)) = (shares.get(c), bounds.get(c)) else {
            return;
        };
        let mut guard = share.lock().unwrap_or_else(|p| p.into_inner());
        for (i, o) in guard.chunks_exact_mut(d).enumerate() {
            let task = first + i;
            let (r, h) = (task / n_head, task % n_head);
            let row = &rows[r];
            let qh = &q[task * d..(task + 1) * d];
            attend_one(
                isa,
                kv,
                g,
                li,
                row,
                window,
                h / group_size,
                qh,
                params.scale,
                o,
            );
        }
    });
    Ok(())
}

/// Task ranges per thread (with more than one thread).
const CHUNKS_PER_THREAD: usize = 4;

/// Fixed per-task cost, in keys, added to each task's key count when balancing.
const TASK_OVERHEAD_KEYS: u64 = 8;

/// Task boundaries (`threads + 1` of them, from 0 to `row_costs.len() · n_head`): part
/// `t` holds tasks `bounds[t]..bounds[t + 1]`, where task `r · n_head + h` is (row `r`,
/// head `h`) and costs `row_costs[r]`. The cumulative cost is split as evenly as
/// contiguous ranges allow.
fn balanced_bounds(row_costs: &[u64], n_head: usize, threads: usize) -> Vec<usize> {
    let n_tasks = row_costs.len() * n_head;
    let total: u64 = row_costs.iter().map(|c| c * n_head as u64).sum();
    let mut bounds = Vec::with_capacity(threads + 1);
    bounds.push(0);
    let mut t = 1;
    let mut acc = 0u64;
    let tasks = row_costs
        .iter()
        .flat_map(|&c| std::iter::repeat_n(c, n_head));
    for (task, cost) in tasks.enumerate() {
        // Thread t starts at the first task whose preceding cost reaches t/T of the total.
        while t < threads && acc * threads as u64 >= total * t as u64 {
            bounds.push(task);
            t += 1;
        }
        acc += cost;
    }
    bounds.resize(threads + 1, n_tasks);
    bounds
}

/// First key a query at `pos` sees.
fn first_key(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// One (row, query head): online softmax over the chunks, result in `acc` (`head_dim`).
#[allow(clippy::too_many_arguments)]
fn attend_one(
    isa: Isa,
    kv: &KvCache,
    g: usize,
    li: usize,
    row: &AttnRow<'_>,
    window: Option<usize>,
    kv_head: usize,
    q: &[f32],
    scale: f32,
    acc: &mut [f32],
) {
    let cfg = kv.config();
    let (d, bsz) = (cfg.head_dim, cfg.block_size);
    let Some(table) = row.seq.table(g) else {
        return;
    };
    let mut scores = [0.0f32; MAX_BLOCK_SIZE];
    let mut e = [0.0f32; MAX_BLOCK_SIZE];
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    acc.fill(0.0);
    let mut start = first_key(row.pos, window);
    while start <= row.pos {
        let b = start / bsz;
        let end = ((b + 1) * bsz).min(row.pos + 1);
        let (n, off) = (end - start, start % bsz);
        // Validated by the caller: every block in the row's range is present.
        let Some(block) = table.block(b) else { return };
        let s = &mut scores[..n];
        let keys = off * d..(off + n) * d;
        match kv.block_keys(g, li, block, kv_head) {
            BlockSlice::F16(k) => kernels::scores_f16(isa, q, &k[keys.clone()], d, scale, s),
            BlockSlice::F32(k) => kernels::scores_f32(isa, q, &k[keys.clone()], d, scale, s),
        }
        // New running max, scanning the chunk in position order.
        let m_new = s.iter().fold(m, |m, &x| if x > m { x } else { m });
        if m_new != m {
            // alpha = exp(m - m_new); skipped when the max is unchanged (alpha would be 1).
            let alpha = crate::canon::exp(m - m_new);
            l *= alpha;
            kernels::scale_in_place(isa, acc, alpha);
            m = m_new;
        }
        let e = &mut e[..n];
        kernels::exp_shifted(isa, s, m, e);
        for &x in e.iter() {
            l += x;
        }
        match kv.block_values(g, li, block, kv_head) {
            BlockSlice::F16(v) => kernels::accumulate_f16(isa, acc, e, &v[keys]),
            BlockSlice::F32(v) => kernels::accumulate_f32(isa, acc, e, &v[keys]),
        }
        start = end;
    }
    kernels::scale_in_place(isa, acc, 1.0 / l);
}

#[cfg(test)]
mod tests {
    use super::balanced_bounds;

    #[test]
    fn balanced_bounds_partition_tasks_by_cost() {
        // A causal prefill of 512 rows, 9 heads: costs grow with the row.
        let costs: Vec<u64> = (0..512u64).map(|p| p + 1 + 8).collect();
        for threads in 1..6 {
            let b = balanced_bounds(&costs, 9, threads);
            assert_eq!(b.len(), threads + 1);
            assert_eq!((b[0], b[threads]), (0, 512 * 9));
            assert!(b.windows(2).all(|w| w[0] <= w[1]), "monotone {b:?}");
            let share = |t: usize| -> u64 { (b[t]..b[t + 1]).map(|i| costs[i / 9]).sum() };
            let total: u64 = (0..threads).map(share).sum();
            for t in 0..threads {
                let s = share(t) as f64 / total as f64;
                assert!(
                    (s - 1.0 / threads as f64).abs() < 0.01,
                    "t {t}: {s} of {b:?}"
                );
            }
        }
        // Equal costs (a decode batch): equal counts.
        assert_eq!(balanced_bounds(&[5], 4, 2), vec![0, 2, 4]);
        // More threads than tasks, and no tasks at all.
        assert_eq!(balanced_bounds(&[5], 1, 3), vec![0, 1, 1, 1]);
        assert_eq!(balanced_bounds(&[], 4, 2), vec![0, 0, 0]);
    }
}
