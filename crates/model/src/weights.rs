//! Weight views over the mapped GGUF file.
//!
//! A [`Matrix`] names a tensor of the file and is resolved to its bytes when used: the
//! weights are never copied (the model keeps the `Arc<GgufFile>` alive). One-dimensional
//! tensors (norm weights, biases) are small and decoded to f32 at load time, whatever
//! their storage type. A later load-time repacking (e.g. N-interleaved tiles) would add an
//! owned byte buffer beside the tensor index; every caller goes through [`Matrix::bytes`].

use crate::ModelError;
use gguf::{GgufFile, TensorInfo};
use quant::{Format, dequantize_row};

/// A weight matrix of `n` rows of `k` values (`dims = [k, n]`, `k` contiguous), in its
/// file format.
#[derive(Clone, Debug)]
pub(crate) struct Matrix {
    /// Index into the file's tensor table.
    tensor: usize,
    /// Tensor name (for error messages).
    pub name: String,
    /// Storage format.
    pub format: Format,
    /// Values per row (the reduction length of a matmul).
    pub k: usize,
    /// Rows (the output width of a matmul).
    pub n: usize,
    /// Bytes per row.
    pub row_bytes: usize,
}

impl Matrix {
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

    /// The matrix `name` with `dims = [k, n]`.
    pub fn matrix(&self, name: &str, k: usize, n: usize) -> Result<Matrix, ModelError> {
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
        Ok(Matrix {
            tensor,
            name: name.into(),
            format,
            k,
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
