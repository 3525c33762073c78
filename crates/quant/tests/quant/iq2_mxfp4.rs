//! Oracles for the two formats of DeepSeek V4 GGUFs, IQ2_XXS and MXFP4, against fixtures
//! from the PyPI `gguf` package (`tests/fixtures/gen_iq2_mxfp4.py`): dequantization bit for
//! bit, the dot product in the canonical order over gguf-py's own integer decoding, every
//! SIMD path bit-identical to the scalar reference (hostile blocks included), the dot within
//! a stated bound of the f64 dot of the dequantized weights, and malformed input as errors.

use lockstep_quant::{
    Format, Kernels, PackedMatrix, QuantError, QuantizedActs, dequantize_row, quantize_row,
};

const IQ2_XXS_BIN: &[u8] = include_bytes!("../fixtures/iq2_xxs.bin");
const MXFP4_BIN: &[u8] = include_bytes!("../fixtures/mxfp4.bin");

/// One fixture block: its bytes and gguf-py's view of it.
struct Case {
    block: Vec<u8>,
    /// The weight scale of the canonical order: `d/8` (IQ2_XXS) or `2^(e−128)` (MXFP4).
    scale: f32,
    /// Per-32-group integer multiplier `2s + 1` (IQ2_XXS; `[1]` for MXFP4).
    ls: Vec<i32>,
    /// Signed integer codes (`grid·sign` or `kvalue`).
    codes: Vec<i32>,
    /// gguf-py's dequantized values.
    values: Vec<f32>,
}

fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn cases(format: Format) -> Vec<Case> {
    let (bin, groups) = match format {
        Format::IQ2_XXS => (IQ2_XXS_BIN, 8),
        Format::MXFP4 => (MXFP4_BIN, 0),
        _ => unreachable!(),
    };
    let (bb, bl) = (format.block_bytes(), format.block_len());
    let rec = bb + 4 + groups + bl + 4 * bl;
    assert_eq!(bin.len() % rec, 0, "{format} fixture length");
    bin.chunks_exact(rec)
        .map(|r| {
            let ls_at = bb + 4;
            let codes_at = ls_at + groups;
            let values_at = codes_at + bl;
            Case {
                block: r[..bb].to_vec(),
                scale: f32_at(r, bb),
                ls: if groups == 0 {
                    vec![1]
                } else {
                    r[ls_at..codes_at].iter().map(|&v| i32::from(v)).collect()
                },
                codes: r[codes_at..values_at]
                    .iter()
                    .map(|&v| i32::from(v as i8))
                    .collect(),
                values: (0..bl).map(|i| f32_at(r, values_at + 4 * i)).collect(),
            }
        })
        .collect()
}

const FORMATS: [Format; 2] = [Format::IQ2_XXS, Format::MXFP4];

/// Bits equal, or both NaN (NaN payloads are not part of any contract).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// splitmix64.
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

fn acts(ks: &Kernels, format: Format, k: usize, x: &[f32]) -> QuantizedActs {
    let mut a = QuantizedActs::new(format.act_layout(), k).unwrap();
    a.quantize_into_with(ks, x).unwrap();
    a
}

fn random_acts(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| match rng.below(16) {
            0 => 0.0,
            1 => rng.unit() * 40.0,
            _ => rng.unit(),
        })
        .collect()
}

/// Blocks whose scale is finite and moderate (no overflow in a dot).
fn tame(format: Format, c: &Case) -> bool {
    let _ = format;
    c.scale.is_finite() && c.scale.abs() < 1.0 && c.scale.abs() > 1e-20
}

#[test]
fn fixtures_cover_every_grid_index_and_every_e8m0_exponent() {
    let iq2 = cases(Format::IQ2_XXS);
    let mut seen = [false; 256];
    for c in &iq2 {
        for g in 0..8 {
            for l in 0..4 {
                seen[usize::from(c.block[2 + 8 * g + l])] = true;
            }
        }
    }
    assert!(seen.iter().all(|&s| s), "every iq2xxs_grid index");
    assert!(iq2.iter().any(|c| c.scale.is_nan()) && iq2.iter().any(|c| c.scale.is_infinite()));
    let mx = cases(Format::MXFP4);
    let mut exps = [false; 256];
    for c in &mx {
        exps[usize::from(c.block[0])] = true;
    }
    assert!(exps.iter().all(|&s| s), "every E8M0 byte");
}

#[test]
fn dequantization_matches_gguf_py_bit_for_bit_including_hostile_scales() {
    for format in FORMATS {
        let cs = cases(format);
        let bl = format.block_len();
        // Block by block, then all blocks as one row.
        for (i, c) in cs.iter().enumerate() {
            let mut out = vec![0.0; bl];
            dequantize_row(format, &c.block, &mut out).unwrap();
            for (j, (&got, &want)) in out.iter().zip(&c.values).enumerate() {
                assert!(same(got, want), "{format} block {i} [{j}]: {got} vs {want}");
            }
        }
        let row: Vec<u8> = cs.iter().flat_map(|c| c.block.clone()).collect();
        let want: Vec<f32> = cs.iter().flat_map(|c| c.values.clone()).collect();
        let mut out = vec![0.0; want.len()];
        dequantize_row(format, &row, &mut out).unwrap();
        assert!(out.iter().zip(&want).all(|(&a, &b)| same(a, b)), "{format}");
        // The packed container (row-major for these formats) dequantizes the same way.
        let p = PackedMatrix::pack(format, &row, 1, want.len()).unwrap();
        assert!(!PackedMatrix::tiles_format(format) && !p.is_tiled());
        let mut out_p = vec![0.0; want.len()];
        p.dequantize_row(0, &mut out_p).unwrap();
        assert!(
            out_p.iter().zip(&want).all(|(&a, &b)| same(a, b)),
            "{format}"
        );
    }
}

#[test]
fn dequantization_literal_examples() {
    // MXFP4: e = 127 → E8M0 scale 2^0, halved for the doubled kvalues; code 7 (kvalue 12,
    // E2M1 6.0) → 6.0, code 0xF → −6.0.
    let mut b = [0u8; 17];
    b[0] = 127;
    b[1] = 0xF7;
    let mut out = [0.0; 32];
    dequantize_row(Format::MXFP4, &b, &mut out).unwrap();
    assert_eq!((out[0], out[16], out[1]), (6.0, -6.0, 0.0));
    // E8M0 255 is not NaN (ggml): 1·2^127 finite, 2·2^127 overflows to +inf.
    b[0] = 255;
    b[1] = 0x21;
    dequantize_row(Format::MXFP4, &b, &mut out).unwrap();
    assert_eq!((out[0], out[16]), (2f32.powi(127), f32::INFINITY));
    // E8M0 0 → 2^-128 (subnormal), kept exactly.
    b[0] = 0;
    dequantize_row(Format::MXFP4, &b, &mut out).unwrap();
    assert_eq!(out[0], 2f32.powi(-128));
    // IQ2_XXS, d = 1, s = 15, grid 0 (all 0x08), no signs: (1·15.5·0.25)·8 = 31.
    let mut q = [0u8; 66];
    q[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
    q[6..10].copy_from_slice(&(15u32 << 28).to_le_bytes());
    let mut out = [0.0; 256];
    dequantize_row(Format::IQ2_XXS, &q, &mut out).unwrap();
    assert!(out[..32].iter().all(|&v| v == 31.0));
    assert!(out[32..].iter().all(|&v| v == 1.0)); // s = 0: 0.125·8
    // Sign index 1 → ksigns 0x81: weights 0 and 7 of group 0 negative.
    q[6..10].copy_from_slice(&1u32.to_le_bytes());
    dequantize_row(Format::IQ2_XXS, &q, &mut out).unwrap();
    assert_eq!((out[0], out[1], out[7], out[8]), (-1.0, 1.0, -1.0, 1.0));
}

/// The canonical order written out over gguf-py's integer decoding: per block
/// `isum = Σ_g ls_g·Σ code·a`, then `acc = fma(scale·da, isum, acc)` in block order.
fn canonical_dot(format: Format, row: &[&Case], a: &[i8], da: &[f32]) -> f32 {
    let bl = format.block_len();
    let gl = bl / row[0].ls.len();
    let mut acc = 0.0f32;
    for (b, c) in row.iter().enumerate() {
        let mut isum = 0i32;
        for (g, &ls) in c.ls.iter().enumerate() {
            let s: i32 = (g * gl..(g + 1) * gl)
                .map(|i| c.codes[i] * i32::from(a[b * bl + i]))
                .sum();
            isum += ls * s;
        }
        acc = (c.scale * da[b]).mul_add(isum as f32, acc);
    }
    acc
}

#[test]
fn dot_is_the_canonical_order_over_gguf_py_codes_on_every_path() {
    let mut rng = Rng(41);
    for format in FORMATS {
        let cs = cases(format);
        let bl = format.block_len();
        for trial in 0..40 {
            let nb = 1 + rng.below(6) as usize;
            // Mostly tame blocks; every fourth row may hold any block, NaN/inf scales too.
            let pool: Vec<&Case> = cs
                .iter()
                .filter(|c| trial % 4 == 3 || tame(format, c))
                .collect();
            let row: Vec<&Case> = (0..nb)
                .map(|_| pool[rng.below(pool.len() as u64) as usize])
                .collect();
            let w: Vec<u8> = row.iter().flat_map(|c| c.block.clone()).collect();
            let x = random_acts(&mut rng, nb * bl);
            for ks in Kernels::all_available() {
                let q = acts(&ks, format, nb * bl, &x);
                let want = canonical_dot(
                    format,
                    &row,
                    q.row_codes(0).unwrap(),
                    q.row_scales(0).unwrap(),
                );
                let got = ks.dot(format, &w, &q, 0).unwrap();
                assert!(
                    same(got, want),
                    "{format} {} trial {trial}: {got} vs {want}",
                    ks.name()
                );
            }
        }
    }
}

#[test]
fn simd_paths_are_bit_identical_to_scalar_over_many_shapes_and_hostile_blocks() {
    let mut rng = Rng(43);
    let scalar = Kernels::scalar();
    let mut compared = 0;
    for format in FORMATS {
        let cs = cases(format);
        let bl = format.block_len();
        for nb in [1, 2, 3, 7, 16] {
            let k = nb * bl;
            for n in [1, 2, 7, 8, 9, 15, 16, 17, 31, 33] {
                let w: Vec<u8> = (0..n * nb)
                    .flat_map(|_| cs[rng.below(cs.len() as u64) as usize].block.clone())
                    .collect();
                for m in [1, 2, 5] {
                    let x = random_acts(&mut rng, m * k);
                    let a = acts(&scalar, format, k, &x);
                    let mut want = vec![0.0; m * n];
                    scalar.matmul(format, &w, n, &a, &mut want).unwrap();
                    for ks in Kernels::all_available() {
                        let a = acts(&ks, format, k, &x);
                        let mut got = vec![f32::NAN; m * n];
                        ks.matmul(format, &w, n, &a, &mut got).unwrap();
                        for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                same(g, e),
                                "{format} {} k={k} n={n} m={m} [{i}]: {g} vs {e}",
                                ks.name()
                            );
                        }
                        // Threads split N only; the packed container is row-major here.
                        let mut t = vec![0.0; m * n];
                        ks.matmul_threaded(format, &w, n, &a, &mut t, 3).unwrap();
                        assert!(t.iter().zip(&got).all(|(&p, &q)| same(p, q)));
                        let p = PackedMatrix::pack(format, &w, n, k).unwrap();
                        let mut pk = vec![0.0; m * n];
                        ks.matmul_packed(&p, &a, 0..n, &mut pk, n).unwrap();
                        assert!(pk.iter().zip(&got).all(|(&p, &q)| same(p, q)));
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared >= 2 * 5 * 10 * 3);
}

/// Stated tolerance: `|dot − Σ w·x| ≤ Σ_b (da_b/2)·Σ_{i∈b} |w_i| + 2^-20·Σ |w_i·x_i|` — the
/// activation rounding (at most half a step per element; weights are dequantized exactly)
/// plus f32 accumulation.
#[test]
fn dot_is_within_the_activation_rounding_bound_of_the_f64_dot() {
    let mut rng = Rng(47);
    for format in FORMATS {
        let bl = format.block_len();
        for trial in 0..20 {
            let k = bl * (1 + rng.below(12) as usize);
            let wv: Vec<f32> = (0..k).map(|_| rng.unit() * 0.3).collect();
            // Realistic rows from the reference quantizer, and the fixtures' tame blocks.
            let w = if trial % 2 == 0 {
                quantize_row(format, &wv).unwrap()
            } else {
                let cs: Vec<Case> = cases(format)
                    .into_iter()
                    .filter(|c| tame(format, c))
                    .collect();
                (0..k / bl)
                    .flat_map(|_| cs[rng.below(cs.len() as u64) as usize].block.clone())
                    .collect()
            };
            let mut wf = vec![0.0; k];
            dequantize_row(format, &w, &mut wf).unwrap();
            let x = random_acts(&mut rng, k);
            let exact: f64 = wf
                .iter()
                .zip(&x)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            for ks in Kernels::all_available() {
                let q = acts(&ks, format, k, &x);
                let da = q.row_scales(0).unwrap();
                let tol: f64 = wf
                    .chunks(bl)
                    .zip(da)
                    .map(|(wb, &d)| {
                        f64::from(d) / 2.0 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
                    })
                    .sum::<f64>()
                    + wf.iter()
                        .zip(&x)
                        .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                        .sum::<f64>()
                        / f64::from(1u32 << 20);
                let got = f64::from(ks.dot(format, &w, &q, 0).unwrap());
                assert!(
                    (got - exact).abs() <= tol,
                    "{format} {} k={k}: {got} vs {exact} (tol {tol})",
                    ks.name()
                );
            }
        }
    }
}

#[test]
fn hostile_blocks_never_panic_and_malformed_shapes_are_errors() {
    let mut rng = Rng(53);
    for format in FORMATS {
        let bl = format.block_len();
        let bb = format.block_bytes();
        // Random bytes everywhere: any f16 (NaN, inf, subnormal) and any E8M0 byte.
        for _ in 0..50 {
            let nb = 1 + rng.below(4) as usize;
            let w: Vec<u8> = (0..nb * bb).map(|_| rng.next() as u8).collect();
            let mut out = vec![0.0; nb * bl];
            dequantize_row(format, &w, &mut out).unwrap();
            let mut x = random_acts(&mut rng, nb * bl);
            x[0] = [f32::NAN, f32::INFINITY, 3e38, 1e-40][rng.below(4) as usize];
            let mut want = None;
            for ks in Kernels::all_available() {
                let got = ks
                    .dot(format, &w, &acts(&ks, format, nb * bl, &x), 0)
                    .unwrap();
                let w0 = *want.get_or_insert(got);
                assert!(same(got, w0), "{format} {}: {got} vs {w0}", ks.name());
            }
        }
        // Shapes.
        let mut out = vec![0.0; bl];
        assert!(matches!(
            dequantize_row(format, &vec![0; bb - 1], &mut out),
            Err(QuantError::Length { .. })
        ));
        let mut short = vec![0.0; bl - 1];
        assert!(matches!(
            dequantize_row(format, &vec![0; bb], &mut short),
            Err(QuantError::RaggedRow { .. })
        ));
        assert!(matches!(
            format.row_bytes(bl + 1),
            Err(QuantError::RaggedRow { .. })
        ));
        let ks = Kernels::scalar();
        let a = acts(&ks, format, bl, &vec![0.5; bl]);
        let mut o = vec![0.0; 2];
        assert!(matches!(
            ks.matmul(format, &vec![0; 2 * bb - 1], 2, &a, &mut o),
            Err(QuantError::Length { .. })
        ));
        let other = if format == Format::MXFP4 {
            Format::IQ2_XXS
        } else {
            Format::MXFP4
        };
        let wrong = acts(&ks, other, 256, &[0.5; 256]);
        assert!(matches!(
            ks.dot(format, &vec![0; 256 / bl * bb], &wrong, 0),
            Err(QuantError::ActLayout { .. })
        ));
        assert!(PackedMatrix::pack(format, &vec![0; bb], 1, bl + 1).is_err());
    }
}
