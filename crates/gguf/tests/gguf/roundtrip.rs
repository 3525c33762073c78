//! Writer → reader round trips: whatever the writer accepts, the reader returns unchanged.

use lockstep_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value, WriteError};
use proptest::prelude::*;

fn leaf_array() -> impl Strategy<Value = Array> {
    use prop::collection::vec;
    prop_oneof![
        vec(any::<u8>(), 0..6).prop_map(Array::U8),
        vec(any::<i8>(), 0..6).prop_map(Array::I8),
        vec(any::<u16>(), 0..6).prop_map(Array::U16),
        vec(any::<i16>(), 0..6).prop_map(Array::I16),
        vec(any::<u32>(), 0..6).prop_map(Array::U32),
        vec(any::<i32>(), 0..6).prop_map(Array::I32),
        vec(any::<f32>(), 0..6).prop_map(Array::F32),
        vec(any::<bool>(), 0..6).prop_map(Array::Bool),
        vec(".{0,8}", 0..6).prop_map(Array::String),
        vec(any::<u64>(), 0..6).prop_map(Array::U64),
        vec(any::<i64>(), 0..6).prop_map(Array::I64),
        vec(any::<f64>(), 0..6).prop_map(Array::F64),
    ]
}

fn array() -> impl Strategy<Value = Array> {
    leaf_array().prop_recursive(3, 24, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(Array::Array)
    })
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<f32>().prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        ".{0,16}".prop_map(Value::String),
        array().prop_map(Value::Array),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f64>().prop_map(Value::F64),
    ]
}

/// A tensor of a random type: `ne0` a whole number of blocks, up to 4 dims, seeded data.
fn tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, u64)> {
    (
        prop::sample::select(GgmlType::ALL.to_vec()),
        1u64..3,
        prop::collection::vec(1u64..4, 0..4),
        any::<u64>(),
    )
        .prop_map(|(t, blocks, rest, seed)| {
            let mut dims = vec![blocks * t.block_len()];
            dims.extend(rest);
            (t, dims, seed)
        })
}

fn seeded_bytes(n: u64, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Floats compared by their Debug text, so NaN equals NaN and -0.0 differs from 0.0.
fn same<T: std::fmt::Debug>(a: &T, b: &T) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn written_files_read_back_identically(
        version in 2u32..4,
        alignment in prop::option::of(prop::sample::select(vec![1u32, 2, 4, 8, 16, 32, 64, 256, 4096])),
        values in prop::collection::vec(value(), 0..12),
        tensors in prop::collection::vec(tensor(), 0..6),
    ) {
        let mut w = GgufWriter::new();
        w.set_version(version).unwrap();
        if let Some(a) = alignment {
            w.set_alignment(a).unwrap();
        }
        let mut expected_kv: Vec<(String, Value)> = Vec::new();
        if let Some(a) = alignment {
            expected_kv.push(("general.alignment".into(), Value::U32(a)));
        }
        for (i, v) in values.into_iter().enumerate() {
            let key = format!("test.key{i}");
            w.add(key.clone(), v.clone()).unwrap();
            expected_kv.push((key, v));
        }
        let mut expected_data = Vec::new();
        for (i, (t, dims, seed)) in tensors.iter().enumerate() {
            let n = t.tensor_bytes(dims).unwrap();
            let data = seeded_bytes(n, *seed);
            w.add_tensor(format!("t{i}"), dims, *t, data.clone()).unwrap();
            expected_data.push(data);
        }

        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        prop_assert_eq!(f.version(), version);
        prop_assert_eq!(f.alignment(), u64::from(alignment.unwrap_or(32)));
        prop_assert!(same(&f.metadata(), &&expected_kv[..]));
        prop_assert_eq!(f.tensors().len(), tensors.len());
        for (i, ((t, dims, _), data)) in tensors.iter().zip(&expected_data).enumerate() {
            let info = f.tensor(&format!("t{i}")).unwrap();
            prop_assert_eq!(info.ggml_type, *t);
            prop_assert_eq!(&info.dims, dims);
            prop_assert_eq!(info.n_bytes, data.len() as u64);
            prop_assert_eq!(info.offset % f.alignment(), 0);
            prop_assert_eq!(f.tensor_data(info), &data[..]);
        }
    }

    #[test]
    fn written_files_are_parsed_through_open_too(values in prop::collection::vec(value(), 0..4)) {
        let mut w = GgufWriter::new();
        for (i, v) in values.iter().enumerate() {
            w.add(format!("k{i}"), v.clone()).unwrap();
        }
        w.add_tensor("t", &[32], GgmlType::Q4_0, vec![9u8; 18]).unwrap();
        let dir = std::env::temp_dir().join(format!("lockstep-gguf-rt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}.gguf", values.len()));
        w.write_file(&path).unwrap();
        let f = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        prop_assert_eq!(f.metadata().len(), values.len());
        prop_assert_eq!(f.tensor_data(f.tensor("t").unwrap()), &[9u8; 18][..]);
    }
}

#[test]
fn writer_rejects_invalid_input() {
    let mut w = GgufWriter::new();
    w.add("a", 1u32).unwrap();
    assert!(matches!(w.add("a", 2u32), Err(WriteError::DuplicateKey(k)) if k == "a"));
    assert!(matches!(
        w.set_version(1),
        Err(WriteError::UnsupportedVersion(1))
    ));
    assert!(matches!(
        w.set_alignment(48),
        Err(WriteError::BadAlignment(_))
    ));
    assert!(matches!(
        w.add("general.alignment", "32"),
        Err(WriteError::BadAlignment(_))
    ));
    w.add_tensor("t", &[4], GgmlType::F32, vec![0u8; 16])
        .unwrap();
    assert!(matches!(
        w.add_tensor("t", &[4], GgmlType::F32, vec![0u8; 16]),
        Err(WriteError::DuplicateTensor(_))
    ));
    assert!(matches!(
        w.add_tensor("u", &[4], GgmlType::F32, vec![0u8; 15]),
        Err(WriteError::DataLength {
            expected: 16,
            actual: 15,
            ..
        })
    ));
    assert!(matches!(
        w.add_tensor("v", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0u8; 4]),
        Err(WriteError::TooManyDims { n_dims: 5, .. })
    ));
    assert!(matches!(
        w.add_tensor("q", &[16], GgmlType::Q4_0, vec![0u8; 9]),
        Err(WriteError::BadShape { .. })
    ));
    let mut deep = Array::U8(vec![1]);
    for _ in 0..lockstep_gguf::MAX_ARRAY_DEPTH {
        deep = Array::Array(vec![deep]);
    }
    assert!(matches!(
        w.add("deep", deep),
        Err(WriteError::ArrayTooDeep(_))
    ));
    // The rejected calls left the writer valid.
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.metadata().len(), 1);
    assert_eq!(f.tensors().len(), 1);
}

#[test]
fn writer_output_has_llama_cpp_layout() {
    // Data section aligned, each tensor padded to the alignment, the last one included.
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12])
        .unwrap();
    w.add_tensor("b", &[1], GgmlType::F32, vec![2u8; 4])
        .unwrap();
    let bytes = w.to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.tensor("a").unwrap().offset, 0);
    assert_eq!(f.tensor("b").unwrap().offset, 32);
    assert_eq!(bytes.len() as u64, f.data_offset() + 64);
}

#[test]
fn released_tensor_pages_read_back_unchanged() {
    // A 1 MiB F32 tensor between two small ones: releasing its pages must not change any
    // byte of it or of its neighbours, mapped or not.
    let mut w = GgufWriter::new();
    let big = seeded_bytes(1 << 20, 7);
    w.add_tensor("a", &[8], GgmlType::F32, seeded_bytes(32, 1))
        .unwrap();
    w.add_tensor("big", &[1 << 18], GgmlType::F32, big.clone())
        .unwrap();
    w.add_tensor("b", &[8], GgmlType::F32, seeded_bytes(32, 2))
        .unwrap();
    let dir = std::env::temp_dir().join(format!("lockstep-gguf-release-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("release.gguf");
    w.write_file(&path).unwrap();
    let mapped = GgufFile::open(&path).unwrap();
    let in_memory = GgufFile::from_bytes(w.to_bytes()).unwrap();
    for f in [&mapped, &in_memory] {
        let info = f.tensor("big").unwrap().clone();
        assert_eq!(f.tensor_data(&info), &big[..]);
        f.release_tensor_pages(&info);
        assert_eq!(f.tensor_data(&info), &big[..]);
        assert_eq!(
            f.tensor_data(f.tensor("a").unwrap()),
            &seeded_bytes(32, 1)[..]
        );
        assert_eq!(
            f.tensor_data(f.tensor("b").unwrap()),
            &seeded_bytes(32, 2)[..]
        );
    }
    std::fs::remove_file(&path).unwrap();
}
