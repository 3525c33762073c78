//! Row operations of the forward pass (norms, activations, residuals, softmax, RoPE).
//!
//! Every operation works row by row with the canonical order of the crate docs, so a
//! row's result never depends on the other rows of the buffer. Buffers are row-major f32;
//! the row length is implied by the weight (norms) or given.

use crate::error::{Error, Result, check_len};
use crate::isa::Isa;
use crate::kernels;
use crate::rope::{RopeStyle, RopeTable};

/// How an RMSNorm weight is applied.
///
/// GGUF files written by llama.cpp's converter store gemma/gemma2/gemma3 norm weights
/// already shifted (`w + 1`, `norm_shift = 1.0` in `convert_hf_to_gguf.py`), so GGUF
/// models use [`NormWeight::Plain`] for every architecture; [`NormWeight::OnePlus`] is for
/// unshifted (Hugging Face) gemma weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormWeight {
    /// `out = (x * inv) * w`.
    Plain,
    /// `out = (x * inv) * (1 + w)`, with `1 + w` rounded to f32 first.
    OnePlus,
}

/// A kernel set: the row operations bound to one [`Isa`]. The free functions of this
/// module use [`Kernels::selected`]; tests and benches build one per path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    isa: Isa,
}

/// Elements processed per piece by the in-place variants (which run the out-of-place
/// kernel on a copy of each piece; element-wise results do not depend on the piece).
const PIECE: usize = 256;

impl Kernels {
    /// The process-wide kernel set ([`Isa::selected`]).
    pub fn selected() -> Kernels {
        Kernels {
            isa: Isa::selected(),
        }
    }

    /// The kernel set for `isa`; an unsupported path runs the scalar reference.
    pub fn new(isa: Isa) -> Kernels {
        Kernels { isa: isa.checked() }
    }

    /// The path these kernels run.
    pub fn isa(self) -> Isa {
        self.isa
    }

    /// Canonical dot product (16 lanes, fma in index order, fixed tree).
    pub fn dot(self, a: &[f32], b: &[f32]) -> Result<f32> {
        check_len("dot b", a.len(), b.len())?;
        Ok(kernels::dot(self.isa, a, b))
    }

    /// Canonical dot product of f32 with f16 values (bit patterns, converted exactly).
    pub fn dot_f16(self, a: &[f32], b: &[u16]) -> Result<f32> {
        check_len("dot_f16 b", a.len(), b.len())?;
        Ok(kernels::dot_f16(self.isa, a, b))
    }

    /// f32 → IEEE binary16 bits, round-to-nearest-even (`vcvtps2ph` semantics, see
    /// [`crate::canon::f32_to_f16`]).
    pub fn f32_to_f16(self, src: &[f32], dst: &mut [u16]) -> Result<()> {
        check_len("f32_to_f16 dst", src.len(), dst.len())?;
        kernels::f32_to_f16(self.isa, src, dst);
        Ok(())
    }

    /// IEEE binary16 bits → f32 (exact).
    pub fn f16_to_f32(self, src: &[u16], dst: &mut [f32]) -> Result<()> {
        check_len("f16_to_f32 dst", src.len(), dst.len())?;
        kernels::f16_to_f32(self.isa, src, dst);
        Ok(())
    }

    /// `out_i = exp(x_i)` with the crate's one exp ([`crate::canon::exp`]).
    pub fn exp(self, x: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("exp out", x.len(), out.len())?;
        // x - 0.0 == x for every x (including -0.0 and NaN), so this is exp(x).
        kernels::exp_shifted(self.isa, x, 0.0, out);
        Ok(())
    }

    /// Canonical sum (16 lanes, adds in index order, fixed tree).
    pub fn sum(self, x: &[f32]) -> f32 {
        kernels::sum(self.isa, x)
    }

    /// RMSNorm of every row of `x` (row length `w.len()`) into `out`:
    /// `ss = dot(x, x)` (canonical), `mean = ss / n` (`n` as f32), `inv = 1 / sqrt(mean + eps)`
    /// (f32 add, correctly rounded sqrt, f32 division), `out_i = (x_i * inv) * w_i`
    /// (or `(x_i * inv) * (1 + w_i)`, see [`NormWeight`]).
    pub fn rms_norm(
        self,
        x: &[f32],
        w: &[f32],
        eps: f32,
        weight: NormWeight,
        out: &mut [f32],
    ) -> Result<()> {
        let n = row_len_of("rms_norm x", x.len(), w.len())?;
        check_len("rms_norm out", x.len(), out.len())?;
        for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let inv = self.rms_inv(xr, eps);
            kernels::scale_mul(self.isa, xr, w, inv, weight == NormWeight::OnePlus, or);
        }
        Ok(())
    }

    /// [`Kernels::rms_norm`] in place (bit-identical results).
    pub fn rms_norm_in_place(
        self,
        x: &mut [f32],
        w: &[f32],
        eps: f32,
        weight: NormWeight,
    ) -> Result<()> {
        let n = row_len_of("rms_norm x", x.len(), w.len())?;
        for xr in x.chunks_exact_mut(n) {
            let inv = self.rms_inv(xr, eps);
            let mut buf = [0.0f32; PIECE];
            for (xp, wp) in xr.chunks_mut(PIECE).zip(w.chunks(PIECE)) {
                let b = &mut buf[..xp.len()];
                b.copy_from_slice(xp);
                kernels::scale_mul(self.isa, b, wp, inv, weight == NormWeight::OnePlus, xp);
            }
        }
        Ok(())
    }

    fn rms_inv(self, x: &[f32], eps: f32) -> f32 {
        let ss = kernels::dot(self.isa, x, x);
        let mean = ss / x.len() as f32;
        1.0 / (mean + eps).sqrt()
    }

    /// SwiGLU: `out_i = silu(gate_i) * up_i` with `silu(g) = g / (1 + exp(-g))`.
    pub fn swiglu(self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("swiglu up", gate.len(), up.len())?;
        check_len("swiglu out", gate.len(), out.len())?;
        kernels::swiglu(self.isa, gate, up, out);
        Ok(())
    }

    /// [`Kernels::swiglu`] with the result written over `gate`.
    pub fn swiglu_in_place(self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        check_len("swiglu up", gate.len(), up.len())?;
        self.pieces(gate, up, kernels::swiglu);
        Ok(())
    }

    /// GeGLU (gemma): `out_i = gelu_tanh(gate_i) * up_i`, with
    /// `gelu_tanh(g) = g / (1 + exp(-z))`, `z = (g * fma(0.044715, g*g, 1)) * 2*sqrt(2/pi)`
    /// (the tanh form `0.5 g (1 + tanh(z/2))` rewritten exactly).
    pub fn geglu(self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("geglu up", gate.len(), up.len())?;
        check_len("geglu out", gate.len(), out.len())?;
        kernels::geglu(self.isa, gate, up, out);
        Ok(())
    }

    /// [`Kernels::geglu`] with the result written over `gate`.
    pub fn geglu_in_place(self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        check_len("geglu up", gate.len(), up.len())?;
        self.pieces(gate, up, kernels::geglu);
        Ok(())
    }

    fn pieces(self, x: &mut [f32], y: &[f32], f: fn(Isa, &[f32], &[f32], &mut [f32])) {
        let mut buf = [0.0f32; PIECE];
        for (xp, yp) in x.chunks_mut(PIECE).zip(y.chunks(PIECE)) {
            let b = &mut buf[..xp.len()];
            b.copy_from_slice(xp);
            f(self.isa, b, yp, xp);
        }
    }

    /// Softmax of every row of `x` (row length `row_len`) into `out`:
    /// `m = max_i x_i` (in index order), `e_i = exp(x_i - m)`, `s = sum(e)` (canonical),
    /// `out_i = e_i * (1 / s)`.
    pub fn softmax(self, x: &[f32], row_len: usize, out: &mut [f32]) -> Result<()> {
        let n = row_len_of("softmax x", x.len(), row_len)?;
        check_len("softmax out", x.len(), out.len())?;
        for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let m = xr
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            kernels::exp_shifted(self.isa, xr, m, or);
            let s = kernels::sum(self.isa, or);
            kernels::scale_in_place(self.isa, or, 1.0 / s);
        }
        Ok(())
    }

    /// `x_i = x_i * s`.
    pub fn scale(self, x: &mut [f32], s: f32) {
        kernels::scale_in_place(self.isa, x, s);
    }

    /// `out_i = a_i + b_i`.
    pub fn add(self, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("add b", a.len(), b.len())?;
        check_len("add out", a.len(), out.len())?;
        // One IEEE add per element: the compiler's vectorisation of this loop cannot change
        // a result, so one implementation serves every path.
        for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
        Ok(())
    }

    /// Residual add: `acc_i = acc_i + x_i`.
    pub fn add_in_place(self, acc: &mut [f32], x: &[f32]) -> Result<()> {
        check_len("add x", acc.len(), x.len())?;
        for (a, &b) in acc.iter_mut().zip(x) {
            *a += b;
        }
        Ok(())
    }

    /// Rotary embedding in place. `x` holds `positions.len()` rows of `n_heads * head_dim`
    /// values; row `r` is rotated by the table row of `positions[r]`, every head alike; the
    /// first `table.dims()` elements of each head are rotated, the rest left as is.
    /// Each pair becomes `(x0*c - x1*s, x0*s + x1*c)` (plain products, no fma).
    pub fn rope(
        self,
        x: &mut [f32],
        head_dim: usize,
        positions: &[usize],
        table: &RopeTable,
        style: RopeStyle,
    ) -> Result<()> {
        if head_dim == 0 || table.dims() > head_dim {
            return Err(Error::Config(format!(
                "RoPE dims {} exceed head_dim {head_dim}",
                table.dims()
            )));
        }
        if positions.is_empty() {
            return check_len("rope x", 0, x.len());
        }
        if !x.len().is_multiple_of(positions.len())
            || !(x.len() / positions.len()).is_multiple_of(head_dim)
        {
            return Err(Error::Shape {
                what: "rope x (rows of whole heads, one row per position)",
                expected: x.len() / positions.len() / head_dim * head_dim * positions.len(),
                got: x.len(),
            });
        }
        let row = x.len() / positions.len();
        for &p in positions {
            table.row(p)?;
        }
        let dims = table.dims();
        for (xr, &p) in x.chunks_exact_mut(row).zip(positions) {
            let (cos, sin) = table.row(p)?;
            for head in xr.chunks_exact_mut(head_dim) {
                let h = &mut head[..dims];
                match style {
                    RopeStyle::Neox => kernels::rope_neox(self.isa, h, cos, sin),
                    RopeStyle::Normal => kernels::rope_normal(self.isa, h, cos, sin),
                }
            }
        }
        Ok(())
    }
}

/// `total / row_len` rows, checking that `total` is a whole number of rows of a non-zero
/// length; returns `row_len`.
fn row_len_of(what: &'static str, total: usize, row_len: usize) -> Result<usize> {
    match total.checked_div(row_len) {
        Some(rows) if rows * row_len == total => Ok(row_len),
        rows => Err(Error::Shape {
            what,
            expected: rows.unwrap_or(0) * row_len,
            got: total,
        }),
    }
}

/// [`Kernels::dot`] with the process-wide kernel set.
pub fn dot(a: &[f32], b: &[f32]) -> Result<f32> {
    Kernels::selected().dot(a, b)
}

/// [`Kernels::sum`] with the process-wide kernel set.
pub fn sum(x: &[f32]) -> f32 {
    Kernels::selected().sum(x)
}

/// [`Kernels::rms_norm`] with the process-wide kernel set.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, weight: NormWeight, out: &mut [f32]) -> Result<()> {
    Kernels::selected().rms_norm(x, w, eps, weight, out)
}

/// [`Kernels::rms_norm_in_place`] with the process-wide kernel set.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32, weight: NormWeight) -> Result<()> {
    Kernels::selected().rms_norm_in_place(x, w, eps, weight)
}

/// [`Kernels::swiglu`] with the process-wide kernel set.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    Kernels::selected().swiglu(gate, up, out)
}

/// [`Kernels::swiglu_in_place`] with the process-wide kernel set.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) -> Result<()> {
    Kernels::selected().swiglu_in_place(gate, up)
}

/// [`Kernels::geglu`] with the process-wide kernel set.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    Kernels::selected().geglu(gate, up, out)
}

/// [`Kernels::geglu_in_place`] with the process-wide kernel set.
pub fn geglu_in_place(gate: &mut [f32], up: &[f32]) -> Result<()> {
    Kernels::selected().geglu_in_place(gate, up)
}

/// [`Kernels::softmax`] with the process-wide kernel set.
pub fn softmax(x: &[f32], row_len: usize, out: &mut [f32]) -> Result<()> {
    Kernels::selected().softmax(x, row_len, out)
}

/// [`Kernels::scale`] with the process-wide kernel set.
pub fn scale(x: &mut [f32], s: f32) {
    Kernels::selected().scale(x, s)
}

/// [`Kernels::add`] with the process-wide kernel set.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    Kernels::selected().add(a, b, out)
}

/// [`Kernels::add_in_place`] with the process-wide kernel set.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) -> Result<()> {
    Kernels::selected().add_in_place(acc, x)
}

/// [`Kernels::rope`] with the process-wide kernel set.
pub fn rope(
    x: &mut [f32],
    head_dim: usize,
    positions: &[usize],
    table: &RopeTable,
    style: RopeStyle,
) -> Result<()> {
    Kernels::selected().rope(x, head_dim, positions, table, style)
}
