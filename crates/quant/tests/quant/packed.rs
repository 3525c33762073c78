//! The packed-tile kernels: every format × every available path × ragged shapes, bit for
//! bit against the scalar reference on the original row-major bytes; independence of M,
//! M-tile tails, threads and N-range splits; packed dequantization; shape errors.

use lockstep_quant::{
    ActLayout, Format, Kernels, PackedMatrix, QuantError, QuantizedActs, dequantize_row,
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

/// Random rows: random code and scale bytes (every bit pattern of codes, scales and
/// mins), finite f16 fields; a quarter from the reference quantizer.
fn random_matrix(format: Format, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n {
        if format.is_float() || rng.below(4) == 0 {
            let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
            out.extend(quantize_row(format, &x).unwrap());
            continue;
        }
        let mut row: Vec<u8> = (0..format.row_bytes(k).unwrap())
            .map(|_| rng.next() as u8)
            .collect();
        for blk in row.chunks_exact_mut(format.block_bytes()) {
            for &off in f16_fields(format) {
                let v = rng.unit() * 0.05 + if rng.below(2) == 0 { 0.001 } else { -0.001 };
                blk[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
            if format == Format::MXFP4 {
                blk[0] = 107 + rng.below(20) as u8; // E8M0 scales 2^-20 … 2^-1
            }
        }
        out.extend(row);
    }
    out
}

fn random_acts(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| match rng.below(16) {
            0 => 0.0,
            1 => rng.unit() * 40.0,
            _ => rng.unit() * (1.0 + (i % 7) as f32),
        })
        .collect()
}

fn acts_for(ks: &Kernels, format: Format, k: usize, x: &[f32]) -> QuantizedActs {
    let mut acts = QuantizedActs::new(format.act_layout(), k).unwrap();
    acts.quantize_into_with(ks, x).unwrap();
    acts
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const TILED: [Format; 8] = [
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q8_0,
    Format::Q4_K,
    Format::Q5_K,
    Format::Q6_K,
];

/// Row counts 1..=25: every pass size (up to 8 rows), alone and split in several passes.
const ALL_M: [usize; 25] = {
    let mut m = [0; 25];
    let mut i = 0;
    while i < 25 {
        m[i] = i + 1;
        i += 1;
    }
    m
};

fn k_values(format: Format) -> &'static [usize] {
    match format.act_layout() {
        ActLayout::Float => &[2, 17, 64],
        ActLayout::Blocks32 => &[32, 96, 576],
        ActLayout::Blocks256 => &[256, 768],
    }
}

#[test]
fn exactly_the_legacy_formats_q4_k_q5_k_and_q6_k_are_tiled() {
    for format in Format::ALL {
        let k = format.block_len() * 2;
        let w = vec![0u8; format.row_bytes(k).unwrap() * 3];
        let p = PackedMatrix::pack(format, &w, 3, k).unwrap();
        assert_eq!(p.is_tiled(), TILED.contains(&format), "{format}");
        assert_eq!(PackedMatrix::tiles_format(format), p.is_tiled());
        assert_eq!((p.format(), p.n(), p.k()), (format, 3, k));
    }
}

#[test]
fn packed_matmul_is_bit_identical_to_the_scalar_reference_for_every_format_path_and_shape() {
    let scalar = Kernels::scalar();
    let paths = Kernels::all_available();
    let mut rng = Rng(0x009A_CCED);
    let mut compared = 0usize;
    for format in Format::ALL {
        for &k in k_values(format) {
            for n in [1usize, 15, 17, 33] {
                let w = random_matrix(format, n, k, &mut rng);
                let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
                // M 1..=25 covers every pass size the kernels have (up to 8 rows) and
                // every split of M into passes; the largest K only for a few M.
                let ms: &[usize] = if k >= 576 { &[1, 5, 9, 13, 25] } else { &ALL_M };
                for &m in ms {
                    let x = random_acts(&mut rng, m * k);
                    let acts = acts_for(&scalar, format, k, &x);
                    let mut want = vec![0.0; m * n];
                    scalar.matmul(format, &w, n, &acts, &mut want).unwrap();
                    for ks in &paths {
                        let acts_p = acts_for(ks, format, k, &x);
                        let mut got = vec![f32::NAN; m * n];
                        ks.matmul_packed(&packed, &acts_p, 0..n, &mut got, n)
                            .unwrap();
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
    assert!(compared >= Format::ALL.len() * 4 * 3 * paths.len());
}

#[test]
fn packed_rows_of_a_batch_equal_the_rows_computed_alone() {
    let mut rng = Rng(21);
    for ks in Kernels::all_available() {
        for format in TILED {
            let k = k_values(format)[1];
            let (n, m) = (20, 27);
            let w = random_matrix(format, n, k, &mut rng);
            let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
            let x = random_acts(&mut rng, m * k);
            let acts = acts_for(&ks, format, k, &x);
            let mut batched = vec![0.0; m * n];
            ks.matmul_packed(&packed, &acts, 0..n, &mut batched, n)
                .unwrap();
            for row in 0..m {
                let alone = acts_for(&ks, format, k, &x[row * k..(row + 1) * k]);
                let mut single = vec![0.0; n];
                ks.matmul_packed(&packed, &alone, 0..n, &mut single, n)
                    .unwrap();
                assert_eq!(
                    bits(&single),
                    bits(&batched[row * n..(row + 1) * n]),
                    "{format} {} row {row}",
                    ks.name()
                );
            }
        }
    }
}

#[test]
fn packed_matmul_is_independent_of_threads_and_n_splits() {
    let mut rng = Rng(33);
    for ks in Kernels::all_available() {
        for format in TILED {
            let k = k_values(format)[1];
            let (n, m) = (45, 6);
            let w = random_matrix(format, n, k, &mut rng);
            let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
            let x = random_acts(&mut rng, m * k);
            let acts = acts_for(&ks, format, k, &x);
            let mut want = vec![0.0; m * n];
            ks.matmul(format, &w, n, &acts, &mut want).unwrap();
            for threads in 1..=4 {
                let mut got = vec![f32::NAN; m * n];
                ks.matmul_packed_threaded(&packed, &acts, &mut got, threads)
                    .unwrap();
                assert_eq!(bits(&got), bits(&want), "{format} threads={threads}");
            }
            for _ in 0..6 {
                // Cuts anywhere, tile-aligned or not; a padded stride.
                let a = rng.below(n as u64 + 1) as usize;
                let b = rng.below(n as u64 + 1) as usize;
                let (c0, c1) = (a.min(b), a.max(b));
                let mut got = vec![f32::NAN; m * n];
                for r in [0..c0, c0..c1, c1..n] {
                    let ldo = r.len() + 3;
                    let mut part = vec![f32::NAN; m * ldo];
                    ks.matmul_packed(&packed, &acts, r.clone(), &mut part, ldo)
                        .unwrap();
                    for mi in 0..m {
                        got[mi * n + r.start..mi * n + r.end]
                            .copy_from_slice(&part[mi * ldo..mi * ldo + r.len()]);
                    }
                }
                assert_eq!(bits(&got), bits(&want), "{format} cuts {c0} {c1}");
            }
        }
    }
}

#[test]
fn packed_dequantize_row_equals_dequantize_row_of_the_original_bytes() {
    let mut rng = Rng(44);
    for format in Format::ALL {
        let k = *k_values(format).last().unwrap();
        let n = 19;
        let w = random_matrix(format, n, k, &mut rng);
        let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
        let rb = format.row_bytes(k).unwrap();
        for row in 0..n {
            let mut want = vec![0.0; k];
            dequantize_row(format, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let mut got = vec![f32::NAN; k];
            packed.dequantize_row(row, &mut got).unwrap();
            assert_eq!(bits(&got), bits(&want), "{format} row {row}");
        }
        let mut out = vec![0.0; k];
        assert!(matches!(
            packed.dequantize_row(n, &mut out),
            Err(QuantError::Row { .. })
        ));
        assert!(packed.dequantize_row(0, &mut out[1..]).is_err());
    }
}

#[test]
fn packed_memory_is_the_size_of_the_weights_up_to_padding() {
    // N a multiple of the tile, K with an even block count: no padding at all.
    let (n, k) = (64, 2048);
    for format in TILED {
        let original = format.row_bytes(k).unwrap() * n;
        let p = PackedMatrix::pack(format, &vec![0u8; original], n, k).unwrap();
        let extra = match format {
            // 12 bytes of 6-bit scales and mins become 16 bytes.
            Format::Q4_K | Format::Q5_K => 4 * n * (k / 256),
            _ => 0,
        };
        assert_eq!(p.bytes(), original + extra, "{format}");
    }
}

#[test]
fn pack_and_matmul_packed_reject_inconsistent_shapes() {
    let ks = Kernels::all_available().pop().unwrap();
    let w = vec![0u8; 2 * 36];
    assert!(matches!(
        PackedMatrix::pack(Format::Q4_0, &w[1..], 2, 64),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        PackedMatrix::pack(Format::Q4_0, &w, 2, 60),
        Err(QuantError::RaggedRow { .. })
    ));
    let p = PackedMatrix::pack(Format::Q4_0, &w, 2, 64).unwrap();
    let mut acts = QuantizedActs::new(ActLayout::Blocks32, 64).unwrap();
    acts.quantize_into(&[0.5; 128]).unwrap();
    let mut out = vec![0.0; 4];
    assert!(ks.matmul_packed(&p, &acts, 0..2, &mut out, 2).is_ok());
    assert!(matches!(
        ks.matmul_packed(&p, &acts, 1..3, &mut out, 2),
        Err(QuantError::NRange { .. })
    ));
    assert!(matches!(
        ks.matmul_packed(&p, &acts, 0..2, &mut out[..3], 2),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        ks.matmul_packed(&p, &acts, 0..2, &mut out, 1),
        Err(QuantError::Length { .. })
    ));
    let mut other_k = QuantizedActs::new(ActLayout::Blocks32, 96).unwrap();
    other_k.quantize_into(&[0.5; 96]).unwrap();
    assert!(matches!(
        ks.matmul_packed(&p, &other_k, 0..2, &mut out, 2),
        Err(QuantError::Length { .. })
    ));
    let mut k_acts = QuantizedActs::new(ActLayout::Blocks256, 256).unwrap();
    k_acts.quantize_into(&[0.5; 256]).unwrap();
    assert!(matches!(
        ks.matmul_packed(&p, &k_acts, 0..2, &mut out, 2),
        Err(QuantError::ActLayout { .. })
    ));
    assert!(
        ks.matmul_packed_threaded(&p, &acts, &mut out[..3], 2)
            .is_err()
    );
}

#[test]
fn long_rows_and_many_activation_rows_split_into_m_blocks_stay_bit_identical() {
    // K = 16384 with M = 30 exceeds the activation block the packed kernels keep hot, so M
    // is processed in several blocks with ragged M tiles.
    let scalar = Kernels::scalar();
    let mut rng = Rng(55);
    let (k, n, m) = (16384, 17, 30);
    for format in [Format::Q4_1, Format::Q4_K] {
        let w = random_matrix(format, n, k, &mut rng);
        let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
        let x = random_acts(&mut rng, m * k);
        let acts = acts_for(&scalar, format, k, &x);
        let mut want = vec![0.0; m * n];
        scalar.matmul(format, &w, n, &acts, &mut want).unwrap();
        for ks in Kernels::all_available() {
            let mut got = vec![f32::NAN; m * n];
            ks.matmul_packed(&packed, &acts, 0..n, &mut got, n).unwrap();
            assert_eq!(bits(&got), bits(&want), "{format} {}", ks.name());
        }
    }
}

#[test]
fn largest_codes_against_full_scale_activations_stay_bit_identical() {
    // Every code at its largest stored value (all bits set) against activation blocks at
    // ±127 everywhere: the largest partial sums any kernel forms (the AVX2 kernels sum
    // several `pmaddubsw` products in i16 lanes before widening; this is their bound).
    // Also all-zero codes (the most negative signed codes of the offset formats).
    let scalar = Kernels::scalar();
    for format in TILED {
        let k = k_values(format)[1];
        let (n, m) = (17, 7);
        let x: Vec<f32> = (0..m * k)
            .map(|i| {
                if (i / k).is_multiple_of(2) {
                    3.5
                } else {
                    -2.25
                }
            })
            .collect();
        for byte in [0xFFu8, 0x00] {
            let mut w = vec![byte; format.row_bytes(k).unwrap() * n];
            for blk in w.chunks_exact_mut(format.block_bytes()) {
                for &off in f16_fields(format) {
                    blk[off..off + 2]
                        .copy_from_slice(&half::f16::from_f32(0.0125).to_bits().to_le_bytes());
                }
            }
            let packed = PackedMatrix::pack(format, &w, n, k).unwrap();
            let acts = acts_for(&scalar, format, k, &x);
            let mut want = vec![0.0; m * n];
            scalar.matmul(format, &w, n, &acts, &mut want).unwrap();
            assert!(want.iter().all(|v| v.is_finite()), "{format}");
            for ks in Kernels::all_available() {
                let acts_p = acts_for(&ks, format, k, &x);
                let mut got = vec![f32::NAN; m * n];
                ks.matmul_packed(&packed, &acts_p, 0..n, &mut got, n)
                    .unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{format} {} byte {byte:#x}",
                    ks.name()
                );
            }
        }
    }
}
