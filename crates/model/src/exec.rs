//! Running the forward's operations on the thread pool: quantized matmuls split over N
//! (never K), row operations split over rows. No result depends on the split (G1): every
//! output element is computed by one kernel call whose arithmetic does not see the others.

use crate::ModelError;
use crate::weights::Matrix;
use backend_cpu::ThreadPool;
use quant::{ActLayout, Kernels, PackedMatrix, QuantizedActs};
use std::ops::Range;
use std::sync::Mutex;

/// Weight rows per unit of work: the packed weights' tile, so thread boundaries never
/// split a tile.
const TILE: usize = PackedMatrix::TILE;
/// At most this many matmuls share one dispatch.
pub(crate) const MAX_GROUP: usize = 4;

/// One matmul of a group: `out[m·n + j] = dot(W row j, acts row m)`.
pub(crate) struct MatJob<'a> {
    /// The weights.
    pub w: &'a Matrix,
    /// The activations (`m` rows, in `w.format`'s layout).
    pub acts: &'a QuantizedActs,
    /// `m · w.n` outputs, row-major.
    pub out: &'a mut [f32],
}

/// A raw output pointer shared by the threads of one dispatch, each writing a disjoint
/// range.
struct SharedOut {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: only used to hand disjoint sub-slices of one `&mut [f32]` to pool threads; the
// slice outlives the dispatch (`ThreadPool::broadcast` returns after every thread).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn new(s: &mut [f32]) -> SharedOut {
        SharedOut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// # Safety
    /// No two live slices obtained from this value may overlap.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len, "SharedOut range");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// Thread `t`'s share of `units` units: `[t·U/T, (t+1)·U/T)`.
fn share(units: usize, threads: usize, t: usize) -> Range<usize> {
    (t * units / threads)..((t + 1) * units / threads)
}

/// The weight rows of job `j` that thread `t` computes.
fn job_rows(ns: &[usize], threads: usize, t: usize, j: usize) -> Range<usize> {
    let units: usize = ns.iter().map(|n| n.div_ceil(TILE)).sum();
    let mine = share(units, threads, t);
    let first: usize = ns[..j].iter().map(|n| n.div_ceil(TILE)).sum();
    let own = first..first + ns[j].div_ceil(TILE);
    let lo = mine.start.max(own.start);
    let hi = mine.end.min(own.end);
    if lo >= hi {
        return 0..0;
    }
    ((lo - first) * TILE).min(ns[j])..((hi - first) * TILE).min(ns[j])
}

/// Runs up to [`MAX_GROUP`] matmuls over `m` activation rows in one pool dispatch. The
/// weight rows of all jobs, in 16-row tiles, are split into one contiguous share per
/// thread. With `m > 1` each thread writes its rows tile-major into `tmp` (so shares are
/// contiguous), then the rows are gathered into the row-major outputs.
pub(crate) fn matmuls(
    pool: &ThreadPool,
    kernels: &Kernels,
    jobs: &mut [MatJob<'_>],
    m: usize,
    tmp: &mut Vec<f32>,
) -> Result<(), ModelError> {
    assert!(jobs.len() <= MAX_GROUP, "matmul group too large");
    if m == 0 || jobs.is_empty() {
        return Ok(());
    }
    let mut ns = [0usize; MAX_GROUP];
    for (n, job) in ns.iter_mut().zip(jobs.iter()) {
        *n = job.w.n;
        let want = m * job.w.n;
        if job.out.len() != want || job.acts.rows() != m || job.acts.k() != job.w.k {
            return Err(ModelError::Batch(format!(
                "matmul {}: output {} (want {want}), activations {}×{} (want {m}×{})",
                job.w.name,
                job.out.len(),
                job.acts.rows(),
                job.acts.k(),
                job.w.k
            )));
        }
    }
    let ns = &ns[..jobs.len()];
    let threads = pool.n_threads();
    let total: usize = ns.iter().sum();
    if m > 1 && tmp.len() < m * total {
        tmp.resize(m * total, 0.0);
    }
    // Where job j's tile-major results go: its own output when m == 1 (tile-major and
    // row-major coincide), else its region of `tmp`.
    let mut targets: [Option<SharedOut>; MAX_GROUP] = [None, None, None, None];
    let mut tmp_off = [0usize; MAX_GROUP];
    {
        let mut off = 0;
        for (j, job) in jobs.iter_mut().enumerate() {
            tmp_off[j] = off;
            off += m * ns[j];
            if m == 1 {
                targets[j] = Some(SharedOut::new(job.out));
            }
        }
    }
    let tmp_out = SharedOut::new(tmp.as_mut_slice());
    // The weights and activations of each job, apart from the outputs now owned by
    // `targets`/`tmp_out`.
    let mut inputs: [Option<(&Matrix, &QuantizedActs)>; MAX_GROUP] = [None; MAX_GROUP];
    for (slot, job) in inputs.iter_mut().zip(jobs.iter()) {
        *slot = Some((job.w, job.acts));
    }
    let error: Mutex<Option<ModelError>> = Mutex::new(None);
    pool.broadcast(|t| {
        for (j, input) in inputs.iter().enumerate() {
            let Some((w, acts)) = *input else { continue };
            let rows = job_rows(ns, threads, t, j);
            if rows.is_empty() {
                continue;
            }
            let dst = m * rows.start..m * rows.end;
            // SAFETY: the row ranges of the threads partition 0..n of job j, so the ranges
            // `m·rows` are disjoint between threads, and the jobs' regions of `tmp` (or
            // their own outputs) are disjoint from each other.
            let out = unsafe {
                match &targets[j] {
                    Some(target) => target.slice(dst),
                    None => tmp_out.slice(tmp_off[j] + dst.start..tmp_off[j] + dst.end),
                }
            };
            let ldo = rows.len();
            if let Err(e) = kernels.matmul_packed(&w.packed, acts, rows, out, ldo) {
                let mut slot = error.lock().unwrap_or_else(|p| p.into_inner());
                slot.get_or_insert(ModelError::Quant(e));
            }
        }
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if m == 1 {
        return Ok(());
    }
    let tmp: &[f32] = tmp;
    for (j, job) in jobs.iter_mut().enumerate() {
        let n = ns[j];
        let region = &tmp[tmp_off[j]..tmp_off[j] + m * n];
        pool.for_chunks_mut(job.out, n, |mi, row| {
            for t in 0..threads {
                let rows = job_rows(ns, threads, t, j);
                let w = rows.len();
                if w == 0 {
                    continue;
                }
                let src = m * rows.start + mi * w;
                row[rows].copy_from_slice(&region[src..src + w]);
            }
        });
    }
    Ok(())
}

/// Runs `f(row index, row)` for every row of `buf` (rows of `row_len`), split over the
/// pool; the first error is returned.
pub(crate) fn for_rows<E: Send>(
    pool: &ThreadPool,
    buf: &mut [f32],
    row_len: usize,
    f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
) -> Result<(), ModelError>
where
    ModelError: From<E>,
{
    let error: Mutex<Option<E>> = Mutex::new(None);
    pool.for_chunks_mut(buf, row_len, |i, row| {
        if let Err(e) = f(i, row) {
            let mut slot = error.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
    });
    match error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Quantized activations, one buffer per (layout, row length), reused across calls.
#[derive(Debug, Default)]
pub(crate) struct ActsCache {
    entries: Vec<QuantizedActs>,
}

impl ActsCache {
    /// Quantizes `x` (rows of `k`) for `layout` into that layout's buffer; returns its index.
    /// Quantizing the same input for a layout twice is avoided by the callers (one call per
    /// distinct layout of a matmul group).
    pub fn quantize(
        &mut self,
        kernels: &Kernels,
        layout: ActLayout,
        k: usize,
        x: &[f32],
    ) -> Result<usize, ModelError> {
        let i = match self
            .entries
            .iter()
            .position(|a| a.layout() == layout && a.k() == k)
        {
            Some(i) => i,
            None => {
                self.entries.push(QuantizedActs::new(layout, k)?);
                self.entries.len() - 1
            }
        };
        self.entries[i].quantize_into_with(kernels, x)?;
        Ok(i)
    }

    /// The buffer at `i` (from [`ActsCache::quantize`]).
    pub fn get(&self, i: usize) -> &QuantizedActs {
        &self.entries[i]
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|a| a.rows() * (a.k() * 5 + 16))
            .sum()
    }

    /// Quantizes `x` once per distinct layout among `ws` and returns, per weight, the index
    /// of its activations.
    pub fn quantize_for(
        &mut self,
        kernels: &Kernels,
        ws: &[&Matrix],
        x: &[f32],
    ) -> Result<[usize; MAX_GROUP], ModelError> {
        let mut idx = [usize::MAX; MAX_GROUP];
        for (j, w) in ws.iter().enumerate() {
            let layout = w.format.act_layout();
            let done = ws[..j]
                .iter()
                .position(|p| p.format.act_layout() == layout && p.k == w.k);
            idx[j] = match done {
                Some(p) => idx[p],
                None => self.quantize(kernels, layout, w.k, x)?,
            };
        }
        Ok(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_rows_partition_every_job_into_tiles() {
        for threads in 1..5 {
            let ns = [576usize, 192, 200, 7];
            for j in 0..ns.len() {
                let mut next = 0;
                for t in 0..threads {
                    let r = job_rows(&ns, threads, t, j);
                    if r.is_empty() {
                        continue;
                    }
                    assert_eq!(r.start, next, "contiguous");
                    assert!(r.start.is_multiple_of(TILE), "tile aligned");
                    next = r.end;
                }
                assert_eq!(next, ns[j], "covers the job");
            }
        }
    }
}
