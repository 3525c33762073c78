//! The DSpark block drafter of a DeepSeek V4 target, loaded from a *support* GGUF
//! (antirez/ds4 `gguf-tools/deepseek4-quantize.c --dspark-only`).
//!
//! ```text
//! context   main_x[p] = rms(main_proj · cap[p], main_norm)        cap[p]: the target's captured
//!                                                                  row at position p
//!           per stage s: kv_s[p] = rope_p(rms(wkv_s · main_x[p], kv_norm_s))
//! block     x = [anchor, noise, …, noise] at positions a, a+1, …, a+B−1 (a = the anchor's
//!           position, the context ends at a−1); h[k, j] = token_embd[x_k] for every stream j
//! stages    a V4 layer each (HC, sliding-window attention, learned-routing MoE) whose
//!           attention lets every block row see the last W context rows kv_s[a−W..a] and all
//!           B block rows (no causal mask inside the block)
//! head      g_k = HyperHead_mtp(h_k) (pre-norm), base_k = output · rms(g_k, norm)
//! Markov    logits_k = base_k + W2 · W1[x_{k−1}]  with x_{−1} = the anchor, applied
//!           sequentially as the drafter chooses x_k
//! confidence c_k = σ(proj · [g_k ; W1[x_{k−1}]])
//! ```
//!
//! The embedding, the output head and the RoPE table are the target's. The stages reuse the
//! target's kernels and numeric order (ARCHITECTURE.md, "DeepSeek V4"); DSpark-specific
//! order: attention keys are the context rows in position order, then the block rows in
//! slot order; `logits_k = base_k + bias_k` (one add); the confidence logit is one canonical
//! dot over the concatenation `[g_k ; W1[x_{k−1}]]`. The reference quantizes the KV rows to
//! FP8 (`act_quant`); this port keeps them in f32.
//!
//! Choices where the sources were silent, kept consistent here and in the drafter:
//! the captured layers are concatenated in ascending layer order whatever order the metadata
//! lists them in (the reference appends them as its forward reaches them); the stages'
//! SwiGLU clamp is the target's last layer's; a file without `markov_rank` takes it from
//! `markov_w1`; the "nonseq" variant (rank 0, no Markov head) is refused.

use super::{
    Attn, Cx, Deepseek4, Deepseek4Scratch, Ffn, Hc, Layer, Log, Moe, Routing, RowOps, V4Attention,
    grow, hyper_head, load_ffn, load_hc, matmul, rms_pieces, rms_rows, rope_tail, sigmoid,
    sink_attention,
};
use crate::ModelError;
use crate::exec::for_rows;
use crate::model::BatchRow;
use crate::weights::{Loader, Matrix, TensorView};
use backend_cpu::NormWeight;
use gguf::GgufFile;
use quant::dequantize_row;
use std::sync::Arc;

/// Metadata key prefixes: ds4's spelling first, then the `deepseek4-dspark` forks'.
const PREFIXES: [&str; 2] = ["deepseek4.dspark.", "dspark."];
const MAX_BLOCK: usize = 64;
const MAX_STAGES: usize = 16;
const MAX_TARGETS: usize = 16;

/// DSpark settings from a support file's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DsparkConfig {
    /// Stages (`n_mtp_layers`): `mtp.0.` … `mtp.{n−1}.`.
    pub n_stages: usize,
    /// Block slots `B` (`block_size`): the anchor plus `B − 1` noise tokens, up to `B`
    /// drafts per block.
    pub block_size: usize,
    /// The token the block's slots after the anchor hold (`noise_token_id`).
    pub noise_token: u32,
    /// Rank of the Markov head (`markov_rank`).
    pub markov_rank: usize,
    /// Target layers whose input rows are captured (`target_layer_ids`), ascending.
    pub target_layers: Vec<usize>,
}

fn dspark_err(msg: impl Into<String>) -> ModelError {
    ModelError::Dspark(msg.into())
}

/// The value of the first of `names` present under either prefix (all present must agree).
fn find_u32(g: &GgufFile, names: &[&str]) -> Result<Option<usize>, ModelError> {
    let mut found: Option<(String, usize)> = None;
    for p in PREFIXES {
        for n in names {
            let key = format!("{p}{n}");
            if g.get(&key).is_none() {
                continue;
            }
            let v = usize::try_from(g.get_u32(&key)?).unwrap_or(usize::MAX);
            match &found {
                Some((k0, v0)) if *v0 != v => {
                    return Err(dspark_err(format!("{k0} = {v0} and {key} = {v} disagree")));
                }
                Some(_) => {}
                None => found = Some((key, v)),
            }
        }
    }
    Ok(found.map(|(_, v)| v))
}

/// `target_layer_ids`: an integer array, or the scalar keys `target_layer_ids.0`, `.1`, ….
fn target_layer_ids(g: &GgufFile) -> Result<Vec<i64>, ModelError> {
    for p in PREFIXES {
        let key = format!("{p}target_layer_ids");
        if let Some(v) = g.get(&key) {
            let ids = v
                .as_array()
                .and_then(|a| a.to_i64s())
                .ok_or_else(|| dspark_err(format!("{key} must be an array of integers")))?;
            return Ok(ids);
        }
        let mut ids = Vec::new();
        for i in 0..=MAX_TARGETS {
            let k = format!("{key}.{i}");
            if g.get(&k).is_none() {
                break;
            }
            ids.push(i64::from(g.get_u32(&k)?));
        }
        if !ids.is_empty() {
            return Ok(ids);
        }
    }
    Err(dspark_err(
        "no target_layer_ids (deepseek4.dspark.target_layer_ids.N or dspark.target_layer_ids)",
    ))
}

impl DsparkConfig {
    /// Reads the DSpark settings of a support file. Both spellings are accepted: ds4's
    /// (`general.architecture = deepseek4`, `deepseek4.dspark.*`, `target_layer_ids.0/.1/.2`
    /// as u32 keys) and the `deepseek4-dspark` forks' (`dspark.*`, an array
    /// `dspark.target_layer_ids`, `stage_count` / `n_layers` for the stage count). Without
    /// a stage count the `mtp.N.attn_norm.weight` tensors are counted.
    pub fn from_gguf(g: &GgufFile) -> Result<DsparkConfig, ModelError> {
        let arch = g.architecture()?;
        if arch != "deepseek4" && arch != "deepseek4-dspark" {
            return Err(dspark_err(format!(
                "general.architecture is {arch:?}; a DSpark support file says deepseek4 or \
                 deepseek4-dspark"
            )));
        }
        let block_size = find_u32(g, &["block_size"])?
            .ok_or_else(|| dspark_err("no block_size (deepseek4.dspark.block_size)"))?;
        if block_size == 0 || block_size > MAX_BLOCK {
            return Err(dspark_err(format!(
                "block_size {block_size} must be in 1..={MAX_BLOCK}"
            )));
        }
        let noise = find_u32(g, &["noise_token_id"])?
            .ok_or_else(|| dspark_err("no noise_token_id (deepseek4.dspark.noise_token_id)"))?;
        let noise_token = u32::try_from(noise)
            .map_err(|_| dspark_err(format!("noise_token_id {noise} is out of range")))?;
        let n_stages = match find_u32(g, &["n_mtp_layers", "stage_count", "n_layers"])? {
            Some(n) => n,
            None => (0..=MAX_STAGES)
                .take_while(|s| g.tensor(&format!("mtp.{s}.attn_norm.weight")).is_some())
                .count(),
        };
        if n_stages == 0 || n_stages > MAX_STAGES {
            return Err(dspark_err(format!(
                "{n_stages} stages: a support file has 1..={MAX_STAGES} (mtp.0. …)"
            )));
        }
        let markov_rank = match find_u32(g, &["markov_rank"])? {
            Some(r) => r,
            None => g
                .tensor(&format!(
                    "mtp.{}.markov_head.markov_w1.weight",
                    n_stages - 1
                ))
                .and_then(|t| t.dims.first().copied())
                .map_or(0, |r| usize::try_from(r).unwrap_or(usize::MAX)),
        };
        if markov_rank == 0 || markov_rank == usize::MAX {
            return Err(dspark_err(
                "markov_rank 0: the Markov-free (nonseq) DSpark head is not supported",
            ));
        }
        let ids = target_layer_ids(g)?;
        if ids.is_empty() || ids.len() > MAX_TARGETS {
            return Err(dspark_err(format!(
                "{} target layers: a support file names 1..={MAX_TARGETS}",
                ids.len()
            )));
        }
        let mut target_layers = Vec::with_capacity(ids.len());
        for &i in &ids {
            match usize::try_from(i) {
                Ok(v) => target_layers.push(v),
                Err(_) => return Err(dspark_err(format!("target layer id {i} is negative"))),
            }
        }
        target_layers.sort_unstable();
        target_layers.dedup();
        if target_layers.len() != ids.len() {
            return Err(dspark_err(format!(
                "target layer ids {ids:?} repeat a layer"
            )));
        }
        Ok(DsparkConfig {
            n_stages,
            block_size,
            noise_token,
            markov_rank,
            target_layers,
        })
    }
}

/// A loaded DSpark drafter bound to its target (whose embedding, output head and kernels it
/// shares). Immutable; the per-sequence context is a [`DsparkState`].
#[derive(Debug)]
pub struct Dspark {
    gguf: Arc<GgufFile>,
    target: Arc<Deepseek4>,
    cfg: DsparkConfig,
    main_proj: Matrix,
    main_norm: Vec<f32>,
    stages: Vec<Layer>,
    norm: Vec<f32>,
    head_hc: Hc,
    markov_w1: TensorView,
    markov_w2: Matrix,
    confidence: Vec<f32>,
}

/// One sequence's DSpark context: per stage the KV rows (normed, rotated) of the context
/// positions the next block attends (the last `W` before its anchor).
#[derive(Clone, Debug)]
pub struct DsparkState {
    stages: Vec<Log>,
    len: usize,
}

impl DsparkState {
    /// Context positions `0..len` are accounted for (those from [`DsparkState::first`] on
    /// are held); the next block's anchor sits at `len`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no context position is accounted for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The lowest context position held.
    pub fn first(&self) -> usize {
        self.stages.first().map_or(0, |l| l.base)
    }

    /// Forgets the context from position `len` on (rows computed for tokens that were not
    /// committed); `len` above the current length changes nothing.
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.stages {
            l.truncate(len);
        }
        self.len = self.len.min(len);
    }

    fn restart_at(&mut self, pos: usize) {
        for l in &mut self.stages {
            l.data.clear();
            l.base = pos;
        }
        self.len = pos;
    }
}

/// Buffers of the drafter's forwards (grown on demand).
#[derive(Debug, Default)]
pub struct DsparkScratch {
    v4: Deepseek4Scratch,
    mx: Vec<f32>,
    mxn: Vec<f32>,
    kv: Vec<f32>,
    cs: Vec<f32>,
    bias: Vec<f32>,
    cat: Vec<f32>,
}

/// The stage chain's output for one block.
#[derive(Clone, Debug, Default)]
pub struct DsparkBlock {
    /// The anchor (slot 0's token).
    pub anchor: u32,
    /// The anchor's position; slot `k` sits at `pos + k` and predicts position `pos + k + 1`.
    pub pos: usize,
    /// `B × D`: each slot's hidden row after the HyperHead collapse, before the norm (the
    /// confidence head's input).
    pub hidden: Vec<f32>,
    /// `B × n_vocab`: each slot's base logits (before the Markov bias).
    pub logits: Vec<f32>,
}

impl Dspark {
    /// Loads the DSpark drafter of `support` for `target`: reads the [`DsparkConfig`] and
    /// checks it and every tensor's shape and type against the target (hidden size, heads,
    /// q-LoRA, output groups, HC streams, experts, vocabulary); anything that does not fit
    /// is a [`ModelError::Dspark`] naming the tensor or key.
    pub fn load(support: Arc<GgufFile>, target: Arc<Deepseek4>) -> Result<Dspark, ModelError> {
        let cfg = DsparkConfig::from_gguf(&support)?;
        let t = target.config();
        if let Some(&bad) = cfg.target_layers.iter().find(|&&l| l >= t.n_layer) {
            return Err(dspark_err(format!(
                "target layer {bad} is outside the target's {} layers",
                t.n_layer
            )));
        }
        if cfg.noise_token as usize >= t.n_vocab {
            return Err(dspark_err(format!(
                "noise_token_id {} is outside the target's vocabulary of {}",
                cfg.noise_token, t.n_vocab
            )));
        }
        let summary = format!(
            "target: hidden size {}, {} heads of {}, q-LoRA {}, {} output groups of rank {}, \
             {} experts of {} ({} shared), {} HC streams, vocabulary {}",
            t.n_embd,
            t.n_head,
            t.head_dim,
            t.q_lora_rank,
            t.o_groups,
            t.o_lora_rank,
            t.n_expert,
            t.n_ff_exp,
            t.n_expert_shared,
            t.hc_streams,
            t.n_vocab
        );
        let fit = |e: ModelError| match e {
            ModelError::Dspark(_) => e,
            other => dspark_err(format!("{other} ({summary})")),
        };
        let l = Loader::new(&support);
        let (d, v, n) = (t.n_embd, t.n_vocab, t.hc_streams);
        let nd = n * d;
        let nt = cfg.target_layers.len();
        let r = cfg.markov_rank;
        let main_proj = l.matrix("mtp.0.main_proj.weight", nt * d, d).map_err(fit)?;
        let main_norm = l.vector("mtp.0.main_norm.weight", d).map_err(fit)?;
        let limit = t.swiglu_limits.last().copied().unwrap_or(f32::INFINITY);
        let mut stages = Vec::with_capacity(cfg.n_stages);
        for s in 0..cfg.n_stages {
            stages.push(load_stage(&l, &format!("mtp.{s}."), t, limit).map_err(fit)?);
        }
        let last = format!("mtp.{}.", cfg.n_stages - 1);
        let norm = l.vector(&format!("{last}norm.weight"), d).map_err(fit)?;
        let head_hc = load_hc(&l, &format!("{last}hc_head"), nd, n, 1).map_err(fit)?;
        let markov_w1 = l
            .view(&format!("{last}markov_head.markov_w1.weight"), r, v)
            .map_err(fit)?;
        let markov_w2 = l
            .matrix(&format!("{last}markov_head.markov_w2.weight"), r, v)
            .map_err(fit)?;
        let confidence = load_confidence(
            &support,
            &format!("{last}confidence_head.proj.weight"),
            d + r,
        )
        .map_err(fit)?;
        Ok(Dspark {
            gguf: support,
            target,
            cfg,
            main_proj,
            main_norm,
            stages,
            norm,
            head_hc,
            markov_w1,
            markov_w2,
            confidence,
        })
    }

    /// The DSpark settings.
    pub fn config(&self) -> &DsparkConfig {
        &self.cfg
    }

    /// The target this drafter drafts for.
    pub fn target(&self) -> &Arc<Deepseek4> {
        &self.target
    }

    /// Width of a captured target row: `target_layers.len() × D`.
    pub fn capture_width(&self) -> usize {
        self.cfg.target_layers.len() * self.target.config().n_embd
    }

    /// Context rows a block attends: the target's sliding window `W`.
    pub fn window(&self) -> usize {
        self.target.config().window
    }

    /// Bytes of the weights the drafter reads (packed matrices and the Markov table).
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.main_proj.n_bytes()
            + self.head_hc.mix.n_bytes()
            + self.markov_w1.n_bytes()
            + self.markov_w2.n_bytes();
        for l in &self.stages {
            let a = &l.attn;
            n += l.hc_attn.mix.n_bytes() + l.hc_ffn.mix.n_bytes();
            n += [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_b]
                .iter()
                .map(|m| m.n_bytes())
                .sum::<usize>();
            n += a.wo_a.iter().map(Matrix::n_bytes).sum::<usize>();
            n += l.moe.router.n_bytes();
            for f in l.moe.experts.iter().chain(l.moe.shared.as_ref()) {
                n += f.gate.n_bytes() + f.up.n_bytes() + f.down.n_bytes();
            }
        }
        n
    }

    /// An empty context.
    pub fn new_state(&self) -> DsparkState {
        DsparkState {
            stages: (0..self.cfg.n_stages)
                .map(|_| Log::new(self.target.config().head_dim))
                .collect(),
            len: 0,
        }
    }

    /// Empty scratch buffers.
    pub fn new_scratch(&self) -> DsparkScratch {
        DsparkScratch::default()
    }

    fn cx(&self) -> Cx<'_> {
        Cx {
            pool: &self.target.pool,
            qk: quant::kernels(),
            ops: RowOps::selected(),
            cfg: &self.target.cfg,
        }
    }

    /// Appends the context of positions `from..from + n` from their captured target rows
    /// (`rows`: `n ×` [`Dspark::capture_width`] values, [`super::Deepseek4State::captured`]).
    /// `from` below the state's length first forgets the context from `from` on; above it
    /// (or below the first position held), the state restarts at `from`: the positions
    /// before it are unknown and a block whose window reaches them is refused. Only the
    /// last `W` positions are kept.
    pub fn extend_context(
        &self,
        sc: &mut DsparkScratch,
        st: &mut DsparkState,
        from: usize,
        rows: &[f32],
    ) -> Result<(), ModelError> {
        let w = self.capture_width();
        if w == 0 || !rows.len().is_multiple_of(w) || st.stages.len() != self.stages.len() {
            return Err(ModelError::Batch(format!(
                "DSpark context: {} values are not whole rows of {w}, or the state was made \
                 for another drafter",
                rows.len()
            )));
        }
        if from > st.len || from < st.first() {
            st.restart_at(from);
        } else {
            st.truncate(from);
        }
        let n = rows.len() / w;
        if n == 0 {
            return Ok(());
        }
        let cx = self.cx();
        let tc = &self.target.cfg;
        let (d, hd, rd) = (tc.n_embd, tc.head_dim, tc.n_rot);
        grow(&mut sc.mx, n * d);
        grow(&mut sc.mxn, n * d);
        grow(&mut sc.kv, n * hd);
        grow(&mut sc.cs, n * rd);
        let s = &mut sc.v4;
        matmul(
            &cx,
            &mut s.acts,
            &mut s.tmp,
            rows,
            n,
            &mut [(&self.main_proj, &mut sc.mx[..])],
        )?;
        rms_rows(&cx, &sc.mx, &self.main_norm, &mut sc.mxn, n)?;
        for i in 0..n {
            self.target
                .rope_main
                .cos_sin(from + i, &mut sc.cs[i * rd..(i + 1) * rd]);
        }
        for (stage, log) in self.stages.iter().zip(&mut st.stages) {
            let a = &stage.attn;
            matmul(
                &cx,
                &mut s.acts,
                &mut s.tmp,
                &sc.mxn,
                n,
                &mut [(&a.wkv, &mut sc.kv[..])],
            )?;
            rms_pieces(&cx, &mut sc.kv, hd, &a.kv_norm, n)?;
            for i in 0..n {
                let row = &mut sc.kv[i * hd..(i + 1) * hd];
                rope_tail(row, hd, &sc.cs[i * rd..(i + 1) * rd], false);
                log.push(row);
            }
        }
        st.len = from + n;
        let keep = st.len.saturating_sub(self.window());
        for log in &mut st.stages {
            log.forget_before(keep);
        }
        Ok(())
    }

    /// Runs the stage chain over the block `[anchor, noise, …]` whose anchor sits right
    /// after the context (position [`DsparkState::len`]), leaving each slot's hidden row
    /// and base logits in `out`. Errors when the context rows the block attends are not held.
    pub fn block(
        &self,
        sc: &mut DsparkScratch,
        st: &DsparkState,
        anchor: u32,
        out: &mut DsparkBlock,
    ) -> Result<(), ModelError> {
        let tc = &self.target.cfg;
        let (d, n, rd, v) = (tc.n_embd, tc.hc_streams, tc.n_rot, tc.n_vocab);
        let nd = n * d;
        let m = self.cfg.block_size;
        let pos = st.len;
        let lo = pos.saturating_sub(self.window());
        if st.stages.len() != self.stages.len() || (pos > 0 && st.first() > lo) {
            return Err(ModelError::Batch(format!(
                "DSpark block at {pos}: context rows {lo}..{pos} are not held (from {})",
                st.first()
            )));
        }
        if anchor as usize >= v {
            return Err(ModelError::Batch(format!(
                "DSpark anchor {anchor} is outside the vocabulary (0..{v})"
            )));
        }
        let cx = self.cx();
        let s = &mut sc.v4;
        s.prepare(tc, m);
        let t = &self.target;
        let rows: Vec<BatchRow> = (0..m)
            .map(|k| BatchRow {
                seq: 0,
                token: if k == 0 { anchor } else { self.cfg.noise_token },
                pos: pos + k,
                wants_logits: true,
            })
            .collect();
        for (k, row) in rows.iter().enumerate() {
            t.rope_main
                .cos_sin(row.pos, &mut s.cs_main[k * rd..(k + 1) * rd]);
            dequantize_row(
                t.embed.format,
                t.embed.row(&t.gguf, row.token as usize),
                &mut s.x[..d],
            )?;
            for j in 0..n {
                let base = (k * n + j) * d;
                s.h[base..base + d].copy_from_slice(&s.x[..d]);
            }
        }
        for (si, stage) in self.stages.iter().enumerate() {
            self.stage_attention(&cx, s, &st.stages[si], stage, pos, m)?;
            t.moe(&cx, s, &rows, si, stage)?;
        }
        // The stages' own HyperHead collapse, the last stage's norm, the target's head.
        rms_rows(&cx, &s.h, &t.ones[..nd], &mut s.flat, m)?;
        let hc = &self.head_hc;
        matmul(
            &cx,
            &mut s.acts,
            &mut s.tmp,
            &s.flat,
            m,
            &mut [(&hc.mix, &mut s.mix[..])],
        )?;
        hyper_head(&cx, hc, &s.h, &s.mix, &mut s.x, m)?;
        out.anchor = anchor;
        out.pos = pos;
        out.hidden.clear();
        out.hidden.extend_from_slice(&s.x[..m * d]);
        rms_rows(&cx, &s.x, &self.norm, &mut s.xn, m)?;
        out.logits.clear();
        out.logits.resize(m * v, 0.0);
        matmul(
            &cx,
            &mut s.acts,
            &mut s.tmp,
            &s.xn,
            m,
            &mut [(&t.output, &mut out.logits[..])],
        )
    }

    /// One stage's attention over the block: q-LoRA queries and the KV row from the normed
    /// block rows; every block row attends the context rows `pos − W..pos` (position order)
    /// then all block rows (slot order) with the sink; then the target's output tail.
    fn stage_attention(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        ctx: &Log,
        layer: &Layer,
        pos: usize,
        m: usize,
    ) -> Result<(), ModelError> {
        let t = &self.target;
        let cfg = cx.cfg;
        let a = &layer.attn;
        let (hd, rd, nh) = (cfg.head_dim, cfg.n_rot, cfg.n_head);
        let qd = nh * hd;
        t.hc_pre(cx, s, &layer.hc_attn, m)?;
        rms_rows(cx, &s.x, &a.norm, &mut s.xn, m)?;
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.xn,
            m,
            &mut [(&a.wq_a, &mut s.qr[..]), (&a.wkv, &mut s.kv[..])],
        )?;
        rms_pieces(cx, &mut s.qr, cfg.q_lora_rank, &a.q_a_norm, m)?;
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.qr,
            m,
            &mut [(&a.wq_b, &mut s.q[..])],
        )?;
        let (ops, eps) = (cx.ops, cfg.rms_eps);
        let ones_hd = &t.ones[..hd];
        let cs = &s.cs_main;
        for_rows(cx.pool, &mut s.q[..m * qd], qd, |r, row| {
            ops.rms_norm_in_place(row, ones_hd, eps, NormWeight::Plain)?;
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        rms_pieces(cx, &mut s.kv, hd, &a.kv_norm, m)?;
        for_rows(cx.pool, &mut s.kv[..m * hd], hd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        {
            let (q, kv) = (&s.q, &s.kv);
            let scale = (hd as f32).powf(-0.5);
            let lo = pos.saturating_sub(cfg.window);
            let sinks = &a.sinks;
            cx.pool.for_chunks_mut(&mut s.att[..m * qd], hd, |rh, out| {
                let (r, h) = (rh / nh, rh % nh);
                let qh = &q[r * qd + h * hd..r * qd + (h + 1) * hd];
                let nw = pos - lo;
                let key = |j: usize| -> &[f32] {
                    if j < nw {
                        ctx.row(lo + j)
                    } else {
                        let b = j - nw;
                        &kv[b * hd..(b + 1) * hd]
                    }
                };
                sink_attention(ops, qh, scale, sinks[h], nw + m, key, out);
            });
        }
        t.attn_project(cx, s, a, m)
    }

    /// `W1[prev]` (the Markov head's embedding of the previous token) into `embed`
    /// (`markov_rank` values).
    pub fn markov_embed(&self, prev: u32, embed: &mut Vec<f32>) -> Result<(), ModelError> {
        let v = self.target.config().n_vocab;
        if prev as usize >= v {
            return Err(ModelError::Batch(format!(
                "DSpark Markov token {prev} is outside the vocabulary (0..{v})"
            )));
        }
        embed.clear();
        embed.resize(self.cfg.markov_rank, 0.0);
        dequantize_row(
            self.markov_w1.format,
            self.markov_w1.row(&self.gguf, prev as usize),
            embed,
        )?;
        Ok(())
    }

    /// `out = base + W2 · embed` (the Markov-corrected logits of a slot).
    pub fn markov_logits(
        &self,
        sc: &mut DsparkScratch,
        embed: &[f32],
        base: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let v = self.target.config().n_vocab;
        if embed.len() != self.cfg.markov_rank || base.len() != v {
            return Err(ModelError::Batch(format!(
                "DSpark Markov: {} embedding values (rank {}), {} logits (vocabulary {v})",
                embed.len(),
                self.cfg.markov_rank,
                base.len()
            )));
        }
        let cx = self.cx();
        grow(&mut sc.bias, v);
        let s = &mut sc.v4;
        matmul(
            &cx,
            &mut s.acts,
            &mut s.tmp,
            embed,
            1,
            &mut [(&self.markov_w2, &mut sc.bias[..])],
        )?;
        out.clear();
        out.extend(base.iter().zip(&sc.bias[..v]).map(|(&b, &x)| b + x));
        Ok(())
    }

    /// The confidence of a slot: `σ(proj · [hidden ; embed])`, `hidden` the slot's row of
    /// [`DsparkBlock::hidden`], `embed` the Markov embedding of its previous token.
    pub fn confidence(
        &self,
        sc: &mut DsparkScratch,
        hidden: &[f32],
        embed: &[f32],
    ) -> Result<f32, ModelError> {
        sc.cat.clear();
        sc.cat.extend_from_slice(hidden);
        sc.cat.extend_from_slice(embed);
        let z = RowOps::selected().dot(&self.confidence, &sc.cat)?;
        Ok(sigmoid(z))
    }
}

/// One stage: a V4 layer with sliding-window attention and learned routing.
fn load_stage(
    l: &Loader<'_>,
    p: &str,
    cfg: &super::Deepseek4Config,
    limit: f32,
) -> Result<Layer, ModelError> {
    let t = |s: &str| format!("{p}{s}");
    let (d, hd, n) = (cfg.n_embd, cfg.head_dim, cfg.hc_streams);
    let nd = n * d;
    let qd = cfg.n_head * hd;
    let gw = qd / cfg.o_groups;
    let gr = cfg.o_groups * cfg.o_lora_rank;
    let (e, f) = (cfg.n_expert, cfg.n_ff_exp);
    let attn = Attn {
        kind: V4Attention::Sliding,
        norm: l.vector(&t("attn_norm.weight"), d)?,
        wq_a: l.matrix(&t("attn_q_a.weight"), d, cfg.q_lora_rank)?,
        q_a_norm: l.vector(&t("attn_q_a_norm.weight"), cfg.q_lora_rank)?,
        wq_b: l.matrix(&t("attn_q_b.weight"), cfg.q_lora_rank, qd)?,
        wkv: l.matrix(&t("attn_kv.weight"), d, hd)?,
        kv_norm: l.vector(&t("attn_kv_a_norm.weight"), hd)?,
        sinks: l.vector(&t("attn_sinks.weight"), cfg.n_head)?,
        wo_a: l.matrix_parts(
            &t("attn_output_a.weight"),
            &[gw as u64, gr as u64],
            cfg.o_lora_rank,
            cfg.o_groups,
        )?,
        wo_b: l.matrix(&t("attn_output_b.weight"), gr, d)?,
        comp: None,
        indexer: None,
    };
    let parts = |name: &str, k: usize, rows: usize| {
        l.matrix_parts(&t(name), &[k as u64, rows as u64, e as u64], rows, e)
    };
    let experts = parts("ffn_gate_exps.weight", d, f)?
        .into_iter()
        .zip(parts("ffn_up_exps.weight", d, f)?)
        .zip(parts("ffn_down_exps.weight", f, d)?)
        .map(|((gate, up), down)| Ffn { gate, up, down })
        .collect();
    let shared = if cfg.n_expert_shared > 0 {
        Some(load_ffn(l, p, "shexp", d, f * cfg.n_expert_shared)?)
    } else {
        None
    };
    let moe = Moe {
        norm: l.vector(&t("ffn_norm.weight"), d)?,
        router: l.matrix(&t("ffn_gate_inp.weight"), d, e)?,
        routing: Routing::Learned(l.vector(&t("exp_probs_b.bias"), e)?),
        experts,
        shared,
        limit,
    };
    Ok(Layer {
        hc_attn: load_hc(l, &t("hc_attn"), nd, cfg.hc_mix(), 3)?,
        attn,
        hc_ffn: load_hc(l, &t("hc_ffn"), nd, cfg.hc_mix(), 3)?,
        moe,
    })
}

/// The confidence projection: `len` values stored as `[len]` or `[len, 1]`.
fn load_confidence(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
    let want = [len as u64];
    let want2 = [len as u64, 1];
    if t.dims != want && t.dims != want2 {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: want2.to_vec(),
            got: t.dims.clone(),
        });
    }
    let format = quant::Format::from_ggml_type_id(t.ggml_type.id()).ok_or_else(|| {
        ModelError::TensorType {
            name: name.into(),
            ggml_type: t.ggml_type.to_string(),
            why: String::new(),
        }
    })?;
    let mut out = vec![0.0f32; len];
    dequantize_row(format, g.tensor_data(t), &mut out).map_err(|e| ModelError::TensorType {
        name: name.into(),
        ggml_type: t.ggml_type.to_string(),
        why: format!(": {e}"),
    })?;
    Ok(out)
}
