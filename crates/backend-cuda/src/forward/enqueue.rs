//! Queuing a forward on the device stream: the scratch buffers, every layer's launches on
//! the general kernels ([`enqueue_rows`]) or, for a decode step, the matvec kernels
//! ([`enqueue_decode`]), attention, the output head and what follows it ([`Tail`]), and the
//! capture of a whole forward as a CUDA graph ([`capture`]) that the backend replays.

use super::{DevKv, StepOptions};
use crate::CudaError;
use crate::device::{Arg, Buf, Device};
use crate::forward::CudaModel;
use crate::ops::{
    ArgmaxParts, DevActs, DevMatrix, Epilogue, MvInput, SUMMARY_STRIDE, matvec_kernel,
};
use cudarc::driver::CudaGraph;
use model::Config;
use quant::{ActLayout, Format};
use std::collections::HashMap;

/// Threads per attention CTA (`ATT_THREADS` in `kernels.cu`).
const ATT_THREADS: u32 = 256;
/// Bytes of shared memory the tiled attention kernel stages K and V through for steps of
/// up to [`GRAPH_MAX_ROWS`] rows (two buffers of a K and a V tile).
const ATT_TILE_SMEM: usize = 128 * 1024;
/// Most keys per attention tile (`ATT_MAX_TK` in `kernels.cu`).
const ATT_MAX_TK: usize = 256;
/// Largest head dimension of the attention kernels (`MAX_HEAD_DIM` in `kernels.cu`).
const MAX_HEAD_DIM: usize = 512;
/// Keys per `att_scores` tile (`ATS_TK` in `kernels.cu`).
const ATS_TK: usize = 64;
/// Most query heads per KV head `att_scores` takes (`ATS_MAXG` in `kernels.cu`).
const ATS_MAXG: usize = 16;
/// Most score values a step's split attention may hold (above it, the step computes its
/// scores in the tiled kernel itself): 128 MiB.
pub(super) const SPLIT_SCORES_MAX: usize = 32 << 20;
/// Key tiles per (row, KV head) the `att_scores` grid offers: enough CTAs for every
/// multiprocessor twice over at one row, each CTA taking every `slices`-th tile.
const ATS_MAX_SLICES: usize = 64;

/// Steps of at most this many rows run from captured graphs (decode, verify blocks).
pub(super) const GRAPH_MAX_ROWS: usize = 16;
/// Captured shapes kept per backend.
pub(super) const GRAPH_CACHE: usize = 8;

/// What a captured forward depends on: rows, the rows that want logits, the generation of
/// the scratch buffers (bumped whenever one is reallocated), whether it ends with the
/// device argmax or the row summaries, and whether its attention is split
/// ([`Scratch::att_split`]).
pub(super) type GraphKey = (usize, Vec<usize>, u64, Tail, bool);

/// What a forward leaves on the device after the logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tail {
    /// Nothing more (the logits are read back).
    Logits,
    /// Each logit row's argmax ([`CudaBackend::forward_greedy`](super::CudaBackend::forward_greedy)).
    Argmax,
    /// Each logit row's [`sampling::RowSummary`] parts (`forward_summaries`).
    Summary,
}

/// Device scratch for one forward of up to `rows` rows.
pub(super) struct Scratch {
    pub(super) rows: usize,
    pub(super) x: Buf<f32>,
    pub(super) xn: Buf<f32>,
    pub(super) q: Buf<f32>,
    pub(super) k: Buf<f32>,
    pub(super) v: Buf<f32>,
    pub(super) attn: Buf<f32>,
    pub(super) proj: Buf<f32>,
    pub(super) gate: Buf<f32>,
    pub(super) up: Buf<f32>,
    pub(super) acts: HashMap<(ActLayout, usize), DevActs>,
    pub(super) logits: Buf<f32>,
    pub(super) logit_rows: usize,
    /// Greedy choices made on the device ([`CudaBackend::forward_greedy`](super::CudaBackend::forward_greedy)), one per row.
    pub(super) ids: Buf<i32>,
    /// The device argmax's slice results.
    pub(super) parts: ArgmaxParts,
    /// The exps of the summarized rows (as many rows as `logits`).
    pub(super) ex: Buf<f32>,
    /// Row summaries ([`Device::row_summaries`]), `SUMMARY_STRIDE` values a row.
    pub(super) sums: Buf<f64>,
    /// Row metadata, uploaded in one copy: positions (`rows`), the physical block each row
    /// writes (`rows`), each row's offset into the block tables (`rows`), the row tiles of
    /// the many-row attention kernel (`rows + 1`: tile starts, then the row count), each
    /// row's offset into `scores` (`rows`), then the tables.
    pub(super) meta: Buf<i32>,
    /// Row tiles of this step for the many-row attention kernel (0: not used this step).
    pub(super) att_tiles: usize,
    /// Whether this step's attention is split ([`StepOptions::attn_split`]: `att_scores`,
    /// then `attention_tiled_pre`).
    pub(super) att_split: bool,
    /// The split attention's scores: per row, `n_head` rows of `pos + 1` keys.
    pub(super) scores: Buf<f32>,
    pub(super) generation: u64,
}

/// Source of distinct [`Scratch::generation`] values.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn next_generation() -> u64 {
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Scratch {
    pub(super) fn new(dev: &Device, cfg: &Config, rows: usize) -> Result<Scratch, CudaError> {
        let (e, f, qd, kvd) = (cfg.n_embd, cfg.n_ff, cfg.q_dim(), cfg.kv_dim());
        Ok(Scratch {
            rows,
            x: dev.zeros(rows * e)?,
            xn: dev.zeros(rows * e.max(qd).max(f))?,
            q: dev.zeros(rows * qd)?,
            k: dev.zeros(rows * kvd)?,
            v: dev.zeros(rows * kvd)?,
            attn: dev.zeros(rows * qd)?,
            proj: dev.zeros(rows * e)?,
            gate: dev.zeros(rows * f)?,
            up: dev.zeros(rows * f)?,
            acts: HashMap::new(),
            logits: dev.zeros(cfg.n_vocab)?,
            logit_rows: 1,
            ids: dev.zeros(rows)?,
            parts: ArgmaxParts::new(dev, rows)?,
            ex: dev.zeros(cfg.n_vocab)?,
            sums: dev.zeros(rows * SUMMARY_STRIDE)?,
            meta: dev.zeros(5 * rows + 64)?,
            att_tiles: 0,
            att_split: false,
            scores: dev.zeros(1)?,
            generation: next_generation(),
        })
    }
}

/// Quantizes `m` rows of `x` (row length `k`) for every distinct activation layout of
/// `ws` (once per layout).
fn quantize_for(
    dev: &Device,
    acts: &mut HashMap<(ActLayout, usize), DevActs>,
    cap: usize,
    ws: &[&DevMatrix],
    x: &Buf<f32>,
    m: usize,
) -> Result<(), CudaError> {
    let mut done: Vec<ActLayout> = Vec::new();
    for w in ws {
        let layout = w.format.act_layout();
        if layout == ActLayout::Float || done.contains(&layout) {
            continue;
        }
        done.push(layout);
        let a = match acts.entry((layout, w.k)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(DevActs::new(dev, layout, w.k, cap)?)
            }
        };
        dev.quantize_acts(x, m, a)?;
    }
    Ok(())
}

fn mm(
    dev: &Device,
    acts: &HashMap<(ActLayout, usize), DevActs>,
    w: &DevMatrix,
    x: &Buf<f32>,
    out: &mut Buf<f32>,
    m: usize,
) -> Result<(), CudaError> {
    dev.matmul(w, x, acts.get(&(w.format.act_layout(), w.k)), out, m)
}

/// The activations of layout `layout` and row length `k` (made on first use).
fn acts_for<'a>(
    dev: &Device,
    acts: &'a mut HashMap<(ActLayout, usize), DevActs>,
    cap: usize,
    layout: ActLayout,
    k: usize,
) -> Result<&'a mut DevActs, CudaError> {
    Ok(match acts.entry((layout, k)) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert(DevActs::new(dev, layout, k, cap)?)
        }
    })
}

/// RMSNorm of `m` rows of `x` into `xn`, and the activations every matrix of `ws` needs:
/// the first quantized layout in the same launch as the norm, any other from `xn`.
#[allow(clippy::too_many_arguments)]
fn norm_for(
    dev: &Device,
    acts: &mut HashMap<(ActLayout, usize), DevActs>,
    cap: usize,
    ws: &[&DevMatrix],
    x: &Buf<f32>,
    w: &Buf<f32>,
    xn: &mut Buf<f32>,
    m: usize,
    n: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let first = ws
        .iter()
        .map(|w| w.format.act_layout())
        .find(|&l| l != ActLayout::Float);
    match first {
        Some(layout) => {
            let a = acts_for(dev, acts, cap, layout, n)?;
            dev.norm_quant_at(x, 0, w, xn, 0, a, 0, m, eps)?;
            let rest: Vec<&DevMatrix> = ws
                .iter()
                .copied()
                .filter(|w| w.format.act_layout() != layout)
                .collect();
            quantize_for(dev, acts, cap, &rest, xn, m)
        }
        None => dev.rms_norm(x, w, xn, m, n, eps),
    }
}

/// One projection of [`project`]: the matrix, its output, its optional bias.
type ProjectJob<'a> = (&'a DevMatrix, &'a mut Buf<f32>, Option<&'a Buf<f32>>);

/// `outs[i] = ws[i] · xn (+ bias)` over `m` rows: quantized matrices of one format share a
/// launch; float ones run on their own, their bias added after.
fn project(
    dev: &Device,
    acts: &HashMap<(ActLayout, usize), DevActs>,
    xn: &Buf<f32>,
    jobs: &mut [ProjectJob<'_>],
    m: usize,
) -> Result<(), CudaError> {
    let mut done = vec![false; jobs.len()];
    for i in 0..jobs.len() {
        if done[i] {
            continue;
        }
        let w = jobs[i].0;
        if jobs[i].1.len() < m * w.n {
            return Err(CudaError::Shape(format!(
                "output for {} rows of {}",
                m, w.n
            )));
        }
        if w.format.is_float() {
            let (w, out, b) = (jobs[i].0, &mut *jobs[i].1, jobs[i].2);
            dev.matmul(w, xn, None, out, m)?;
            if let Some(b) = b {
                dev.add_bias(out, b, w.n, m * w.n)?;
            }
            done[i] = true;
            continue;
        }
        let mut group: Vec<(&DevMatrix, u64, Option<&Buf<f32>>)> = Vec::new();
        for (jd, job) in jobs.iter().enumerate().skip(i) {
            if !done[jd] && job.0.format == w.format && job.0.k == w.k {
                if job.1.len() < m * job.0.n {
                    return Err(CudaError::Shape(format!(
                        "output for {} rows of {}",
                        m, job.0.n
                    )));
                }
                group.push((job.0, dev.ptr(&*job.1, 0), job.2));
                done[jd] = true;
            }
        }
        let a = acts
            .get(&(w.format.act_layout(), w.k))
            .ok_or_else(|| CudaError::Shape("matmul without activations".into()))?;
        dev.matmul_fused(&group, a, m, Epilogue::Store)?;
    }
    Ok(())
}

/// `x += w · input` over `m` rows (`proj` is scratch for float weights).
fn residual(
    dev: &Device,
    acts: &HashMap<(ActLayout, usize), DevActs>,
    w: &DevMatrix,
    input: &Buf<f32>,
    x: &mut Buf<f32>,
    proj: &mut Buf<f32>,
    m: usize,
) -> Result<(), CudaError> {
    if w.format.is_float() {
        dev.matmul(w, input, None, proj, m)?;
        return dev.add_in_place(x, proj, m * w.n);
    }
    if x.len() < m * w.n {
        return Err(CudaError::Shape(format!(
            "residual of {} rows of {}",
            m, w.n
        )));
    }
    let a = acts
        .get(&(w.format.act_layout(), w.k))
        .ok_or_else(|| CudaError::Shape("matmul without activations".into()))?;
    let xp = dev.ptr(&*x, 0);
    dev.matmul_fused(&[(w, xp, None)], a, m, Epilogue::Accumulate)
}

/// `g = silu(gate · xn) * (up · xn)` over `m` rows: one launch when both are quantized in
/// one format.
#[allow(clippy::too_many_arguments)]
fn gate_up(
    dev: &Device,
    acts: &HashMap<(ActLayout, usize), DevActs>,
    gate: &DevMatrix,
    up: &DevMatrix,
    xn: &Buf<f32>,
    g: &mut Buf<f32>,
    u: &mut Buf<f32>,
    m: usize,
) -> Result<(), CudaError> {
    if !gate.format.is_float() && gate.format == up.format && gate.n == up.n && gate.k == up.k {
        if g.len() < m * gate.n {
            return Err(CudaError::Shape(format!("gate output of {} rows", m)));
        }
        let a = acts
            .get(&(gate.format.act_layout(), gate.k))
            .ok_or_else(|| CudaError::Shape("matmul without activations".into()))?;
        let gp = dev.ptr(&*g, 0);
        return dev.matmul_fused(&[(gate, gp, None), (up, 0, None)], a, m, Epilogue::SwiGlu);
    }
    mm(dev, acts, gate, xn, g, m)?;
    mm(dev, acts, up, xn, u, m)?;
    dev.swiglu(g, u, m * gate.n)
}

/// Queues the whole forward of `m` rows (inputs already in `s`) on the device stream:
/// every layer, then the output head of `logit_rows` into `s.logits`. Allocates nothing
/// once `s` has served a forward of the same shape, so it can be captured in a graph.
#[allow(clippy::too_many_arguments)]
pub(super) fn enqueue(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &mut Scratch,
    m: usize,
    logit_rows: &[usize],
    opts: StepOptions,
    tail: Tail,
) -> Result<(), CudaError> {
    if m == 1 && opts.matvec && model.matvec_ready {
        enqueue_decode(dev, model, kv, s, logit_rows, opts)?;
    } else {
        enqueue_rows(dev, model, kv, s, m, logit_rows, opts)?;
    }
    let nl = logit_rows.len();
    if tail != Tail::Logits && nl > 0 {
        let n = model.cfg.n_vocab;
        dev.argmax_rows(&s.logits, nl, n, &mut s.parts, &mut s.ids)?;
        if tail == Tail::Summary {
            dev.row_summaries(&s.logits, nl, n, &s.ids, &mut s.ex, &mut s.sums)?;
        }
    }
    Ok(())
}

/// [`enqueue`] of any number of rows on the general kernels.
fn enqueue_rows(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &mut Scratch,
    m: usize,
    logit_rows: &[usize],
    opts: StepOptions,
) -> Result<(), CudaError> {
    let cfg = &model.cfg;
    let e = cfg.n_embd;
    let cap = s.rows;
    let eps = cfg.rms_eps;
    for (li, l) in model.layers.iter().enumerate() {
        // Attention block: norm + quantize, the q/k/v projections with their biases, RoPE
        // with the cache write, attention, the output projection added to the residual.
        norm_for(
            dev,
            &mut s.acts,
            cap,
            &[&l.wq, &l.wk, &l.wv],
            &s.x,
            &l.attn_norm,
            &mut s.xn,
            m,
            e,
            eps,
        )?;
        project(
            dev,
            &s.acts,
            &s.xn,
            &mut [
                (&l.wq, &mut s.q, l.bq.as_ref()),
                (&l.wk, &mut s.k, l.bk.as_ref()),
                (&l.wv, &mut s.v, l.bv.as_ref()),
            ],
            m,
        )?;
        rope_kv(dev, model, kv, s, li, m)?;
        attention(dev, model, kv, s, li, m, opts)?;
        quantize_for(dev, &mut s.acts, cap, &[&l.wo], &s.attn, m)?;
        residual(dev, &s.acts, &l.wo, &s.attn, &mut s.x, &mut s.proj, m)?;
        // Feed-forward block: norm + quantize, gate and up with SwiGLU, down added to the
        // residual.
        norm_for(
            dev,
            &mut s.acts,
            cap,
            &[&l.gate, &l.up],
            &s.x,
            &l.ffn_norm,
            &mut s.xn,
            m,
            e,
            eps,
        )?;
        gate_up(
            dev,
            &s.acts,
            &l.gate,
            &l.up,
            &s.xn,
            &mut s.gate,
            &mut s.up,
            m,
        )?;
        quantize_for(dev, &mut s.acts, cap, &[&l.down], &s.gate, m)?;
        residual(dev, &s.acts, &l.down, &s.gate, &mut s.x, &mut s.proj, m)?;
    }
    // Output head over the rows that want logits.
    let nl = logit_rows.len();
    if nl == 0 {
        return Ok(());
    }
    let out = &model.output;
    if out.format.is_float() {
        for (i, &r) in logit_rows.iter().enumerate() {
            dev.rms_norm_at(&s.x, r * e, &model.output_norm, &mut s.xn, i * e, 1, e, eps)?;
        }
    } else {
        let a = acts_for(dev, &mut s.acts, cap, out.format.act_layout(), e)?;
        for (i, &r) in logit_rows.iter().enumerate() {
            dev.norm_quant_at(
                &s.x,
                r * e,
                &model.output_norm,
                &mut s.xn,
                i * e,
                a,
                i,
                1,
                eps,
            )?;
        }
    }
    project(dev, &s.acts, &s.xn, &mut [(out, &mut s.logits, None)], nl)?;
    Ok(())
}

/// RoPE of the step's q and k rows with the K/V cache write of layer `li` (one launch).
fn rope_kv(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &Scratch,
    li: usize,
    m: usize,
) -> Result<(), CudaError> {
    let cfg = &model.cfg;
    let (hd, n_kv) = (cfg.head_dim, cfg.n_head_kv);
    let neox = cfg.arch.rope_style() == backend_cpu::RopeStyle::Neox;
    let hp = hd / 2;
    let per_row = (cfg.n_head + n_kv) * hp + n_kv * hd;
    dev.launch(
        "rope_kv",
        (
            u32::try_from((m * per_row).div_ceil(256)).unwrap_or(u32::MAX),
            1,
            1,
        ),
        (256, 1, 1),
        &[
            Arg::Ptr(dev.ptr(&s.q, 0)),
            Arg::Ptr(dev.ptr(&s.k, 0)),
            Arg::Ptr(dev.ptr(&s.v, 0)),
            Arg::Ptr(dev.ptr(&kv.k[li], 0)),
            Arg::Ptr(dev.ptr(&kv.v[li], 0)),
            Arg::Ptr(dev.ptr(&s.meta, 0)),
            Arg::Ptr(dev.ptr(&s.meta, s.rows)),
            Arg::Ptr(dev.ptr(&model.cos, 0)),
            Arg::Ptr(dev.ptr(&model.sin, 0)),
            Arg::I32(m as i32),
            Arg::I32(cfg.n_head as i32),
            Arg::I32(n_kv as i32),
            Arg::I32(hd as i32),
            Arg::I32(cfg.n_rot as i32),
            Arg::I32(i32::from(neox)),
            Arg::I32(kv.bsz as i32),
        ],
    )
}

/// Dynamic shared memory of `att_scores`: the query rows of one KV head's heads (f32, to
/// a 16-byte boundary), then one K tile.
fn att_scores_smem(cfg: &Config) -> usize {
    let g = cfg.n_head / cfg.n_head_kv.max(1);
    (g * cfg.head_dim * 4).div_ceil(16) * 16 + ATS_TK * cfg.head_dim * 2
}

/// Whether the split attention (`att_scores`, `attention_tiled_pre`) takes this shape:
/// whole groups of at most `ATS_MAXG` query heads per KV head, head dimension a multiple of
/// 8 up to `MAX_HEAD_DIM`, the score kernel's shared memory within `smem_limit`.
pub(super) fn split_attention_fits(cfg: &Config, smem_limit: usize) -> bool {
    cfg.n_head_kv > 0
        && cfg.n_head.is_multiple_of(cfg.n_head_kv)
        && (1..=ATS_MAXG).contains(&(cfg.n_head / cfg.n_head_kv))
        && cfg.head_dim.is_multiple_of(8)
        && (8..=MAX_HEAD_DIM).contains(&cfg.head_dim)
        && att_scores_smem(cfg) <= smem_limit
}

/// Keys per tile of the tiled attention kernel: whole KV blocks, both buffers of K and V
/// tiles within `ATT_TILE_SMEM` bytes for steps of up to [`GRAPH_MAX_ROWS`] rows (few
/// CTAs, long tiles), a quarter of that for larger steps (many CTAs per multiprocessor);
/// at most `ATT_MAX_TK` (`kernels.cu`). The tile size never changes a result.
/// With `v_only` (`attention_tiled_pre`) only V tiles take the budget.
fn attention_tile(hd: usize, bsz: usize, m: usize, limit: usize, v_only: bool) -> usize {
    let budget = if m <= GRAPH_MAX_ROWS {
        ATT_TILE_SMEM
    } else {
        ATT_TILE_SMEM / 4
    }
    .min(limit);
    let per_key = if v_only { 4 * hd } else { 8 * hd };
    let keys = (budget / per_key).min(ATT_MAX_TK);
    (keys / bsz * bsz).max(bsz)
}

/// Rows per CTA of the many-row attention kernel unless `LOCKSTEP_CUDA_ATTR_ROWS` says
/// otherwise (one warp a row).
const ATTR_ROWS_DEFAULT: usize = 8;
/// Most rows per CTA the many-row attention kernel holds (`ATTR_MAX_ROWS` in `kernels.cu`).
const ATTR_MAX_ROWS: usize = 8;

/// Rows per CTA of the many-row attention kernel: `LOCKSTEP_CUDA_ATTR_ROWS` (1 to
/// [`ATTR_MAX_ROWS`]) if set, else [`ATTR_ROWS_DEFAULT`]. Read once per process. The tile
/// size changes which rows share a CTA, never a row's arithmetic.
pub(crate) fn attr_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("LOCKSTEP_CUDA_ATTR_ROWS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|r| (1..=ATTR_MAX_ROWS).contains(r))
            .unwrap_or(ATTR_ROWS_DEFAULT)
    })
}
/// Most query heads per KV head (`ATTR_MAXG`) and key chunks per tile (`ATTR_MAXC`) the
/// many-row attention kernel holds.
const ATTR_MAXG: usize = 8;
const ATTR_MAXC: usize = 8;
/// f32 padding per K row of the many-row attention kernel's tile (`ATTR_PAD`).
const ATTR_PAD: usize = 16;
/// The many-row attention kernels by query heads per KV head (1..=8), head dimension 64.
pub(crate) const ATTENTION_ROWS_64: [&str; ATTR_MAXG] = [
    "attention_rows_64_1",
    "attention_rows_64_2",
    "attention_rows_64_3",
    "attention_rows_64_4",
    "attention_rows_64_5",
    "attention_rows_64_6",
    "attention_rows_64_7",
    "attention_rows_64_8",
];
/// The same for head dimension 128.
pub(crate) const ATTENTION_ROWS_128: [&str; ATTR_MAXG] = [
    "attention_rows_128_1",
    "attention_rows_128_2",
    "attention_rows_128_3",
    "attention_rows_128_4",
    "attention_rows_128_5",
    "attention_rows_128_6",
    "attention_rows_128_7",
    "attention_rows_128_8",
];

/// The row tiles of the many-row attention kernel for rows with block-table offsets
/// `toff` (one offset per sequence): runs of consecutive rows of one sequence, at most
/// `rows` each, as the list of tile starts followed by the row count.
pub(super) fn attention_row_tiles(toff: &[i32], rows: usize) -> Vec<usize> {
    let mut tiles = Vec::with_capacity(toff.len() + 1);
    for (r, &t) in toff.iter().enumerate() {
        let start = tiles.last().copied();
        if start.is_none_or(|s0: usize| toff[s0] != t || r - s0 == rows) {
            tiles.push(r);
        }
    }
    tiles.push(toff.len());
    tiles
}

/// The many-row attention kernel for this step, with its keys per tile, when it applies:
/// steps of more than [`GRAPH_MAX_ROWS`] rows (never captured: the tile list is not part of
/// a graph's key) averaging at least two rows per tile, head dimension 64 or 128, at most
/// [`ATTR_MAXG`] query heads per KV head.
pub(super) fn attention_rows_kernel(
    cfg: &Config,
    bsz: usize,
    m: usize,
    tiles: usize,
) -> Option<(&'static str, usize)> {
    let g = cfg.n_head.checked_div(cfg.n_head_kv)?;
    let names = match cfg.head_dim {
        64 => &ATTENTION_ROWS_64,
        128 => &ATTENTION_ROWS_128,
        _ => return None,
    };
    let name = *names.get(g.checked_sub(1)?)?;
    // Keys per tile: whole KV blocks, at least 32.
    let tk = bsz * 32usize.div_ceil(bsz);
    let ok = m > GRAPH_MAX_ROWS
        && tiles > 0
        && 2 * tiles <= m
        && cfg.n_head.is_multiple_of(cfg.n_head_kv)
        && (1..=ATTR_MAXG).contains(&g)
        && tk / bsz <= ATTR_MAXC;
    ok.then_some((name, tk))
}

/// Threads per CTA of the compact attention kernel (`ATC_THREADS` in `kernels.cu`).
const ATC_THREADS: u32 = 128;
/// Most keys per tile of the compact attention kernel (`ATC_MAX_TK` in `kernels.cu`).
const ATC_MAX_TK: usize = 128;

/// The compact attention kernel and its keys per tile for a step of `m` rows, if it takes
/// this shape: head dimension 64 or 128, KV blocks of a power of two from 16 to
/// [`ATC_MAX_TK`] positions, at most [`GRAPH_MAX_ROWS`] rows. Tiles hold [`ATC_MAX_TK`]
/// keys when every (row, query head) CTA has a multiprocessor to itself, else a third of
/// the shared memory per CTA (several CTAs per multiprocessor); whole blocks either way.
/// The tile size never changes a result.
pub(super) fn attention_compact_kernel(
    cfg: &Config,
    bsz: usize,
    m: usize,
    sm_count: usize,
    smem_limit: usize,
) -> Option<(&'static str, usize)> {
    let name = match cfg.head_dim {
        64 => "attention_compact_64",
        128 => "attention_compact_128",
        _ => return None,
    };
    let budget = if m * cfg.n_head <= sm_count {
        smem_limit
    } else {
        smem_limit / 3
    };
    let tk = (budget / (8 * cfg.head_dim)).min(ATC_MAX_TK) / bsz.max(1) * bsz;
    let ok = m <= GRAPH_MAX_ROWS
        && bsz.is_power_of_two()
        && (16..=ATC_MAX_TK).contains(&bsz)
        && tk >= bsz
        && cfg.n_head_kv > 0
        && cfg.n_head.is_multiple_of(cfg.n_head_kv);
    ok.then_some((name, tk))
}

/// Attention of the step's rows over layer `li`'s cache into `s.attn`: the many-row
/// kernel for prefill-sized steps (with `attn_rows` on), else the split, compact or tiled
/// kernel, or with `attn_tiled` off the span kernel (the same bits in every case).
fn attention(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &Scratch,
    li: usize,
    m: usize,
    opts: StepOptions,
) -> Result<(), CudaError> {
    let (tiled, rows) = (opts.attn_tiled, opts.attn_rows);
    let cfg = &model.cfg;
    let hd = cfg.head_dim;
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    // q, the cache, the output, positions, table offsets, tables: every attention kernel's
    // first arguments.
    let buffers = vec![
        Arg::Ptr(dev.ptr(&s.q, 0)),
        Arg::Ptr(dev.ptr(&kv.k[li], 0)),
        Arg::Ptr(dev.ptr(&kv.v[li], 0)),
        Arg::Ptr(dev.ptr(&s.attn, 0)),
        Arg::Ptr(dev.ptr(&s.meta, 0)),
        Arg::Ptr(dev.ptr(&s.meta, 2 * s.rows)),
        Arg::Ptr(dev.ptr(&s.meta, 5 * s.rows + 1)),
    ];
    if let Some((name, tk)) = attention_rows_kernel(cfg, kv.bsz, m, s.att_tiles).filter(|_| rows) {
        // Two f16 (K, V) buffers, the f32 K and V tiles, the scores.
        let rows = attr_rows();
        let smem =
            4 * tk * hd * 2 + tk * (hd + ATTR_PAD) * 4 + tk * hd * 4 + rows * tk * ATTR_MAXG * 4;
        let mut args = buffers;
        args.extend([
            Arg::Ptr(dev.ptr(&s.meta, 3 * s.rows)),
            Arg::I32(s.att_tiles as i32),
            Arg::I32(cfg.n_head as i32),
            Arg::I32(cfg.n_head_kv as i32),
            Arg::I32(kv.bsz as i32),
            Arg::F32(scale),
            Arg::I32(tk as i32),
        ]);
        let grid = (
            u32::try_from(s.att_tiles).unwrap_or(u32::MAX),
            u32::try_from(cfg.n_head_kv).unwrap_or(u32::MAX),
            1,
        );
        return dev.launch_smem(
            name,
            grid,
            ((rows * 32) as u32, 1, 1),
            u32::try_from(smem).unwrap_or(u32::MAX),
            &args,
        );
    }
    let buffers_len = buffers.len();
    let mut args = buffers;
    args.extend([
        Arg::I32(cfg.n_head as i32),
        Arg::I32(cfg.n_head_kv as i32),
        Arg::I32(hd as i32),
        Arg::I32(kv.bsz as i32),
        Arg::F32(scale),
    ]);
    let grid = (u32::try_from(m * cfg.n_head).unwrap_or(u32::MAX), 1, 1);
    if !tiled {
        return dev.launch("attention", grid, (ATT_THREADS, 1, 1), &args);
    }
    if s.att_split {
        // The scores over (key tile, row, KV head), then the other phases per (row, query
        // head) on V tiles.
        let rk = m * cfg.n_head_kv;
        let slices = (2 * dev.sm_count()).div_ceil(rk).clamp(1, ATS_MAX_SLICES);
        dev.launch_smem(
            "att_scores",
            (
                u32::try_from(slices).unwrap_or(u32::MAX),
                u32::try_from(rk).unwrap_or(u32::MAX),
                1,
            ),
            (ATT_THREADS, 1, 1),
            u32::try_from(att_scores_smem(cfg)).unwrap_or(u32::MAX),
            &[
                Arg::Ptr(dev.ptr(&s.q, 0)),
                Arg::Ptr(dev.ptr(&kv.k[li], 0)),
                Arg::Ptr(dev.ptr(&s.meta, 0)),
                Arg::Ptr(dev.ptr(&s.meta, 2 * s.rows)),
                Arg::Ptr(dev.ptr(&s.meta, 5 * s.rows + 1)),
                Arg::Ptr(dev.ptr(&s.meta, 4 * s.rows + 1)),
                Arg::Ptr(dev.ptr(&s.scores, 0)),
                Arg::I32(cfg.n_head as i32),
                Arg::I32(cfg.n_head_kv as i32),
                Arg::I32(hd as i32),
                Arg::I32(kv.bsz as i32),
                Arg::F32(scale),
            ],
        )?;
        let tk = attention_tile(hd, kv.bsz, m, dev.smem_limit(), true);
        args.push(Arg::I32(tk as i32));
        args.push(Arg::Ptr(dev.ptr(&s.scores, 0)));
        args.push(Arg::Ptr(dev.ptr(&s.meta, 4 * s.rows + 1)));
        return dev.launch_smem(
            "attention_tiled_pre",
            grid,
            (ATT_THREADS, 1, 1),
            u32::try_from(4 * tk * hd).unwrap_or(u32::MAX),
            &args,
        );
    }
    let compact = attention_compact_kernel(cfg, kv.bsz, m, dev.sm_count(), dev.smem_limit())
        .filter(|_| opts.attn_compact);
    if let Some((name, tk)) = compact {
        // The tiled kernel's arguments but the head dimension (the kernel's own).
        args.remove(buffers_len + 2);
        args.push(Arg::I32(tk as i32));
        return dev.launch_smem(
            name,
            grid,
            (ATC_THREADS, 1, 1),
            u32::try_from(4 * tk * hd * 2).unwrap_or(u32::MAX),
            &args,
        );
    }
    let tk = attention_tile(hd, kv.bsz, m, dev.smem_limit(), false);
    args.push(Arg::I32(tk as i32));
    dev.launch_smem(
        "attention_tiled",
        grid,
        (ATT_THREADS, 1, 1),
        u32::try_from(8 * tk * hd).unwrap_or(u32::MAX),
        &args,
    )
}

/// The matvec launches of one projection of the decode step: one when the formats allow
/// ([`matvec_kernel`]), else one per format.
fn mv_groups(ws: &[&DevMatrix]) -> Vec<Vec<usize>> {
    let formats: Vec<Format> = ws.iter().map(|w| w.format).collect();
    if matvec_kernel(&formats).is_some() {
        return vec![(0..ws.len()).collect()];
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        match groups.iter_mut().find(|g| ws[g[0]].format == w.format) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

/// Whether every decode-step product of `model` runs on the matvec kernels: every matrix
/// quantized in a format they take, q/k/v sharing an activation layout, gate and up of
/// one format and shape.
pub(super) fn matvec_ready(model: &CudaModel) -> bool {
    let ok = |w: &DevMatrix| matvec_kernel(&[w.format]).is_some();
    model.layers.iter().all(|l| {
        [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
            .iter()
            .all(|w| ok(w))
            && l.wk.format.act_layout() == l.wq.format.act_layout()
            && l.wv.format.act_layout() == l.wq.format.act_layout()
            && l.gate.format == l.up.format
            && l.gate.n == l.up.n
    }) && ok(&model.output)
}

/// Queues the forward of one row (a decode step) on the matvec kernels: each projection
/// makes its activation row itself (the RMSNorm and quantizer in its prologue), so a layer
/// is at most six launches (q/k/v, RoPE + cache write, attention, output projection + residual,
/// gate/up + SwiGLU, down + residual). The same operations as [`enqueue`], so the same bits.
fn enqueue_decode(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &mut Scratch,
    logit_rows: &[usize],
    opts: StepOptions,
) -> Result<(), CudaError> {
    let cfg = &model.cfg;
    let eps = cfg.rms_eps;
    let xp = dev.ptr(&s.x, 0);
    for (li, l) in model.layers.iter().enumerate() {
        let ws = [&l.wq, &l.wk, &l.wv];
        let outs = [dev.ptr(&s.q, 0), dev.ptr(&s.k, 0), dev.ptr(&s.v, 0)];
        let biases = [l.bq.as_ref(), l.bk.as_ref(), l.bv.as_ref()];
        for g in mv_groups(&ws) {
            let jobs: Vec<(&DevMatrix, u64, Option<&Buf<f32>>)> =
                g.iter().map(|&i| (ws[i], outs[i], biases[i])).collect();
            dev.matvec(
                &jobs,
                MvInput::Row(xp, Some((&l.attn_norm, eps))),
                Epilogue::Store,
                opts.layer_style,
            )?;
        }
        rope_kv(dev, model, kv, s, li, 1)?;
        attention(
            dev,
            model,
            kv,
            s,
            li,
            1,
            StepOptions {
                attn_rows: false,
                ..opts
            },
        )?;
        dev.matvec(
            &[(&l.wo, xp, None)],
            MvInput::Row(dev.ptr(&s.attn, 0), None),
            Epilogue::Accumulate,
            opts.layer_style,
        )?;
        dev.matvec(
            &[(&l.gate, dev.ptr(&s.gate, 0), None), (&l.up, 0, None)],
            MvInput::Row(xp, Some((&l.ffn_norm, eps))),
            Epilogue::SwiGlu,
            opts.layer_style,
        )?;
        dev.matvec(
            &[(&l.down, xp, None)],
            MvInput::Row(dev.ptr(&s.gate, 0), None),
            Epilogue::Accumulate,
            opts.layer_style,
        )?;
    }
    let e = cfg.n_embd;
    for (i, &r) in logit_rows.iter().enumerate() {
        dev.matvec(
            &[(&model.output, dev.ptr(&s.logits, i * cfg.n_vocab), None)],
            MvInput::Row(dev.ptr(&s.x, r * e), Some((&model.output_norm, eps))),
            Epilogue::Store,
            opts.head_style,
        )?;
    }
    Ok(())
}

/// A captured forward (`CUgraphExec`), replayed on the device stream.
pub(super) struct Graph(pub(super) CudaGraph);

// SAFETY: the graph is instantiated and launched only by the backend that owns it, on its
// context's stream (the context is bound before every launch); CUDA graph handles are not
// tied to the thread that made them.
unsafe impl Send for Graph {}

/// Captures [`enqueue`] into a graph (the stream is back to normal whatever happens).
#[allow(clippy::too_many_arguments)]
pub(super) fn capture(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &mut Scratch,
    m: usize,
    logit_rows: &[usize],
    opts: StepOptions,
    tail: Tail,
) -> Result<Graph, CudaError> {
    let stream = dev.stream();
    stream
        .begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .map_err(|e| CudaError::Driver(format!("begin capture: {e}")))?;
    let queued = enqueue(dev, model, kv, s, m, logit_rows, opts, tail);
    let graph = stream.end_capture(
        cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    queued?;
    match graph {
        Ok(Some(g)) => Ok(Graph(g)),
        Ok(None) => Err(CudaError::Driver("graph capture produced no graph".into())),
        Err(e) => Err(CudaError::Driver(format!("end capture: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::attention_row_tiles;

    #[test]
    fn row_tiles_split_at_sequences_and_at_the_row_limit() {
        // Sequences of 6, 1 and 3 rows (table offsets 0, 9, 4).
        let toff = [0, 0, 0, 0, 0, 0, 9, 4, 4, 4];
        assert_eq!(attention_row_tiles(&toff, 4), [0, 4, 6, 7, 10]);
        assert_eq!(attention_row_tiles(&toff, 8), [0, 6, 7, 10]);
        assert_eq!(attention_row_tiles(&toff, 2), [0, 2, 4, 6, 7, 9, 10]);
        assert_eq!(attention_row_tiles(&toff, 1), (0..=10).collect::<Vec<_>>());
        assert_eq!(attention_row_tiles(&[], 4), [0]);
    }
}
