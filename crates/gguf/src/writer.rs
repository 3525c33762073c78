//! A GGUF writer: builds valid v2/v3 files from metadata and tensors.
//!
//! Everything is validated as it is added, so a finished writer always produces a file
//! that [`GgufFile`](crate::GgufFile) accepts. Layout follows llama.cpp and gguf-py: the
//! tensor table in insertion order, the data section at the next multiple of the
//! alignment, each tensor's data at an aligned offset and padded with zeros to the
//! alignment (the last one included).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::GgmlType;
use crate::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, align_up};
use crate::value::{Array, Value};

/// The largest alignment the writer accepts (the reader accepts any power of two).
pub const MAX_WRITER_ALIGNMENT: u64 = 1 << 20;

/// An error building or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// A version other than 2 or 3.
    #[error("cannot write GGUF version {0}: only 2 and 3")]
    UnsupportedVersion(u32),
    /// The key was already added.
    #[error("duplicate metadata key '{0}'")]
    DuplicateKey(String),
    /// The tensor name was already added.
    #[error("duplicate tensor name '{0}'")]
    DuplicateTensor(String),
    /// `general.alignment` not an integer power of two in 1..=[`MAX_WRITER_ALIGNMENT`].
    #[error(
        "general.alignment must be an integer power of two up to {MAX_WRITER_ALIGNMENT}, got {0}"
    )]
    BadAlignment(String),
    /// Arrays nested deeper than the reader accepts.
    #[error("key '{0}': arrays nested deeper than {MAX_ARRAY_DEPTH} levels")]
    ArrayTooDeep(String),
    /// More than 4 dimensions.
    #[error("tensor '{tensor}': {n_dims} dimensions (at most 4)")]
    TooManyDims {
        /// Tensor name.
        tensor: String,
        /// Dimensions given.
        n_dims: usize,
    },
    /// `ne0` not a whole number of blocks, or the size overflows.
    #[error(
        "tensor '{tensor}': dimensions {dims:?} do not make whole {ggml_type} blocks or overflow"
    )]
    BadShape {
        /// Tensor name.
        tensor: String,
        /// Dimensions given.
        dims: Vec<u64>,
        /// The type.
        ggml_type: GgmlType,
    },
    /// The data is not exactly the tensor's size.
    #[error("tensor '{tensor}': {actual} bytes of data, its shape and type need {expected}")]
    DataLength {
        /// Tensor name.
        tensor: String,
        /// Bytes the shape needs.
        expected: u64,
        /// Bytes given.
        actual: u64,
    },
    /// Writing failed.
    #[error("cannot write {path}")]
    Io {
        /// The file (empty for a plain writer).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF file.
///
/// ```
/// use lockstep_gguf::{GgmlType, GgufFile, GgufWriter};
///
/// let mut w = GgufWriter::new();
/// w.add("general.architecture", "llama")?;
/// w.add("llama.block_count", 2u32)?;
/// w.add_tensor("output_norm.weight", &[4], GgmlType::F32, vec![0u8; 16])?;
/// let file = GgufFile::from_bytes(w.to_bytes())?;
/// assert_eq!(file.get_u32("llama.block_count")?, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Sets the GGUF version (2 or 3; the layout is the same).
    pub fn set_version(&mut self, version: u32) -> Result<&mut Self, WriteError> {
        if version != 2 && version != 3 {
            return Err(WriteError::UnsupportedVersion(version));
        }
        self.version = version;
        Ok(self)
    }

    /// Sets the alignment by adding `general.alignment` as a `u32`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self, WriteError> {
        self.add(ALIGNMENT_KEY, Value::U32(alignment))
    }

    /// The alignment the file will use.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Adds a metadata entry (kept in insertion order). `general.alignment` must be an
    /// integer power of two up to [`MAX_WRITER_ALIGNMENT`] and sets the alignment.
    pub fn add(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<&mut Self, WriteError> {
        let key = key.into();
        let value = value.into();
        if self.keys.contains(&key) {
            return Err(WriteError::DuplicateKey(key));
        }
        if key == ALIGNMENT_KEY {
            match value.as_u64() {
                Some(a) if a.is_power_of_two() && a <= MAX_WRITER_ALIGNMENT => self.alignment = a,
                _ => {
                    return Err(WriteError::BadAlignment(format!(
                        "{} {value}",
                        value.type_description()
                    )));
                }
            }
        }
        if let Value::Array(a) = &value
            && array_depth(a) > MAX_ARRAY_DEPTH
        {
            return Err(WriteError::ArrayTooDeep(key));
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Adds a tensor: `dims` with `ne0` first (at most 4), `data` exactly the tensor's size
    /// (`ne0 / block_len * type_size * ne1 * ...` bytes).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut Self, WriteError> {
        let name = name.into();
        let data = data.into();
        if self.names.contains(&name) {
            return Err(WriteError::DuplicateTensor(name));
        }
        if dims.len() > MAX_DIMS {
            return Err(WriteError::TooManyDims {
                tensor: name,
                n_dims: dims.len(),
            });
        }
        let Some(expected) = ggml_type.tensor_bytes(dims) else {
            return Err(WriteError::BadShape {
                tensor: name,
                dims: dims.to_vec(),
                ggml_type,
            });
        };
        if expected != data.len() as u64 {
            return Err(WriteError::DataLength {
                tensor: name,
                expected,
                actual: data.len() as u64,
            });
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        Ok(self)
    }

    /// Header, metadata and tensor table, padded to the start of the data section.
    fn header_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = self.padded(offset + t.data.len() as u64);
        }
        let len = out.len() as u64;
        out.resize(self.padded(len) as usize, 0);
        out
    }

    fn padded(&self, x: u64) -> u64 {
        // The alignment is at most MAX_WRITER_ALIGNMENT and sizes are in-memory lengths,
        // so this cannot overflow.
        align_up(x, self.alignment).unwrap_or(x)
    }

    /// Writes the file to `w`.
    pub fn write_to(&self, w: &mut dyn Write) -> std::io::Result<()> {
        w.write_all(&self.header_bytes())?;
        let zeros = vec![0u8; self.alignment as usize];
        for t in &self.tensors {
            w.write_all(&t.data)?;
            let len = t.data.len() as u64;
            let pad = (self.padded(len) - len) as usize;
            w.write_all(zeros.get(..pad).unwrap_or(&[]))?;
        }
        Ok(())
    }

    /// The whole file in memory.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_to(&mut out);
        out
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), WriteError> {
        let path = path.as_ref();
        let io = |source| WriteError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        self.write_to(&mut f).map_err(io)?;
        f.flush().map_err(io)
    }
}

fn array_depth(a: &Array) -> usize {
    match a {
        Array::Array(v) => 1 + v.iter().map(array_depth).max().unwrap_or(0),
        _ => 1,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
    }
}
