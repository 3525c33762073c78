//! Weights of the forward.
//!
//! A [`Matrix`] (a matmul weight) is repacked once at load time into a
//! [`PackedMatrix`] (16-row N-interleaved tiles, bit-identical results to the row-major
//! kernels), owned by the model. A [`TensorView`] names a tensor of the mapped file and is
//! resolved to its bytes when used (the embedding table, read one row per token; the model
//! keeps the `Arc<GgufFile>` alive). One-dimensional tensors (norm weights, biases) are
//! small and decoded to f32 at load time, whatever their storage type.

use crate::ModelError;
use gguf::{GgufFile, TensorInfo};
use quant::{Format, PackedMatrix, dequantize_row};
use std::sync::Arc;

/// A matmul weight of `n` rows of `k` values (`dims = [k, n]` in the file), packed.
#[derive(Clone, Debug)]
pub(crate) struct Matrix {
    /// Tensor name (for error messages).
    pub name: String,
    /// Storage format.
    pub format: Format,
    /// Values per row (the reduction length of a matmul).
    pub k: usize,
    /// Rows (the output width of a matmul).
    pub n: usize,
    /// The packed weights.
    pub packed: Arc<PackedMatrix>,
}

impl Matrix {
    /// Bytes held by the packed weights.
    pub fn n_bytes(&self) -> usize {
        self.packed.bytes()
    }
}

/// A matrix tensor of the mapped file (`n` rows of `k` values), read in place.
#[derive(Clone, Debug)]
pub(crate) struct TensorView {
    /// Index into the file's tensor table.
    tensor: usize,
    /// Tensor name (for error messages).
    pub name: String,
    /// Storage format.
    pub format: Format,
    /// Rows.
    pub n: usize,
    /// Bytes per row.
    pub row_bytes: usize,
}

impl TensorView {
    /// The bytes of the whole matrix (`n * row_bytes`).
    pub fn bytes<'a>(&self, gguf: &'a GgufFile) -> &'a [u8] {
        gguf.tensors()
            .get(self.tensor)
            .map_or(&[], |t| gguf.tensor_data(t))
    }

    /// The bytes of row `r` (empty when out of range; callers validate `r < n`).
    pub fn row<'a>(&self, gguf: &'a GgufFile, r: usize) -> &'a [u8] {
        self.bytes(gguf)
            .get(r * self.row_bytes..(r + 1) * self.row_bytes)
            .unwrap_or(&[])
    }

    /// Bytes in the file.
    pub fn n_bytes(&self) -> usize {
        self.n * self.row_bytes
    }
}

/// Looks tensors up by name, checking shape and type.
pub(crate) struct Loader<'a> {
    gguf: &'a GgufFile,
}

impl<'a> Loader<'a> {
    /// A loader over `gguf`.
    pub fn new(gguf: &'a GgufFile) -> Loader<'a> {
        Loader { gguf }
    }

    fn info(&self, name: &str) -> Result<(usize, &'a TensorInfo), ModelError> {
        let t = self
            .gguf
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let index = self
            .gguf
            .tensors()
            .iter()
            .position(|x| std::ptr::eq(x, t))
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        Ok((index, t))
    }

    fn format(t: &TensorInfo) -> Result<Format, ModelError> {
        Format::from_ggml_type_id(t.ggml_type.id()).ok_or_else(|| ModelError::TensorType {
            name: t.name.clone(),
            ggml_type: t.ggml_type.to_string(),
            why: String::new(),
        })
    }

    /// Whether the file has a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }

    /// The matrix `name` with `dims = [k, n]`, packed for the matmul kernels; the file's
    /// pages of the tensor are released from the resident set once copied.
    pub fn matrix(&self, name: &str, k: usize, n: usize) -> Result<Matrix, ModelError> {
        let v = self.view(name, k, n)?;
        let packed = PackedMatrix::pack(v.format, v.bytes(self.gguf), n, k).map_err(|e| {
            ModelError::TensorType {
                name: name.into(),
                ggml_type: v.format.to_string(),
                why: format!(": packing: {e}"),
            }
        })?;
        // The packed copy is what the forward reads: the mapped pages of the original leave
        // the resident set (views such as the embedding lookup fault rows back in on use).
        if let Ok((_, t)) = self.info(name) {
            self.gguf.release_tensor_pages(t);
        }
        Ok(Matrix {
            name: v.name,
            format: v.format,
            k,
            n,
            packed: Arc::new(packed),
        })
    }

    /// The rows of tensor `name` (dims `dims`, whose first entry is the row length `k`),
    /// cut into `parts` matrices of `n` consecutive rows each and packed: a stacked
    /// expert tensor (`dims = [k, n, parts]`, one matrix per expert) or a grouped
    /// projection (`dims = [k, parts·n]`, one matrix per group). The file's pages are
    /// released afterwards, as for [`Loader::matrix`].
    pub fn matrix_parts(
        &self,
        name: &str,
        dims: &[u64],
        n: usize,
        parts: usize,
    ) -> Result<Vec<Matrix>, ModelError> {
        let (_, t) = self.info(name)?;
        check_dims(t, dims)?;
        let k = usize::try_from(dims.first().copied().unwrap_or(0)).unwrap_or(usize::MAX);
        let format = Self::format(t)?;
        let bad = |why: String| ModelError::TensorType {
            name: name.into(),
            ggml_type: t.ggml_type.to_string(),
            why,
        };
        let row_bytes = format.row_bytes(k).map_err(|e| bad(format!(": {e}")))?;
        let part_bytes = row_bytes
            .checked_mul(n)
            .ok_or_else(|| bad(": too large".into()))?;
        let bytes = self.gguf.tensor_data(t);
        if (bytes.len() as u128) != (part_bytes as u128) * (parts as u128) {
            return Err(bad(format!(
                ": {} bytes, expected {parts} parts of {n} rows of {row_bytes} bytes",
                bytes.len()
            )));
        }
        let mut out = Vec::with_capacity(parts);
        for (i, chunk) in bytes
            .chunks_exact(part_bytes.max(1))
            .take(parts)
            .enumerate()
        {
            let packed = PackedMatrix::pack(format, chunk, n, k)
                .map_err(|e| bad(format!(": packing part {i}: {e}")))?;
            out.push(Matrix {
                name: format!("{name}[{i}]"),
                format,
                k,
                n,
                packed: Arc::new(packed),
            });
        }
        if out.len() != parts {
            return Err(bad(format!(": {} parts, expected {parts}", out.len())));
        }
        self.gguf.release_tensor_pages(t);
        Ok(out)
    }

    /// The I32 tensor `name` with dimensions `dims`, decoded (little-endian).
    pub fn i32s(&self, name: &str, dims: &[u64]) -> Result<Vec<i32>, ModelError> {
        let (_, t) = self.info(name)?;
        check_dims(t, dims)?;
        if t.ggml_type != gguf::GgmlType::I32 {
            return Err(ModelError::TensorType {
                name: name.into(),
                ggml_type: t.ggml_type.to_string(),
                why: ": expected i32".into(),
            });
        }
        let bytes = self.gguf.tensor_data(t);
        let want = t.n_elements().saturating_mul(4);
        if bytes.len() as u64 != want {
            return Err(ModelError::TensorType {
                name: name.into(),
                ggml_type: t.ggml_type.to_string(),
                why: format!(": {} bytes, expected {want}", bytes.len()),
            });
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// A view of the matrix `name` with `dims = [k, n]` in the mapped file.
    pub fn view(&self, name: &str, k: usize, n: usize) -> Result<TensorView, ModelError> {
        let (tensor, t) = self.info(name)?;
        check_dims(t, &[k as u64, n as u64])?;
        let format = Self::format(t)?;
        let row_bytes = format.row_bytes(k).map_err(|e| ModelError::TensorType {
            name: name.into(),
            ggml_type: t.ggml_type.to_string(),
            why: format!(": {e}"),
        })?;
        if (t.n_bytes as u128) != (row_bytes as u128) * (n as u128) {
            return Err(ModelError::TensorType {
                name: name.into(),
                ggml_type: t.ggml_type.to_string(),
                why: format!(
                    ": {} bytes, expected {n} rows of {row_bytes} bytes",
                    t.n_bytes
                ),
            });
        }
        Ok(TensorView {
            tensor,
            name: name.into(),
            format,
            n,
            row_bytes,
        })
    }

    /// The vector `name` of `len` values, decoded to f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let (_, t) = self.info(name)?;
        check_dims(t, &[len as u64])?;
        let format = Self::format(t)?;
        let mut out = vec![0.0f32; len];
        dequantize_row(format, self.gguf.tensor_data(t), &mut out).map_err(|e| {
            ModelError::TensorType {
                name: name.into(),
                ggml_type: t.ggml_type.to_string(),
                why: format!(": {e}"),
            }
        })?;
        Ok(out)
    }

    /// [`Loader::vector`] when the tensor exists, `None` otherwise.
    pub fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, ModelError> {
        if self.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

fn check_dims(t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
    if t.dims != expected {
        return Err(ModelError::TensorShape {
            name: t.name.clone(),
            expected: expected.to_vec(),
            got: t.dims.clone(),
        });
    }
    Ok(())
}
