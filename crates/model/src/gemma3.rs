//! The Gemma 3 decoder (llama.cpp's `gemma3` graph).
//!
//! ```text
//! x = token_embd[token] · sqrt(n_embd)
//! per block N:   q = rope(rms_norm_heads(attn_q · n, attn_q_norm)),
//!                k = rope(rms_norm_heads(attn_k · n, attn_k_norm)),   n = rms_norm(x, attn_norm)
//!                x += rms_norm(attn_output · attention(q, k, attn_v · n), attn_post_norm)
//!                x += rms_norm(ffn_down · (gelu_tanh(ffn_gate · n) * (ffn_up · n)), ffn_post_norm),
//!                                                                      n = rms_norm(x, ffn_norm)
//! logits = token_embd · rms_norm(x, output_norm)     (tied; c·tanh(logits/c) if soft-capped)
//! ```
//!
//! Layers slide or not by [`Config::layer_windows`] (every 6th layer global by default): a
//! sliding layer attends to the last `attention.sliding_window` keys and rotates with
//! `rope.freq_base_swa` (10000, unscaled), a global one attends to everything with
//! `rope.freq_base` (and the file's RoPE scaling). RoPE pairs NeoX-style. Scores are scaled
//! by [`Config::attn_scale`] (`1/sqrt(key_length)`). The norm weights in the GGUF are
//! already `1 + w` (llama.cpp's converter shifts them), so every norm is a plain RMSNorm.

use crate::ModelError;
use crate::config::Config;
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

/// A gemma3 model's weights.
#[derive(Debug)]
pub(crate) struct Gemma3 {
    /// `token_embd.weight`: `[n_embd, n_vocab]`, read in place (one row per token).
    embed: TensorView,
    /// The factor the embedding rows are multiplied by: `sqrt(n_embd)` in f32.
    embed_scale: f32,
    blocks: Vec<Block>,
    /// `output_norm.weight`.
    output_norm: Vec<f32>,
    /// `output.weight`, or `token_embd.weight` when tied (packed).
    output: Matrix,
}

impl Gemma3 {
    /// Loads the weights of `gguf`, checking every shape against `cfg`.
    pub fn load(cfg: &Config, gguf: &GgufFile) -> Result<Gemma3, ModelError> {
        let l = Loader::new(gguf);
        let (e, f, v, hd) = (cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.head_dim);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let embed = l.view("token_embd.weight", e, v)?;
        let output = if cfg.tied_embeddings {
            l.matrix("token_embd.weight", e, v)?
        } else {
            l.matrix("output.weight", e, v)?
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
                bq: None,
                bk: None,
                bv: None,
                q_norm: Some(l.vector(&p("attn_q_norm.weight"), hd)?),
                k_norm: Some(l.vector(&p("attn_k_norm.weight"), hd)?),
                post_norm: Some(l.vector(&p("post_attention_norm.weight"), e)?),
            };
            let mlp = Mlp {
                norm: l.vector(&p("ffn_norm.weight"), e)?,
                gate: l.matrix(&p("ffn_gate.weight"), e, f)?,
                up: l.matrix(&p("ffn_up.weight"), e, f)?,
                down: l.matrix(&p("ffn_down.weight"), f, e)?,
                act: GateAct::GeluTanh,
                post_norm: Some(l.vector(&p("post_ffw_norm.weight"), e)?),
            };
            blocks.push(Block { attn, mlp });
        }
        Ok(Gemma3 {
            embed,
            // llama.cpp: ggml_scale(inp, sqrtf(n_embd)), an f32 square root.
            embed_scale: (e as f32).sqrt(),
            blocks,
            output_norm: l.vector("output_norm.weight", e)?,
            output,
        })
    }

    /// Bytes of the weights used by the forward (packed matmul weights, the output head,
    /// the embedding table viewed in the file).
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
            cx.ops.scale(x, self.embed_scale);
        }
        for (layer, b) in self.blocks.iter().enumerate() {
            b.attn.forward(cx, s, kv, layer, rows)?;
            b.mlp.forward(cx, s, m)?;
        }
        logits_head(cx, s, &self.output_norm, &self.output, logits)?;
        if let Some(c) = cfg.final_logit_softcap {
            // llama.cpp: scale by 1/c, tanh, scale by c (element-wise, so per row).
            let inv = 1.0 / c;
            for x in logits.iter_mut() {
                *x = (*x * inv).tanh() * c;
            }
        }
        Ok(())
    }
}
