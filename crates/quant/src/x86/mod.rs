//! x86-64 SIMD kernels (AVX2 and AVX-512 VNNI). The tile driver computes NR output rows at
//! once: per weight block, each row's exact integer sum, reduced to one i32 per row, then
//! the f32 fused multiply-adds of the canonical order with one lane per output row. Blocks
//! are visited in order; nothing is ever summed across blocks except through that FMA chain.

pub(crate) mod acts;
mod isa;
pub(crate) mod packed;
mod qfmt;

use crate::{ActLayout, Format, QuantizedActs};
use isa::{Avx2, Avx512, Isa};
use qfmt::{ActBlock, Mins, QFmt};
use std::arch::x86_64::*;
use std::ops::Range;

/// One matmul job over a contiguous set of weight rows.
pub(crate) struct Job<'a> {
    /// The weight rows (`rows · row_bytes` bytes).
    pub w: &'a [u8],
    /// Number of rows in `w`.
    pub rows: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// The activations.
    pub acts: &'a QuantizedActs,
    /// Activation rows to compute.
    pub ms: Range<usize>,
    /// Output: `out[(m - ms.start)·ldo + r]`.
    pub out: &'a mut [f32],
    /// Output row stride.
    pub ldo: usize,
}

/// Whether the SIMD drivers can take this job: the float drivers gather with i32 offsets
/// (row offsets must fit) and read 4 bytes at a time (16-bit rows need two elements).
pub(crate) fn supports(format: Format, job: &Job<'_>) -> bool {
    if !format.is_float() {
        return true;
    }
    let fits = job
        .row_bytes
        .checked_mul(16)
        .is_some_and(|b| b < i32::MAX as usize);
    fits && (format == Format::F32 || job.acts.k >= 2)
}

/// Run a job with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the job must be consistent (validated shapes)
/// and `supports` must hold.
pub(crate) unsafe fn matmul_avx2(format: Format, job: &mut Job<'_>) {
    // SAFETY: forwarded contract.
    unsafe { dispatch_avx2(format, job) }
}

/// Run a job with AVX-512 VNNI.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI plus AVX2, FMA and F16C; the job must be
/// consistent and `supports` must hold.
pub(crate) unsafe fn matmul_avx512(format: Format, job: &mut Job<'_>) {
    // SAFETY: forwarded contract.
    unsafe { dispatch_avx512(format, job) }
}

macro_rules! dispatcher {
    ($name:ident, $isa:ty, $feat:literal) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name(format: Format, job: &mut Job<'_>) {
            // SAFETY: the features are enabled; the job is consistent (caller contract).
            unsafe {
                match format {
                    Format::Q4_0 => matmul_q::<$isa, qfmt::Q4_0>(job),
                    Format::Q4_1 => matmul_q::<$isa, qfmt::Q4_1>(job),
                    Format::Q5_0 => matmul_q::<$isa, qfmt::Q5_0>(job),
                    Format::Q5_1 => matmul_q::<$isa, qfmt::Q5_1>(job),
                    Format::Q8_0 => matmul_q::<$isa, qfmt::Q8_0>(job),
                    Format::Q2_K => matmul_q::<$isa, qfmt::Q2K>(job),
                    Format::Q3_K => matmul_q::<$isa, qfmt::Q3K>(job),
                    Format::Q4_K => matmul_q::<$isa, qfmt::Q4K>(job),
                    Format::Q5_K => matmul_q::<$isa, qfmt::Q5K>(job),
                    Format::Q6_K => matmul_q::<$isa, qfmt::Q6K>(job),
                    Format::IQ2_XXS => matmul_q::<$isa, qfmt::Iq2Xxs>(job),
                    Format::MXFP4 => matmul_q::<$isa, qfmt::Mxfp4>(job),
                    Format::F32 | Format::F16 | Format::BF16 => matmul_f::<$isa>(format, job),
                }
            }
        }
    };
}

dispatcher!(dispatch_avx2, Avx2, "avx2,fma,f16c");
dispatcher!(
    dispatch_avx512,
    Avx512,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);

/// Row pointers of one tile (the last valid row repeated to fill NR) and their offsets
/// from the first.
#[inline(always)]
fn tile_rows(w: &[u8], n0: usize, count: usize, row_bytes: usize) -> ([*const u8; 16], [i32; 16]) {
    let mut ptrs = [w.as_ptr(); 16];
    let mut idx = [0i32; 16];
    for r in 0..16 {
        let rr = r.min(count - 1);
        ptrs[r] = w[(n0 + rr) * row_bytes..].as_ptr();
        idx[r] = (rr * row_bytes) as i32;
    }
    (ptrs, idx)
}

#[inline(always)]
unsafe fn matmul_q<I: Isa, F: QFmt>(job: &mut Job<'_>) {
    let acts = job.acts;
    let bl = acts.layout.block_len();
    let k = acts.k;
    let nb = k / bl;
    let mut n0 = 0;
    while n0 < job.rows {
        let count = I::NR.min(job.rows - n0);
        let (ptrs, _) = tile_rows(job.w, n0, count, job.row_bytes);
        for (mi, m) in job.ms.clone().enumerate() {
            let qs = acts.qs[m * k..].as_ptr();
            let ds = &acts.d[m * nb..(m + 1) * nb];
            let s32 = acts.s32[m * k / 32..].as_ptr();
            let s16 = if acts.layout == ActLayout::Blocks256 {
                acts.s16[m * k / 16..].as_ptr()
            } else {
                std::ptr::null()
            };
            let out = job.out[mi * job.ldo + n0..mi * job.ldo + n0 + count].as_mut_ptr();
            // SAFETY: register operation.
            let mut acc = unsafe { I::zero() };
            for (b, &da) in ds.iter().enumerate() {
                // SAFETY: all pointers stay inside the validated rows and activation row:
                // block b of each row, codes/sums of activation block b.
                unsafe {
                    let ab = ActBlock {
                        qs: qs.add(b * bl),
                        s16: s16.wrapping_add(b * 16),
                        s32: s32.add(b * bl / 32),
                        asum: i32::from(*s32.add(b * bl / 32)),
                    };
                    let mut parts = [_mm256_setzero_si256(); 16];
                    let mut mparts = [_mm256_setzero_si256(); 16];
                    for r in 0..I::NR {
                        let (p, q) = F::parts::<I>(ptrs[r].add(b * F::BB), &ab);
                        parts[r] = p;
                        mparts[r] = q;
                    }
                    let mut isum = I::reduce(&parts);
                    let off = F::act_offset::<I>();
                    if off != 0 {
                        isum = I::sub_splat(isum, off * ab.asum);
                    }
                    // The scale fields of the NR rows (plain loads beat vpgatherdd here).
                    let mut gs = [0i32; 16];
                    for r in 0..I::NR {
                        gs[r] =
                            (ptrs[r].add(b * F::BB + F::GATHER_OFF) as *const i32).read_unaligned();
                    }
                    let g = I::load_idx(&gs);
                    let dw = F::scale::<I>(g);
                    let dav = I::splat(da);
                    acc = I::fma(I::mul(dw, dav), I::to_f32(isum), acc);
                    match F::MINS {
                        Mins::None => {}
                        Mins::Act => {
                            let mw = I::f16_hi(g);
                            acc = I::fma(I::mul(mw, dav), I::splat(ab.asum as f32), acc);
                        }
                        Mins::K => {
                            let msum = I::reduce(&mparts);
                            let dmin = I::f16_hi(g);
                            acc = I::fma(I::neg(I::mul(dmin, dav)), I::to_f32(msum), acc);
                        }
                    }
                }
            }
            // SAFETY: `out` has `count` writable elements.
            unsafe { I::store(acc, out, count) };
        }
        n0 += I::NR;
    }
}

#[inline(always)]
unsafe fn matmul_f<I: Isa>(format: Format, job: &mut Job<'_>) {
    let acts = job.acts;
    let k = acts.k;
    let mut n0 = 0;
    while n0 < job.rows {
        let count = I::NR.min(job.rows - n0);
        let (ptrs, idx) = tile_rows(job.w, n0, count, job.row_bytes);
        // SAFETY: register load from a local array.
        let idxv = unsafe { I::load_idx(&idx) };
        let base = ptrs[0];
        for (mi, m) in job.ms.clone().enumerate() {
            let x = &acts.f[m * k..(m + 1) * k];
            let out = job.out[mi * job.ldo + n0..mi * job.ldo + n0 + count].as_mut_ptr();
            // SAFETY: every gather reads 4 bytes inside each tile row: F32 element i at 4i;
            // 16-bit pairs at 4i (elements 2i, 2i+1); an odd tail element at byte 2k-4
            // (k ≥ 2, checked by `supports`).
            unsafe {
                let mut acc = I::zero();
                match format {
                    Format::F32 => {
                        for (i, &xv) in x.iter().enumerate() {
                            let g = I::gather_u32(base.add(4 * i), idxv);
                            acc = I::fma(I::as_f32(g), I::splat(xv), acc);
                        }
                    }
                    _ => {
                        let bf = format == Format::BF16;
                        let pairs = x.chunks_exact(2);
                        let tail = pairs.remainder();
                        for (i, xp) in pairs.enumerate() {
                            let g = I::gather_u32(base.add(4 * i), idxv);
                            let (w0, w1) = if bf {
                                (I::bf16_lo(g), I::bf16_hi(g))
                            } else {
                                (I::f16_lo(g), I::f16_hi(g))
                            };
                            acc = I::fma(w0, I::splat(xp[0]), acc);
                            acc = I::fma(w1, I::splat(xp[1]), acc);
                        }
                        if let Some(&xv) = tail.first() {
                            let g = I::gather_u32(base.add(2 * k - 4), idxv);
                            let w1 = if bf { I::bf16_hi(g) } else { I::f16_hi(g) };
                            acc = I::fma(w1, I::splat(xv), acc);
                        }
                    }
                }
                I::store(acc, out, count);
            }
        }
        n0 += I::NR;
    }
}
