//! The activation quantizer (ARCHITECTURE.md "Activation quantization") and the buffer that
//! holds quantized activation rows for reuse across calls.

use crate::kernels::{Kernels, Path};
use crate::{ActLayout, QuantError};

/// M activation rows of length K, in the representation one weight layout consumes:
/// int8 codes with an f32 scale per block and integer code sums (quantized layouts), or the
/// f32 values themselves ([`ActLayout::Float`]). Allocate once, refill with
/// [`QuantizedActs::quantize_into`].
#[derive(Debug, Clone)]
pub struct QuantizedActs {
    pub(crate) layout: ActLayout,
    pub(crate) k: usize,
    pub(crate) m: usize,
    /// Codes, `m·k` (quantized layouts).
    pub(crate) qs: Vec<i8>,
    /// Block scales, `m·k/block_len`.
    pub(crate) d: Vec<f32>,
    /// Code sums per 16 (`m·k/16`, [`ActLayout::Blocks256`] only).
    pub(crate) s16: Vec<i16>,
    /// Code sums per 32 (`m·k/32`, quantized layouts).
    pub(crate) s32: Vec<i16>,
    /// The f32 rows ([`ActLayout::Float`] only).
    pub(crate) f: Vec<f32>,
}

impl QuantizedActs {
    /// An empty buffer for rows of length `k` (no rows yet).
    pub fn new(layout: ActLayout, k: usize) -> Result<Self, QuantError> {
        let bl = layout.block_len();
        if !k.is_multiple_of(bl) || k == 0 {
            return Err(QuantError::Length {
                what: "activation row length (multiple of the block length)",
                expected: bl.max(1) * (k / bl.max(1)).max(1),
                got: k,
            });
        }
        Ok(QuantizedActs {
            layout,
            k,
            m: 0,
            qs: Vec::new(),
            d: Vec::new(),
            s16: Vec::new(),
            s32: Vec::new(),
            f: Vec::new(),
        })
    }

    /// The layout these activations are in.
    pub fn layout(&self) -> ActLayout {
        self.layout
    }

    /// Row length K.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Number of rows M currently held.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Quantize `x` (M rows of K, row-major; M = `x.len() / k`) into this buffer with the
    /// process-wide kernels. Reuses the allocation when M does not grow.
    pub fn quantize_into(&mut self, x: &[f32]) -> Result<(), QuantError> {
        self.quantize_into_with(crate::kernels(), x)
    }

    /// As [`QuantizedActs::quantize_into`], with an explicit kernel set (tests compare paths).
    pub fn quantize_into_with(&mut self, kernels: &Kernels, x: &[f32]) -> Result<(), QuantError> {
        if !x.len().is_multiple_of(self.k) {
            return Err(QuantError::Length {
                what: "activations (a multiple of K)",
                expected: (x.len() / self.k + 1) * self.k,
                got: x.len(),
            });
        }
        let m = x.len() / self.k;
        self.m = m;
        if self.layout == ActLayout::Float {
            self.f.clear();
            self.f.extend_from_slice(x);
            return Ok(());
        }
        let bl = self.layout.block_len();
        self.qs.resize(m * self.k, 0);
        self.d.resize(m * self.k / bl, 0.0);
        self.s32.resize(m * self.k / 32, 0);
        if self.layout == ActLayout::Blocks256 {
            self.s16.resize(m * self.k / 16, 0);
        }
        for (((xb, qb), d), s32) in x
            .chunks_exact(bl)
            .zip(self.qs.chunks_exact_mut(bl))
            .zip(self.d.iter_mut())
            .zip(self.s32.chunks_exact_mut(bl / 32))
        {
            *d = quantize_block(kernels.path(), xb, qb);
            for (s, q) in s32.iter_mut().zip(qb.chunks_exact(32)) {
                *s = q.iter().map(|&v| i16::from(v)).sum();
            }
        }
        for (s, q) in self.s16.iter_mut().zip(self.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        Ok(())
    }

    /// The int8 codes of row `m` (empty for [`ActLayout::Float`]).
    pub fn row_codes(&self, m: usize) -> Result<&[i8], QuantError> {
        self.check_row(m)?;
        if self.layout == ActLayout::Float {
            return Ok(&[]);
        }
        Ok(&self.qs[m * self.k..(m + 1) * self.k])
    }

    /// The block scales of row `m` (empty for [`ActLayout::Float`]).
    pub fn row_scales(&self, m: usize) -> Result<&[f32], QuantError> {
        self.check_row(m)?;
        let nb = self.k / self.layout.block_len();
        if self.layout == ActLayout::Float {
            return Ok(&[]);
        }
        Ok(&self.d[m * nb..(m + 1) * nb])
    }

    /// The code sums per 32 of row `m` (empty for [`ActLayout::Float`]).
    pub fn row_sums32(&self, m: usize) -> Result<&[i16], QuantError> {
        self.check_row(m)?;
        if self.layout == ActLayout::Float {
            return Ok(&[]);
        }
        Ok(&self.s32[m * self.k / 32..(m + 1) * self.k / 32])
    }

    /// The code sums per 16 of row `m` ([`ActLayout::Blocks256`] only, else empty).
    pub fn row_sums16(&self, m: usize) -> Result<&[i16], QuantError> {
        self.check_row(m)?;
        if self.layout != ActLayout::Blocks256 {
            return Ok(&[]);
        }
        Ok(&self.s16[m * self.k / 16..(m + 1) * self.k / 16])
    }

    /// The f32 values of row `m` ([`ActLayout::Float`] only, else empty).
    pub fn row_f32(&self, m: usize) -> Result<&[f32], QuantError> {
        self.check_row(m)?;
        if self.layout != ActLayout::Float {
            return Ok(&[]);
        }
        Ok(&self.f[m * self.k..(m + 1) * self.k])
    }

    fn check_row(&self, m: usize) -> Result<(), QuantError> {
        if m >= self.m {
            return Err(QuantError::Row {
                row: m,
                rows: self.m,
            });
        }
        Ok(())
    }
}

/// Quantize one block with the given path; returns the block scale `d`.
fn quantize_block(path: Path, x: &[f32], q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        match path {
            // SAFETY: a `Kernels` value for these paths exists only after runtime detection
            // of the features the functions enable; `x` and `q` have equal lengths, a
            // multiple of 16.
            Path::Avx512Vnni => return unsafe { crate::x86::acts::quantize_block_avx512(x, q) },
            // SAFETY: as above, for AVX2.
            Path::Avx2 => return unsafe { crate::x86::acts::quantize_block_avx2(x, q) },
            Path::Scalar => {}
        }
    }
    let _ = path;
    quantize_block_scalar(x, q)
}

/// The clamp of the contract with x86 `minps`/`maxps` semantics: `min(v, 127)` yields 127
/// when `v` is NaN, then `max(·, -127)`.
#[inline]
fn clamp127(v: f32) -> f32 {
    let v = if v < 127.0 { v } else { 127.0 };
    if v > -127.0 { v } else { -127.0 }
}

/// `|x|` maxima are compared as IEEE bit patterns with the sign cleared (identical to float
/// comparison for non-NaN values; NaN compares largest), so every path agrees on NaN too.
#[inline]
pub(crate) fn abs_bits(x: f32) -> u32 {
    x.to_bits() & 0x7FFF_FFFF
}

/// The scalar reference quantizer for one block. Returns `d`.
pub(crate) fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = f32::from_bits(x.iter().map(|&v| abs_bits(v)).max().unwrap_or(0));
    let (d, id) = scales(amax);
    for (o, &v) in q.iter_mut().zip(x) {
        *o = clamp127(v * id).round_ties_even() as i8;
    }
    d
}

/// `d = amax / 127`, `id = 127 / amax` (0 when `amax == 0`).
#[inline]
pub(crate) fn scales(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
    (d, id)
}
