//! Dequantization of whole rows to f32 (scalar; not on the hot path).

use crate::blocks::{IntBlock, decode, float_at, sub_len};
use crate::{Format, QuantError};

/// Dequantize one row: `bytes` holds whole blocks, `out` receives `out.len()` weights.
///
/// The arithmetic follows ggml's `dequantize_row_*` without contraction: legacy
/// `code·d` or `code·d + m`; k-quants `(d·sc)·code − (dmin·mn)`; MXFP4 `kvalue·2^(e−128)`;
/// IQ2_XXS `((d/8)·(2s+1))·(grid·sign)`, which equals ggml's `d·(0.5+s)·0.25·grid·sign`
/// bit for bit (every step is exact: an 11-bit significand times at most 5 + 6 more bits).
pub fn dequantize_row(format: Format, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let expected = format.row_bytes(out.len())?;
    if bytes.len() != expected {
        return Err(QuantError::Length {
            what: "dequantize_row bytes",
            expected,
            got: bytes.len(),
        });
    }
    if format.is_float() {
        for (i, o) in out.iter_mut().enumerate() {
            *o = float_at(format, bytes, i);
        }
        return Ok(());
    }
    let bl = format.block_len();
    for (blk, ys) in bytes
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(bl))
    {
        dequantize_block(format, &decode(format, blk), ys);
    }
    Ok(())
}

/// Dequantize one decoded block of a quantized format into `ys` (one block of weights).
pub(crate) fn dequantize_block(format: Format, ib: &IntBlock, ys: &mut [f32]) {
    let sl = sub_len(format);
    match format {
        Format::Q4_0 | Format::Q5_0 | Format::Q8_0 | Format::MXFP4 => {
            for (y, &c) in ys.iter_mut().zip(&ib.codes) {
                *y = f32::from(c) * ib.d;
            }
        }
        Format::Q4_1 | Format::Q5_1 => {
            for (y, &c) in ys.iter_mut().zip(&ib.codes) {
                *y = f32::from(c) * ib.d + ib.m;
            }
        }
        _ => {
            let has_min = matches!(format, Format::Q2_K | Format::Q4_K | Format::Q5_K);
            for (j, sub) in ys.chunks_exact_mut(sl).enumerate() {
                let dl = ib.d * ib.sc[j] as f32;
                let ml = if has_min { ib.m * ib.mn[j] as f32 } else { 0.0 };
                for (y, &c) in sub.iter_mut().zip(&ib.codes[j * sl..]) {
                    *y = if has_min {
                        dl * f32::from(c) - ml
                    } else {
                        dl * f32::from(c)
                    };
                }
            }
        }
    }
}
