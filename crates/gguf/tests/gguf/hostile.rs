//! Hostile and damaged files: every one is a specific typed error, never a panic.

use crate::common::{Raw, small_valid_file};
use lockstep_gguf::{GgufError, GgufFile, MAX_ARRAY_DEPTH};
use proptest::prelude::*;

fn parse(raw: Raw) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(raw.0)
}

/// A header with no metadata and the given tensor table, padded, then `data` bytes.
fn with_tensors(tensors: &[(&str, &[u64], u32, u64)], data: usize) -> Raw {
    let mut r = Raw::header(3, tensors.len() as u64, 0);
    for &(name, dims, ty, off) in tensors {
        r = r.tensor(name, dims, ty, off);
    }
    r.pad(32).data(data)
}

#[test]
fn small_valid_file_parses() {
    let f = GgufFile::from_bytes(small_valid_file()).unwrap();
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.metadata().len(), 17);
    assert_eq!(f.data_offset() + 192, f.file_len());
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error() {
    let bytes = small_valid_file();
    for len in 0..bytes.len() {
        let r = GgufFile::from_bytes(bytes[..len].to_vec());
        assert!(r.is_err(), "prefix of {len} bytes parsed");
    }
}

#[test]
fn truncation_inside_the_header_reports_the_offset_and_what() {
    let bytes = Raw::header(3, 0, 1)
        .kv_str("general.architecture", b"llama")
        .0;
    // Header (24) + key length (8) + "general.architecture" (20) + type (4) + length (8):
    // the value "llama" starts at 64.
    match GgufFile::from_bytes(bytes[..66].to_vec()) {
        Err(GgufError::Truncated {
            offset,
            what,
            needed,
            available,
        }) => {
            assert_eq!((offset, needed, available), (64, 5, 2), "{what}");
            assert!(what.contains("general.architecture"), "{what}");
        }
        r => panic!("{r:?}"),
    }
}

#[test]
fn truncated_tensor_data_is_out_of_bounds() {
    let bytes = small_valid_file();
    let r = GgufFile::from_bytes(bytes[..bytes.len() - 1].to_vec());
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { ref tensor, .. }) if tensor == "c"),
        "{r:?}"
    );
}

#[test]
fn empty_file_is_truncated() {
    assert!(matches!(
        parse(Raw::default()),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn wrong_magic_is_rejected() {
    let r = parse(Raw(b"GGML\x03\0\0\0".to_vec()).u64(0).u64(0));
    assert!(
        matches!(r, Err(GgufError::BadMagic { found }) if &found == b"GGML"),
        "{r:?}"
    );
}

#[test]
fn version_1_is_rejected_clearly() {
    let err = parse(Raw::header(1, 0, 0)).unwrap_err();
    assert!(matches!(
        err,
        GgufError::UnsupportedVersion { version: 1, .. }
    ));
    assert!(err.to_string().contains("v1"), "{err}");
}

#[test]
fn big_endian_and_future_versions_are_rejected() {
    let err = parse(Raw::header(3u32.swap_bytes(), 0, 0)).unwrap_err();
    assert!(err.to_string().contains("big-endian"), "{err}");
    assert!(matches!(
        parse(Raw::header(4, 0, 0)),
        Err(GgufError::UnsupportedVersion { version: 4, .. })
    ));
}

#[test]
fn versions_2_and_3_parse_empty_files() {
    assert_eq!(parse(Raw::header(2, 0, 0)).unwrap().version(), 2);
    assert_eq!(parse(Raw::header(3, 0, 0)).unwrap().version(), 3);
}

#[test]
fn absurd_tensor_count_is_rejected_before_allocating() {
    let r = parse(Raw::header(3, u64::MAX, 0));
    assert!(
        matches!(
            r,
            Err(GgufError::CountTooLarge {
                count: u64::MAX,
                offset: 8,
                ..
            })
        ),
        "{r:?}"
    );
    let r = parse(Raw::header(3, 1 << 40, 0).data(1000));
    assert!(matches!(r, Err(GgufError::CountTooLarge { .. })), "{r:?}");
}

#[test]
fn absurd_metadata_count_is_rejected_before_allocating() {
    let r = parse(Raw::header(3, 0, u64::MAX / 2));
    assert!(
        matches!(r, Err(GgufError::CountTooLarge { offset: 16, .. })),
        "{r:?}"
    );
}

#[test]
fn huge_key_length_is_truncated_not_allocated() {
    let r = parse(Raw::header(3, 0, 1).u64(u64::MAX).u32(4).u32(0));
    assert!(
        matches!(
            r,
            Err(GgufError::Truncated {
                needed: u64::MAX,
                offset: 32,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn huge_string_value_length_is_truncated_not_allocated() {
    let r = parse(
        Raw::header(3, 0, 1)
            .str(b"k")
            .u32(8)
            .u64(1 << 62)
            .bytes(b"abc"),
    );
    match r {
        Err(GgufError::Truncated { what, needed, .. }) => {
            assert_eq!(needed, 1 << 62);
            assert!(what.contains("'k'"), "{what}");
        }
        r => panic!("{r:?}"),
    }
}

#[test]
fn huge_array_counts_are_rejected_for_every_element_kind() {
    // u32 elements need 4 bytes each, strings at least 8, nested arrays at least 12.
    for (elem_type, count) in [(4u32, 3u64), (8, 2), (9, 1), (0, 100), (10, u64::MAX)] {
        let r = parse(
            Raw::header(3, 0, 1)
                .str(b"arr")
                .u32(9)
                .u32(elem_type)
                .u64(count)
                .data(11),
        );
        match r {
            Err(GgufError::CountTooLarge { what, count: c, .. }) => {
                assert_eq!(c, count);
                assert!(what.contains("'arr'"), "{what}");
            }
            r => panic!("type {elem_type}: {r:?}"),
        }
    }
}

#[test]
fn unknown_value_type_names_the_key() {
    let r = parse(Raw::header(3, 0, 1).str(b"weird").u32(13).u32(0));
    assert!(
        matches!(r, Err(GgufError::UnknownValueType { ref key, type_id: 13, offset: 37 }) if key == "weird"),
        "{r:?}"
    );
    let r = parse(Raw::header(3, 0, 1).str(b"arr").u32(9).u32(99).u64(0));
    assert!(
        matches!(r, Err(GgufError::UnknownValueType { type_id: 99, .. })),
        "{r:?}"
    );
}

#[test]
fn bool_other_than_0_or_1_is_rejected() {
    let r = parse(Raw::header(3, 0, 1).str(b"flag").u32(7).u8(2));
    assert!(
        matches!(r, Err(GgufError::InvalidBool { byte: 2, .. })),
        "{r:?}"
    );
    let r = parse(
        Raw::header(3, 0, 1)
            .str(b"flags")
            .u32(9)
            .u32(7)
            .u64(3)
            .bytes(&[1, 0, 9]),
    );
    assert!(
        matches!(r, Err(GgufError::InvalidBool { byte: 9, .. })),
        "{r:?}"
    );
}

#[test]
fn non_utf8_strings_are_errors_naming_the_place() {
    let r = parse(Raw::header(3, 0, 1).str(b"bad\xff").u32(4).u32(0));
    assert!(
        matches!(r, Err(GgufError::InvalidUtf8 { offset: 32, .. })),
        "{r:?}"
    );
    let r = parse(Raw::header(3, 0, 1).kv_str("name", b"\xc3\x28"));
    match r {
        Err(GgufError::InvalidUtf8 { what, .. }) => assert!(what.contains("'name'"), "{what}"),
        r => panic!("{r:?}"),
    }
    let r = parse(
        Raw::header(3, 0, 1)
            .str(b"toks")
            .u32(9)
            .u32(8)
            .u64(2)
            .str(b"ok")
            .str(b"\x80"),
    );
    match r {
        Err(GgufError::InvalidUtf8 { what, .. }) => {
            assert!(
                what.contains("element 1") && what.contains("'toks'"),
                "{what}"
            )
        }
        r => panic!("{r:?}"),
    }
    let r = parse(with_tensors(&[("t\u{0}", &[4], 0, 0)], 16));
    assert!(r.is_ok(), "NUL is valid UTF-8: {r:?}");
    let mut raw = Raw::header(3, 1, 0)
        .str(b"\xfe")
        .u32(1)
        .u64(4)
        .u32(0)
        .u64(0);
    raw = raw.pad(32).data(16);
    assert!(matches!(parse(raw), Err(GgufError::InvalidUtf8 { .. })));
}

#[test]
fn duplicate_keys_are_rejected() {
    let r = parse(Raw::header(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2));
    assert!(
        matches!(r, Err(GgufError::DuplicateKey { ref key, offset: 43 }) if key == "a.b"),
        "{r:?}"
    );
}

#[test]
fn duplicate_tensor_names_are_rejected() {
    let r = parse(with_tensors(&[("w", &[8], 0, 0), ("w", &[8], 0, 32)], 64));
    assert!(
        matches!(r, Err(GgufError::DuplicateTensor { ref tensor, .. }) if tensor == "w"),
        "{r:?}"
    );
}

#[test]
fn nested_array_depth_bomb_is_rejected_without_recursing_deeply() {
    // 100,000 levels of arrays of one array: would overflow the stack if followed.
    let mut raw = Raw::header(3, 0, 1).str(b"bomb").u32(9);
    for _ in 0..100_000 {
        raw = raw.u32(9).u64(1);
    }
    raw = raw.u32(4).u64(0);
    let r = parse(raw);
    assert!(
        matches!(r, Err(GgufError::ArrayTooDeep { ref key, max: MAX_ARRAY_DEPTH, .. }) if key == "bomb"),
        "{r:?}"
    );
}

#[test]
fn nesting_up_to_the_limit_is_accepted() {
    let mut raw = Raw::header(3, 0, 1).str(b"deep").u32(9);
    for _ in 1..MAX_ARRAY_DEPTH {
        raw = raw.u32(9).u64(1);
    }
    raw = raw.u32(4).u64(1).u32(42);
    let f = parse(raw).unwrap();
    let mut a = f.get_array("deep").unwrap();
    for _ in 1..MAX_ARRAY_DEPTH {
        a = &a.as_arrays().unwrap()[0];
    }
    assert_eq!(a.as_u32s(), Some(&[42u32][..]));
}

#[test]
fn bad_alignment_values_are_rejected() {
    for v in [0u32, 3, 48] {
        let r = parse(Raw::header(3, 0, 1).kv_u32("general.alignment", v));
        assert!(
            matches!(r, Err(GgufError::BadAlignment { .. })),
            "{v}: {r:?}"
        );
    }
    let r = parse(Raw::header(3, 0, 1).kv_str("general.alignment", b"32"));
    assert!(matches!(r, Err(GgufError::BadAlignment { .. })), "{r:?}");
    // A power of two beyond u32 (the spec's type for the key).
    let r = parse(
        Raw::header(3, 0, 1)
            .str(b"general.alignment")
            .u32(10)
            .u64(1 << 63),
    );
    assert!(matches!(r, Err(GgufError::BadAlignment { .. })), "{r:?}");
}

#[test]
fn alignment_is_read_from_metadata() {
    let raw = Raw::header(3, 1, 1)
        .kv_u32("general.alignment", 64)
        .tensor("t", &[4], 0, 0)
        .pad(64)
        .data(16);
    let f = parse(raw).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    let raw = Raw::header(3, 1, 1)
        .kv_u32("general.alignment", 64)
        .tensor("t", &[4], 0, 32)
        .pad(64)
        .data(64);
    assert!(matches!(
        parse(raw),
        Err(GgufError::MisalignedTensor {
            alignment: 64,
            offset: 32,
            ..
        })
    ));
}

#[test]
fn more_than_four_dims_is_rejected() {
    let r = parse(with_tensors(&[("t", &[1, 1, 1, 1, 1], 0, 0)], 4));
    assert!(
        matches!(r, Err(GgufError::TooManyDims { n_dims: 5, .. })),
        "{r:?}"
    );
    let r = parse(Raw::header(3, 1, 0).str(b"t").u32(u32::MAX).data(64));
    assert!(matches!(r, Err(GgufError::TooManyDims { .. })), "{r:?}");
}

#[test]
fn dims_overflow_is_rejected() {
    for dims in [
        &[u64::MAX, 2][..],
        &[1 << 32, 1 << 32],
        &[1 << 62, 2],
        &[4, 1 << 62],
    ] {
        let r = parse(with_tensors(&[("t", dims, 0, 0)], 64));
        assert!(
            matches!(r, Err(GgufError::DimsOverflow { ref tensor, .. }) if tensor == "t"),
            "{dims:?}: {r:?}"
        );
    }
}

#[test]
fn unknown_ggml_type_ids_are_rejected() {
    for id in [4u32, 31, 36, 42, 1000] {
        let r = parse(with_tensors(&[("t", &[32], id, 0)], 64));
        assert!(
            matches!(r, Err(GgufError::UnknownGgmlType { type_id, .. }) if type_id == id),
            "{id}: {r:?}"
        );
    }
}

#[test]
fn first_dim_not_a_whole_number_of_blocks_is_rejected() {
    // Q4_K (12) has blocks of 256.
    let r = parse(with_tensors(&[("t", &[100, 2], 12, 0)], 1000));
    assert!(
        matches!(
            r,
            Err(GgufError::PartialBlock {
                ne0: 100,
                block_len: 256,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn tensor_past_the_end_is_rejected() {
    let r = parse(with_tensors(&[("t", &[16], 0, 0)], 63));
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { ref tensor, .. }) if tensor == "t"),
        "{r:?}"
    );
    let r = parse(with_tensors(&[("t", &[16], 0, 1 << 20)], 64));
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { .. })),
        "{r:?}"
    );
    // Offset so large that offset + size overflows u64.
    let r = parse(with_tensors(&[("t", &[16], 0, u64::MAX - 31)], 64));
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { .. })),
        "{r:?}"
    );
}

#[test]
fn misaligned_tensor_offset_is_rejected() {
    let r = parse(with_tensors(&[("t", &[4], 0, 4)], 64));
    assert!(
        matches!(
            r,
            Err(GgufError::MisalignedTensor {
                offset: 4,
                alignment: 32,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn overlapping_tensors_are_rejected() {
    let r = parse(with_tensors(
        &[("a", &[16], 0, 0), ("b", &[16], 0, 32)],
        128,
    ));
    assert!(
        matches!(r, Err(GgufError::TensorOverlap { ref first, ref second }) if first == "a" && second == "b"),
        "{r:?}"
    );
    // Listed out of order, and one inside another.
    let r = parse(with_tensors(
        &[("small", &[8], 0, 64), ("big", &[64], 0, 0)],
        256,
    ));
    assert!(
        matches!(r, Err(GgufError::TensorOverlap { ref first, .. }) if first == "big"),
        "{r:?}"
    );
    // Sharing one offset.
    let r = parse(with_tensors(&[("a", &[8], 0, 0), ("b", &[8], 0, 0)], 64));
    assert!(matches!(r, Err(GgufError::TensorOverlap { .. })), "{r:?}");
}

#[test]
fn adjacent_and_empty_tensors_do_not_overlap() {
    let f = parse(with_tensors(
        &[("a", &[8], 0, 0), ("b", &[8], 0, 32), ("e", &[0], 0, 32)],
        64,
    ))
    .unwrap();
    assert_eq!(
        f.tensor_data(f.tensor("b").unwrap()),
        &(32..64).map(|i| i as u8).collect::<Vec<_>>()[..]
    );
    assert!(f.tensor_data(f.tensor("e").unwrap()).is_empty());
}

#[test]
fn typed_getters_give_clear_errors() {
    let f = GgufFile::from_bytes(small_valid_file()).unwrap();
    assert!(matches!(f.get_u32("nope"), Err(GgufError::MissingKey { ref key }) if key == "nope"));
    let e = f.get_u32("general.architecture").unwrap_err();
    assert_eq!(
        e.to_string(),
        "metadata key 'general.architecture' has type string, expected u32"
    );
    assert!(matches!(f.get_u32("i8"), Err(GgufError::OutOfRange { .. })));
    assert!(matches!(
        f.get_u32("u64"),
        Err(GgufError::OutOfRange { .. })
    ));
    assert_eq!(f.get_u64("u64").unwrap(), 1 << 40);
    assert_eq!(f.get_u32("u8").unwrap(), 7);
    assert_eq!(f.get_i64("i16").unwrap(), -700);
    assert_eq!(f.get_f32("f64").unwrap(), 2.25);
    assert!(matches!(f.get_f32("u32"), Err(GgufError::WrongType { .. })));
    assert!(f.get_bool("bool").unwrap());
    let e = f.get_str("tokens").unwrap_err();
    assert!(e.to_string().contains("array of string"), "{e}");
    assert_eq!(f.architecture().unwrap(), "llama");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bit_flips_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..8)) {
        let mut bytes = small_valid_file();
        for (i, bit) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            for t in f.tensors() {
                prop_assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
            }
        }
    }

    #[test]
    fn random_byte_overwrites_never_panic(
        writes in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..16),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = small_valid_file();
        for (i, b) in writes {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        let _ = GgufFile::from_bytes(bytes);
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(
        version in 2u32..4,
        n_tensors in prop_oneof![0u64..4, any::<u64>()],
        n_kv in prop_oneof![0u64..4, any::<u64>()],
        tail in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let _ = parse(Raw::header(version, n_tensors, n_kv).bytes(&tail));
    }
}
