//! Loading a llama/qwen2 model onto a CUDA device: the configuration checks, the weights
//! uploaded in their GGUF block layout (the embedding table stays in the mapped file), the
//! RoPE tables.

use super::enqueue::matvec_ready;
use crate::CudaError;
use crate::device::{Buf, Device};
use crate::ops::{DevMatrix, rope_tables};
use backend_cpu::RopeTable;
use gguf::GgufFile;
use model::{Arch, Config};
use quant::{Format, dequantize_row};
use std::sync::Arc;

/// Largest head size the attention kernel takes (`MAX_HEAD_DIM`).
const MAX_HEAD_DIM: usize = 512;

pub(super) struct Layer {
    pub(super) attn_norm: Buf<f32>,
    pub(super) wq: DevMatrix,
    pub(super) wk: DevMatrix,
    pub(super) wv: DevMatrix,
    pub(super) wo: DevMatrix,
    pub(super) bq: Option<Buf<f32>>,
    pub(super) bk: Option<Buf<f32>>,
    pub(super) bv: Option<Buf<f32>>,
    pub(super) ffn_norm: Buf<f32>,
    pub(super) gate: DevMatrix,
    pub(super) up: DevMatrix,
    pub(super) down: DevMatrix,
}

/// A llama/qwen2 model's weights on a CUDA device (matmul weights in their GGUF block
/// layout; the embedding table stays in the mapped file and rows are dequantized on the
/// host, exactly as the CPU model does).
pub struct CudaModel {
    pub(super) dev: Device,
    pub(super) gguf: Arc<GgufFile>,
    pub(super) cfg: Config,
    pub(super) n_ctx: usize,
    pub(super) embed_format: Format,
    pub(super) layers: Vec<Layer>,
    pub(super) output_norm: Buf<f32>,
    pub(super) output: DevMatrix,
    pub(super) cos: Buf<f32>,
    pub(super) sin: Buf<f32>,
    pub(super) weight_bytes: usize,
    /// Whether one-row steps can run on the matvec kernels (`enqueue::matvec_ready`).
    pub(super) matvec_ready: bool,
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
