//! The llama/qwen2 forward on one CUDA device over a paged KV cache in device memory, and
//! [`CudaBackend`], the engine's [`ForwardBackend`] over it.
//!
//! Every step is the CPU model's step (crates/model/src/llama.rs, layers.rs) with a kernel
//! that reproduces the CPU arithmetic bit for bit, so a row's logits equal the CPU
//! backend's and never depend on the batch (G1).
//!
//! Layout: `load` (the model's weights on the device), `enqueue` (a forward's launches on
//! the device stream and their capture as graphs), `kv_io` (saving and restoring KV
//! blocks); this file is the backend: the paged KV cache, kernel choices, the graph cache
//! and the engine's contract.

use crate::CudaError;
use crate::device::{Arg, Buf, Device};
use crate::ops::{MvStyle, SUMMARY_STRIDE, i32_of, summary_of};
use backend_cpu::{BlockAllocator, DEFAULT_BLOCK_SIZE};
use enqueue::{
    GRAPH_CACHE, GRAPH_MAX_ROWS, Graph, GraphKey, SPLIT_SCORES_MAX, Scratch, Tail,
    attention_row_tiles, attention_rows_kernel, attr_rows, capture, enqueue, next_generation,
    split_attention_fits,
};
use gguf::GgufFile;
use model::{BackendError, Batch, ForwardBackend, ForwardRow, KvSlot};
use quant::dequantize_row;
use std::sync::Arc;

mod enqueue;
mod kv_io;
mod load;

pub(crate) use enqueue::{ATTENTION_ROWS_64, ATTENTION_ROWS_128};
pub use load::CudaModel;

/// Block sizes the attention kernel takes (`ATT_MAX_CHUNKS`, `MAX_BSZ` in `kernels.cu`).
const ATT_BLOCK_SIZES: std::ops::RangeInclusive<usize> = 16..=256;

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
    /// Row summaries for the engine ([`CudaBackend::set_summaries`]): always, never, or
    /// (`None`, the default) for steps of at least [`SUMMARY_MIN_ROWS`] plain greedy rows.
    summaries: Option<bool>,
    /// Logit rows the last `forward_summaries` left on the device (0 after any other
    /// forward).
    summarized: usize,
}

/// The fewest plain greedy logit rows of a step for which the engine takes row summaries
/// unless [`CudaBackend::set_summaries`] says always or never: one. With the normaliser's
/// 256 lanes summed by 256 threads a row, summarizing even one 151,936-value row costs less
/// than reading it back (tg128 on the 1.5B shape, H100: 472.4 / 470.3 t/s summarized
/// against 453.6 / 450.2 read back; with 8 lanes the summary was the dearer one).
pub const SUMMARY_MIN_ROWS: usize = 1;

/// Which kernels a step runs on. Every choice computes the same bits; the older ones stay
/// selectable to measure what each newer one buys (`cuda_bench --ab`), from the environment
/// (`LOCKSTEP_CUDA_MATVEC=0|1|2|3|4|5`, `LOCKSTEP_CUDA_ATT_TILED=0`, `LOCKSTEP_CUDA_ATT_ROWS=0`) or
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
    /// With `attn_tiled`: steps of up to 16 rows whose attention is not split take the
    /// compact kernel (head dimension 64 or 128 fixed at compile time, 128 threads, three
    /// barriers a tile) where the shape allows, instead of the general tiled kernel.
    pub attn_compact: bool,
    /// Steps of many rows (prefill chunks) through the many-row attention kernel (a CTA per
    /// tile of rows and KV head) instead of a CTA per row and query head.
    pub attn_rows: bool,
    /// With `attn_tiled`: the scores first, spread over the device (a CTA per key tile,
    /// row and KV head, the query heads of a KV head sharing each K tile), then the tiled
    /// kernel's other phases on V tiles alone; otherwise each (row, query head) CTA computes
    /// its own scores. The same bits either way.
    pub attn_split: bool,
    /// With `attn_split`: split only steps whose longest row attends to at least this many
    /// keys (below it the extra launch costs more than it saves).
    pub attn_split_min_keys: usize,
}

/// The default [`StepOptions::attn_split_min_keys`]. Measured on the H200 (2026-12-07,
/// 1.5B shape, one decode step, split / one kernel): 0.82× at 64 keys, 0.98× at 512,
/// 1.09× at 1,024, 1.22× at 2,048, 1.29× at 4,000; against the compact kernel (H100,
/// eleventh session, speed-up of the split): 0.78× at 64, 1.03× at 512, 1.17× at 1,024,
/// 1.40× at 2,048, 1.58× at 4,000; with f16 conversions in groups (H100, twelfth session,
/// split / compact ms): 2.011 / 1.469 at 64, 2.431 / 2.013 at 512, 2.821 / 2.652 at 1,024,
/// 3.656 / 3.847 at 2,048, 5.200 / 6.132 at 4,000, so the split now pays from 2,048 keys.
pub const ATT_SPLIT_MIN_KEYS: usize = 2048;

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
    /// parallel matvec throughout, 2 row-group matvec throughout, 4 tensor-core matvec
    /// throughout, 5 tensor-core matvec for the layers and row groups for the output head,
    /// 3 (and anything else) block-parallel for the layers and row groups for the output
    /// head; tiled attention. The tensor-core kernels cover Q4_K and Q6_K matrices; others
    /// take the block-parallel ones.
    pub fn matvec_mode(mode: u32) -> StepOptions {
        let (layer_style, head_style) = match mode {
            1 => (MvStyle::Blocks, MvStyle::Blocks),
            2 => (MvStyle::Rows, MvStyle::Rows),
            4 => (MvStyle::Tensor, MvStyle::Tensor),
            5 => (MvStyle::Tensor, MvStyle::Rows),
            _ => (MvStyle::Blocks, MvStyle::Rows),
        };
        StepOptions {
            matvec: mode != 0,
            layer_style,
            head_style,
            attn_tiled: true,
            attn_compact: true,
            attn_rows: true,
            attn_split: true,
            attn_split_min_keys: ATT_SPLIT_MIN_KEYS,
        }
    }

    /// The choice for `model`: matvec mode 3 when its layers hold at least
    /// `MATVEC_MIN_LAYER_BYTES` of weights each, else mode 0 (the general kernels), as
    /// `LOCKSTEP_CUDA_MATVEC`, `LOCKSTEP_CUDA_ATT_TILED=0`, `LOCKSTEP_CUDA_ATT_COMPACT=0`,
    /// `LOCKSTEP_CUDA_ATT_ROWS=0`, `LOCKSTEP_CUDA_ATT_SPLIT=0` and
    /// `LOCKSTEP_CUDA_ATT_SPLIT_MIN=KEYS` change it.
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
        o.attn_compact = std::env::var("LOCKSTEP_CUDA_ATT_COMPACT").map_or(true, |v| v != "0");
        o.attn_rows = std::env::var("LOCKSTEP_CUDA_ATT_ROWS").map_or(true, |v| v != "0");
        o.attn_split = std::env::var("LOCKSTEP_CUDA_ATT_SPLIT").map_or(true, |v| v != "0");
        if let Some(n) = std::env::var("LOCKSTEP_CUDA_ATT_SPLIT_MIN")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            o.attn_split_min_keys = n;
        }
        o
    }
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
            summaries: match std::env::var("LOCKSTEP_CUDA_SUMMARIES").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            },
            summarized: 0,
        }
    }

    /// Whether the engine chooses from row summaries made on the device
    /// ([`ForwardBackend::forward_summaries`]: plain greedy rows never cross to the host)
    /// in every step it can (`true`) or reads every logit row back (`false`). Without a
    /// call (or `LOCKSTEP_CUDA_SUMMARIES=1` / `0`), steps of at least [`SUMMARY_MIN_ROWS`]
    /// plain greedy rows take summaries and others read their rows back (a summary costs
    /// less than one row's copy). The choices are the same either way.
    pub fn set_summaries(&mut self, on: bool) {
        self.summaries = Some(on);
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
        let tables_at = 5 * cap_rows + 1;
        if s.meta.len() < tables_at + tables.len() {
            s.meta = dev
                .zeros(tables_at + tables.len().next_power_of_two())
                .map_err(be)?;
            s.generation = next_generation();
        }
        let tiles = attention_row_tiles(&toff, attr_rows());
        s.att_tiles = tiles.len() - 1;
        // The split attention's score rows (n_head × (pos + 1) per row), when this step
        // takes it (the choice is part of a graph's key; a larger buffer is a new
        // generation).
        let mut soff = Vec::with_capacity(m);
        let mut total = 0usize;
        for &p in &pos {
            // Only used when total stays within SPLIT_SCORES_MAX (an i32).
            soff.push(i32::try_from(total).unwrap_or(i32::MAX));
            total = total.saturating_add(cfg.n_head * (p as usize + 1));
        }
        let keys = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
        let split = opts.attn_split
            && keys >= opts.attn_split_min_keys
            && opts.attn_tiled
            && !(opts.attn_rows && attention_rows_kernel(&cfg, bsz, m, s.att_tiles).is_some())
            && split_attention_fits(&cfg, dev.smem_limit())
            && total <= SPLIT_SCORES_MAX;
        if split && s.scores.len() < total {
            s.scores = dev.zeros(total.next_power_of_two()).map_err(be)?;
            s.generation = next_generation();
        }
        s.att_split = split;
        let mut meta = vec![0i32; tables_at + tables.len()];
        meta[..m].copy_from_slice(&pos);
        meta[cap_rows..cap_rows + m].copy_from_slice(&phys);
        meta[2 * cap_rows..2 * cap_rows + m].copy_from_slice(&toff);
        for (i, &t) in tiles.iter().enumerate() {
            meta[3 * cap_rows + i] = i32_of("row tile", t).map_err(be)?;
        }
        meta[4 * cap_rows + 1..4 * cap_rows + 1 + m].copy_from_slice(&soff);
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
        let key = (m, logit_rows.clone(), s.generation, tail, s.att_split);
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
        // No row wants logits (an empty batch included, which leaves no scratch): nothing
        // to read, as the CPU backend returns nothing.
        if nl == 0 {
            dev.sync().map_err(be)?;
            return Ok(Vec::new());
        }
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
        let ids = dev.read(&s.ids, nl).map_err(be)?;
        Ok(ids.into_iter().map(|v| v as u32).collect())
    }
}

/// Prompt rows per forward the engine gives the GPU by default: the wide tensor-core
/// tiles (64 rows) fill the multiprocessors only with many row tiles, so a 256-row chunk
/// leaves most of them idle on the narrow matrices (BENCHMARKS.md, issue 19).
pub const CUDA_PREFILL_CHUNK: usize = 1024;

impl ForwardBackend for CudaBackend {
    fn n_vocab(&self) -> usize {
        self.model.cfg.n_vocab
    }

    fn preferred_prefill_chunk(&self) -> usize {
        CUDA_PREFILL_CHUNK
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
        kv.alloc
            .blocks_needed(&seq.blocks, seq.len, kv.bsz, from, to)
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
        // No row wants logits (an empty batch included, which leaves no scratch): nothing
        // to read, as the CPU backend returns nothing.
        if nl == 0 {
            return dev.sync().map_err(be);
        }
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
        logits.resize(nl * self.model.cfg.n_vocab, 0.0);
        dev.read_into(&s.logits, 0, logits).map_err(be)
    }

    fn summarizes(&self) -> bool {
        self.summaries != Some(false)
    }

    fn summary_min_rows(&self) -> usize {
        if self.summaries == Some(true) {
            1
        } else {
            SUMMARY_MIN_ROWS
        }
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
        // No row wants logits (an empty batch included, which leaves no scratch): nothing
        // to read, as the CPU backend returns nothing.
        if nl == 0 {
            return dev.sync().map_err(be);
        }
        let Some(s) = self.scratch.as_ref() else {
            return Err(BackendError::Internal("no scratch after a forward".into()));
        };
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
