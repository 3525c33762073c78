//! The llama/qwen2 forward on one CUDA device over a paged KV cache in device memory, and
//! [`CudaBackend`], the engine's [`ForwardBackend`] over it.
//!
//! Every step is the CPU model's step (crates/model/src/llama.rs, layers.rs) with a kernel
//! that reproduces the CPU arithmetic bit for bit, so a row's logits equal the CPU
//! backend's and never depend on the batch (G1).

use crate::CudaError;
use crate::device::{Arg, Buf, Device};
use crate::ops::{
    ArgmaxParts, DevActs, DevMatrix, Epilogue, MvInput, MvStyle, SUMMARY_STRIDE, i32_of,
    matvec_kernel, rope_tables, summary_of,
};
use backend_cpu::{BlockAllocator, DEFAULT_BLOCK_SIZE, RopeTable};
use cudarc::driver::CudaGraph;
use gguf::GgufFile;
use model::{Arch, Config};
use model::{BackendError, Batch, ForwardBackend, ForwardRow, KvSlot};
use quant::{ActLayout, Format, dequantize_row};
use std::collections::HashMap;
use std::sync::Arc;

mod kv_io;

/// Threads per attention CTA (`ATT_THREADS` in `kernels.cu`).
const ATT_THREADS: u32 = 256;
/// Block sizes the attention kernel takes (`ATT_MAX_CHUNKS`, `MAX_BSZ` in `kernels.cu`).
const ATT_BLOCK_SIZES: std::ops::RangeInclusive<usize> = 16..=256;
/// Largest head size the attention kernel takes (`MAX_HEAD_DIM`).
const MAX_HEAD_DIM: usize = 512;

struct Layer {
    attn_norm: Buf<f32>,
    wq: DevMatrix,
    wk: DevMatrix,
    wv: DevMatrix,
    wo: DevMatrix,
    bq: Option<Buf<f32>>,
    bk: Option<Buf<f32>>,
    bv: Option<Buf<f32>>,
    ffn_norm: Buf<f32>,
    gate: DevMatrix,
    up: DevMatrix,
    down: DevMatrix,
}

/// A llama/qwen2 model's weights on a CUDA device (matmul weights in their GGUF block
/// layout; the embedding table stays in the mapped file and rows are dequantized on the
/// host, exactly as the CPU model does).
pub struct CudaModel {
    dev: Device,
    gguf: Arc<GgufFile>,
    cfg: Config,
    n_ctx: usize,
    embed_format: Format,
    layers: Vec<Layer>,
    output_norm: Buf<f32>,
    output: DevMatrix,
    cos: Buf<f32>,
    sin: Buf<f32>,
    weight_bytes: usize,
    /// Whether one-row steps can run on the matvec kernels ([`matvec_ready`]).
    matvec_ready: bool,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaModel({:?}, {} layers on {:?})",
            self.cfg.arch, self.cfg.n_layer, self.dev
        )
    }
}

fn format_of(gguf: &GgufFile, name: &str) -> Result<Format, CudaError> {
    let t = gguf
        .tensor(name)
        .ok_or_else(|| CudaError::Model(format!("missing tensor {name}")))?;
    Format::from_ggml_type_id(t.ggml_type.id())
        .ok_or_else(|| CudaError::Unsupported(format!("tensor {name}: type {}", t.ggml_type)))
}

fn tensor<'a>(
    gguf: &'a GgufFile,
    name: &str,
    dims: &[usize],
) -> Result<(Format, &'a [u8]), CudaError> {
    let t = gguf
        .tensor(name)
        .ok_or_else(|| CudaError::Model(format!("missing tensor {name}")))?;
    let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if t.dims != want {
        return Err(CudaError::Model(format!(
            "tensor {name}: shape {:?}, expected {want:?}",
            t.dims
        )));
    }
    Ok((format_of(gguf, name)?, gguf.tensor_data(t)))
}

impl CudaModel {
    /// Loads `gguf` (llama or qwen2) onto `dev` with a context of `n_ctx` positions (the
    /// trained context when `None`).
    pub fn load(
        dev: Device,
        gguf: Arc<GgufFile>,
        n_ctx: Option<usize>,
    ) -> Result<CudaModel, CudaError> {
        let cfg = Config::from_gguf(&gguf).map_err(|e| CudaError::Model(e.to_string()))?;
        if !matches!(cfg.arch, Arch::Llama | Arch::Qwen2) {
            return Err(CudaError::Unsupported(format!(
                "architecture {:?} on CUDA",
                cfg.arch
            )));
        }
        if gguf.tensor("rope_freqs.weight").is_some() {
            return Err(CudaError::Unsupported(
                "per-dimension RoPE frequency factors".into(),
            ));
        }
        if !cfg.head_dim.is_multiple_of(8) {
            return Err(CudaError::Unsupported(format!(
                "head size {} (the attention kernel copies rows in 16-byte pieces: a multiple \
                 of 8)",
                cfg.head_dim
            )));
        }
        if cfg.head_dim > MAX_HEAD_DIM {
            return Err(CudaError::Unsupported(format!(
                "head size {} (at most {MAX_HEAD_DIM})",
                cfg.head_dim
            )));
        }
        let n_ctx = n_ctx.unwrap_or(cfg.n_ctx_train);
        if n_ctx == 0 || n_ctx > cfg.n_ctx_train {
            return Err(CudaError::Model(format!(
                "context length {n_ctx} must be in 1..={} (the model's trained context)",
                cfg.n_ctx_train
            )));
        }
        let (e, f, v, qd, kvd) = (cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.q_dim(), cfg.kv_dim());
        let mut weight_bytes = 0usize;
        let mut matrix = |name: &str, k: usize, n: usize| -> Result<DevMatrix, CudaError> {
            let (fmt, bytes) = tensor(&gguf, name, &[k, n])?;
            let m = dev.upload_matrix(fmt, bytes, n, k)?;
            weight_bytes += m.n_bytes();
            Ok(m)
        };
        let vector = |name: &str, len: usize| -> Result<Buf<f32>, CudaError> {
            let (fmt, bytes) = tensor(&gguf, name, &[len])?;
            let mut out = vec![0.0f32; len];
            dequantize_row(fmt, bytes, &mut out)
                .map_err(|e| CudaError::Model(format!("{name}: {e}")))?;
            dev.upload(&out)
        };
        let bias = |name: String, len: usize| -> Result<Option<Buf<f32>>, CudaError> {
            if gguf.tensor(&name).is_some() {
                vector(&name, len).map(Some)
            } else if cfg.arch.requires_qkv_bias() {
                Err(CudaError::Model(format!("missing tensor {name}")))
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |t: &str| format!("blk.{i}.{t}");
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm.weight"), e)?,
                wq: matrix(&p("attn_q.weight"), e, qd)?,
                wk: matrix(&p("attn_k.weight"), e, kvd)?,
                wv: matrix(&p("attn_v.weight"), e, kvd)?,
                wo: matrix(&p("attn_output.weight"), qd, e)?,
                bq: bias(p("attn_q.bias"), qd)?,
                bk: bias(p("attn_k.bias"), kvd)?,
                bv: bias(p("attn_v.bias"), kvd)?,
                ffn_norm: vector(&p("ffn_norm.weight"), e)?,
                gate: matrix(&p("ffn_gate.weight"), e, f)?,
                up: matrix(&p("ffn_up.weight"), e, f)?,
                down: matrix(&p("ffn_down.weight"), f, e)?,
            });
        }
        let output = if cfg.tied_embeddings {
            matrix("token_embd.weight", e, v)?
        } else {
            matrix("output.weight", e, v)?
        };
        let (embed_format, _) = tensor(&gguf, "token_embd.weight", &[e, v])?;
        let output_norm = vector("output_norm.weight", e)?;
        let table = RopeTable::new(
            f64::from(cfg.rope_base),
            cfg.n_rot,
            f64::from(cfg.rope_scaling.factor()),
            n_ctx,
        )
        .map_err(|e| CudaError::Model(format!("RoPE table: {e}")))?;
        let (c, s) = rope_tables(&table)?;
        let cos = dev.upload(&c)?;
        let sin = dev.upload(&s)?;
        let mut model = CudaModel {
            dev,
            gguf,
            cfg,
            n_ctx,
            embed_format,
            layers,
            output_norm,
            output,
            cos,
            sin,
            weight_bytes,
            matvec_ready: false,
        };
        model.matvec_ready = matvec_ready(&model);
        Ok(model)
    }

    /// The model configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Context length (positions).
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Bytes of weights a decode step must read from device memory: every matmul weight,
    /// the output head included (the embedding table stays on the host; one row per
    /// token is uploaded).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
}

/// Device scratch for one forward of up to `rows` rows.
struct Scratch {
    rows: usize,
    x: Buf<f32>,
    xn: Buf<f32>,
    q: Buf<f32>,
    k: Buf<f32>,
    v: Buf<f32>,
    attn: Buf<f32>,
    proj: Buf<f32>,
    gate: Buf<f32>,
    up: Buf<f32>,
    acts: HashMap<(ActLayout, usize), DevActs>,
    logits: Buf<f32>,
    logit_rows: usize,
    /// Greedy choices made on the device ([`CudaBackend::forward_greedy`]), one per row.
    ids: Buf<i32>,
    /// The device argmax's slice results.
    parts: ArgmaxParts,
    /// The exps of the summarized rows (as many rows as `logits`).
    ex: Buf<f32>,
    /// Row summaries ([`Device::row_summaries`]), `SUMMARY_STRIDE` values a row.
    sums: Buf<f64>,
    /// Row metadata, uploaded in one copy: positions (`rows`), the physical block each row
    /// writes (`rows`), each row's offset into the block tables (`rows`), the row tiles of
    /// the many-row attention kernel (`rows + 1`: tile starts, then the row count), then the
    /// tables.
    meta: Buf<i32>,
    /// Row tiles of this step for the many-row attention kernel (0: not used this step).
    att_tiles: usize,
    generation: u64,
}

/// Source of distinct [`Scratch::generation`] values.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn next_generation() -> u64 {
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Scratch {
    fn new(dev: &Device, cfg: &Config, rows: usize) -> Result<Scratch, CudaError> {
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
            meta: dev.zeros(4 * rows + 64)?,
            att_tiles: 0,
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

/// One sequence's KV blocks on the device.
#[derive(Clone, Debug, Default)]
struct Seq {
    blocks: Vec<u32>,
    len: usize,
}

/// The paged KV cache in device memory: per layer K and V, each
/// `[blocks][n_kv_head][block_size][head_dim]` f16, with a refcounting block allocator
/// (prefix sharing by fork, copy-on-write, copy-free truncation).
struct DevKv {
    k: Vec<Buf<u16>>,
    v: Vec<Buf<u16>>,
    alloc: BlockAllocator,
    bsz: usize,
    per_block: usize,
}

/// The engine's backend on a CUDA device: the [`CudaModel`] plus its paged KV cache.
pub struct CudaBackend {
    model: CudaModel,
    kv: Option<DevKv>,
    seqs: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    scratch: Option<Scratch>,
    use_graphs: bool,
    opts: StepOptions,
    /// Captured forwards by shape, least recently used first.
    graphs: Vec<(GraphKey, Graph)>,
    /// Shapes seen once (captured the next time they come).
    warm_keys: Vec<GraphKey>,
    /// Whether the engine gets row summaries ([`CudaBackend::set_summaries`]).
    summaries: bool,
    /// Logit rows the last `forward_summaries` left on the device (0 after any other
    /// forward).
    summarized: usize,
}

/// Which kernels a step runs on. Every choice computes the same bits; the older ones stay
/// selectable to measure what each newer one buys (`cuda_bench --ab`), from the environment
/// (`LOCKSTEP_CUDA_MATVEC=0|1|2|3`, `LOCKSTEP_CUDA_ATT_TILED=0`, `LOCKSTEP_CUDA_ATT_ROWS=0`) or
/// [`CudaBackend::set_step_options`]; [`StepOptions::for_model`] is the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepOptions {
    /// One-row steps on the matvec kernels (the norm and quantizer in each projection's
    /// prologue), instead of the general matmul with separate norm and quantize launches.
    pub matvec: bool,
    /// How the matvec kernels spread the layers' matrices.
    pub layer_style: MvStyle,
    /// How the matvec kernels spread the output head.
    pub head_style: MvStyle,
    /// Attention through the tiled kernel (K and V staged together, the next tile in
    /// flight) instead of the span kernel.
    pub attn_tiled: bool,
    /// Steps of many rows (prefill chunks) through the many-row attention kernel (a CTA per
    /// tile of rows and KV head) instead of a CTA per row and query head.
    pub attn_rows: bool,
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions::matvec_mode(3)
    }
}

/// Weight bytes per layer from which one-row steps run on the matvec kernels by default.
/// Measured on the H200 (2026-12-04, tg128, same call): the qwen2.5-1.5b shape (~28 MB per
/// layer) decodes in 2.03 ms/token on them against 2.31 on the general kernels; the 0.5b
/// (~10 MB per layer) and smollm2 (~2 MB) shapes are faster on the general kernels (1.43 vs
/// 1.87 and 1.27 vs 1.70 ms/token): their matrices are too small to amortize each CTA's
/// norm-and-quantize prologue.
const MATVEC_MIN_LAYER_BYTES: usize = 16 << 20;

impl StepOptions {
    /// The matvec choice `mode` (as `LOCKSTEP_CUDA_MATVEC`): 0 the general kernels, 1 block-
    /// parallel matvec throughout, 2 row-group matvec throughout, 3 (and anything else)
    /// block-parallel for the layers and row groups for the output head; tiled attention.
    pub fn matvec_mode(mode: u32) -> StepOptions {
        let (layer_style, head_style) = match mode {
            1 => (MvStyle::Blocks, MvStyle::Blocks),
            2 => (MvStyle::Rows, MvStyle::Rows),
            _ => (MvStyle::Blocks, MvStyle::Rows),
        };
        StepOptions {
            matvec: mode != 0,
            layer_style,
            head_style,
            attn_tiled: true,
            attn_rows: true,
        }
    }

    /// The choice for `model`: matvec mode 3 when its layers hold at least
    /// `MATVEC_MIN_LAYER_BYTES` of weights each, else mode 0 (the general kernels), as
    /// `LOCKSTEP_CUDA_MATVEC` and `LOCKSTEP_CUDA_ATT_TILED=0` change it.
    pub fn for_model(model: &CudaModel) -> StepOptions {
        let layers = model.cfg.n_layer.max(1);
        let per_layer = model.weight_bytes.saturating_sub(model.output.n_bytes()) / layers;
        let auto = if per_layer >= MATVEC_MIN_LAYER_BYTES {
            3
        } else {
            0
        };
        let mode = std::env::var("LOCKSTEP_CUDA_MATVEC")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(auto);
        let mut o = StepOptions::matvec_mode(mode);
        o.attn_tiled = std::env::var("LOCKSTEP_CUDA_ATT_TILED").map_or(true, |v| v != "0");
        o.attn_rows = std::env::var("LOCKSTEP_CUDA_ATT_ROWS").map_or(true, |v| v != "0");
        o
    }
}

/// Bytes of shared memory the tiled attention kernel stages K and V through for steps of
/// up to [`GRAPH_MAX_ROWS`] rows (two buffers of a K and a V tile).
const ATT_TILE_SMEM: usize = 128 * 1024;
/// Most keys per attention tile (`ATT_MAX_TK` in `kernels.cu`).
const ATT_MAX_TK: usize = 256;

/// Steps of at most this many rows run from captured graphs (decode, verify blocks).
const GRAPH_MAX_ROWS: usize = 16;
/// Captured shapes kept per backend.
const GRAPH_CACHE: usize = 8;

/// What a captured forward depends on: rows, the rows that want logits, the generation of
/// the scratch buffers (bumped whenever one is reallocated), and whether it ends with the
/// device argmax or the row summaries.
type GraphKey = (usize, Vec<usize>, u64, Tail);

/// What a forward leaves on the device after the logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tail {
    /// Nothing more (the logits are read back).
    Logits,
    /// Each logit row's argmax ([`CudaBackend::forward_greedy`]).
    Argmax,
    /// Each logit row's [`sampling::RowSummary`] parts (`forward_summaries`).
    Summary,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({:?})", self.model)
    }
}

fn be(e: CudaError) -> BackendError {
    BackendError::device(e)
}

impl CudaBackend {
    /// Wraps a loaded model (the KV pool is made by [`ForwardBackend::init_kv`]).
    pub fn new(model: CudaModel) -> CudaBackend {
        let opts = StepOptions::for_model(&model);
        CudaBackend {
            model,
            kv: None,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            scratch: None,
            use_graphs: std::env::var("LOCKSTEP_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            opts,
            graphs: Vec::new(),
            warm_keys: Vec::new(),
            summaries: std::env::var("LOCKSTEP_CUDA_SUMMARIES").is_ok_and(|v| v == "1"),
            summarized: 0,
        }
    }

    /// Whether the engine chooses from row summaries made on the device
    /// ([`ForwardBackend::forward_summaries`]: plain greedy rows never cross to the host)
    /// or reads every logit row back (off by default until the summary kernels have run
    /// their oracle tests on a GPU; `LOCKSTEP_CUDA_SUMMARIES=1` turns them on). The choices
    /// are the same either way.
    pub fn set_summaries(&mut self, on: bool) {
        self.summaries = on;
    }

    /// Turns graph capture and replay on or off (on by default, or as
    /// `LOCKSTEP_CUDA_GRAPHS=0` says); off runs every step's kernels one by one, which
    /// `cuda_bench --profile` needs to time them. Results are the same either way.
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        self.graphs.clear();
        self.warm_keys.clear();
    }

    /// Chooses the kernels of a step (see [`StepOptions`]); results are the same either way.
    pub fn set_step_options(&mut self, opts: StepOptions) {
        self.opts = opts;
        self.graphs.clear();
        self.warm_keys.clear();
    }

    /// The kernel choices in use.
    pub fn step_options(&self) -> StepOptions {
        self.opts
    }

    /// The model.
    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    fn seq(&self, slot: KvSlot) -> Result<&Seq, BackendError> {
        self.seqs
            .get(slot.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(BackendError::UnknownSlot(slot.0))
    }

    fn kv_ref(&self) -> Result<&DevKv, BackendError> {
        self.kv.as_ref().ok_or(BackendError::NoKvPool)
    }

    fn truncate_seq(kv: &mut DevKv, seq: &mut Seq, len: usize) {
        if len >= seq.len {
            return;
        }
        let keep = len.div_ceil(kv.bsz);
        for b in seq.blocks.drain(keep.min(seq.blocks.len())..) {
            kv.alloc.release(b);
        }
        seq.len = len;
    }

    /// Truncates to `from`, reserves up to `to`, copies shared blocks at or after `from`.
    fn prepare_seq(
        dev: &Device,
        kv: &mut DevKv,
        seq: &mut Seq,
        from: usize,
        to: usize,
    ) -> Result<(), BackendError> {
        Self::truncate_seq(kv, seq, from);
        if to > seq.len {
            let need = to.div_ceil(kv.bsz);
            let more = need.saturating_sub(seq.blocks.len());
            if more > kv.alloc.free_count() {
                return Err(BackendError::OutOfBlocks {
                    needed: more,
                    free: kv.alloc.free_count(),
                });
            }
            while seq.blocks.len() < need {
                let b = kv
                    .alloc
                    .alloc()
                    .ok_or(BackendError::OutOfBlocks { needed: 1, free: 0 })?;
                seq.blocks.push(b);
            }
            seq.len = to;
        }
        let first = from / kv.bsz;
        let shared = seq
            .blocks
            .iter()
            .skip(first)
            .filter(|&&b| kv.alloc.refcount(b) > 1)
            .count();
        if shared > kv.alloc.free_count() {
            return Err(BackendError::OutOfBlocks {
                needed: shared,
                free: kv.alloc.free_count(),
            });
        }
        for i in first..seq.blocks.len() {
            let old = seq.blocks[i];
            if kv.alloc.refcount(old) <= 1 {
                continue;
            }
            let new = kv
                .alloc
                .alloc()
                .ok_or(BackendError::OutOfBlocks { needed: 1, free: 0 })?;
            let pb = kv.per_block;
            for buf in kv.k.iter().chain(kv.v.iter()) {
                dev.launch(
                    "copy_u16",
                    (u32::try_from(pb.div_ceil(256)).unwrap_or(u32::MAX), 1, 1),
                    (256, 1, 1),
                    &[
                        Arg::Ptr(dev.ptr(buf, 0)),
                        Arg::I64(old as i64 * pb as i64),
                        Arg::I64(new as i64 * pb as i64),
                        Arg::I64(pb as i64),
                    ],
                )
                .map_err(be)?;
            }
            kv.alloc.release(old);
            seq.blocks[i] = new;
        }
        Ok(())
    }

    /// Runs the forward of `rows` and leaves the logits of the rows that want them in the
    /// scratch's logit buffer (row order), with `greedy` also each such row's argmax in the
    /// scratch's ids; returns how many rows that is.
    fn run_forward(&mut self, rows: &[ForwardRow], tail: Tail) -> Result<usize, BackendError> {
        let opts = self.opts;
        let cfg = self.model.cfg.clone();
        let m = rows.len();
        let e = cfg.n_embd;
        // Validate: consecutive positions per sequence, starting at most at its length.
        let batch = Batch::from_rows(rows, cfg.n_vocab, self.model.n_ctx)?;
        let (order, spans) = (&batch.slots, &batch.spans);
        for (&slot, &(first, _)) in order.iter().zip(spans) {
            let len = self.seq(slot)?.len;
            if first > len {
                return Err(BackendError::Invalid(format!(
                    "sequence {}: first row is at position {first} but only positions 0..{len} \
                     are cached",
                    slot.0
                )));
            }
        }
        let dev = &self.model.dev;
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        for (&slot, &(first, last)) in order.iter().zip(spans) {
            let seq = self.seqs[slot.0 as usize]
                .as_mut()
                .ok_or(BackendError::UnknownSlot(slot.0))?;
            Self::prepare_seq(dev, kv, seq, first, last + 1)?;
        }
        // Row metadata: positions, the physical block each row writes, block tables.
        let bsz = kv.bsz;
        let mut tables: Vec<i32> = Vec::new();
        let mut seq_off: Vec<i32> = Vec::with_capacity(order.len());
        for &slot in order {
            seq_off.push(i32_of("table offset", tables.len()).map_err(be)?);
            let seq = self.seqs[slot.0 as usize]
                .as_ref()
                .ok_or(BackendError::UnknownSlot(slot.0))?;
            tables.extend(seq.blocks.iter().map(|&b| b as i32));
        }
        let mut pos = Vec::with_capacity(m);
        let mut phys = Vec::with_capacity(m);
        let mut toff = Vec::with_capacity(m);
        for (r, br) in rows.iter().zip(&batch.rows) {
            let j = br.seq;
            let seq = self.seqs[r.slot.0 as usize]
                .as_ref()
                .ok_or(BackendError::UnknownSlot(r.slot.0))?;
            pos.push(r.pos as i32);
            phys.push(seq.blocks[r.pos / bsz] as i32);
            toff.push(seq_off[j]);
        }
        let logit_rows: Vec<usize> = (0..m).filter(|&i| rows[i].wants_logits).collect();
        if m == 0 {
            return Ok(0);
        }
        // Scratch.
        if self.scratch.as_ref().is_none_or(|s| s.rows < m) {
            self.scratch = None;
            self.scratch = Some(Scratch::new(dev, &cfg, m.next_power_of_two()).map_err(be)?);
        }
        let s = self
            .scratch
            .as_mut()
            .ok_or_else(|| BackendError::Internal("scratch".into()))?;
        let cap_rows = s.rows;
        let tables_at = 4 * cap_rows + 1;
        if s.meta.len() < tables_at + tables.len() {
            s.meta = dev
                .zeros(tables_at + tables.len().next_power_of_two())
                .map_err(be)?;
            s.generation = next_generation();
        }
        let tiles = attention_row_tiles(&toff);
        s.att_tiles = tiles.len() - 1;
        let mut meta = vec![0i32; tables_at + tables.len()];
        meta[..m].copy_from_slice(&pos);
        meta[cap_rows..cap_rows + m].copy_from_slice(&phys);
        meta[2 * cap_rows..2 * cap_rows + m].copy_from_slice(&toff);
        for (i, &t) in tiles.iter().enumerate() {
            meta[3 * cap_rows + i] = i32_of("row tile", t).map_err(be)?;
        }
        meta[tables_at..].copy_from_slice(&tables);
        dev.write(&meta, &mut s.meta).map_err(be)?;
        // Embedding rows, dequantized on the host from the mapped file.
        let model = &self.model;
        let embed = model
            .gguf
            .tensor("token_embd.weight")
            .ok_or_else(|| BackendError::Internal("token_embd.weight".into()))?;
        let data = model.gguf.tensor_data(embed);
        let rb = model
            .embed_format
            .row_bytes(e)
            .map_err(BackendError::model)?;
        let mut xh = vec![0.0f32; m * e];
        for (i, r) in rows.iter().enumerate() {
            let t = r.token as usize;
            dequantize_row(
                model.embed_format,
                &data[t * rb..(t + 1) * rb],
                &mut xh[i * e..(i + 1) * e],
            )
            .map_err(BackendError::model)?;
        }
        dev.write(&xh, &mut s.x).map_err(be)?;
        let nl = logit_rows.len();
        if s.logit_rows < nl {
            s.logits = dev.zeros(nl * cfg.n_vocab).map_err(be)?;
            s.ex = dev.zeros(nl * cfg.n_vocab).map_err(be)?;
            s.logit_rows = nl;
            s.generation = next_generation();
        }
        // Steps of up to GRAPH_MAX_ROWS rows (decode and verify blocks) replay a CUDA graph
        // of the whole forward once one eager step of the same shape has run: the same
        // kernels and arguments, one launch. A few shapes are kept, the least recently
        // used dropped first.
        let key = (m, logit_rows.clone(), s.generation, tail);
        let kv = &*kv;
        if m <= GRAPH_MAX_ROWS && self.use_graphs {
            if let Some(i) = self.graphs.iter().position(|(k, _)| *k == key) {
                let entry = self.graphs.remove(i);
                entry
                    .1
                    .0
                    .launch()
                    .map_err(|e| be(CudaError::Driver(format!("graph launch: {e}"))))?;
                self.graphs.push(entry);
            } else if let Some(i) = self.warm_keys.iter().position(|k| *k == key) {
                self.warm_keys.remove(i);
                if self.graphs.len() >= GRAPH_CACHE {
                    self.graphs.remove(0);
                }
                let g = capture(dev, model, kv, s, m, &logit_rows, opts, tail).map_err(be)?;
                g.0.launch()
                    .map_err(|e| be(CudaError::Driver(format!("graph launch: {e}"))))?;
                self.graphs.push((key, g));
            } else {
                enqueue(dev, model, kv, s, m, &logit_rows, opts, tail).map_err(be)?;
                if self.warm_keys.len() >= GRAPH_CACHE {
                    self.warm_keys.remove(0);
                }
                self.warm_keys.push(key);
            }
        } else {
            enqueue(dev, model, kv, s, m, &logit_rows, opts, tail).map_err(be)?;
        }
        Ok(nl)
    }

    /// Greedy decoding on the device: runs the forward of `rows` and returns, for each row
    /// that wants logits (in row order), the id of its largest logit (ties to the lowest id;
    /// NaN never chosen), the choice the engine's greedy sampler makes on the same logits.
    /// Only the ids cross to the host.
    pub fn forward_greedy(&mut self, rows: &[ForwardRow]) -> Result<Vec<u32>, BackendError> {
        self.summarized = 0;
        let nl = self.run_forward(rows, Tail::Argmax)?;
        let dev = &self.model.dev;
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
        if nl == 0 {
            dev.sync().map_err(be)?;
            return Ok(Vec::new());
        }
        let ids = dev.read(&s.ids, nl).map_err(be)?;
        Ok(ids.into_iter().map(|v| v as u32).collect())
    }
}

/// Queues the whole forward of `m` rows (inputs already in `s`) on the device stream:
/// every layer, then the output head of `logit_rows` into `s.logits`. Allocates nothing
/// once `s` has served a forward of the same shape, so it can be captured in a graph.
#[allow(clippy::too_many_arguments)]
fn enqueue(
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
        attention(dev, model, kv, s, li, m, opts.attn_tiled, opts.attn_rows)?;
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

/// Keys per tile of the tiled attention kernel: whole KV blocks, both buffers of K and V
/// tiles within `ATT_TILE_SMEM` bytes for steps of up to [`GRAPH_MAX_ROWS`] rows (few
/// CTAs, long tiles), a quarter of that for larger steps (many CTAs per multiprocessor);
/// at most `ATT_MAX_TK` (`kernels.cu`). The tile size never changes a result.
fn attention_tile(hd: usize, bsz: usize, m: usize, limit: usize) -> usize {
    let budget = if m <= GRAPH_MAX_ROWS {
        ATT_TILE_SMEM
    } else {
        ATT_TILE_SMEM / 4
    }
    .min(limit);
    let keys = (budget / (8 * hd)).min(ATT_MAX_TK);
    (keys / bsz * bsz).max(bsz)
}

/// Rows per CTA of the many-row attention kernel (`ATTR_ROWS` in `kernels.cu`).
const ATTR_ROWS: usize = 4;
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
/// [`ATTR_ROWS`] each, as the list of tile starts followed by the row count.
fn attention_row_tiles(toff: &[i32]) -> Vec<usize> {
    let mut tiles = Vec::with_capacity(toff.len() + 1);
    for (r, &t) in toff.iter().enumerate() {
        let start = tiles.last().copied();
        if start.is_none_or(|s0: usize| toff[s0] != t || r - s0 == ATTR_ROWS) {
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
fn attention_rows_kernel(
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

/// Attention of the step's rows over layer `li`'s cache into `s.attn`: the many-row
/// kernel for prefill-sized steps (with `rows` on), else the tiled kernel, or with `tiled`
/// off the span kernel (the same bits in every case).
#[allow(clippy::too_many_arguments)]
fn attention(
    dev: &Device,
    model: &CudaModel,
    kv: &DevKv,
    s: &Scratch,
    li: usize,
    m: usize,
    tiled: bool,
    rows: bool,
) -> Result<(), CudaError> {
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
        Arg::Ptr(dev.ptr(&s.meta, 4 * s.rows + 1)),
    ];
    if let Some((name, tk)) = attention_rows_kernel(cfg, kv.bsz, m, s.att_tiles).filter(|_| rows) {
        // Two f16 (K, V) buffers, the f32 K and V tiles, the scores.
        let smem = 4 * tk * hd * 2
            + tk * (hd + ATTR_PAD) * 4
            + tk * hd * 4
            + ATTR_ROWS * tk * ATTR_MAXG * 4;
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
            ((ATTR_ROWS * 32) as u32, 1, 1),
            u32::try_from(smem).unwrap_or(u32::MAX),
            &args,
        );
    }
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
    let tk = attention_tile(hd, kv.bsz, m, dev.smem_limit());
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
fn matvec_ready(model: &CudaModel) -> bool {
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
        attention(dev, model, kv, s, li, 1, opts.attn_tiled, false)?;
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
struct Graph(CudaGraph);

// SAFETY: the graph is instantiated and launched only by the backend that owns it, on its
// context's stream (the context is bound before every launch); CUDA graph handles are not
// tied to the thread that made them.
unsafe impl Send for Graph {}

/// Captures [`enqueue`] into a graph (the stream is back to normal whatever happens).
#[allow(clippy::too_many_arguments)]
fn capture(
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

impl ForwardBackend for CudaBackend {
    fn n_vocab(&self) -> usize {
        self.model.cfg.n_vocab
    }

    fn max_context(&self) -> usize {
        self.model.n_ctx
    }

    fn init_kv(&mut self, max_tokens: usize) -> Result<(), BackendError> {
        self.graphs.clear();
        self.warm_keys.clear();
        self.seqs.clear();
        self.free_slots.clear();
        self.kv = None;
        let cfg = &self.model.cfg;
        let bsz = DEFAULT_BLOCK_SIZE;
        if !ATT_BLOCK_SIZES.contains(&bsz) {
            return Err(BackendError::Unsupported(format!(
                "KV block size {bsz} outside the CUDA attention kernel's {ATT_BLOCK_SIZES:?}"
            )));
        }
        let n_blocks = max_tokens.div_ceil(bsz).max(1);
        let per_block = cfg.n_head_kv * bsz * cfg.head_dim;
        let mut k = Vec::with_capacity(cfg.n_layer);
        let mut v = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            k.push(
                self.model
                    .dev
                    .zeros::<u16>(n_blocks * per_block)
                    .map_err(be)?,
            );
            v.push(
                self.model
                    .dev
                    .zeros::<u16>(n_blocks * per_block)
                    .map_err(be)?,
            );
        }
        self.kv = Some(DevKv {
            k,
            v,
            alloc: BlockAllocator::new(n_blocks),
            bsz,
            per_block,
        });
        Ok(())
    }

    fn block_size(&self) -> usize {
        self.kv.as_ref().map_or(DEFAULT_BLOCK_SIZE, |kv| kv.bsz)
    }

    fn total_blocks(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.alloc.capacity())
    }

    fn free_blocks(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.alloc.free_count())
    }

    fn kv_new(&mut self) -> KvSlot {
        if self.kv.is_none() {
            return KvSlot(u32::MAX);
        }
        match self.free_slots.pop() {
            Some(i) => {
                self.seqs[i as usize] = Some(Seq::default());
                KvSlot(i)
            }
            None => {
                self.seqs.push(Some(Seq::default()));
                KvSlot((self.seqs.len() - 1) as u32)
            }
        }
    }

    fn kv_fork(&mut self, src: KvSlot, len: usize) -> Result<KvSlot, BackendError> {
        let mut seq = self.seq(src)?.clone();
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        for &b in &seq.blocks {
            kv.alloc.retain(b);
        }
        Self::truncate_seq(kv, &mut seq, len);
        let slot = self.kv_new();
        self.seqs[slot.0 as usize] = Some(seq);
        Ok(slot)
    }

    fn kv_len(&self, slot: KvSlot) -> usize {
        self.seq(slot).map_or(0, |s| s.len)
    }

    fn kv_prepare(&mut self, slot: KvSlot, from: usize, to: usize) -> Result<(), BackendError> {
        let needed = self.kv_blocks_needed(slot, from, to);
        let free = self.free_blocks();
        if needed > free {
            return Err(BackendError::OutOfBlocks { needed, free });
        }
        self.seq(slot)?;
        let kv = self.kv.as_mut().ok_or(BackendError::NoKvPool)?;
        let seq = self.seqs[slot.0 as usize]
            .as_mut()
            .ok_or(BackendError::UnknownSlot(slot.0))?;
        Self::prepare_seq(&self.model.dev, kv, seq, from, to)
    }

    fn kv_blocks_needed(&self, slot: KvSlot, from: usize, to: usize) -> usize {
        let (Ok(seq), Ok(kv)) = (self.seq(slot), self.kv_ref()) else {
            return 0;
        };
        let bs = kv.bsz;
        let kept = if from < seq.len {
            from.div_ceil(bs).min(seq.blocks.len())
        } else {
            seq.blocks.len()
        };
        let new = to.div_ceil(bs).saturating_sub(kept);
        let shared = seq
            .blocks
            .get(from / bs..kept)
            .unwrap_or_default()
            .iter()
            .filter(|&&b| kv.alloc.refcount(b) > 1)
            .count();
        new + shared
    }

    fn kv_truncate(&mut self, slot: KvSlot, len: usize) {
        if let (Some(kv), Some(Some(seq))) = (self.kv.as_mut(), self.seqs.get_mut(slot.0 as usize))
        {
            Self::truncate_seq(kv, seq, len);
        }
    }

    fn kv_release(&mut self, slot: KvSlot) {
        if let Some(seq) = self.seqs.get_mut(slot.0 as usize).and_then(Option::take) {
            if let Some(kv) = self.kv.as_mut() {
                let mut seq = seq;
                Self::truncate_seq(kv, &mut seq, 0);
            }
            self.free_slots.push(slot.0);
        }
    }

    fn kv_block_format(&self) -> Option<String> {
        self.kv_layout()
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv_bytes_per_block()
    }

    fn kv_export_block(
        &self,
        slot: KvSlot,
        block: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        self.export_kv_block(slot, block, out)
    }

    fn kv_restore_block(&mut self, slot: KvSlot, data: &[u8]) -> Result<(), BackendError> {
        self.restore_kv_block(slot, data)
    }

    fn forward(&mut self, rows: &[ForwardRow], logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.summarized = 0;
        let nl = self.run_forward(rows, Tail::Logits)?;
        let dev = &self.model.dev;
        logits.clear();
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
        if nl == 0 {
            return dev.sync().map_err(be);
        }
        logits.resize(nl * self.model.cfg.n_vocab, 0.0);
        dev.read_into(&s.logits, 0, logits).map_err(be)
    }

    fn summarizes(&self) -> bool {
        self.summaries
    }

    fn forward_summaries(
        &mut self,
        rows: &[ForwardRow],
        summaries: &mut Vec<sampling::RowSummary>,
    ) -> Result<(), BackendError> {
        summaries.clear();
        self.summarized = 0;
        let nl = self.run_forward(rows, Tail::Summary)?;
        let dev = &self.model.dev;
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
        if nl == 0 {
            return dev.sync().map_err(be);
        }
        let raw = dev.read(&s.sums, nl * SUMMARY_STRIDE).map_err(be)?;
        summaries.extend(raw.chunks_exact(SUMMARY_STRIDE).map(summary_of));
        self.summarized = nl;
        Ok(())
    }

    fn logit_row(&mut self, i: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        let n = self.model.cfg.n_vocab;
        let s = match self.scratch.as_ref() {
            Some(s) if i < self.summarized => s,
            _ => {
                return Err(BackendError::Invalid(format!(
                    "no logit row {i} in the last forward ({} rows)",
                    self.summarized
                )));
            }
        };
        out.resize(n, 0.0);
        self.model.dev.read_into(&s.logits, i * n, out).map_err(be)
    }
}

/// Opens CUDA device `ordinal` and loads the model onto it, ready for the engine.
pub fn load_backend(
    ordinal: usize,
    gguf: Arc<GgufFile>,
    n_ctx: Option<usize>,
) -> Result<CudaBackend, CudaError> {
    let dev = Device::new(ordinal)?;
    Ok(CudaBackend::new(CudaModel::load(dev, gguf, n_ctx)?))
}
