//! The weights (hyper-connections, attention with its compressor and indexer, the mixture
//! of experts) and [`Deepseek4::load`], which checks and packs them.

use super::*;

/// The mixing weights of one hyper-connection block (or of the final HyperHead).
#[derive(Debug)]
pub(super) struct Hc {
    /// `*_fn`: `[N·D] → mix`.
    pub(super) mix: Matrix,
    /// `*_base`.
    pub(super) base: Vec<f32>,
    /// `*_scale`.
    pub(super) scale: Vec<f32>,
}

/// A compressor: per-token projections pooled once per `ratio` positions.
#[derive(Debug)]
pub(super) struct Compressor {
    /// `*_compressor_kv`: `D → cw`.
    pub(super) wkv: Matrix,
    /// `*_compressor_gate`: `D → cw`.
    pub(super) wgate: Matrix,
    /// `*_compressor_ape`: `ratio × cw`, row-major.
    pub(super) ape: Vec<f32>,
    /// `*_compressor_norm`: `width`.
    pub(super) norm: Vec<f32>,
    pub(super) ratio: usize,
    /// Output row width.
    pub(super) width: usize,
    /// Overlapping windows (CSA): `cw = 2·width`, series A feeds the next row.
    pub(super) overlap: bool,
}

impl Compressor {
    /// Values per projected token (`c` or `z`).
    pub(super) fn cw(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }
}

/// The lightning indexer of a CSA layer.
#[derive(Debug)]
pub(super) struct Indexer {
    pub(super) comp: Compressor,
    /// `indexer.attn_q_b`: `q_lora_rank → n_I·d_I`.
    pub(super) wq_b: Matrix,
    /// `indexer.proj`: `D → n_I`.
    pub(super) proj: Matrix,
}

#[derive(Debug)]
pub(super) struct Attn {
    pub(super) kind: V4Attention,
    pub(super) norm: Vec<f32>,
    pub(super) wq_a: Matrix,
    pub(super) q_a_norm: Vec<f32>,
    pub(super) wq_b: Matrix,
    pub(super) wkv: Matrix,
    pub(super) kv_norm: Vec<f32>,
    pub(super) sinks: Vec<f32>,
    /// `attn_output_a` cut into the G groups (`H·hd/G → R` each).
    pub(super) wo_a: Vec<Matrix>,
    pub(super) wo_b: Matrix,
    pub(super) comp: Option<Compressor>,
    pub(super) indexer: Option<Indexer>,
}

#[derive(Debug)]
pub(super) enum Routing {
    /// `ffn_gate_tid2eid`: `k` experts per token id (row-major `[vocab][k]`).
    Hash(Vec<u32>),
    /// `exp_probs_b.bias`: added to the scores for the selection only.
    Learned(Vec<f32>),
}

#[derive(Debug)]
pub(super) struct Ffn {
    pub(super) gate: Matrix,
    pub(super) up: Matrix,
    pub(super) down: Matrix,
}

#[derive(Debug)]
pub(super) struct Moe {
    pub(super) norm: Vec<f32>,
    pub(super) router: Matrix,
    pub(super) routing: Routing,
    pub(super) experts: Vec<Ffn>,
    pub(super) shared: Option<Ffn>,
    pub(super) limit: f32,
}

#[derive(Debug)]
pub(super) struct Layer {
    pub(super) hc_attn: Hc,
    pub(super) attn: Attn,
    pub(super) hc_ffn: Hc,
    pub(super) moe: Moe,
}

pub(super) fn load_hc(
    l: &Loader<'_>,
    prefix: &str,
    nd: usize,
    n_mix: usize,
    n_scale: usize,
) -> Result<Hc, ModelError> {
    Ok(Hc {
        mix: l.matrix(&format!("{prefix}_fn.weight"), nd, n_mix)?,
        base: l.vector(&format!("{prefix}_base.weight"), n_mix)?,
        scale: l.vector(&format!("{prefix}_scale.weight"), n_scale)?,
    })
}

/// A small 2-D tensor (`dims = [k, n]`) decoded to f32, row-major.
pub(super) fn load_table(
    l: &Loader<'_>,
    name: &str,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, ModelError> {
    let parts = l.matrix_parts(name, &[k as u64, n as u64], 1, n)?;
    let mut out = vec![0.0f32; k * n];
    for (row, m) in out.chunks_exact_mut(k).zip(&parts) {
        m.packed.dequantize_row(0, row)?;
    }
    Ok(out)
}

pub(super) fn load_compressor(
    l: &Loader<'_>,
    prefix: &str,
    d: usize,
    width: usize,
    ratio: usize,
    overlap: bool,
) -> Result<Compressor, ModelError> {
    let cw = if overlap { 2 * width } else { width };
    Ok(Compressor {
        wkv: l.matrix(&format!("{prefix}_kv.weight"), d, cw)?,
        wgate: l.matrix(&format!("{prefix}_gate.weight"), d, cw)?,
        ape: load_table(l, &format!("{prefix}_ape.weight"), cw, ratio)?,
        norm: l.vector(&format!("{prefix}_norm.weight"), width)?,
        ratio,
        width,
        overlap,
    })
}

pub(super) fn load_ffn(
    l: &Loader<'_>,
    p: &str,
    kind: &str,
    d: usize,
    f: usize,
) -> Result<Ffn, ModelError> {
    Ok(Ffn {
        gate: l.matrix(&format!("{p}ffn_gate_{kind}.weight"), d, f)?,
        up: l.matrix(&format!("{p}ffn_up_{kind}.weight"), d, f)?,
        down: l.matrix(&format!("{p}ffn_down_{kind}.weight"), f, d)?,
    })
}

impl Deepseek4 {
    /// Loads the DeepSeek V4 model in `gguf`: reads the [`Deepseek4Config`], checks every
    /// tensor's shape and type and packs the matmul weights. `opts.kv_type` is ignored (the
    /// state is f32).
    pub fn load(gguf: Arc<GgufFile>, opts: &LoadOptions) -> Result<Deepseek4, ModelError> {
        let cfg = Deepseek4Config::from_gguf(&gguf)?;
        let n_ctx = opts.n_ctx.unwrap_or(cfg.n_ctx_train);
        if n_ctx == 0 || n_ctx > cfg.n_ctx_train {
            return Err(ModelError::Config(format!(
                "context length {n_ctx} must be in 1..={} (the model's trained context)",
                cfg.n_ctx_train
            )));
        }
        let l = Loader::new(&gguf);
        let (d, v, hd, n) = (cfg.n_embd, cfg.n_vocab, cfg.head_dim, cfg.hc_streams);
        let nd = n * d;
        let qd = cfg.n_head * hd;
        let gw = qd / cfg.o_groups;
        let gr = cfg.o_groups * cfg.o_lora_rank;
        let embed = l.view("token_embd.weight", d, v)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, &kind) in cfg.layers.iter().enumerate() {
            let p = format!("blk.{i}.");
            let t = |s: &str| format!("{p}{s}");
            let (comp, indexer) = match kind {
                V4Attention::Sliding => (None, None),
                V4Attention::Hca { ratio } => (
                    Some(load_compressor(
                        &l,
                        &t("attn_compressor"),
                        d,
                        hd,
                        ratio,
                        false,
                    )?),
                    None,
                ),
                V4Attention::Csa { ratio } => {
                    let (ni, di) = (cfg.indexer_heads, cfg.indexer_dim);
                    let indexer = Indexer {
                        comp: load_compressor(&l, &t("indexer_compressor"), d, di, ratio, true)?,
                        wq_b: l.matrix(&t("indexer.attn_q_b.weight"), cfg.q_lora_rank, ni * di)?,
                        proj: l.matrix(&t("indexer.proj.weight"), d, ni)?,
                    };
                    (
                        Some(load_compressor(
                            &l,
                            &t("attn_compressor"),
                            d,
                            hd,
                            ratio,
                            true,
                        )?),
                        Some(indexer),
                    )
                }
            };
            let attn = Attn {
                kind,
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
                comp,
                indexer,
            };
            let (e, f) = (cfg.n_expert, cfg.n_ff_exp);
            let routing = if i < cfg.hash_layers {
                let k = cfg.n_expert_used;
                let table = l.i32s(&t("ffn_gate_tid2eid.weight"), &[k as u64, v as u64])?;
                let mut ids = Vec::with_capacity(table.len());
                for (j, &x) in table.iter().enumerate() {
                    match u32::try_from(x) {
                        Ok(x) if (x as usize) < e => ids.push(x),
                        _ => {
                            return Err(ModelError::Config(format!(
                                "{}: entry {j} = {x} is not an expert id (0..{e})",
                                t("ffn_gate_tid2eid.weight")
                            )));
                        }
                    }
                }
                Routing::Hash(ids)
            } else {
                Routing::Learned(l.vector(&t("exp_probs_b.bias"), e)?)
            };
            let gate = l.matrix_parts(
                &t("ffn_gate_exps.weight"),
                &[d as u64, f as u64, e as u64],
                f,
                e,
            )?;
            let up = l.matrix_parts(
                &t("ffn_up_exps.weight"),
                &[d as u64, f as u64, e as u64],
                f,
                e,
            )?;
            let down = l.matrix_parts(
                &t("ffn_down_exps.weight"),
                &[f as u64, d as u64, e as u64],
                d,
                e,
            )?;
            let experts = gate
                .into_iter()
                .zip(up)
                .zip(down)
                .map(|((gate, up), down)| Ffn { gate, up, down })
                .collect();
            let shared = if cfg.n_expert_shared > 0 {
                Some(load_ffn(&l, &p, "shexp", d, f * cfg.n_expert_shared)?)
            } else {
                None
            };
            let moe = Moe {
                norm: l.vector(&t("ffn_norm.weight"), d)?,
                router: l.matrix(&t("ffn_gate_inp.weight"), d, e)?,
                routing,
                experts,
                shared,
                limit: cfg.swiglu_limits[i],
            };
            layers.push(Layer {
                hc_attn: load_hc(&l, &t("hc_attn"), nd, cfg.hc_mix(), 3)?,
                attn,
                hc_ffn: load_hc(&l, &t("hc_ffn"), nd, cfg.hc_mix(), 3)?,
                moe,
            });
        }
        let head_hc = load_hc(&l, "output_hc", nd, n, 1)?;
        let output_norm = l.vector("output_norm.weight", d)?;
        let output = l.matrix("output.weight", d, v)?;
        let rope_main = Rope::new(f64::from(cfg.rope_base), cfg.n_rot, None);
        let rope_comp = Rope::new(f64::from(cfg.compress_rope_base), cfg.n_rot, cfg.yarn);
        let ones = vec![1.0f32; nd.max(hd).max(cfg.indexer_dim)];
        Ok(Deepseek4 {
            gguf,
            cfg,
            embed,
            layers,
            head_hc,
            output_norm,
            output,
            pool: ThreadPool::for_machine(opts.threads),
            rope_main,
            rope_comp,
            n_ctx,
            ones,
        })
    }
}
