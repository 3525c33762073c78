//! Synthetic model files: a real model's shapes, formats and tokenizer metadata with
//! random weights, so speed can be measured (and the CUDA oracles run) wherever the real
//! weights are not at hand.
//!
//! A *skeleton* is a GGUF file holding a model's metadata and, under
//! [`SKELETON_KEY`], its tensor table (`name|ggml type id|dim,dim,…` per tensor) but no
//! tensor data: a few megabytes that can travel where a gigabyte cannot.
//! [`spec_from_gguf`] reads either a full model or a skeleton.
//!
//! Random weights: quantized blocks get random code bytes and per-block scales drawn
//! around a per-format magnitude (weights of about ±0.02), float norm weights about 1,
//! other float tensors small. Same seed, same bytes.

use gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use std::path::Path;

/// Metadata key under which a skeleton keeps its tensor table.
pub const SKELETON_KEY: &str = "lockstep.synth.tensors";

/// Errors of synthesis.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A tensor type without a random-weight rule.
    #[error("tensor {name}: type {ty} is not supported by synth")]
    Unsupported {
        /// Tensor name.
        name: String,
        /// Its type.
        ty: String,
    },
    /// A malformed skeleton table entry.
    #[error("skeleton entry {0:?} is malformed (want name|type id|dims)")]
    BadSkeleton(String),
    /// Writing the file failed.
    #[error("writing the model: {0}")]
    Write(String),
}

/// One tensor to synthesize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// GGUF tensor name.
    pub name: String,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Dimensions, `ne0` first.
    pub dims: Vec<u64>,
}

/// A model to synthesize: metadata (copied as is) and the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// Metadata entries, in file order (without [`SKELETON_KEY`]).
    pub metadata: Vec<(String, Value)>,
    /// Tensors, in file order.
    pub tensors: Vec<TensorSpec>,
}

impl SynthSpec {
    /// Bytes of tensor data the model will hold.
    pub fn data_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.ggml_type.tensor_bytes(&t.dims).unwrap_or(0))
            .sum()
    }
}

/// The spec of a model file or of a skeleton (see the module docs).
pub fn spec_from_gguf(g: &GgufFile) -> Result<SynthSpec, SynthError> {
    let metadata: Vec<(String, Value)> = g
        .metadata()
        .iter()
        .filter(|(k, _)| k != SKELETON_KEY)
        .cloned()
        .collect();
    let tensors = match g.get(SKELETON_KEY) {
        Some(Value::Array(Array::String(entries))) => entries
            .iter()
            .map(|e| parse_entry(e))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(SynthError::BadSkeleton(SKELETON_KEY.into())),
        None => g
            .tensors()
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                ggml_type: t.ggml_type,
                dims: t.dims.clone(),
            })
            .collect(),
    };
    Ok(SynthSpec { metadata, tensors })
}

fn parse_entry(e: &str) -> Result<TensorSpec, SynthError> {
    let bad = || SynthError::BadSkeleton(e.to_string());
    let mut parts = e.split('|');
    let (Some(name), Some(ty), Some(dims), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let ggml_type = ty
        .parse::<u32>()
        .ok()
        .and_then(GgmlType::from_id)
        .ok_or_else(bad)?;
    let dims = dims
        .split(',')
        .map(|d| d.parse::<u64>().map_err(|_| bad()))
        .collect::<Result<Vec<_>, _>>()?;
    if name.is_empty() || dims.is_empty() || ggml_type.tensor_bytes(&dims).is_none() {
        return Err(bad());
    }
    Ok(TensorSpec {
        name: name.to_string(),
        ggml_type,
        dims,
    })
}

/// Writes `spec` as a skeleton (metadata + tensor table, no data) to `path`.
pub fn write_skeleton(spec: &SynthSpec, path: &Path) -> Result<(), SynthError> {
    let mut w = GgufWriter::new();
    for (k, v) in &spec.metadata {
        w.add(k.clone(), v.clone())
            .map_err(|e| SynthError::Write(e.to_string()))?;
    }
    let table: Vec<String> = spec
        .tensors
        .iter()
        .map(|t| {
            let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
            format!("{}|{}|{}", t.name, t.ggml_type.id(), dims.join(","))
        })
        .collect();
    w.add(SKELETON_KEY, Value::Array(Array::String(table)))
        .map_err(|e| SynthError::Write(e.to_string()))?;
    w.write_file(path)
        .map_err(|e| SynthError::Write(e.to_string()))
}

/// A small counter-based generator (splitmix64): reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    fn fill(&mut self, b: &mut [u8]) {
        let mut chunks = b.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let v = self.next().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&v[..n]);
    }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

/// (block bytes, [(offset of an f16 scale, its magnitude)]) of the quantized types.
fn scale_fields(t: GgmlType) -> Option<(usize, &'static [(usize, f32)])> {
    Some(match t {
        GgmlType::Q4_0 => (18, &[(0, 0.004)]),
        GgmlType::Q4_1 => (20, &[(0, 0.003), (2, -0.02)]),
        GgmlType::Q5_0 => (22, &[(0, 0.002)]),
        GgmlType::Q5_1 => (24, &[(0, 0.0015), (2, -0.02)]),
        GgmlType::Q8_0 => (34, &[(0, 0.000_25)]),
        GgmlType::Q2_K => (84, &[(80, 0.002), (82, 0.001)]),
        GgmlType::Q3_K => (110, &[(108, 0.000_5)]),
        GgmlType::Q4_K => (144, &[(0, 0.000_1), (2, 0.000_1)]),
        GgmlType::Q5_K => (176, &[(0, 0.000_05), (2, 0.000_1)]),
        GgmlType::Q6_K => (210, &[(208, 0.000_02)]),
        _ => return None,
    })
}

/// Random bytes for one tensor.
pub fn random_tensor(t: &TensorSpec, rng_seed: u64) -> Result<Vec<u8>, SynthError> {
    let n_bytes = t
        .ggml_type
        .tensor_bytes(&t.dims)
        .ok_or_else(|| SynthError::Unsupported {
            name: t.name.clone(),
            ty: t.ggml_type.to_string(),
        })? as usize;
    let mut rng = Rng(rng_seed);
    let n = t.dims.iter().product::<u64>() as usize;
    let is_norm = t.name.contains("norm");
    let float = |rng: &mut Rng| {
        if is_norm {
            1.0 + 0.1 * rng.unit()
        } else {
            0.02 * rng.unit()
        }
    };
    match t.ggml_type {
        GgmlType::F32 => Ok((0..n).flat_map(|_| float(&mut rng).to_le_bytes()).collect()),
        GgmlType::F16 => Ok((0..n).flat_map(|_| f16_bytes(float(&mut rng))).collect()),
        GgmlType::BF16 => Ok((0..n)
            .flat_map(|_| ((float(&mut rng).to_bits() >> 16) as u16).to_le_bytes())
            .collect()),
        ty => {
            let (bb, fields) = scale_fields(ty).ok_or_else(|| SynthError::Unsupported {
                name: t.name.clone(),
                ty: ty.to_string(),
            })?;
            let mut data = vec![0u8; n_bytes];
            rng.fill(&mut data);
            for block in data.chunks_exact_mut(bb) {
                for &(off, mag) in fields {
                    let jitter = 1.0 + 0.5 * rng.unit();
                    block[off..off + 2].copy_from_slice(&f16_bytes(mag * jitter));
                }
            }
            Ok(data)
        }
    }
}

/// Writes a model with `spec`'s metadata and tensor table and random weights from `seed`
/// to `path`; returns the tensor data bytes written.
pub fn write_model(spec: &SynthSpec, seed: u64, path: &Path) -> Result<u64, SynthError> {
    let mut w = GgufWriter::new();
    for (k, v) in &spec.metadata {
        w.add(k.clone(), v.clone())
            .map_err(|e| SynthError::Write(e.to_string()))?;
    }
    let mut total = 0u64;
    for (i, t) in spec.tensors.iter().enumerate() {
        let data = random_tensor(t, seed ^ (i as u64).wrapping_mul(0x1000_0000_01B3))?;
        total += data.len() as u64;
        w.add_tensor(t.name.clone(), &t.dims, t.ggml_type, data)
            .map_err(|e| SynthError::Write(e.to_string()))?;
    }
    w.write_file(path)
        .map_err(|e| SynthError::Write(e.to_string()))?;
    Ok(total)
}

/// Shapes of a small llama-family model for tests.
#[derive(Debug, Clone, Copy)]
pub struct TinyShape {
    /// Layers.
    pub n_layer: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Feed-forward width.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Vocabulary.
    pub n_vocab: usize,
    /// Trained context.
    pub n_ctx: usize,
}

/// The spec of a small `arch` model (`llama` or `qwen2`; qwen2 gets Q/K/V biases) whose
/// matmul weights are `matmul` and whose untied output head is `head` (tied when `None`).
/// Norms and biases are f32. No tokenizer metadata.
pub fn tiny_spec(arch: &str, s: TinyShape, matmul: GgmlType, head: Option<GgmlType>) -> SynthSpec {
    let a = |k: &str| format!("{arch}.{k}");
    let metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.to_string()),
        ),
        (a("block_count"), Value::U32(s.n_layer as u32)),
        (a("embedding_length"), Value::U32(s.n_embd as u32)),
        (a("feed_forward_length"), Value::U32(s.n_ff as u32)),
        (a("attention.head_count"), Value::U32(s.n_head as u32)),
        (a("attention.head_count_kv"), Value::U32(s.n_head_kv as u32)),
        (a("context_length"), Value::U32(s.n_ctx as u32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (a("rope.freq_base"), Value::F32(10000.0)),
    ];
    let (e, f, v) = (s.n_embd as u64, s.n_ff as u64, s.n_vocab as u64);
    let hd = e / s.n_head as u64;
    let kvd = hd * s.n_head_kv as u64;
    let t = |name: String, ty: GgmlType, dims: Vec<u64>| TensorSpec {
        name,
        ggml_type: ty,
        dims,
    };
    let mut tensors = vec![t("token_embd.weight".into(), matmul, vec![e, v])];
    for i in 0..s.n_layer {
        let p = |x: &str| format!("blk.{i}.{x}");
        tensors.push(t(p("attn_norm.weight"), GgmlType::F32, vec![e]));
        tensors.push(t(p("attn_q.weight"), matmul, vec![e, e]));
        tensors.push(t(p("attn_k.weight"), matmul, vec![e, kvd]));
        tensors.push(t(p("attn_v.weight"), matmul, vec![e, kvd]));
        if arch == "qwen2" {
            tensors.push(t(p("attn_q.bias"), GgmlType::F32, vec![e]));
            tensors.push(t(p("attn_k.bias"), GgmlType::F32, vec![kvd]));
            tensors.push(t(p("attn_v.bias"), GgmlType::F32, vec![kvd]));
        }
        tensors.push(t(p("attn_output.weight"), matmul, vec![e, e]));
        tensors.push(t(p("ffn_norm.weight"), GgmlType::F32, vec![e]));
        tensors.push(t(p("ffn_gate.weight"), matmul, vec![e, f]));
        tensors.push(t(p("ffn_up.weight"), matmul, vec![e, f]));
        tensors.push(t(p("ffn_down.weight"), matmul, vec![f, e]));
    }
    tensors.push(t("output_norm.weight".into(), GgmlType::F32, vec![e]));
    if let Some(h) = head {
        tensors.push(t("output.weight".into(), h, vec![e, v]));
    }
    SynthSpec { metadata, tensors }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skeleton_round_trips_the_tensor_table_and_models_load() {
        let shape = TinyShape {
            n_layer: 2,
            n_embd: 256,
            n_ff: 512,
            n_head: 4,
            n_head_kv: 2,
            n_vocab: 300,
            n_ctx: 128,
        };
        let spec = tiny_spec("qwen2", shape, GgmlType::Q4_K, Some(GgmlType::Q6_K));
        let dir = std::env::temp_dir().join(format!("lockstep-synth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let skel = dir.join("skel.gguf");
        write_skeleton(&spec, &skel).unwrap();
        let back = spec_from_gguf(&GgufFile::open(&skel).unwrap()).unwrap();
        assert_eq!(back, spec);
        let full = dir.join("full.gguf");
        let bytes = write_model(&back, 7, &full).unwrap();
        assert_eq!(bytes, spec.data_bytes());
        let g = std::sync::Arc::new(GgufFile::open(&full).unwrap());
        assert_eq!(spec_from_gguf(&g).unwrap(), spec);
        // The CPU model loads it and gives finite logits.
        let m = model::Model::load(g, &model::LoadOptions::default()).unwrap();
        let mut kv = m.new_kv_cache(64).unwrap();
        let mut seq = m.new_sequence(&kv);
        let mut scratch = m.new_scratch();
        let rows: Vec<model::BatchRow> = (0..3)
            .map(|p| model::BatchRow {
                seq: 0,
                token: 5 + p as u32,
                pos: p,
                wants_logits: p == 2,
            })
            .collect();
        let mut logits = Vec::new();
        m.forward(&mut scratch, &mut kv, &mut [&mut seq], &rows, &mut logits)
            .unwrap();
        assert_eq!(logits.len(), 300);
        assert!(logits.iter().all(|v| v.is_finite()));
        // Same seed, same bytes; another seed, other bytes.
        let t = &spec.tensors[1];
        assert_eq!(random_tensor(t, 1).unwrap(), random_tensor(t, 1).unwrap());
        assert_ne!(random_tensor(t, 1).unwrap(), random_tensor(t, 2).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_skeleton_entries_are_errors() {
        for bad in ["x", "x|12", "x|999|4", "x|12|a,b", "|12|256", "x|12|256|1"] {
            assert!(parse_entry(bad).is_err(), "{bad}");
        }
        assert!(parse_entry("blk.0.attn_q.weight|12|256,256").is_ok());
    }
}
