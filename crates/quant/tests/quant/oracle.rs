//! The kernel oracle table (in the spirit of ggml's test-backend-ops): every format × every
//! available kernel path × many shapes, compared bit for bit against the scalar reference;
//! batch-, thread- and split-invariance; dequantization and dot products checked against
//! blocks built here from the format definitions.

use lockstep_quant::{
    ActLayout, Format, Kernels, Path, QuantError, QuantizedActs, dequantize_row, kernels,
    quantize_row,
};

/// splitmix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

/// Offsets of the f16 fields of each quantized format's block.
fn f16_fields(format: Format) -> &'static [usize] {
    match format {
        Format::Q4_0 | Format::Q5_0 | Format::Q8_0 | Format::IQ2_XXS => &[0],
        Format::Q4_1 | Format::Q5_1 | Format::Q4_K | Format::Q5_K => &[0, 2],
        Format::Q2_K => &[80, 82],
        Format::Q3_K => &[108],
        Format::Q6_K => &[208],
        Format::F32 | Format::F16 | Format::BF16 | Format::MXFP4 => &[],
    }
}

/// A random row: random code/scale bytes, with every f16 field finite and moderate.
fn random_row(format: Format, k: usize, rng: &mut Rng) -> Vec<u8> {
    if format.is_float() {
        let x: Vec<f32> = (0..k).map(|_| rng.unit() * 2.0).collect();
        return quantize_row(format, &x).unwrap();
    }
    if rng.below(4) == 0 {
        // Realistic blocks from the reference quantizer.
        let x: Vec<f32> = (0..k).map(|_| rng.unit() * 0.5).collect();
        return quantize_row(format, &x).unwrap();
    }
    let bb = format.block_bytes();
    let mut row: Vec<u8> = (0..format.row_bytes(k).unwrap())
        .map(|_| rng.byte())
        .collect();
    for blk in row.chunks_exact_mut(bb) {
        for &off in f16_fields(format) {
            let v = rng.unit() * 0.05 + if rng.below(2) == 0 { 0.001 } else { -0.001 };
            blk[off..off + 2].copy_from_slice(&f16_bytes(v));
        }
        if format == Format::MXFP4 {
            // E8M0 scales 2^-20 … 2^-1 (hostile exponents: tests/iq2_mxfp4.rs).
            blk[0] = 107 + rng.below(20) as u8;
        }
    }
    row
}

fn random_matrix(format: Format, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    (0..n).flat_map(|_| random_row(format, k, rng)).collect()
}

fn random_acts(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            // Mostly smooth values, some outliers, some exact zeros.
            match rng.below(16) {
                0 => 0.0,
                1 => rng.unit() * 40.0,
                _ => rng.unit() * (1.0 + (i % 7) as f32),
            }
        })
        .collect()
}

fn k_values(format: Format) -> Vec<usize> {
    match format.act_layout() {
        ActLayout::Float => vec![1, 2, 3, 17, 64, 100],
        ActLayout::Blocks32 => vec![32, 64, 96, 224, 896],
        ActLayout::Blocks256 => vec![256, 512, 768, 1792],
    }
}

const N_VALUES: [usize; 6] = [1, 3, 15, 16, 17, 33];
const M_VALUES: [usize; 3] = [1, 2, 5];

fn acts_for(k_set: &Kernels, format: Format, k: usize, x: &[f32]) -> QuantizedActs {
    let mut acts = QuantizedActs::new(format.act_layout(), k).unwrap();
    acts.quantize_into_with(k_set, x).unwrap();
    acts
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn ggml_type_ids_round_trip_and_match_ggml() {
    let expected = [
        (Format::F32, 0),
        (Format::F16, 1),
        (Format::Q4_0, 2),
        (Format::Q4_1, 3),
        (Format::Q5_0, 6),
        (Format::Q5_1, 7),
        (Format::Q8_0, 8),
        (Format::Q2_K, 10),
        (Format::Q3_K, 11),
        (Format::Q4_K, 12),
        (Format::Q5_K, 13),
        (Format::Q6_K, 14),
        (Format::IQ2_XXS, 16),
        (Format::BF16, 30),
        (Format::MXFP4, 39),
    ];
    for (f, id) in expected {
        assert_eq!(f.ggml_type_id(), id);
        assert_eq!(Format::from_ggml_type_id(id), Some(f));
    }
    for unsupported in [4, 5, 9, 15, 17, 29, 31, 38, 40, 1000] {
        assert_eq!(Format::from_ggml_type_id(unsupported), None);
    }
    let sizes = [
        (Format::Q4_0, 18),
        (Format::Q4_1, 20),
        (Format::Q5_0, 22),
        (Format::Q5_1, 24),
        (Format::Q8_0, 34),
        (Format::Q2_K, 84),
        (Format::Q3_K, 110),
        (Format::Q4_K, 144),
        (Format::Q5_K, 176),
        (Format::Q6_K, 210),
        (Format::IQ2_XXS, 66),
        (Format::MXFP4, 17),
    ];
    for (f, b) in sizes {
        assert_eq!(f.block_bytes(), b, "{f}");
    }
}

#[test]
fn every_simd_path_is_bit_identical_to_scalar_for_every_format_and_shape() {
    let scalar = Kernels::scalar();
    let paths = Kernels::all_available();
    assert!(
        paths.iter().any(|k| k.path() == Path::Scalar),
        "scalar is always available"
    );
    let mut rng = Rng(0x0A11_F0A7);
    let mut compared = 0usize;
    for format in Format::ALL {
        for k in k_values(format) {
            for n in N_VALUES {
                let w = random_matrix(format, n, k, &mut rng);
                for m in M_VALUES {
                    let x = random_acts(&mut rng, m * k);
                    let acts = acts_for(&scalar, format, k, &x);
                    let mut want = vec![0.0; m * n];
                    scalar.matmul(format, &w, n, &acts, &mut want).unwrap();
                    for ks in &paths {
                        let acts_p = acts_for(ks, format, k, &x);
                        let mut got = vec![f32::NAN; m * n];
                        ks.matmul(format, &w, n, &acts_p, &mut got).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{format} path {} k={k} n={n} m={m}",
                            ks.name()
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared >= Format::ALL.len() * 4 * N_VALUES.len() * M_VALUES.len());
}

#[test]
fn a_row_of_a_batched_matmul_equals_the_row_computed_alone() {
    let mut rng = Rng(7);
    for ks in Kernels::all_available() {
        for format in Format::ALL {
            let k = *k_values(format).last().unwrap();
            let n = 19;
            let m = 6;
            let w = random_matrix(format, n, k, &mut rng);
            let x = random_acts(&mut rng, m * k);
            let acts = acts_for(&ks, format, k, &x);
            let mut batched = vec![0.0; m * n];
            ks.matmul(format, &w, n, &acts, &mut batched).unwrap();
            for row in 0..m {
                let alone = acts_for(&ks, format, k, &x[row * k..(row + 1) * k]);
                let mut single = vec![0.0; n];
                ks.matmul(format, &w, n, &alone, &mut single).unwrap();
                assert_eq!(
                    bits(&single),
                    bits(&batched[row * n..(row + 1) * n]),
                    "{format} {} row {row}",
                    ks.name()
                );
                let d = ks.dot(format, &w[..w.len() / n], &acts, row).unwrap();
                assert_eq!(d.to_bits(), batched[row * n].to_bits());
            }
        }
    }
}

#[test]
fn matmul_is_independent_of_thread_count_and_n_splits() {
    let mut rng = Rng(11);
    for ks in Kernels::all_available() {
        for format in [
            Format::Q4_0,
            Format::Q8_0,
            Format::Q4_K,
            Format::Q6_K,
            Format::F16,
        ] {
            let k = *k_values(format).last().unwrap();
            let n = 45;
            let m = 3;
            let w = random_matrix(format, n, k, &mut rng);
            let x = random_acts(&mut rng, m * k);
            let acts = acts_for(&ks, format, k, &x);
            let mut want = vec![0.0; m * n];
            ks.matmul(format, &w, n, &acts, &mut want).unwrap();
            for threads in 1..=4 {
                let mut got = vec![0.0; m * n];
                ks.matmul_threaded(format, &w, n, &acts, &mut got, threads)
                    .unwrap();
                assert_eq!(bits(&got), bits(&want), "{format} threads={threads}");
            }
            for _ in 0..5 {
                let cut = rng.below(n as u64 + 1) as usize;
                let mut got = vec![0.0; m * n];
                for r in [0..cut, cut..n] {
                    let mut part = vec![0.0; m * r.len()];
                    ks.matmul_n_range(format, &w, n, &acts, r.clone(), &mut part, r.len())
                        .unwrap();
                    for mi in 0..m {
                        got[mi * n + r.start..mi * n + r.end]
                            .copy_from_slice(&part[mi * r.len()..(mi + 1) * r.len()]);
                    }
                }
                assert_eq!(bits(&got), bits(&want), "{format} split at {cut}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Blocks built here from the format definitions (ggml-common.h), with known fields.

/// A block's fields: stored codes (unsigned form as stored, Q8_0 signed), sub-block scales
/// and mins as stored, and the f16 scales.
struct Fields {
    d: f32,
    m: f32,
    sc: Vec<i32>,
    mn: Vec<i32>,
    codes: Vec<i32>,
}

fn random_fields(format: Format, rng: &mut Rng) -> Fields {
    let (max_code, nsub, max_sc, max_mn) = match format {
        Format::Q4_0 | Format::Q4_1 => (16, 0, 0, 0),
        Format::Q5_0 | Format::Q5_1 => (32, 0, 0, 0),
        Format::Q8_0 => (256, 0, 0, 0),
        Format::Q2_K => (4, 16, 16, 16),
        Format::Q3_K => (8, 16, 64, 0),
        Format::Q4_K => (16, 8, 64, 64),
        Format::Q5_K => (32, 8, 64, 64),
        Format::Q6_K => (64, 16, 256, 0),
        _ => unreachable!(),
    };
    let codes = (0..format.block_len())
        .map(|_| {
            let c = rng.below(max_code) as i32;
            if format == Format::Q8_0 { c - 128 } else { c }
        })
        .collect();
    let sc = (0..nsub)
        .map(|_| {
            let s = rng.below(max_sc) as i32;
            if format == Format::Q6_K { s - 128 } else { s }
        })
        .collect();
    let mn = (0..nsub)
        .map(|_| {
            if max_mn > 0 {
                rng.below(max_mn) as i32
            } else {
                0
            }
        })
        .collect();
    // Powers of two times small integers: exactly representable in f16.
    let d = (1 + rng.below(7)) as f32 / 64.0 * if rng.below(2) == 0 { 1.0 } else { -1.0 };
    let m = (1 + rng.below(15)) as f32 / 32.0 * if rng.below(2) == 0 { 1.0 } else { -1.0 };
    Fields {
        d,
        m,
        sc,
        mn,
        codes,
    }
}

// Index loops mirror the layout definitions (element 64j + l, byte l, …).
#[allow(clippy::needless_range_loop)]
fn encode(format: Format, f: &Fields) -> Vec<u8> {
    let c = |i: usize| f.codes[i] as u8;
    let mut out = Vec::new();
    let nibbles = |out: &mut Vec<u8>| {
        for j in 0..16 {
            out.push((c(j) & 0xF) | ((c(j + 16) & 0xF) << 4));
        }
    };
    let high_bits = |out: &mut Vec<u8>| {
        let qh = (0..32).fold(0u32, |h, j| h | (u32::from(c(j) >> 4) << j));
        out.extend_from_slice(&qh.to_le_bytes());
    };
    match format {
        Format::Q4_0 => {
            out.extend_from_slice(&f16_bytes(f.d));
            nibbles(&mut out);
        }
        Format::Q4_1 => {
            out.extend_from_slice(&f16_bytes(f.d));
            out.extend_from_slice(&f16_bytes(f.m));
            nibbles(&mut out);
        }
        Format::Q5_0 => {
            out.extend_from_slice(&f16_bytes(f.d));
            high_bits(&mut out);
            nibbles(&mut out);
        }
        Format::Q5_1 => {
            out.extend_from_slice(&f16_bytes(f.d));
            out.extend_from_slice(&f16_bytes(f.m));
            high_bits(&mut out);
            nibbles(&mut out);
        }
        Format::Q8_0 => {
            out.extend_from_slice(&f16_bytes(f.d));
            out.extend(f.codes.iter().map(|&v| v as i8 as u8));
        }
        Format::Q2_K | Format::Q3_K => {
            let mut qs = [0u8; 64];
            let mut hmask = [0u8; 32];
            for h in 0..2 {
                for s in 0..4 {
                    for l in 0..32 {
                        let v = c(128 * h + 32 * s + l);
                        qs[32 * h + l] |= (v & 3) << (2 * s);
                        hmask[l] |= (v >> 2) << (4 * h + s);
                    }
                }
            }
            if format == Format::Q2_K {
                out.extend((0..16).map(|j| (f.sc[j] as u8) | ((f.mn[j] as u8) << 4)));
                out.extend_from_slice(&qs);
                out.extend_from_slice(&f16_bytes(f.d));
                out.extend_from_slice(&f16_bytes(f.m));
            } else {
                out.extend_from_slice(&hmask);
                out.extend_from_slice(&qs);
                let mut scales = [0u8; 12];
                for j in 0..16 {
                    let l = f.sc[j] as u8;
                    if j < 8 {
                        scales[j] |= l & 0xF;
                    } else {
                        scales[j - 8] |= (l & 0xF) << 4;
                    }
                    scales[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
                }
                out.extend_from_slice(&scales);
                out.extend_from_slice(&f16_bytes(f.d));
            }
        }
        Format::Q4_K | Format::Q5_K => {
            out.extend_from_slice(&f16_bytes(f.d));
            out.extend_from_slice(&f16_bytes(f.m));
            let mut s = [0u8; 12];
            for j in 0..8 {
                let (ls, lm) = (f.sc[j] as u8, f.mn[j] as u8);
                if j < 4 {
                    s[j] |= ls;
                    s[j + 4] |= lm;
                } else {
                    s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                    s[j - 4] |= (ls >> 4) << 6;
                    s[j] |= (lm >> 4) << 6;
                }
            }
            out.extend_from_slice(&s);
            if format == Format::Q5_K {
                let mut qh = [0u8; 32];
                for j in 0..4 {
                    for l in 0..32 {
                        qh[l] |= (c(64 * j + l) >> 4) << (2 * j);
                        qh[l] |= (c(64 * j + 32 + l) >> 4) << (2 * j + 1);
                    }
                }
                out.extend_from_slice(&qh);
            }
            for j in 0..4 {
                for l in 0..32 {
                    out.push((c(64 * j + l) & 0xF) | ((c(64 * j + 32 + l) & 0xF) << 4));
                }
            }
        }
        Format::Q6_K => {
            let mut ql = [0u8; 128];
            let mut qh = [0u8; 64];
            for h in 0..2 {
                for l in 0..32 {
                    let e = |t: usize| c(128 * h + 32 * t + l);
                    ql[64 * h + l] = (e(0) & 0xF) | ((e(2) & 0xF) << 4);
                    ql[64 * h + 32 + l] = (e(1) & 0xF) | ((e(3) & 0xF) << 4);
                    qh[32 * h + l] =
                        (e(0) >> 4) | ((e(1) >> 4) << 2) | ((e(2) >> 4) << 4) | ((e(3) >> 4) << 6);
                }
            }
            out.extend_from_slice(&ql);
            out.extend_from_slice(&qh);
            out.extend(f.sc.iter().map(|&s| s as i8 as u8));
            out.extend_from_slice(&f16_bytes(f.d));
        }
        _ => unreachable!(),
    }
    assert_eq!(out.len(), format.block_bytes());
    out
}

/// The signed integer code of element i and its sub-block's (scale, min), per definition.
fn int_form(format: Format, f: &Fields, i: usize) -> (i32, i32, i32) {
    let c = f.codes[i];
    match format {
        Format::Q4_0 => (c - 8, 1, 0),
        Format::Q5_0 => (c - 16, 1, 0),
        Format::Q4_1 | Format::Q5_1 | Format::Q8_0 => (c, 1, 0),
        Format::Q2_K => (c, f.sc[i / 16], f.mn[i / 16]),
        Format::Q3_K => (c - 4, f.sc[i / 16] - 32, 0),
        Format::Q4_K | Format::Q5_K => (c, f.sc[i / 32], f.mn[i / 32]),
        Format::Q6_K => (c - 32, f.sc[i / 16], 0),
        _ => unreachable!(),
    }
}

/// Expected dequantized value of element i, from the format definition.
fn expected_value(format: Format, f: &Fields, i: usize) -> f32 {
    let (q, sc, mn) = int_form(format, f, i);
    match format {
        Format::Q4_0 | Format::Q5_0 | Format::Q8_0 => q as f32 * f.d,
        Format::Q4_1 | Format::Q5_1 => q as f32 * f.d + f.m,
        Format::Q2_K | Format::Q4_K | Format::Q5_K => {
            (f.d * sc as f32) * q as f32 - f.m * mn as f32
        }
        _ => (f.d * sc as f32) * q as f32,
    }
}

const QUANT_FORMATS: [Format; 10] = [
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q8_0,
    Format::Q2_K,
    Format::Q3_K,
    Format::Q4_K,
    Format::Q5_K,
    Format::Q6_K,
];

#[test]
fn dequantize_hand_built_blocks_gives_the_values_of_the_format_definition() {
    let mut rng = Rng(3);
    for format in QUANT_FORMATS {
        for _ in 0..20 {
            let blocks: Vec<Fields> = (0..3).map(|_| random_fields(format, &mut rng)).collect();
            let bytes: Vec<u8> = blocks.iter().flat_map(|f| encode(format, f)).collect();
            let bl = format.block_len();
            let mut out = vec![0.0; 3 * bl];
            dequantize_row(format, &bytes, &mut out).unwrap();
            for (b, f) in blocks.iter().enumerate() {
                for i in 0..bl {
                    assert_eq!(
                        out[b * bl + i].to_bits(),
                        expected_value(format, f, i).to_bits(),
                        "{format} block {b} element {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn dequantize_literal_examples() {
    // Q4_0, d = 0.5: byte 0x1F → element 0 = (15-8)·0.5 = 3.5, element 16 = (1-8)·0.5 = -3.5.
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&f16_bytes(0.5));
    b[2] = 0x1F;
    let mut out = [0.0; 32];
    dequantize_row(Format::Q4_0, &b, &mut out).unwrap();
    assert_eq!(out[0], 3.5);
    assert_eq!(out[16], -3.5);
    assert_eq!(out[1], -4.0);
    // Q5_0: high bit of element 17 set, its low nibble (high nibble of byte 1) = 2 → 18-16 = 2.
    let mut b = vec![0u8; 22];
    b[..2].copy_from_slice(&f16_bytes(1.0));
    b[2..6].copy_from_slice(&(1u32 << 17).to_le_bytes());
    b[7] = 0x20;
    let mut out = [0.0; 32];
    dequantize_row(Format::Q5_0, &b, &mut out).unwrap();
    assert_eq!(out[17], 2.0);
    assert_eq!(out[0], -16.0);
    // Q8_0: d = 0.25, byte -3 → -0.75.
    let mut b = vec![0u8; 34];
    b[..2].copy_from_slice(&f16_bytes(0.25));
    b[2] = (-3i8) as u8;
    let mut out = [0.0; 32];
    dequantize_row(Format::Q8_0, &b, &mut out).unwrap();
    assert_eq!(out[0], -0.75);
    // Q6_K: all zero codes → (0-32)·d·sc; d = 1, scale[0] = -2 → 64 for the first 16.
    let mut b = vec![0u8; 210];
    b[192] = (-2i8) as u8;
    b[208..210].copy_from_slice(&f16_bytes(1.0));
    let mut out = [0.0; 256];
    dequantize_row(Format::Q6_K, &b, &mut out).unwrap();
    assert_eq!(out[0], 64.0);
    assert_eq!(out[15], 64.0);
    assert_eq!(out[16], 0.0);
    // F16 / BF16 / F32 rows.
    let mut out = [0.0; 2];
    dequantize_row(Format::F16, &[0x00, 0x3C, 0x00, 0xC0], &mut out).unwrap();
    assert_eq!(out, [1.0, -2.0]);
    dequantize_row(Format::BF16, &[0x80, 0x3F, 0x40, 0x40], &mut out).unwrap();
    assert_eq!(out, [1.0, 3.0]);
    let mut out = [0.0; 1];
    dequantize_row(Format::F32, &1.5f32.to_le_bytes(), &mut out).unwrap();
    assert_eq!(out, [1.5]);
}

#[test]
fn dequantize_rejects_wrong_lengths() {
    let mut out = vec![0.0; 32];
    assert!(matches!(
        dequantize_row(Format::Q4_0, &[0; 17], &mut out),
        Err(QuantError::Length { .. })
    ));
    let mut out = vec![0.0; 33];
    assert!(matches!(
        dequantize_row(Format::Q4_0, &[0; 36], &mut out),
        Err(QuantError::RaggedRow { .. })
    ));
    let mut out = vec![0.0; 3];
    assert!(matches!(
        dequantize_row(Format::F16, &[0; 5], &mut out),
        Err(QuantError::Length { .. })
    ));
}

#[test]
fn dot_equals_the_canonical_formula_over_the_integer_codes_on_every_path() {
    let mut rng = Rng(5);
    for format in QUANT_FORMATS {
        let bl = format.block_len();
        let nblocks = 5;
        let k = nblocks * bl;
        let blocks: Vec<Fields> = (0..nblocks)
            .map(|_| random_fields(format, &mut rng))
            .collect();
        let w: Vec<u8> = blocks.iter().flat_map(|f| encode(format, f)).collect();
        let x = random_acts(&mut rng, k);
        for ks in Kernels::all_available() {
            let acts = acts_for(&ks, format, k, &x);
            let a = acts.row_codes(0).unwrap();
            let da = acts.row_scales(0).unwrap();
            let mut acc = 0.0f32;
            for (b, f) in blocks.iter().enumerate() {
                let mut isum = 0i32;
                let mut msum = 0i32;
                let mut asum = 0i32;
                for i in 0..bl {
                    let (q, sc, mn) = int_form(format, f, i);
                    let av = i32::from(a[b * bl + i]);
                    isum += sc * q * av;
                    msum += mn * av;
                    asum += av;
                }
                let dw = f.d * da[b];
                acc = dw.mul_add(isum as f32, acc);
                match format {
                    Format::Q4_1 | Format::Q5_1 => acc = (f.m * da[b]).mul_add(asum as f32, acc),
                    Format::Q2_K | Format::Q4_K | Format::Q5_K => {
                        acc = (-(f.m * da[b])).mul_add(msum as f32, acc)
                    }
                    _ => {}
                }
            }
            let got = ks.dot(format, &w, &acts, 0).unwrap();
            assert_eq!(got.to_bits(), acc.to_bits(), "{format} {}", ks.name());
        }
    }
}

#[test]
fn dot_approximates_the_float_dot_of_dequantized_weights() {
    let mut rng = Rng(9);
    for format in Format::ALL {
        let k = *k_values(format).last().unwrap();
        let w = random_row(format, k, &mut rng);
        let mut wf = vec![0.0; k];
        dequantize_row(format, &w, &mut wf).unwrap();
        let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
        let exact: f64 = wf
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let scale: f64 = wf
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from((a * b).abs()))
            .sum();
        let acts = acts_for(kernels(), format, k, &x);
        let got = f64::from(kernels().dot(format, &w, &acts, 0).unwrap());
        // int8 activations: relative error per element ≲ 1/254.
        let tol = if format.is_float() { 1e-5 } else { 0.01 } * scale + 1e-6;
        assert!(
            (got - exact).abs() <= tol,
            "{format}: {got} vs {exact} (tol {tol})"
        );
    }
}

#[test]
fn reference_quantizer_round_trips_within_format_precision() {
    let mut rng = Rng(13);
    for format in Format::ALL {
        let k = 512;
        let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
        let bytes = quantize_row(format, &x).unwrap();
        assert_eq!(bytes.len(), format.row_bytes(k).unwrap());
        let mut y = vec![0.0; k];
        dequantize_row(format, &bytes, &mut y).unwrap();
        let rms = (x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / k as f32).sqrt();
        let limit = match format {
            Format::F32 => 0.0,
            Format::F16 | Format::BF16 => 0.005,
            Format::Q8_0 | Format::Q6_K => 0.02,
            Format::Q5_0 | Format::Q5_1 | Format::Q5_K => 0.04,
            Format::Q4_0 | Format::Q4_1 | Format::Q4_K => 0.08,
            Format::Q3_K => 0.2,
            Format::Q2_K => 0.35,
            Format::MXFP4 => 0.12,
            // 256 grid points for 3^8 magnitude patterns: a coarse format by design.
            Format::IQ2_XXS => 0.4,
        };
        assert!(rms <= limit, "{format}: rms error {rms} > {limit}");
    }
}

// ---------------------------------------------------------------------------------------
// Activation quantizer.

#[test]
fn activation_quantizer_rounds_halves_to_even_on_every_path() {
    for layout in [ActLayout::Blocks32, ActLayout::Blocks256] {
        let bl = layout.block_len();
        // amax = 127 → id = 1 exactly, so codes are round_half_even(x).
        let mut x = vec![0.0f32; bl];
        let ties = [
            (127.0, 127),
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.5, -2),
            (126.5, 126),
            (-126.5, -126),
            (3.4999998, 3),
            (-3.5, -4),
            (0.49999997, 0),
        ];
        for (i, &(v, _)) in ties.iter().enumerate() {
            x[i] = v;
        }
        for ks in Kernels::all_available() {
            let mut acts = QuantizedActs::new(layout, bl).unwrap();
            acts.quantize_into_with(&ks, &x).unwrap();
            assert_eq!(acts.row_scales(0).unwrap(), &[1.0]);
            let q = acts.row_codes(0).unwrap();
            for (i, &(v, want)) in ties.iter().enumerate() {
                assert_eq!(i32::from(q[i]), want, "{} x={v}", ks.name());
            }
            assert!(q[ties.len()..].iter().all(|&c| c == 0));
        }
    }
}

#[test]
fn activation_quantizer_zero_blocks_have_zero_scale_and_codes() {
    for layout in [ActLayout::Blocks32, ActLayout::Blocks256] {
        let bl = layout.block_len();
        let mut x = vec![0.0f32; 2 * bl];
        x[bl] = -2.0; // second block non-zero
        x[bl + 1] = -0.0;
        for ks in Kernels::all_available() {
            let mut acts = QuantizedActs::new(layout, 2 * bl).unwrap();
            acts.quantize_into_with(&ks, &x).unwrap();
            let d = acts.row_scales(0).unwrap();
            assert_eq!(d[0].to_bits(), 0.0f32.to_bits());
            assert_eq!(d[1], 2.0 / 127.0);
            let q = acts.row_codes(0).unwrap();
            assert!(q[..bl].iter().all(|&c| c == 0));
            assert_eq!(q[bl], -127);
            assert!(acts.row_sums32(0).unwrap()[0] == 0);
        }
    }
}

#[test]
fn activation_quantizer_simd_equals_scalar_including_special_values() {
    let mut rng = Rng(17);
    let scalar = Kernels::scalar();
    for layout in [ActLayout::Blocks32, ActLayout::Blocks256] {
        let bl = layout.block_len();
        let k = 4 * bl;
        for trial in 0..40 {
            let mut x = random_acts(&mut rng, 3 * k);
            // Exact ties relative to the block scale, and special values in some trials.
            for v in x.iter_mut().step_by(5) {
                *v = (rng.below(255) as f32 - 127.0) * 0.5;
            }
            if trial % 4 == 1 {
                let specials = [
                    f32::NAN,
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    1e-40,
                    -1e-45,
                    3.0e38,
                    -0.0,
                ];
                for s in specials {
                    let i = rng.below(x.len() as u64) as usize;
                    x[i] = s;
                }
            }
            if trial % 4 == 2 {
                // A block of denormals only.
                for v in x[bl..2 * bl].iter_mut() {
                    *v = rng.unit() * 1e-39;
                }
            }
            let mut want = QuantizedActs::new(layout, k).unwrap();
            want.quantize_into_with(&scalar, &x).unwrap();
            for ks in Kernels::all_available() {
                let mut got = QuantizedActs::new(layout, k).unwrap();
                got.quantize_into_with(&ks, &x).unwrap();
                for m in 0..3 {
                    assert_eq!(got.row_codes(m).unwrap(), want.row_codes(m).unwrap());
                    assert_eq!(
                        bits(got.row_scales(m).unwrap()),
                        bits(want.row_scales(m).unwrap()),
                        "{} trial {trial}",
                        ks.name()
                    );
                    assert_eq!(got.row_sums32(m).unwrap(), want.row_sums32(m).unwrap());
                    assert_eq!(got.row_sums16(m).unwrap(), want.row_sums16(m).unwrap());
                }
            }
        }
    }
}

#[test]
fn activation_sums_are_the_sums_of_the_codes() {
    let mut rng = Rng(19);
    let k = 512;
    let x = random_acts(&mut rng, 2 * k);
    let mut acts = QuantizedActs::new(ActLayout::Blocks256, k).unwrap();
    acts.quantize_into(&x).unwrap();
    for m in 0..2 {
        let q = acts.row_codes(m).unwrap();
        let s16: Vec<i16> = q
            .chunks(16)
            .map(|c| c.iter().map(|&v| i16::from(v)).sum())
            .collect();
        let s32: Vec<i16> = q
            .chunks(32)
            .map(|c| c.iter().map(|&v| i16::from(v)).sum())
            .collect();
        assert_eq!(acts.row_sums16(m).unwrap(), &s16[..]);
        assert_eq!(acts.row_sums32(m).unwrap(), &s32[..]);
    }
}

#[test]
fn quantize_into_reuses_the_buffer_for_fewer_rows() {
    let mut acts = QuantizedActs::new(ActLayout::Blocks32, 64).unwrap();
    acts.quantize_into(&[1.0; 64 * 4]).unwrap();
    assert_eq!(acts.rows(), 4);
    acts.quantize_into(&[2.0; 64]).unwrap();
    assert_eq!(acts.rows(), 1);
    assert!(acts.row_codes(1).is_err());
    assert!(acts.quantize_into(&[0.0; 65]).is_err());
}

#[test]
fn matmul_rejects_inconsistent_shapes() {
    let ks = kernels();
    let mut acts = QuantizedActs::new(ActLayout::Blocks32, 64).unwrap();
    acts.quantize_into(&[0.5; 64]).unwrap();
    let w = vec![0u8; 2 * 36];
    let mut out = vec![0.0; 2];
    assert!(ks.matmul(Format::Q4_0, &w, 2, &acts, &mut out).is_ok());
    assert!(matches!(
        ks.matmul(Format::Q4_0, &w[1..], 2, &acts, &mut out),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        ks.matmul(Format::Q4_K, &w, 2, &acts, &mut out),
        Err(QuantError::ActLayout { .. })
    ));
    assert!(matches!(
        ks.matmul(Format::Q4_0, &w, 2, &acts, &mut out[..1]),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        ks.matmul_n_range(Format::Q4_0, &w, 2, &acts, 1..3, &mut out, 2),
        Err(QuantError::NRange { .. })
    ));
    assert!(matches!(
        ks.dot(Format::Q4_0, &w[..36], &acts, 1),
        Err(QuantError::Row { .. })
    ));
}

#[test]
fn the_process_kernels_are_the_fastest_available_path() {
    let best = Kernels::all_available().pop().unwrap();
    if std::env::var("LOCKSTEP_KERNELS").is_err() {
        assert_eq!(kernels().path(), best.path());
    }
    assert!(["scalar", "avx2", "avx512vnni"].contains(&kernels().name()));
    eprintln!("kernel paths available: {:?}", Kernels::all_available());
}
