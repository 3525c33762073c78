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

/// Chunks per thread a matmul group is cut into (with more than one thread): enough that a
/// thread left waiting for a preempted one can take over most of its share, few enough that
/// each kernel call still streams a long run of weights.
const CHUNKS_PER_THREAD: usize = 8;

/// The units of work of one matmul group: each job's 16-row tiles cut into chunks of at most
/// `tiles` tiles (a chunk never spans two jobs). The cut depends only on the shapes and
/// the thread count, never on which thread runs a chunk.
struct Chunks {
    ns: [usize; MAX_GROUP],
    counts: [usize; MAX_GROUP],
    tiles: usize,
}

impl Chunks {
    fn new(ns: &[usize], threads: usize) -> Chunks {
        let units: usize = ns.iter().map(|n| n.div_ceil(TILE)).sum();
        // One thread: one call per job, as a plain loop would make.
        let tiles = if threads <= 1 {
            units
        } else {
            units.div_ceil(threads * CHUNKS_PER_THREAD)
        }
        .max(1);
        let mut c = Chunks {
            ns: [0; MAX_GROUP],
            counts: [0; MAX_GROUP],
            tiles,
        };
        for (j, &n) in ns.iter().enumerate() {
            c.ns[j] = n;
            c.counts[j] = n.div_ceil(TILE).div_ceil(tiles);
        }
        c
    }

    fn total(&self) -> usize {
        self.counts.iter().sum()
    }

    /// Chunk `c`: its job and that job's weight rows.
    fn get(&self, mut c: usize) -> (usize, Range<usize>) {
        for j in 0..MAX_GROUP {
            if c < self.counts[j] {
                let rows = self.tiles * TILE;
                return (j, c * rows..((c + 1) * rows).min(self.ns[j]));
            }
            c -= self.counts[j];
        }
        unreachable!("chunk index beyond the group")
    }

    /// The weight-row ranges of job `j`'s chunks, in order.
    fn of_job(&self, j: usize) -> impl Iterator<Item = Range<usize>> + '_ {
        let rows = self.tiles * TILE;
        (0..self.counts[j]).map(move |c| c * rows..((c + 1) * rows).min(self.ns[j]))
    }
}

/// Runs up to [`MAX_GROUP`] matmuls over `m` activation rows in one pool dispatch. The
/// weight rows of all jobs, in 16-row tiles, are cut into chunks ([`Chunks`]) that the
/// threads share out with [`ThreadPool::for_chunks_stealing`]. With `m > 1` each chunk's
/// results go tile-major into `tmp` (so a chunk's outputs are contiguous), then the rows
/// are gathered into the row-major outputs.
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
    let chunks = Chunks::new(ns, threads);
    let error: Mutex<Option<ModelError>> = Mutex::new(None);
    pool.for_chunks_stealing(chunks.total(), |_, c| {
        let (j, rows) = chunks.get(c);
        let Some((w, acts)) = inputs[j] else { return };
        let dst = m * rows.start..m * rows.end;
        // SAFETY: the chunks of job j partition 0..n and each chunk runs once, so the
        // ranges `m·rows` are disjoint between calls, and the jobs' regions of `tmp` (or
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
        let chunks = &chunks;
        pool.for_chunks_mut(job.out, n, |mi, row| {
            for rows in chunks.of_job(j) {
                let w = rows.len();
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
    fn chunks_partition_every_job_into_tiles() {
        for threads in 1..5 {
            for ns in [
                &[576usize, 192, 200, 7][..],
                &[8960, 8960],
                &[16],
                &[151_936],
            ] {
                let chunks = Chunks::new(ns, threads);
                let mut seen: Vec<Vec<Range<usize>>> = vec![Vec::new(); ns.len()];
                for c in 0..chunks.total() {
                    let (j, r) = chunks.get(c);
                    assert!(!r.is_empty(), "no empty chunk");
                    seen[j].push(r);
                }
                if threads > 1 {
                    // No chunk larger than an even cut into CHUNKS_PER_THREAD per thread.
                    let units: usize = ns.iter().map(|n| n.div_ceil(TILE)).sum();
                    let most = units.div_ceil(threads * CHUNKS_PER_THREAD) * TILE;
                    assert!(
                        seen.iter().flatten().all(|r| r.len() <= most),
                        "small chunks"
                    );
                } else {
                    assert_eq!(chunks.total(), ns.len(), "one call per job on one thread");
                }
                for (j, got) in seen.iter().enumerate() {
                    let of_job: Vec<_> = chunks.of_job(j).collect();
                    assert_eq!(&of_job, got, "of_job lists the same chunks");
                    let mut next = 0;
                    for r in got {
                        assert_eq!(r.start, next, "contiguous, in order");
                        assert!(r.start.is_multiple_of(TILE), "tile aligned");
                        next = r.end;
                    }
                    assert_eq!(next, ns[j], "covers the job");
                }
            }
        }
    }
}
