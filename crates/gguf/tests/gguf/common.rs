//! Shared test helpers: a raw byte builder for hand-crafted (possibly invalid) files and a
//! small valid file.

#![allow(dead_code)]

use lockstep_gguf::{Array, GgmlType, GgufWriter, Value};

/// Builds GGUF bytes field by field, with no validation.
#[derive(Clone, Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    /// Magic, version and the two counts.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(Vec::new())
            .bytes(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    pub fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    pub fn u8(self, v: u8) -> Raw {
        self.bytes(&[v])
    }
    pub fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    /// A GGUF string: `u64` length then the bytes.
    pub fn str(self, s: &[u8]) -> Raw {
        self.u64(s.len() as u64).bytes(s)
    }
    /// A `u32` metadata entry.
    pub fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key.as_bytes()).u32(4).u32(v)
    }
    /// A string metadata entry.
    pub fn kv_str(self, key: &str, v: &[u8]) -> Raw {
        self.str(key.as_bytes()).u32(8).str(v)
    }
    /// A tensor-table entry.
    pub fn tensor(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut r = self.str(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(type_id).u64(offset)
    }
    /// Zero padding up to a multiple of `align`.
    pub fn pad(mut self, align: usize) -> Raw {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        self
    }
    /// `n` bytes of tensor data.
    pub fn data(mut self, n: usize) -> Raw {
        self.0.extend((0..n).map(|i| i as u8));
        self
    }
}

/// A small valid file exercising every value type, nested arrays and three tensors whose
/// sizes are multiples of the alignment, so the file ends exactly at the last tensor's
/// data (every strict prefix is then invalid).
pub fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let kvs: Vec<(&str, Value)> = vec![
        ("general.architecture", "llama".into()),
        ("u8", 7u8.into()),
        ("i8", (-7i8).into()),
        ("u16", 700u16.into()),
        ("i16", (-700i16).into()),
        ("u32", 70_000u32.into()),
        ("i32", (-70_000i32).into()),
        ("f32", 1.5f32.into()),
        ("bool", true.into()),
        ("u64", (1u64 << 40).into()),
        ("i64", (-(1i64 << 40)).into()),
        ("f64", 2.25f64.into()),
        ("tokens", vec!["a", "bc", "ünï"].into()),
        ("scores", vec![0.5f32, -1.0].into()),
        ("types", vec![1i32, 3, 6].into()),
        ("flags", vec![true, false].into()),
        (
            "nested",
            Array::Array(vec![Array::U8(vec![1, 2]), Array::String(vec!["x".into()])]).into(),
        ),
    ];
    for (k, v) in kvs {
        w.add(k, v).expect("valid key");
    }
    w.add_tensor("a", &[32, 2], GgmlType::Q8_0, vec![1u8; 68])
        .expect("valid tensor");
    w.add_tensor("b", &[16], GgmlType::F32, vec![2u8; 64])
        .expect("valid tensor");
    w.add_tensor("c", &[8, 2], GgmlType::F16, vec![3u8; 32])
        .expect("valid tensor");
    let bytes = w.to_bytes();
    assert_eq!(bytes.len() % 32, 0);
    bytes
}
