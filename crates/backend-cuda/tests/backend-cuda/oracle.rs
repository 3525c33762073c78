//! CUDA oracles (G6, G1 on CUDA): every CUDA op against the CPU reference over shapes and
//! formats, compared bit for bit; the whole llama/qwen2 forward against the CPU model;
//! batch invariance, fork and copy-on-write on the device.
//!
//! These tests need an NVIDIA GPU with its driver and NVRTC: without one they FAIL (they
//! are compiled only with `--features cuda`; CI runs `cargo check --features cuda`).

#![cfg(feature = "cuda")]

use engine::{ForwardBackend, ForwardRow, KvSlot, ModelBackend};
use gguf::{GgmlType, GgufFile};
use lockstep_backend_cuda::synth::{TinyShape, tiny_spec, write_model};
use lockstep_backend_cuda::{CudaModel, Device, MvStyle, StepOptions};
use quant::{Format, QuantizedActs, quantize_row};
use std::sync::{Arc, OnceLock};

fn device() -> &'static Device {
    static DEV: OnceLock<Device> = OnceLock::new();
    DEV.get_or_init(|| {
        Device::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
    })
}

/// Deterministic pseudo-random values in [-scale, scale).
fn randv(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (((s >> 40) as f32) / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bits_eq(what: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    if let Some(i) = (0..gpu.len()).find(|&i| gpu[i].to_bits() != cpu[i].to_bits()) {
        panic!(
            "{what}: element {i} differs: cuda {} ({:#x}) cpu {} ({:#x})",
            gpu[i],
            gpu[i].to_bits(),
            cpu[i],
            cpu[i].to_bits()
        );
    }
}

const FORMATS: [Format; 13] = [
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
    Format::F32,
    Format::F16,
    Format::BF16,
];

#[test]
fn kernels_compile_with_nvrtc_for_hopper_and_ampere() {
    for cc in [(9, 0), (8, 0)] {
        let ptx = lockstep_backend_cuda::compile_ptx(cc).unwrap();
        assert!(
            ptx.contains("matmul_q4_k_m1") && ptx.contains("attention"),
            "{cc:?}"
        );
    }
}

#[test]
fn device_opens_and_reports() {
    let d = device();
    let (free, total) = d.memory().unwrap();
    assert!(total > 0 && free <= total);
    eprintln!(
        "device {} sm_{}{}; kernels from cache: {}",
        d.name(),
        d.compute_capability().0,
        d.compute_capability().1,
        d.kernels_from_cache()
    );
}

#[test]
fn matmul_matches_cpu_bit_for_bit_over_formats_and_shapes() {
    let d = device();
    // (n, k, m): decode rows, 4- and 16-row tiles, ragged M and N, odd block counts.
    let shapes = [
        (1, 256, 1),
        (37, 512, 3),
        (64, 1024, 8),
        (130, 256, 17),
        (16, 2304, 5),
        (48, 2304, 12),
        (5, 1536, 40),
        // Rows longer than one warp's staging buffer (6 KiB): staged in chunks.
        (9, 8960, 1),
        (5, 8960, 18),
    ];
    for (fi, &format) in FORMATS.iter().enumerate() {
        for (si, &(n, k, m)) in shapes.iter().enumerate() {
            let seed = (fi * 100 + si) as u64;
            let wf = randv(n * k, seed, 1.0);
            let mut w = Vec::new();
            for row in wf.chunks_exact(k) {
                w.extend(quantize_row(format, row).unwrap());
            }
            let x = randv(m * k, seed + 7, 3.0);
            let mut acts = QuantizedActs::new(format.act_layout(), k).unwrap();
            acts.quantize_into(&x).unwrap();
            let mut cpu = vec![0.0f32; m * n];
            quant::kernels()
                .matmul(format, &w, n, &acts, &mut cpu)
                .unwrap();
            let gpu = d.matmul_host(format, &w, n, k, &x).unwrap();
            assert_bits_eq(&format!("matmul {format} n {n} k {k} m {m}"), &gpu, &cpu);
        }
    }
}

#[test]
fn tensor_core_matmul_matches_cpu_and_the_warp_kernels() {
    // Its own device, so switching the tensor-core kernels does not reach other tests.
    let d = Device::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"));
    d.set_mma(true);
    assert!(
        d.mma(),
        "the tensor-core matmuls need compute capability 8.0 (this device: {:?})",
        d.compute_capability()
    );
    // Down to one row (the default threshold is 17; decode, verify blocks and batched
    // decode steps may take the tensor cores with fewer).
    d.set_mma_min_rows(1);
    // (n, k, m): from one row up (a mostly empty tile) through the default threshold
    // (17), ragged and whole tiles (32 rows by 64 columns; Q4_K's wide tiles: 64 rows),
    // one and many blocks per row.
    let shapes = [
        (65, 2304, 1),
        (130, 1024, 5),
        (200, 1536, 2),
        (64, 256, 16),
        (1, 256, 17),
        (63, 512, 32),
        (64, 256, 33),
        (65, 2304, 40),
        (130, 1024, 100),
        (200, 8960, 64),
        (96, 4096, 512),
        (70, 768, 129),
    ];
    // The 32-element block formats: k any multiple of 32 (stages of eight blocks, the
    // last one short: 896 = 3.5 stages, 576 = 2.25, a single block).
    let shapes32 = [
        (70, 896, 1),
        (65, 1536, 2),
        (130, 1024, 9),
        (64, 576, 16),
        (1, 32, 17),
        (63, 96, 32),
        (64, 576, 33),
        (70, 896, 40),
        (130, 1024, 100),
        (200, 4864, 64),
        (96, 2048, 512),
    ];
    let formats = [
        Format::Q4_K,
        Format::Q6_K,
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
    ];
    for (fi, format) in formats.into_iter().enumerate() {
        let shapes: &[(usize, usize, usize)] = if format.block_len() == 32 {
            &shapes32
        } else {
            &shapes
        };
        for (si, &(n, k, m)) in shapes.iter().enumerate() {
            let seed = (1000 + fi * 100 + si) as u64;
            let wf = randv(n * k, seed, 1.0);
            let mut w = Vec::new();
            for row in wf.chunks_exact(k) {
                w.extend(quantize_row(format, row).unwrap());
            }
            let x = randv(m * k, seed + 7, 3.0);
            let mut acts = QuantizedActs::new(format.act_layout(), k).unwrap();
            acts.quantize_into(&x).unwrap();
            let mut cpu = vec![0.0f32; m * n];
            quant::kernels()
                .matmul(format, &w, n, &acts, &mut cpu)
                .unwrap();
            d.set_mma(true);
            let what = format!("{format} n {n} k {k} m {m}");
            // The wide tiles (over 32 rows; Q4_K, Q6_K and the 32-element formats) and the 32-row ones.
            for wide in [true, false] {
                d.set_mmq_wide(wide);
                let mma = d.matmul_host(format, &w, n, k, &x).unwrap();
                assert_bits_eq(
                    &format!("tensor-core matmul {what} (wide {wide})"),
                    &mma,
                    &cpu,
                );
            }
            d.set_mmq_wide(true);
            d.set_mma(false);
            let warp = d.matmul_host(format, &w, n, k, &x).unwrap();
            assert_bits_eq(&format!("warp matmul {what}"), &warp, &cpu);
        }
    }
}

#[test]
fn matvec_matches_cpu_bit_for_bit_over_formats_shapes_and_prologues() {
    let d = device();
    // (n, k): one row, ragged N, rows of several staging units (k = 8960), many rows per
    // warp (n = 3000).
    let shapes = [(1, 256), (37, 512), (130, 2304), (9, 8960), (3000, 1536)];
    let quantize = |f: Format, n: usize, k: usize, seed: u64| -> Vec<u8> {
        let wf = randv(n * k, seed, 1.0);
        wf.chunks_exact(k)
            .flat_map(|row| quantize_row(f, row).unwrap())
            .collect()
    };
    // The CPU reference: optional RMSNorm, the activation quantizer, the block matmul.
    let cpu = |f: Format, w: &[u8], n: usize, x: &[f32], norm: Option<(&[f32], f32)>| {
        let mut xn = x.to_vec();
        if let Some((nw, eps)) = norm {
            backend_cpu::rms_norm(x, nw, eps, backend_cpu::NormWeight::Plain, &mut xn).unwrap();
        }
        let mut acts = QuantizedActs::new(f.act_layout(), x.len()).unwrap();
        acts.quantize_into(&xn).unwrap();
        let mut out = vec![0.0f32; n];
        quant::kernels().matmul(f, w, n, &acts, &mut out).unwrap();
        out
    };
    for (fi, &format) in FORMATS[..10].iter().enumerate() {
        for (si, &(n, k)) in shapes.iter().enumerate() {
            let seed = (fi * 100 + si) as u64 + 5000;
            let w = quantize(format, n, k, seed);
            let x = randv(k, seed + 7, 3.0);
            let nw = randv(k, seed + 9, 1.5);
            for norm in [None, Some((&nw[..], 1e-6f32))] {
                let want = cpu(format, &w, n, &x, norm);
                for style in [MvStyle::Blocks, MvStyle::Rows, MvStyle::Tensor] {
                    let gpu = d
                        .matvec_host(&[(format, &w, n)], k, &x, norm, style)
                        .unwrap();
                    let what = format!(
                        "matvec {style:?} {format} n {n} k {k} norm {}",
                        norm.is_some()
                    );
                    assert_bits_eq(&what, &gpu[0], &want);
                }
            }
        }
    }
    // Three matrices in one launch, the third in another format (q, k, v of *_K_M files).
    for (fa, fb) in [(Format::Q4_K, Format::Q6_K), (Format::Q5_K, Format::Q6_K)] {
        let k = 1536;
        let ns = [1536, 256, 256];
        let ws: Vec<Vec<u8>> = ns
            .iter()
            .enumerate()
            .map(|(i, &n)| quantize(if i == 2 { fb } else { fa }, n, k, 77 + i as u64))
            .collect();
        let x = randv(k, 78, 2.0);
        let nw = randv(k, 79, 1.5);
        let mats: Vec<(Format, &[u8], usize)> = (0..3)
            .map(|i| (if i == 2 { fb } else { fa }, &ws[i][..], ns[i]))
            .collect();
        for style in [MvStyle::Blocks, MvStyle::Rows, MvStyle::Tensor] {
            let gpu = d
                .matvec_host(&mats, k, &x, Some((&nw, 1e-6)), style)
                .unwrap();
            for (i, &(f, w, n)) in mats.iter().enumerate() {
                let what = format!("matvec {style:?} {fa}+{fb} matrix {i}");
                assert_bits_eq(&what, &gpu[i], &cpu(f, w, n, &x, Some((&nw, 1e-6))));
            }
        }
    }
}

#[test]
fn tensor_core_matvec_rows_match_cpu() {
    // Matmuls of 1 to 16 rows of Q4_K and Q6_K on the tensor-core matvec kernels (`_tc8`:
    // sixteen weight rows a warp, row r of the activations in B column r; more than eight
    // rows in launches of eight; and `_tcs8`, a group's blocks over a CTA's warps): ragged
    // N, rows of several staging units (k = 8960), and row counts of verify blocks and
    // batched decode steps.
    let d = device();
    let shapes = [(37, 512), (130, 2304), (9, 8960), (300, 1536)];
    d.set_tc_rows(true);
    for (split, (fi, format)) in [false, true].into_iter().flat_map(|sp| {
        [Format::Q4_K, Format::Q6_K]
            .into_iter()
            .enumerate()
            .map(move |f| (sp, f))
    }) {
        d.set_tc_split(split);
        for (si, &(n, k)) in shapes.iter().enumerate() {
            let seed = (7000 + fi * 100 + si) as u64;
            let wf = randv(n * k, seed, 1.0);
            let w: Vec<u8> = wf
                .chunks_exact(k)
                .flat_map(|row| quantize_row(format, row).unwrap())
                .collect();
            for m in [1, 2, 3, 5, 8, 11, 16] {
                let x = randv(m * k, seed + m as u64, 3.0);
                let mut acts = QuantizedActs::new(format.act_layout(), k).unwrap();
                acts.quantize_into(&x).unwrap();
                let mut cpu = vec![0.0f32; m * n];
                quant::kernels()
                    .matmul(format, &w, n, &acts, &mut cpu)
                    .unwrap();
                let gpu = d.matmul_host(format, &w, n, k, &x).unwrap();
                assert_bits_eq(
                    &format!("tensor-core matvec {format} n {n} k {k} m {m} split {split}"),
                    &gpu,
                    &cpu,
                );
            }
        }
    }
    d.set_tc_rows(false);
    d.set_tc_split(true);
}

#[test]
fn verify_blocks_on_tensor_core_matvec_match_cpu() {
    // Blocks of 2 to 13 rows through the whole forward with the tensor-core matvec kernels on
    // (Q4_K q/k/v with bias, the output projection and down projection accumulating into
    // the residual, the gate/up pair with SwiGLU; the Q6_K head), then
    // decode steps with the layers and the head on the one-row tensor-core kernels.
    let g = tiny_model(
        "qwen2",
        GgmlType::Q4_K,
        Some(GgmlType::Q6_K),
        "tc-rows-qwen",
    );
    let mut cpu = cpu_backend(&g);
    let (prompt, more) = (tokens(33, 51), tokens(26, 52));
    let sc = cpu.kv_new();
    run_chunks(&mut cpu, sc, 0, &prompt, 33);
    let want = run_chunks(&mut cpu, sc, 33, &more, 1);
    let want_steps = run_chunks(&mut cpu, sc, 59, &more[..6], 1);
    for (split, chunk) in [
        (false, 2),
        (false, 13),
        (true, 2),
        (true, 3),
        (true, 5),
        (true, 8),
        (true, 13),
    ] {
        let mut gpu = cuda_backend(&g);
        gpu.model().device().set_tc_rows(true);
        gpu.model().device().set_tc_split(split);
        gpu.set_step_options(StepOptions::matvec_mode(4));
        let sg = gpu.kv_new();
        run_chunks(&mut gpu, sg, 0, &prompt, 33);
        let got = run_chunks(&mut gpu, sg, 33, &more, chunk);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(b.iter().all(|v| v.is_finite()), "cpu logits finite");
            assert_bits_eq(
                &format!("{chunk}-row blocks (split {split}), position {}", 33 + i),
                a,
                b,
            );
        }
        let steps = run_chunks(&mut gpu, sg, 59, &more[..6], 1);
        for (i, (a, b)) in steps.iter().zip(&want_steps).enumerate() {
            assert_bits_eq(
                &format!("decode after {chunk}-row blocks, position {}", 59 + i),
                a,
                b,
            );
        }
    }
}

#[test]
fn activation_quantizer_matches_cpu() {
    let d = device();
    for layout in [quant::ActLayout::Blocks32, quant::ActLayout::Blocks256] {
        let k = 512;
        let mut x = randv(3 * k, 11, 5.0);
        x[7] = 0.0;
        x[40..72].iter_mut().for_each(|v| *v = 0.0); // an all-zero block of 32
        let mut acts = QuantizedActs::new(layout, k).unwrap();
        acts.quantize_into(&x).unwrap();
        let (qs, ds) = d.quantize_host(layout, k, &x).unwrap();
        for r in 0..3 {
            assert_eq!(
                &qs[r * k..(r + 1) * k],
                acts.row_codes(r).unwrap(),
                "{layout:?} codes row {r}"
            );
            let nb = k / layout.block_len();
            assert_bits_eq(
                &format!("{layout:?} scales"),
                &ds[r * nb..(r + 1) * nb],
                acts.row_scales(r).unwrap(),
            );
        }
    }
}

#[test]
fn row_ops_match_cpu() {
    let d = device();
    for (n, rows) in [(64, 1), (896, 3), (1536, 2), (100, 5)] {
        let x = randv(n * rows, n as u64, 4.0);
        let w = randv(n, 3, 1.5);
        let mut cpu = vec![0.0; n * rows];
        backend_cpu::rms_norm(&x, &w, 1e-6, backend_cpu::NormWeight::Plain, &mut cpu).unwrap();
        assert_bits_eq(
            &format!("rms_norm {n}"),
            &d.rms_norm_host(&x, &w, 1e-6).unwrap(),
            &cpu,
        );
        let u = randv(n * rows, 9, 2.0);
        let mut g = randv(n * rows, 10, 12.0);
        g[0] = 95.0; // exp overflow and underflow edges of the silu
        g[1] = -120.0;
        let mut cpu = vec![0.0; n * rows];
        backend_cpu::swiglu(&g, &u, &mut cpu).unwrap();
        assert_bits_eq("swiglu", &d.swiglu_host(&g, &u).unwrap(), &cpu);
        let mut cpu = vec![0.0; n * rows];
        backend_cpu::add(&x, &u, &mut cpu).unwrap();
        assert_bits_eq("add", &d.add_host(&x, &u).unwrap(), &cpu);
    }
}

#[test]
fn rope_matches_cpu_both_styles() {
    let d = device();
    for (head_dim, dims, heads) in [(64, 64, 3), (128, 128, 2), (128, 64, 2)] {
        let table = backend_cpu::RopeTable::new(1_000_000.0, dims, 1.0, 4096).unwrap();
        let positions = [0usize, 1, 17, 4095];
        let x = randv(positions.len() * heads * head_dim, head_dim as u64, 2.0);
        for (style, neox) in [
            (backend_cpu::RopeStyle::Neox, true),
            (backend_cpu::RopeStyle::Normal, false),
        ] {
            let mut cpu = x.clone();
            backend_cpu::rope(&mut cpu, head_dim, &positions, &table, style).unwrap();
            let gpu = d.rope_host(&x, head_dim, &positions, &table, neox).unwrap();
            assert_bits_eq(
                &format!("rope {style:?} hd {head_dim} dims {dims}"),
                &gpu,
                &cpu,
            );
        }
    }
}

#[test]
fn argmax_ties_to_lowest_and_skips_nan() {
    let d = device();
    let n = 151_936;
    let mut l = randv(3 * n, 5, 10.0);
    l[n + 77] = 50.0;
    l[n + 9000] = 50.0; // tie: the lower id wins
    l[2 * n] = f32::NAN;
    l[2 * n + 5] = 60.0;
    let got = d.argmax_host(&l, n).unwrap();
    let cpu0 = (0..n).fold(0, |b, i| if l[i] > l[b] { i } else { b });
    assert_eq!(got, vec![cpu0 as u32, 77, 5]);
    // Short rows (one slice): ties inside a slice, NaN first, a row of NaN only (id 0).
    let short = [
        f32::NAN,
        3.0,
        3.0,
        -1.0,
        f32::NAN,
        f32::NAN,
        f32::NAN,
        f32::NAN,
    ];
    assert_eq!(d.argmax_host(&short, 4).unwrap(), vec![1, 0]);
}

// ---- the whole forward --------------------------------------------------------------

fn tiny_model(arch: &str, matmul: GgmlType, head: Option<GgmlType>, tag: &str) -> Arc<GgufFile> {
    tiny_model_ctx(arch, matmul, head, tag, 512)
}

fn tiny_model_ctx(
    arch: &str,
    matmul: GgmlType,
    head: Option<GgmlType>,
    tag: &str,
    n_ctx: usize,
) -> Arc<GgufFile> {
    let shape = TinyShape {
        n_layer: 2,
        n_embd: 256,
        n_ff: 512,
        n_head: 4,
        n_head_kv: 2,
        n_vocab: 320,
        n_ctx,
    };
    let spec = tiny_spec(arch, shape, matmul, head);
    let dir = std::env::temp_dir().join(format!("lockstep-cuda-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.gguf"));
    write_model(&spec, 42, &path).unwrap();
    Arc::new(GgufFile::open(&path).unwrap())
}

fn cuda_backend(g: &Arc<GgufFile>) -> lockstep_backend_cuda::CudaBackend {
    cuda_backend_kv(g, 2048)
}

fn cuda_backend_kv(g: &Arc<GgufFile>, kv_tokens: usize) -> lockstep_backend_cuda::CudaBackend {
    let dev = Device::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"));
    let mut b =
        lockstep_backend_cuda::CudaBackend::new(CudaModel::load(dev, g.clone(), None).unwrap());
    b.init_kv(kv_tokens).unwrap();
    b
}

fn cpu_backend(g: &Arc<GgufFile>) -> ModelBackend {
    let m = model::Model::load(g.clone(), &model::LoadOptions::default()).unwrap();
    let mut b = ModelBackend::new(Arc::new(m));
    b.init_kv(4096).unwrap();
    b
}

/// Runs `tokens` through `slot` in chunks of `chunk`, returning every position's logits.
fn run_chunks(
    b: &mut dyn ForwardBackend,
    slot: KvSlot,
    start: usize,
    tokens: &[u32],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let nv = b.n_vocab();
    let mut out = Vec::new();
    let mut logits = Vec::new();
    let mut p = start;
    for c in tokens.chunks(chunk) {
        b.kv_prepare(slot, p, p + c.len()).unwrap();
        let rows: Vec<ForwardRow> = c
            .iter()
            .enumerate()
            .map(|(i, &t)| ForwardRow {
                slot,
                token: t,
                pos: p + i,
                wants_logits: true,
            })
            .collect();
        b.forward(&rows, &mut logits).unwrap();
        out.extend(logits.chunks_exact(nv).map(<[f32]>::to_vec));
        p += c.len();
    }
    out
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    randv(n, seed, 1.0)
        .iter()
        .map(|v| ((v + 1.0) * 150.0) as u32 % 320)
        .collect()
}

#[test]
fn forward_matches_cpu_model_bit_for_bit() {
    let cases = [
        ("qwen2", GgmlType::Q4_K, Some(GgmlType::Q6_K), "qwen-q4k"),
        ("llama", GgmlType::Q8_0, None, "llama-q8-tied"),
        (
            "qwen2",
            GgmlType::Q4_0,
            Some(GgmlType::F16),
            "qwen-q40-f16head",
        ),
        ("llama", GgmlType::Q5_0, Some(GgmlType::Q4_1), "llama-q50"),
    ];
    for (arch, mm, head, tag) in cases {
        let g = tiny_model(arch, mm, head, tag);
        let mut cpu = cpu_backend(&g);
        let mut gpu = cuda_backend(&g);
        let toks = tokens(70, 3); // crosses two block boundaries (block size 32)
        let sc = cpu.kv_new();
        let sg = gpu.kv_new();
        let lc = run_chunks(&mut cpu, sc, 0, &toks, 9);
        let lg = run_chunks(&mut gpu, sg, 0, &toks, 9);
        for (p, (a, b)) in lg.iter().zip(&lc).enumerate() {
            assert!(b.iter().all(|v| v.is_finite()), "{tag}: cpu logits finite");
            assert_bits_eq(&format!("{tag} position {p}"), a, b);
        }
        // Then single-row decode steps (the CUDA graph path after the first step).
        let more = tokens(6, 4);
        let lc = run_chunks(&mut cpu, sc, 70, &more, 1);
        let lg = run_chunks(&mut gpu, sg, 70, &more, 1);
        for (p, (a, b)) in lg.iter().zip(&lc).enumerate() {
            assert_bits_eq(&format!("{tag} decode position {}", 70 + p), a, b);
        }
    }
}

#[test]
fn matvec_decode_through_graphs_matches_cpu() {
    // Decode steps on the matvec kernels (each projection makes its activation row in its
    // prologue; the step's kernels are chained by programmatic dependent launch and, after
    // the first step, replayed from a captured graph) give the CPU model's bits in every
    // layout. By default only layers of 16 MiB and more take the matvec kernels, so the
    // other tests' tiny files never run them chained: a kernel that reads its input before
    // `griddepcontrol.wait` passes the single-launch matvec test and must fail here.
    let shape = TinyShape {
        n_layer: 3,
        n_embd: 1024,
        n_ff: 2816,
        n_head: 8,
        n_head_kv: 2,
        n_vocab: 320,
        n_ctx: 512,
    };
    let spec = tiny_spec("qwen2", shape, GgmlType::Q4_K, Some(GgmlType::Q6_K));
    let dir = std::env::temp_dir().join(format!("lockstep-cuda-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("matvec-chained.gguf");
    write_model(&spec, 42, &path).unwrap();
    let g = Arc::new(GgufFile::open(&path).unwrap());
    let mut cpu = cpu_backend(&g);
    let (prompt, more) = (tokens(40, 41), tokens(24, 42));
    let sc = cpu.kv_new();
    run_chunks(&mut cpu, sc, 0, &prompt, 40);
    let want = run_chunks(&mut cpu, sc, 40, &more, 1);
    for mode in [3, 1, 2, 4, 5] {
        let mut gpu = cuda_backend(&g);
        gpu.set_step_options(StepOptions::matvec_mode(mode));
        let sg = gpu.kv_new();
        run_chunks(&mut gpu, sg, 0, &prompt, 40);
        let got = run_chunks(&mut gpu, sg, 40, &more, 1);
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(b.iter().all(|v| v.is_finite()), "cpu logits finite");
            assert_bits_eq(
                &format!("matvec mode {mode}, decode position {}", 40 + i),
                a,
                b,
            );
        }
    }
}

#[test]
fn an_empty_batch_on_a_new_backend_answers_as_the_cpu_does() {
    // Before any forward there is no scratch; an empty batch must not need one.
    let g = tiny_model("llama", GgmlType::Q8_0, None, "llama-q8-empty");
    let mut cpu = cpu_backend(&g);
    let mut gpu = cuda_backend(&g);
    let (mut lc, mut lg) = (vec![1.0f32], vec![1.0f32]);
    cpu.forward(&[], &mut lc).unwrap();
    gpu.forward(&[], &mut lg).unwrap();
    assert_eq!((lc.len(), lg.len()), (0, 0));
    let mut sums = Vec::new();
    gpu.forward_summaries(&[], &mut sums).unwrap();
    assert!(sums.is_empty());
    assert_eq!(gpu.forward_greedy(&[]).unwrap(), Vec::<u32>::new());
}

#[test]
fn prefill_with_tensor_cores_matches_cpu_model_bit_for_bit() {
    // Chunks of 14 rows and more take the tensor-core matmuls (Q4_K, Q6_K and the 32-element
    // block formats):
    // q/k/v with bias (qwen2), the output projection and down projection accumulating into
    // the residual, the gate/up pair with SwiGLU, and the Q6_K output head.
    let cases = [
        (
            "qwen2",
            GgmlType::Q4_K,
            Some(GgmlType::Q6_K),
            "mma-qwen-q4k",
        ),
        ("llama", GgmlType::Q6_K, None, "mma-llama-q6k-tied"),
        // The 32-element block formats (the 0.5b and smollm2 files' matmuls).
        (
            "qwen2",
            GgmlType::Q5_0,
            Some(GgmlType::Q8_0),
            "mma-qwen-q50",
        ),
        (
            "llama",
            GgmlType::Q4_1,
            Some(GgmlType::Q8_0),
            "mma-llama-q41",
        ),
        ("llama", GgmlType::Q4_0, None, "mma-llama-q40-tied"),
        (
            "qwen2",
            GgmlType::Q5_1,
            Some(GgmlType::Q8_0),
            "mma-qwen-q51",
        ),
    ];
    for (arch, mm, head, tag) in cases {
        let g = tiny_model(arch, mm, head, tag);
        let mut cpu = cpu_backend(&g);
        let sc = cpu.kv_new();
        let toks = tokens(120, 5);
        let lc = run_chunks(&mut cpu, sc, 0, &toks, 120);
        for (mma, wide) in [(true, true), (true, false), (false, false)] {
            let mut gpu = cuda_backend(&g);
            gpu.model().device().set_mma(mma);
            gpu.model().device().set_mmq_wide(wide);
            assert_eq!(gpu.model().device().mma(), mma, "{tag}");
            let sg = gpu.kv_new();
            // 50 rows, then 70 (a whole and a ragged row tile, over a cached prefix).
            let mut lg = run_chunks(&mut gpu, sg, 0, &toks[..50], 50);
            lg.extend(run_chunks(&mut gpu, sg, 50, &toks[50..], 70));
            for (p, (a, b)) in lg.iter().zip(&lc).enumerate() {
                assert!(b.iter().all(|v| v.is_finite()), "{tag}: cpu logits finite");
                assert_bits_eq(
                    &format!("{tag} (tensor cores {mma}, wide {wide}) position {p}"),
                    a,
                    b,
                );
            }
        }
    }
}

/// A 2-layer qwen2 file in Q8_0 of width `n_embd` with `n_head` query and `n_head_kv` KV
/// heads (the attention tests' head shapes).
fn head_shape_model(n_embd: usize, n_head: usize, n_head_kv: usize, tag: &str) -> Arc<GgufFile> {
    let shape = TinyShape {
        n_layer: 2,
        n_embd,
        n_ff: 512,
        n_head,
        n_head_kv,
        n_vocab: 320,
        n_ctx: 512,
    };
    let spec = tiny_spec("qwen2", shape, GgmlType::Q8_0, Some(GgmlType::Q8_0));
    let dir = std::env::temp_dir().join(format!("lockstep-cuda-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.gguf"));
    write_model(&spec, 42, &path).unwrap();
    Arc::new(GgufFile::open(&path).unwrap())
}

#[test]
fn many_row_attention_matches_cpu_over_head_shapes_and_batches() {
    // Steps of more than 16 rows take the many-row attention kernel (a CTA per tile of up to
    // four rows of one sequence and one KV head, every query head of that KV head in one
    // warp): head dimensions 128 and 64, 1 to 8 query heads per KV head, rows tiles cut at
    // sequence boundaries in a step that prefills two sequences at once, and prompt chunks
    // that start inside a KV block. Both kernels must give the CPU model's bits.
    let shapes = [
        (768, 6, 1, "rows-hd128-g6"),
        (512, 8, 1, "rows-hd64-g8"),
        (448, 7, 1, "rows-hd64-g7"),
        (512, 4, 4, "rows-hd128-g1"),
    ];
    for (n_embd, n_head, n_head_kv, tag) in shapes {
        let g = head_shape_model(n_embd, n_head, n_head_kv, tag);
        let mut cpu = cpu_backend(&g);
        let (ta, tb, tc) = (tokens(150, 31), tokens(45, 32), tokens(38, 33));
        let (ca, cb, cc) = (cpu.kv_new(), cpu.kv_new(), cpu.kv_new());
        let la = run_chunks(&mut cpu, ca, 0, &ta, 150);
        let lb = run_chunks(&mut cpu, cb, 0, &tb, 45);
        let lc = run_chunks(&mut cpu, cc, 0, &tc, 38);
        // The many-row kernel; else the tiled kernel with its scores split out over the
        // device, or computed per (row, query head) in the tiled kernel itself.
        for (rows_kernel, split) in [(true, true), (false, true), (false, false)] {
            let mut gpu = cuda_backend(&g);
            let mut o = gpu.step_options();
            o.attn_rows = rows_kernel;
            o.attn_split = split;
            o.attn_split_min_keys = 0;
            gpu.set_step_options(o);
            let what = format!("{tag} (many-row kernel {rows_kernel}, split scores {split})");
            // One sequence: 37 rows, then 113 (starting inside a block).
            let sa = gpu.kv_new();
            let mut lg = run_chunks(&mut gpu, sa, 0, &ta[..37], 37);
            lg.extend(run_chunks(&mut gpu, sa, 37, &ta[37..], 113));
            for (p, (a, b)) in lg.iter().zip(&la).enumerate() {
                assert!(b.iter().all(|v| v.is_finite()), "{what}: cpu logits finite");
                assert_bits_eq(&format!("{what} position {p}"), a, b);
            }
            // Two sequences in one step: 45 rows of one, then 38 of the other.
            let (sb, sc) = (gpu.kv_new(), gpu.kv_new());
            gpu.kv_prepare(sb, 0, tb.len()).unwrap();
            gpu.kv_prepare(sc, 0, tc.len()).unwrap();
            let rows: Vec<ForwardRow> = tb
                .iter()
                .enumerate()
                .map(|(i, &t)| (sb, t, i))
                .chain(tc.iter().enumerate().map(|(i, &t)| (sc, t, i)))
                .map(|(slot, token, pos)| ForwardRow {
                    slot,
                    token,
                    pos,
                    wants_logits: true,
                })
                .collect();
            let mut logits = Vec::new();
            gpu.forward(&rows, &mut logits).unwrap();
            let nv = gpu.n_vocab();
            let got: Vec<&[f32]> = logits.chunks_exact(nv).collect();
            for (i, want) in lb.iter().chain(&lc).enumerate() {
                assert_bits_eq(&format!("{what} batched row {i}"), got[i], want);
            }
        }
    }
}

#[test]
fn compact_attention_matches_cpu_over_head_shapes_and_tiles() {
    // Decode steps and 16-row verify blocks take the compact attention kernel (head
    // dimension 64 or 128, 128 keys a tile, or 64 when the step has more CTAs than the
    // device has multiprocessors): contexts of one to three tiles, rows whose keys end
    // inside a KV block, 1 to 8 query heads per KV head. The compact and the general tiled
    // kernel must both give the CPU model's bits.
    let shapes = [
        (768, 6, 1, "compact-hd128-g6"),
        (512, 4, 4, "compact-hd128-g1"),
        (1152, 9, 3, "compact-hd128-g3-narrow-tiles"),
        (512, 8, 1, "compact-hd64-g8"),
        (448, 7, 1, "compact-hd64-g7"),
    ];
    for (n_embd, n_head, n_head_kv, tag) in shapes {
        let g = head_shape_model(n_embd, n_head, n_head_kv, tag);
        let toks = tokens(300, 51);
        let mut cpu = cpu_backend(&g);
        let sc = cpu.kv_new();
        let mut want = run_chunks(&mut cpu, sc, 0, &toks[..100], 100);
        // Decode rows at 100 .. 107 (one tile, keys ending inside a block), a verify block at
        // 108 .. 123, then rows across the 128-key tile boundary and a block ending in the
        // third tile.
        want.extend(run_chunks(&mut cpu, sc, 100, &toks[100..108], 1));
        want.extend(run_chunks(&mut cpu, sc, 108, &toks[108..124], 16));
        want.extend(run_chunks(&mut cpu, sc, 124, &toks[124..131], 1));
        want.extend(run_chunks(&mut cpu, sc, 131, &toks[131..261], 13));
        for compact in [true, false] {
            let mut gpu = cuda_backend(&g);
            let mut o = gpu.step_options();
            o.attn_compact = compact;
            o.attn_split = false;
            gpu.set_step_options(o);
            let sg = gpu.kv_new();
            let mut got = run_chunks(&mut gpu, sg, 0, &toks[..100], 100);
            got.extend(run_chunks(&mut gpu, sg, 100, &toks[100..108], 1));
            got.extend(run_chunks(&mut gpu, sg, 108, &toks[108..124], 16));
            got.extend(run_chunks(&mut gpu, sg, 124, &toks[124..131], 1));
            got.extend(run_chunks(&mut gpu, sg, 131, &toks[131..261], 13));
            assert_eq!(got.len(), want.len());
            for (p, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(b.iter().all(|v| v.is_finite()), "{tag}: cpu logits finite");
                assert_bits_eq(&format!("{tag} (compact {compact}) position {p}"), a, b);
            }
        }
    }
}

#[test]
fn attention_past_one_span_matches_cpu() {
    // The attention kernel scores 2048 keys per span; a context of 2,300 positions takes
    // two spans, with the running max, sum and accumulators carried across. Decode steps
    // run with the scores split out over the device (many key tiles per row) and without.
    let g = tiny_model_ctx("qwen2", GgmlType::Q8_0, None, "spans", 4096);
    let mut cpu = cpu_backend(&g);
    let toks = tokens(2300, 21);
    let sc = cpu.kv_new();
    let lc = run_chunks(&mut cpu, sc, 0, &toks[..2290], 512);
    let dc = run_chunks(&mut cpu, sc, 2290, &toks[2290..], 1);
    for split in [true, false] {
        let mut gpu = cuda_backend_kv(&g, 4096);
        let mut o = gpu.step_options();
        o.attn_split = split;
        o.attn_split_min_keys = 0;
        gpu.set_step_options(o);
        let sg = gpu.kv_new();
        let lg = run_chunks(&mut gpu, sg, 0, &toks[..2290], 512);
        for p in [0, 2047, 2048, 2049, 2289] {
            assert_bits_eq(
                &format!("split {split}: prefill position {p}"),
                &lg[p],
                &lc[p],
            );
        }
        let dg = run_chunks(&mut gpu, sg, 2290, &toks[2290..], 1);
        for (p, (a, b)) in dg.iter().zip(&dc).enumerate() {
            assert_bits_eq(
                &format!("split {split}: decode position {}", 2290 + p),
                a,
                b,
            );
        }
    }
}

#[test]
fn g1_rows_are_bit_identical_whatever_the_batching() {
    let g = tiny_model("qwen2", GgmlType::Q4_K, Some(GgmlType::Q6_K), "g1");
    let mut b = cuda_backend(&g);
    let toks = tokens(80, 9);
    let s1 = b.kv_new();
    let whole = run_chunks(&mut b, s1, 0, &toks, 80);
    for chunk in [1, 3, 16, 33] {
        let s = b.kv_new();
        let got = run_chunks(&mut b, s, 0, &toks, chunk);
        for (p, (a, w)) in got.iter().zip(&whole).enumerate() {
            assert_eq!(bits(a), bits(w), "chunk {chunk} position {p}");
        }
        b.kv_release(s);
    }
    // Decode steps and verify-sized blocks with the attention's scores split out at every
    // context (the default splits only long ones): the same rows.
    let defaults = b.step_options();
    let mut o = defaults;
    o.attn_split = true;
    o.attn_split_min_keys = 0;
    b.set_step_options(o);
    for chunk in [1, 16] {
        let s = b.kv_new();
        let got = run_chunks(&mut b, s, 0, &toks, chunk);
        for (p, (a, w)) in got.iter().zip(&whole).enumerate() {
            assert_eq!(bits(a), bits(w), "split scores, chunk {chunk} position {p}");
        }
        b.kv_release(s);
    }
    b.set_step_options(defaults);
    // Two sequences in one batch (decode row of one beside a prefill of the other).
    let other = tokens(40, 10);
    let sa = b.kv_new();
    let sb = b.kv_new();
    let _ = run_chunks(&mut b, sa, 0, &toks[..50], 50);
    b.kv_prepare(sa, 50, 51).unwrap();
    b.kv_prepare(sb, 0, 40).unwrap();
    let mut rows = vec![ForwardRow {
        slot: sa,
        token: toks[50],
        pos: 50,
        wants_logits: true,
    }];
    rows.extend(other.iter().enumerate().map(|(i, &t)| ForwardRow {
        slot: sb,
        token: t,
        pos: i,
        wants_logits: i == 39,
    }));
    let mut logits = Vec::new();
    b.forward(&rows, &mut logits).unwrap();
    let nv = b.n_vocab();
    assert_eq!(bits(&logits[..nv]), bits(&whole[50]), "mixed batch row");
    let sc = b.kv_new();
    let alone = run_chunks(&mut b, sc, 0, &other, 1);
    assert_eq!(
        bits(&logits[nv..]),
        bits(&alone[39]),
        "mixed batch prefill row"
    );
}

#[test]
fn fork_truncate_and_copy_on_write_keep_rows_exact() {
    let g = tiny_model("llama", GgmlType::Q4_K, None, "fork");
    let mut b = cuda_backend(&g);
    let toks = tokens(60, 21);
    let base = b.kv_new();
    let ref_all = run_chunks(&mut b, base, 0, &toks, 60);
    // Fork at 45 (inside the second block, which becomes shared), continue differently.
    let f = b.kv_fork(base, 45).unwrap();
    assert_eq!(b.kv_len(f), 45);
    let alt = tokens(10, 22);
    let forked = run_chunks(&mut b, f, 45, &alt, 4);
    let fresh = b.kv_new();
    let mut prefix = toks[..45].to_vec();
    prefix.extend(&alt);
    let fresh_all = run_chunks(&mut b, fresh, 0, &prefix, 55);
    for (i, l) in forked.iter().enumerate() {
        assert_eq!(
            bits(l),
            bits(&fresh_all[45 + i]),
            "forked position {}",
            45 + i
        );
    }
    // The source is untouched by the fork's writes.
    let again = b.kv_new();
    let _ = run_chunks(&mut b, again, 0, &toks[..59], 59);
    b.kv_truncate(base, 59);
    let last = run_chunks(&mut b, base, 59, &toks[59..], 1);
    assert_eq!(bits(&last[0]), bits(&ref_all[59]), "source after fork");
    // Speculative rollback: truncate and recompute gives the same rows.
    b.kv_truncate(base, 50);
    let redo = run_chunks(&mut b, base, 50, &toks[50..], 10);
    for (i, l) in redo.iter().enumerate() {
        assert_eq!(
            bits(l),
            bits(&ref_all[50 + i]),
            "rollback position {}",
            50 + i
        );
    }
    let free0 = b.free_blocks();
    b.kv_release(f);
    assert!(b.free_blocks() > free0, "release gives blocks back");
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let g = tiny_model("llama", GgmlType::Q8_0, None, "bad");
    let mut b = cuda_backend(&g);
    let s = b.kv_new();
    let mut logits = Vec::new();
    let row = |pos, token| ForwardRow {
        slot: s,
        token,
        pos,
        wants_logits: true,
    };
    b.kv_prepare(s, 0, 2).unwrap();
    assert!(
        b.forward(&[row(0, 1_000_000)], &mut logits).is_err(),
        "token outside vocab"
    );
    assert!(
        b.forward(&[row(0, 1), row(2, 1)], &mut logits).is_err(),
        "skipped position"
    );
    assert!(
        b.forward(&[row(5, 1)], &mut logits).is_err(),
        "position past the cache"
    );
    assert!(
        b.forward(&[row(600, 1)], &mut logits).is_err(),
        "position past the context"
    );
    assert!(
        b.forward(
            &[ForwardRow {
                slot: KvSlot(99),
                token: 1,
                pos: 0,
                wants_logits: true
            }],
            &mut logits
        )
        .is_err(),
        "unknown slot"
    );
    b.forward(&[row(0, 1), row(1, 2)], &mut logits).unwrap();
    assert_eq!(logits.len(), 2 * b.n_vocab());
}

#[test]
fn saved_kv_blocks_restore_to_the_same_logits() {
    let g = tiny_model("llama", GgmlType::Q4_K, None, "kvio");
    let mut b = cuda_backend(&g);
    let bs = b.block_size();
    let n = 2 * bs + 7;
    let toks = tokens(n, 31);
    let base = b.kv_new();
    let cold = run_chunks(&mut b, base, 0, &toks, 16);
    let layout = b.kv_block_format().expect("the CUDA backend saves its KV");
    assert!(layout.starts_with("cuda paged KV v1"), "{layout}");
    let bytes = b.kv_block_bytes();
    let mut saved = Vec::new();
    for blk in 0..2 {
        let mut out = Vec::new();
        b.kv_export_block(base, blk, &mut out).unwrap();
        assert_eq!(out.len(), bytes, "block {blk} bytes");
        saved.push(out);
    }
    assert_ne!(saved[0], saved[1], "two blocks of different tokens differ");
    // The third block is not complete: an error, not a panic.
    assert!(b.kv_export_block(base, 2, &mut Vec::new()).is_err());
    // A fresh backend (as after a restart): restore two blocks, compute the rest.
    let mut r = cuda_backend(&g);
    let s = r.kv_new();
    for blk in &saved {
        r.kv_restore_block(s, blk).unwrap();
    }
    assert_eq!(r.kv_len(s), 2 * bs);
    let rest = run_chunks(&mut r, s, 2 * bs, &toks[2 * bs..], 3);
    for (i, l) in rest.iter().enumerate() {
        assert_bits_eq(
            &format!("position {} after a restore", 2 * bs + i),
            l,
            &cold[2 * bs + i],
        );
    }
    // Bad data changes nothing: a short block, and a restore off a block boundary.
    let t = r.kv_new();
    let free = r.free_blocks();
    assert!(r.kv_restore_block(t, &saved[0][..bytes - 2]).is_err());
    assert_eq!(
        (r.kv_len(t), r.free_blocks()),
        (0, free),
        "short block left no trace"
    );
    assert!(
        r.kv_restore_block(s, &saved[0]).is_err(),
        "sequence not at a block boundary"
    );
    // The CPU backend's blocks are another layout (f32 or f16 with its own key).
    let cpu = cpu_backend(&g);
    assert_ne!(cpu.kv_block_format(), Some(layout));
}

/// The device row summaries (argmax, max, the 8 f64 lanes of the log-softmax sum) equal
/// `sampling`'s bit for bit, and so the greedy token and its logprob: ties, `-inf`, NaN,
/// `+inf`, underflowing exps, rows of a length that is not a multiple of 8.
#[test]
fn row_summaries_match_sampling_bit_for_bit() {
    let d = device();
    for (n, rows) in [
        (151_936usize, 3usize),
        (1001, 5),
        (13, 4),
        (7, 2),
        (4096, 3),
    ] {
        let mut l = Vec::new();
        for r in 0..rows {
            let mut row = randv(n, 17 + r as u64 + n as u64, 30.0);
            match r % 4 {
                // Coarse values: many ties at the max.
                0 => row.iter_mut().for_each(|x| *x = (*x / 6.0).round()),
                // Some -inf, a value far below the max (its exp underflows).
                1 => {
                    for i in (0..n).step_by(3) {
                        row[i] = f32::NEG_INFINITY;
                    }
                    row[n - 1] = 200.0;
                }
                2 => row[n / 2] = 1e-30,
                _ => {}
            }
            l.extend(row);
        }
        let got = d.row_summaries_host(&l, n).unwrap();
        assert_eq!(got.len(), rows);
        for (r, g) in got.iter().enumerate() {
            let want = sampling::row_summary(&l[r * n..(r + 1) * n]);
            assert!(!want.fallback, "n {n} row {r}");
            assert_eq!(g.fallback, want.fallback, "n {n} row {r}");
            assert_eq!(g.argmax, want.argmax, "n {n} row {r}: argmax");
            assert_eq!(g.max, want.max, "n {n} row {r}: max");
            for j in 0..sampling::SUMMARY_LANES {
                assert_eq!(
                    g.lanes[j].to_bits(),
                    want.lanes[j].to_bits(),
                    "n {n} row {r}: lane {j}: {} vs {}",
                    g.lanes[j],
                    want.lanes[j]
                );
            }
            let (gt, gl) = g.greedy().unwrap();
            let (wt, wl) = want.greedy().unwrap();
            assert_eq!((gt, gl.to_bits()), (wt, wl.to_bits()), "n {n} row {r}");
        }
    }
    // Rows the host must read in full: a NaN, a +inf, nothing above -inf.
    let n = 1003;
    let mut l = randv(4 * n, 5, 4.0);
    l[17] = f32::NAN;
    l[n + 900] = f32::INFINITY;
    l[2 * n..3 * n].fill(f32::NEG_INFINITY);
    l[3 * n..4 * n].fill(f32::NAN);
    let got = d.row_summaries_host(&l, n).unwrap();
    for (r, g) in got.iter().enumerate() {
        assert!(sampling::row_summary(&l[r * n..(r + 1) * n]).fallback);
        assert!(g.fallback, "row {r}: {g:?}");
        assert!(g.greedy().is_none());
    }
}

/// `forward_summaries` (eager, then from captured graphs) summarizes exactly the rows
/// `forward` returns, and `logit_row` copies those rows out bit for bit.
#[test]
fn forward_summaries_match_forward_rows() {
    let g = tiny_model("qwen2", GgmlType::Q4_K, Some(GgmlType::Q6_K), "qwen-q4k");
    let mut full = cuda_backend(&g);
    let mut summ = cuda_backend(&g);
    summ.set_summaries(true);
    assert!(summ.summarizes());
    let nv = full.n_vocab();
    let toks = tokens(40, 8);
    let (sf, ss) = (full.kv_new(), summ.kv_new());
    let mut logits = Vec::new();
    let mut sums = Vec::new();
    let mut row = Vec::new();
    let mut p = 0;
    // A prompt chunk (last row only), then verify-sized blocks and single decode rows,
    // each shape several times so the graphs are captured and replayed.
    let mut chunks = vec![(12usize, false)];
    chunks.extend([
        (4, true),
        (1, true),
        (1, true),
        (4, true),
        (1, true),
        (4, true),
    ]);
    chunks.extend([(1, true); 6]);
    for (c, all) in chunks {
        let rows: Vec<ForwardRow> = (0..c)
            .map(|i| ForwardRow {
                slot: sf,
                token: toks[p + i],
                pos: p + i,
                wants_logits: all || i + 1 == c,
            })
            .collect();
        full.kv_prepare(sf, p, p + c).unwrap();
        summ.kv_prepare(ss, p, p + c).unwrap();
        full.forward(&rows, &mut logits).unwrap();
        let rows_s: Vec<ForwardRow> = rows.iter().map(|r| ForwardRow { slot: ss, ..*r }).collect();
        summ.forward_summaries(&rows_s, &mut sums).unwrap();
        assert_eq!(sums.len() * nv, logits.len(), "position {p}");
        for (i, s) in sums.iter().enumerate() {
            let want_row = &logits[i * nv..(i + 1) * nv];
            assert_eq!(*s, sampling::row_summary(want_row), "position {p} row {i}");
            summ.logit_row(i, &mut row).unwrap();
            assert_bits_eq(&format!("position {p} row {i}"), &row, want_row);
        }
        assert!(summ.logit_row(sums.len(), &mut row).is_err());
        p += c;
    }
}
