//! Rotary position embedding tables: cos/sin per (position, pair) computed once, in f64,
//! so every path (and every batch shape) rotates with the very same f32 values.

use crate::error::{Error, Result};

/// Which elements of a head form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// llama (GGML "normal"): pairs `(2i, 2i + 1)`.
    Normal,
    /// GPT-NeoX (qwen2, gemma3): pairs `(i, i + dims/2)`.
    Neox,
}

/// cos/sin of `theta(p, i) = (p / factor) * base^(-2i / dims)` for every position
/// `p < n_positions` and pair `i < dims / 2`.
///
/// Exact definition: in f64, `pos = p as f64 / factor`, `freq = base.powf(-(2 * i) as f64
/// / dims as f64)`, `theta = pos * freq`; the table holds `theta.cos() as f32` and
/// `theta.sin() as f32`. (`factor` is the linear RoPE scaling factor, 1 for none.)
#[derive(Clone, Debug)]
pub struct RopeTable {
    base: f64,
    dims: usize,
    factor: f64,
    n_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for positions `0..n_positions`.
    ///
    /// `dims` is the number of rotated elements per head (even, > 0; usually the head
    /// dimension), `base` the frequency base (`rope.freq_base`), `factor` the linear
    /// scaling factor (`rope.scaling.factor` with type linear, else 1).
    pub fn new(base: f64, dims: usize, factor: f64, n_positions: usize) -> Result<Self> {
        if dims == 0 || !dims.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "RoPE dims must be even and > 0, got {dims}"
            )));
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(Error::Config(format!(
                "RoPE base must be finite and > 0, got {base}"
            )));
        }
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::Config(format!(
                "RoPE scaling factor must be finite and > 0, got {factor}"
            )));
        }
        let mut t = RopeTable {
            base,
            dims,
            factor,
            n_positions: 0,
            cos: Vec::new(),
            sin: Vec::new(),
        };
        t.extend_to(n_positions);
        Ok(t)
    }

    /// Grows the table to cover positions `0..n_positions` (values of existing positions
    /// do not change: each entry depends only on its own position and pair).
    pub fn extend_to(&mut self, n_positions: usize) {
        if n_positions <= self.n_positions {
            return;
        }
        let half = self.dims / 2;
        let freqs: Vec<f64> = (0..half)
            .map(|i| self.base.powf(-((2 * i) as f64) / self.dims as f64))
            .collect();
        self.cos.reserve((n_positions - self.n_positions) * half);
        self.sin.reserve((n_positions - self.n_positions) * half);
        for p in self.n_positions..n_positions {
            let pos = p as f64 / self.factor;
            for &f in &freqs {
                let theta = pos * f;
                self.cos.push(theta.cos() as f32);
                self.sin.push(theta.sin() as f32);
            }
        }
        self.n_positions = n_positions;
    }

    /// Rotated elements per head.
    pub fn dims(&self) -> usize {
        self.dims
    }

    /// Positions covered.
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }

    /// Frequency base.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// Linear scaling factor.
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// `(cos, sin)` rows of `dims / 2` values for position `pos`.
    pub fn row(&self, pos: usize) -> Result<(&[f32], &[f32])> {
        if pos >= self.n_positions {
            return Err(Error::RopePosition {
                pos,
                len: self.n_positions,
            });
        }
        let half = self.dims / 2;
        let r = pos * half..(pos + 1) * half;
        Ok((&self.cos[r.clone()], &self.sin[r]))
    }
}
