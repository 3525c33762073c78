//! The llama decoder, which also serves qwen2.
//!
//! ```text
//! x = token_embd[token]
//! per block N:   x += attn_output · attention(rope(attn_q · n + bq), rope(attn_k · n + bk),
//!                                             attn_v · n + bv),   n = rms_norm(x, attn_norm)
//!                x += ffn_down · (silu(ffn_gate · n) * (ffn_up · n)), n = rms_norm(x, ffn_norm)
//! logits = output · rms_norm(x, output_norm)      (output = token_embd when tied)
//! ```
//!
//! qwen2 differs from llama only in the Q/K/V biases (required) and the RoPE pairing (NeoX
//! style, pairs `(i, i + d/2)`; llama pairs `(2i, 2i+1)`: llama.cpp's
//! `LLAMA_ROPE_TYPE_NORM` vs `LLAMA_ROPE_TYPE_NEOX`). Weight names are the GGUF names.

use crate::ModelError;
use crate::config::{Arch, Config};
use crate::layers::{Attention, Ctx, ForwardScratch, GateAct, Mlp, logits_head};
use crate::weights::{Loader, Matrix, TensorView};
use backend_cpu::{AttnRow, KvCache};
use gguf::GgufFile;
use quant::dequantize_row;

/// One transformer block.
#[derive(Debug)]
struct Block {
    attn: Attention,
    mlp: Mlp,
}

/// A llama/qwen2 model's weights.
#[derive(Debug)]
pub(crate) struct Llama {
    /// `token_embd.weight`: `[n_embd, n_vocab]`, read in place (one row per token).
    embed: TensorView,
    blocks: Vec<Block>,
    /// `output_norm.weight`.
    output_norm: Vec<f32>,
    /// `output.weight`, or `token_embd.weight` when tied (packed; the lookup keeps using
    /// the file's view).
    output: Matrix,
}

impl Llama {
    /// Loads the weights of `gguf`, checking every shape against `cfg`: every matmul weight
    /// is packed, the embedding table stays a view of the file.
    pub fn load(cfg: &Config, gguf: &GgufFile) -> Result<Llama, ModelError> {
        let l = Loader::new(gguf);
        if l.has("rope_freqs.weight") {
            return Err(ModelError::UnsupportedRopeScaling {
                kind: "per-dimension frequency factors (llama3-style)".into(),
                key: "rope_freqs.weight".into(),
            });
        }
        let (e, f, v) = (cfg.n_embd, cfg.n_ff, cfg.n_vocab);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let embed = l.view("token_embd.weight", e, v)?;
        let output = if cfg.tied_embeddings {
            l.matrix("token_embd.weight", e, v)?
        } else {
            l.matrix("output.weight", e, v)?
        };
        let bias = |name: String, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
            if cfg.arch.requires_qkv_bias() {
                l.vector(&name, len).map(Some)
            } else {
                l.optional_vector(&name, len)
            }
        };
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |t: &str| format!("blk.{i}.{t}");
            let attn = Attention {
                norm: l.vector(&p("attn_norm.weight"), e)?,
                wq: l.matrix(&p("attn_q.weight"), e, qd)?,
                wk: l.matrix(&p("attn_k.weight"), e, kvd)?,
                wv: l.matrix(&p("attn_v.weight"), e, kvd)?,
                wo: l.matrix(&p("attn_output.weight"), qd, e)?,
                bq: bias(p("attn_q.bias"), qd)?,
                bk: bias(p("attn_k.bias"), kvd)?,
                bv: bias(p("attn_v.bias"), kvd)?,
                q_norm: None,
                k_norm: None,
                post_norm: None,
            };
            let mlp = Mlp {
                norm: l.vector(&p("ffn_norm.weight"), e)?,
                gate: l.matrix(&p("ffn_gate.weight"), e, f)?,
                up: l.matrix(&p("ffn_up.weight"), e, f)?,
                down: l.matrix(&p("ffn_down.weight"), f, e)?,
                act: GateAct::Silu,
                post_norm: None,
            };
            blocks.push(Block { attn, mlp });
        }
        debug_assert!(matches!(cfg.arch, Arch::Llama | Arch::Qwen2));
        Ok(Llama {
            embed,
            blocks,
            output_norm: l.vector("output_norm.weight", e)?,
            output,
        })
    }

    /// Bytes of the weights used by the forward: the packed matmul weights (the output
    /// head too, also when tied) plus the embedding table viewed in the file.
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.embed.n_bytes() + self.output.n_bytes();
        for b in &self.blocks {
            n += [&b.attn.wq, &b.attn.wk, &b.attn.wv, &b.attn.wo]
                .iter()
                .chain([&b.mlp.gate, &b.mlp.up, &b.mlp.down].iter())
                .map(|m| m.n_bytes())
                .sum::<usize>();
        }
        n
    }

    /// The forward over `rows` (K/V blocks reserved, `s.positions` filled) with token ids
    /// `tokens`; logits of the rows listed in `s.logit_rows`, in that order, into `logits`.
    pub fn forward(
        &self,
        cx: &Ctx<'_>,
        s: &mut ForwardScratch,
        kv: &mut KvCache,
        rows: &[AttnRow<'_>],
        tokens: &[u32],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (m, e) = (rows.len(), cfg.n_embd);
        s.prepare(cfg, m);
        for (r, &tok) in tokens.iter().enumerate() {
            let x = &mut s.x[r * e..(r + 1) * e];
            dequantize_row(self.embed.format, self.embed.row(cx.gguf, tok as usize), x)?;
        }
        for (layer, b) in self.blocks.iter().enumerate() {
            b.attn.forward(cx, s, kv, layer, rows)?;
            b.mlp.forward(cx, s, m)?;
        }
        logits_head(cx, s, &self.output_norm, &self.output, logits)
    }
}
