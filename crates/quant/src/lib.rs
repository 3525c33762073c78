//! Quantized block formats: dequantization and canonical-order dot kernels (scalar, AVX2,
//! AVX-512).
//!
//! This crate knows the ggml block formats (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q2_K–Q6_K, IQ2_XXS, MXFP4) byte for byte, but nothing of GGUF files: it takes byte
//! slices and a [`Format`]. Every dot product follows the canonical order of
//! ARCHITECTURE.md ("Numerics: the canonical order"): activations quantized per block by
//! one quantizer, an exact integer sum inside each weight block, then f32 fused
//! multiply-adds across blocks in block order. The SIMD paths vectorise across output
//! rows and are bit-identical to the scalar reference.
//!
//! ```
//! use lockstep_quant::{kernels, quantize_row, Format, PackedMatrix, QuantizedActs};
//!
//! let k = 64;
//! let w: Vec<f32> = (0..2 * k).map(|i| (i as f32 * 0.37).sin()).collect();
//! let mut bytes = quantize_row(Format::Q8_0, &w[..k]).unwrap();
//! bytes.extend(quantize_row(Format::Q8_0, &w[k..]).unwrap());
//! let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.11).cos()).collect();
//! let mut acts = QuantizedActs::new(Format::Q8_0.act_layout(), k).unwrap();
//! acts.quantize_into(&x).unwrap();
//! let mut out = vec![0.0; 2];
//! kernels().matmul(Format::Q8_0, &bytes, 2, &acts, &mut out).unwrap();
//!
//! // Repacked once at load time into 16-row tiles: same results, faster kernels.
//! let packed = PackedMatrix::pack(Format::Q8_0, &bytes, 2, k).unwrap();
//! let mut out_p = vec![0.0; 2];
//! kernels().matmul_packed(&packed, &acts, 0..2, &mut out_p, 2).unwrap();
//! assert_eq!(out[0].to_bits(), out_p[0].to_bits());
//! ```
//!
//! [`PackedMatrix`] holds weights in N-interleaved 16-row tiles (codes transposed by 4 so
//! that one `vpdpbusd` accumulates 16 output rows, scales as 16-lane vectors) and
//! [`Kernels::matmul_packed`] tiles over M as well, reusing each weight load for several
//! activation rows. Decode (M = 1) and prefill both use it.

mod acts;
mod blocks;
mod dequant;
mod error;
mod format;
mod kernels;
mod packed;
mod quantize;
mod scalar;
mod tables;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use acts::QuantizedActs;
pub use dequant::dequantize_row;
pub use error::QuantError;
pub use format::{ActLayout, Format, QK_K, QK_LEGACY};
pub use kernels::{Kernels, Path, kernels};
pub use packed::PackedMatrix;
pub use quantize::quantize_row;

/// How many bytes ahead of their read position the packed kernels prefetch the weight
/// stream into L2 (default 16 KiB; 0 turns it off). Results never depend on it; it exists
/// so the effect can be measured side by side in one process (`cargo run --release -p
/// lockstep-model --example prefetch_ab`).
#[doc(hidden)]
pub fn set_stream_prefetch(bytes_ahead: usize) {
    #[cfg(target_arch = "x86_64")]
    x86::packed::STREAM_AHEAD.store(bytes_ahead, std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes_ahead;
}
