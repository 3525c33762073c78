//! The scalar reference dot products: the canonical order written out plainly. Every SIMD
//! path is tested bit-identical to these.

use crate::blocks::{IntBlock, decode, float_at, sub_len};
use crate::{Format, QuantizedActs};

/// `dot(W row, A row m)`. Lengths were validated by the caller: `w` is one whole row of
/// `acts.k` weights and `m < acts.m`.
pub(crate) fn dot(format: Format, w: &[u8], acts: &QuantizedActs, m: usize) -> f32 {
    let k = acts.k;
    if format.is_float() {
        let x = &acts.f[m * k..(m + 1) * k];
        let mut acc = 0.0f32;
        for (i, &xv) in x.iter().enumerate() {
            acc = float_at(format, w, i).mul_add(xv, acc);
        }
        return acc;
    }
    let bb = format.block_bytes();
    dot_blocks(format, acts, m, |b| {
        decode(format, &w[b * bb..(b + 1) * bb])
    })
}

/// The canonical block loop of a quantized format over blocks produced by `block(b)`, for
/// `b` in block order (`acts.k / block_len` of them), against activation row `m`.
pub(crate) fn dot_blocks(
    format: Format,
    acts: &QuantizedActs,
    m: usize,
    mut block: impl FnMut(usize) -> IntBlock,
) -> f32 {
    let k = acts.k;
    let bl = format.block_len();
    let nb = k / bl;
    let sl = sub_len(format);
    let qs = &acts.qs[m * k..(m + 1) * k];
    let ds = &acts.d[m * nb..(m + 1) * nb];
    let s32 = &acts.s32[m * k / 32..(m + 1) * k / 32];
    let mut acc = 0.0f32;
    for (b, &da) in ds.iter().enumerate() {
        let ib = block(b);
        let a = &qs[b * bl..(b + 1) * bl];
        match format {
            Format::Q4_0 | Format::Q5_0 | Format::Q8_0 | Format::MXFP4 => {
                let isum = int_dot(&ib.codes[..bl], a);
                acc = (ib.d * da).mul_add(isum as f32, acc);
            }
            Format::Q4_1 | Format::Q5_1 => {
                let isum = int_dot(&ib.codes[..bl], a);
                let asum = i32::from(s32[b]);
                acc = (ib.d * da).mul_add(isum as f32, acc);
                acc = (ib.m * da).mul_add(asum as f32, acc);
            }
            _ => {
                let mut isum = 0i32;
                let mut msum = 0i32;
                for j in 0..bl / sl {
                    let c = &ib.codes[j * sl..(j + 1) * sl];
                    let aj = &a[j * sl..(j + 1) * sl];
                    isum += ib.sc[j] * int_dot(c, aj);
                    msum += ib.mn[j] * aj.iter().map(|&v| i32::from(v)).sum::<i32>();
                }
                acc = (ib.d * da).mul_add(isum as f32, acc);
                if matches!(format, Format::Q2_K | Format::Q4_K | Format::Q5_K) {
                    acc = (-(ib.m * da)).mul_add(msum as f32, acc);
                }
            }
        }
    }
    acc
}

fn int_dot(w: &[i8], a: &[i8]) -> i32 {
    w.iter()
        .zip(a)
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum()
}
