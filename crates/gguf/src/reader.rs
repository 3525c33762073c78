//! Parsing: a bounds-checked cursor over the file bytes, the header, metadata and tensor
//! table, and the validation of tensor placement.
//!
//! Every count read from the file is checked against the bytes that remain before anything
//! is allocated for it, so a hostile count costs an error, not memory.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use crate::value::{Array, Value, ValueType};
use crate::{GgmlType, GgufError};

/// The alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The largest alignment accepted: the largest power of two in a `u32`, the spec's type
/// for `general.alignment` (any integer type holding such a value is accepted).
pub const MAX_ALIGNMENT: u64 = 1 << 31;
/// The deepest nesting of arrays accepted (an array value is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;
/// The metadata key holding the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Fewest bytes one tensor-table entry takes: name length, `n_dims`, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// Fewest bytes one metadata entry takes: key length, type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, `ne0` (the contiguous one) first, as stored in the file; at most 4.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to [`GgufFile::data_offset`].
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dimensions; validated not to overflow).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }
}

/// Where the file bytes live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// Everything parsed from the header, independent of where the bytes live.
struct Header {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_offset: u64,
}

/// An opened, fully validated GGUF file (v2 or v3, single file).
///
/// Opening validates the whole header and the placement of every tensor, so the accessors
/// below cannot fail on file contents.
pub struct GgufFile {
    storage: Storage,
    header: Header,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("len", &self.file_len())
            .field("version", &self.header.version)
            .field("alignment", &self.header.alignment)
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .field("data_offset", &self.header.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps a file, then parses and validates it.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let storage = if len == 0 {
            // A zero-length mapping is an error on some systems; an empty file is simply
            // truncated, which the parser reports.
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this value. Rust's aliasing rules
            // assume the bytes do not change while mapped; like every mmap-based model
            // loader we accept that another process truncating or rewriting the file
            // during use is outside our guarantees (documented on the crate).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
            Storage::Mapped(map)
        };
        Self::from_storage(storage)
    }

    /// Parses and validates a file held in memory (tests, fuzzing, small generated files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let header = parse(storage.bytes())?;
        Ok(GgufFile { storage, header })
    }

    /// File length in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset where tensor data starts.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let i = *self.header.key_index.get(key)?;
        self.header.metadata.get(i).map(|(_, v)| v)
    }

    /// The value of a metadata key, or [`GgufError::MissingKey`].
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
        })
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        conv: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let v = self.require(key)?;
        conv(v).ok_or_else(|| {
            if v.is_integer() && matches!(expected, "u32" | "u64" | "i64") {
                GgufError::OutOfRange {
                    key: key.to_string(),
                    value: v.to_string(),
                    expected,
                }
            } else {
                GgufError::WrongType {
                    key: key.to_string(),
                    found: v.type_description(),
                    expected,
                }
            }
        })
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    /// An integer value of any integer type that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "u32", Value::as_u32)
    }

    /// An integer value of any integer type that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "u64", Value::as_u64)
    }

    /// An integer value of any integer type that fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.typed(key, "i64", Value::as_i64)
    }

    /// An `f32` value (an `f64` is narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "f32", Value::as_f32)
    }

    /// An `f32` or `f64` value as `f64`.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.typed(key, "f64", Value::as_f64)
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "bool", Value::as_bool)
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        self.typed(key, "array", Value::as_array)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor with this name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let i = *self.header.tensor_index.get(name)?;
        self.header.tensors.get(i)
    }

    /// Tells the OS that this process no longer needs the mapped pages of tensor `t` (for
    /// a tensor whose bytes were copied elsewhere, e.g. repacked at load). The pages leave
    /// this process's resident set; the bytes stay readable (a later read faults them in
    /// again from the file). Only whole pages inside the tensor are released; a no-op for
    /// files read into memory and on platforms without `madvise`.
    pub fn release_tensor_pages(&self, t: &TensorInfo) {
        #[cfg(unix)]
        if let Storage::Mapped(map) = &self.storage {
            let Some(start) = self
                .header
                .data_offset
                .checked_add(t.offset)
                .and_then(|s| usize::try_from(s).ok())
            else {
                return;
            };
            let Some(end) = usize::try_from(t.n_bytes)
                .ok()
                .and_then(|n| start.checked_add(n))
            else {
                return;
            };
            let end = end.min(map.len());
            let page = RELEASE_ALIGN;
            let lo = start.div_ceil(page) * page;
            let hi = end / page * page;
            if lo < hi {
                // SAFETY: the mapping is a read-only shared file mapping; MADV_DONTNEED only
                // drops this process's page-table entries for the range, and later reads
                // fault the same file bytes back in (the file is assumed unchanged while
                // mapped, as for the whole mapping). The range lies inside the mapping.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
                };
            }
        }
        #[cfg(not(unix))]
        let _ = t;
    }

    /// The bytes of a tensor of this file (validated in bounds when the file was opened).
    ///
    /// A `TensorInfo` that does not belong to this file gives its bytes if they happen to
    /// lie inside this file, and an empty slice otherwise.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = self
            .header
            .data_offset
            .checked_add(t.offset)
            .and_then(|start| Some((start, start.checked_add(t.n_bytes)?)))
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range
            .and_then(|r| self.storage.bytes().get(r))
            .unwrap_or(&[])
    }
}

/// A bounds-checked reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    /// The next `n` bytes; `what` describes the read for the error.
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let truncated = || GgufError::Truncated {
            what: what(),
            offset: self.offset(),
            needed: n,
            available: self.remaining(),
        };
        let n_usize = usize::try_from(n).map_err(|_| truncated())?;
        let end = self.pos.checked_add(n_usize).ok_or_else(truncated)?;
        let slice = self.buf.get(self.pos..end).ok_or_else(truncated)?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string: `u64` length, then that many UTF-8 bytes.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let start = self.offset();
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                what: what(),
                offset: start,
            }),
        }
    }

    /// Rejects a count of items of at least `min_size` bytes each that cannot fit in the
    /// rest of the file, and returns it as a `usize` that is safe to allocate for.
    fn check_count(
        &self,
        count: u64,
        min_size: u64,
        count_offset: u64,
        what: &dyn Fn() -> String,
    ) -> Result<usize, GgufError> {
        let min_bytes = count.saturating_mul(min_size);
        let too_large = || GgufError::CountTooLarge {
            what: what(),
            offset: count_offset,
            count,
            min_bytes,
            available: self.remaining(),
        };
        if min_bytes > self.remaining() {
            return Err(too_large());
        }
        usize::try_from(count).map_err(|_| too_large())
    }
}

/// Parses and validates a whole file.
fn parse(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };

    let magic = c.array::<4>(&|| "magic".to_string())?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".to_string())?;
    if version != 2 && version != 3 {
        let hint = if version == 1 {
            " (GGUF v1 is obsolete; re-convert the model)"
        } else if matches!(version.swap_bytes(), 2 | 3) {
            " (the file looks big-endian)"
        } else {
            ""
        };
        return Err(GgufError::UnsupportedVersion { version, hint });
    }

    let tensor_count_offset = c.offset();
    let tensor_count = c.u64(&|| "tensor count".to_string())?;
    let kv_count_offset = c.offset();
    let kv_count = c.u64(&|| "metadata entry count".to_string())?;
    // Both tables follow; each must at least fit in what is left.
    c.check_count(
        tensor_count,
        MIN_TENSOR_INFO_BYTES,
        tensor_count_offset,
        &|| "tensor count".to_string(),
    )?;
    let n_kv = c.check_count(kv_count, MIN_KV_BYTES, kv_count_offset, &|| {
        "metadata entry count".to_string()
    })?;

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv);
    let mut key_index: HashMap<String, usize> = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key_offset = c.offset();
        let key = c.string(&|| format!("key of metadata entry #{i}"))?;
        if key_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: key_offset,
            });
        }
        let value = read_value(&mut c, &key)?;
        key_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }

    let alignment = match key_index.get(ALIGNMENT_KEY).and_then(|&i| metadata.get(i)) {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => a,
            _ => {
                return Err(GgufError::BadAlignment {
                    found: format!("{} {v}", v.type_description()),
                });
            }
        },
    };

    let n_tensors = c.check_count(
        tensor_count,
        MIN_TENSOR_INFO_BYTES,
        tensor_count_offset,
        &|| "tensor count".to_string(),
    )?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name_offset = c.offset();
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        if tensor_index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                tensor: name,
                offset: name_offset,
            });
        }
        let t = read_tensor_info(&mut c, name, alignment)?;
        tensor_index.insert(t.name.clone(), tensors.len());
        tensors.push(t);
    }

    let header_end = c.offset();
    let data_offset = align_up(header_end, alignment).ok_or_else(|| GgufError::BadAlignment {
        found: format!("{alignment} (data section start overflows)"),
    })?;
    check_placement(&tensors, data_offset, buf.len() as u64)?;

    Ok(Header {
        version,
        alignment,
        metadata,
        key_index,
        tensors,
        tensor_index,
        data_offset,
    })
}

/// `x` rounded up to a multiple of the power of two `align`.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    let mask = align.checked_sub(1)?;
    Some(x.checked_add(mask)? & !mask)
}

fn read_tensor_info(
    c: &mut Cursor<'_>,
    name: String,
    alignment: u64,
) -> Result<TensorInfo, GgufError> {
    let n_dims_offset = c.offset();
    let n_dims = c.u32(&|| format!("dimension count of tensor '{name}'"))?;
    if n_dims as usize > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            tensor: name,
            n_dims,
            offset: n_dims_offset,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(c.u64(&|| format!("dimension {d} of tensor '{name}'"))?);
    }
    let type_offset = c.offset();
    let type_id = c.u32(&|| format!("type of tensor '{name}'"))?;
    let offset = c.u64(&|| format!("offset of tensor '{name}'"))?;

    let Some(ggml_type) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownGgmlType {
            tensor: name,
            type_id,
            offset: type_offset,
        });
    };
    let ne0 = dims.first().copied().unwrap_or(1);
    if ne0 % ggml_type.block_len() != 0 {
        return Err(GgufError::PartialBlock {
            tensor: name,
            ggml_type,
            ne0,
            block_len: ggml_type.block_len(),
        });
    }
    let Some(n_bytes) = ggml_type.tensor_bytes(&dims) else {
        return Err(GgufError::DimsOverflow { tensor: name, dims });
    };
    if offset % alignment != 0 {
        return Err(GgufError::MisalignedTensor {
            tensor: name,
            offset,
            alignment,
        });
    }
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        n_bytes,
    })
}

/// Every tensor's data inside the file, and no two overlapping.
fn check_placement(
    tensors: &[TensorInfo],
    data_offset: u64,
    file_len: u64,
) -> Result<(), GgufError> {
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => {
                if t.n_bytes > 0 {
                    spans.push((start, end, i));
                }
            }
            _ => {
                let start = data_offset.saturating_add(t.offset);
                return Err(GgufError::TensorOutOfBounds {
                    tensor: t.name.clone(),
                    start,
                    end: start.saturating_add(t.n_bytes),
                    file_len,
                });
            }
        }
    }
    spans.sort_unstable();
    // Sorted by start: a span overlaps an earlier one iff it starts before the furthest end
    // seen so far.
    let mut furthest: Option<(u64, usize)> = None;
    for &(start, end, i) in &spans {
        if let Some((fend, fi)) = furthest
            && start < fend
        {
            let name = |k: usize| tensors.get(k).map(|t| t.name.clone()).unwrap_or_default();
            return Err(GgufError::TensorOverlap {
                first: name(fi),
                second: name(i),
            });
        }
        if furthest.is_none_or(|(fend, _)| end > fend) {
            furthest = Some((end, i));
        }
    }
    Ok(())
}

/// One metadata value: its `u32` type tag, then the value.
fn read_value(c: &mut Cursor<'_>, key: &str) -> Result<Value, GgufError> {
    let type_offset = c.offset();
    let type_id = c.u32(&|| format!("value type of key '{key}'"))?;
    let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        type_id,
        offset: type_offset,
    })?;
    let what = || format!("value of key '{key}'");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.u8(&what)?),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array(&what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(c.u32(&what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::U64 => Value::U64(c.u64(&what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => {
            let offset = c.offset();
            Value::Bool(to_bool(c.u8(&what)?, key, offset)?)
        }
        ValueType::String => Value::String(c.string(&what)?),
        ValueType::Array => Value::Array(read_array(c, key, 1)?),
    })
}

fn to_bool(byte: u8, key: &str, offset: u64) -> Result<bool, GgufError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(GgufError::InvalidBool {
            key: key.to_string(),
            byte,
            offset,
        }),
    }
}

/// Decodes `n` fixed-size little-endian elements.
fn fixed<const N: usize, T>(
    c: &mut Cursor<'_>,
    n: usize,
    what: &dyn Fn() -> String,
    conv: fn([u8; N]) -> T,
) -> Result<Vec<T>, GgufError> {
    let bytes = c.take((n as u64).saturating_mul(N as u64), what)?;
    Ok(bytes
        .chunks_exact(N)
        .map(|ch| {
            let mut a = [0u8; N];
            a.copy_from_slice(ch);
            conv(a)
        })
        .collect())
}

/// An array: element type tag, `u64` count, elements. `depth` is 1 for a top-level array.
fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<Array, GgufError> {
    let start = c.offset();
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::ArrayTooDeep {
            key: key.to_string(),
            max: MAX_ARRAY_DEPTH,
            offset: start,
        });
    }
    let type_id = c.u32(&|| format!("element type of array '{key}'"))?;
    let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        type_id,
        offset: start,
    })?;
    let count_offset = c.offset();
    let count = c.u64(&|| format!("length of array '{key}'"))?;
    let n = c.check_count(count, ty.min_encoded_size(), count_offset, &|| {
        format!("array '{key}' of {ty}")
    })?;
    let what = || format!("elements of array '{key}'");
    Ok(match ty {
        ValueType::U8 => Array::U8(c.take(n as u64, &what)?.to_vec()),
        ValueType::I8 => Array::I8(fixed(c, n, &what, i8::from_le_bytes)?),
        ValueType::U16 => Array::U16(fixed(c, n, &what, u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(fixed(c, n, &what, i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(fixed(c, n, &what, u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(fixed(c, n, &what, i32::from_le_bytes)?),
        ValueType::F32 => Array::F32(fixed(c, n, &what, f32::from_le_bytes)?),
        ValueType::U64 => Array::U64(fixed(c, n, &what, u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(fixed(c, n, &what, i64::from_le_bytes)?),
        ValueType::F64 => Array::F64(fixed(c, n, &what, f64::from_le_bytes)?),
        ValueType::Bool => {
            let bytes_offset = c.offset();
            let bytes = c.take(n as u64, &what)?;
            let mut v = Vec::with_capacity(n);
            for (i, &b) in bytes.iter().enumerate() {
                v.push(to_bool(b, key, bytes_offset + i as u64)?);
            }
            Array::Bool(v)
        }
        ValueType::String => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(c.string(&|| format!("element {i} of array '{key}'"))?);
            }
            Array::String(v)
        }
        ValueType::Array => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            Array::Array(v)
        }
    })
}

/// Alignment of released ranges: a multiple of every common page size (4, 16 and 64 KiB),
/// so no system call is needed to ask for it.
#[cfg(unix)]
const RELEASE_ALIGN: usize = 64 * 1024;
