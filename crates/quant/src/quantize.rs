//! Simple reference quantizers for weights (round-to-nearest with per-block scales; not
//! ggml's error-minimising search). Used to build test blocks and synthetic models.

use crate::tables::{IQ2XXS_GRID, KVALUES_MXFP4, e8m0_to_f32_half};
use crate::{Format, QuantError};
use half::{bf16, f16};

fn put_f16(out: &mut Vec<u8>, x: f32) -> f32 {
    let h = f16::from_f32(x);
    out.extend_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

fn nearest(x: f32) -> i32 {
    x.round_ties_even() as i32
}

fn inv(d: f32) -> f32 {
    if d == 0.0 { 0.0 } else { 1.0 / d }
}

/// Quantize one row of weights. `x.len()` must be a multiple of the format's block length.
pub fn quantize_row(format: Format, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = Vec::with_capacity(format.row_bytes(x.len())?);
    match format {
        Format::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        Format::F16 => x
            .iter()
            .for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())),
        Format::BF16 => x
            .iter()
            .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())),
        _ => {
            for blk in x.chunks_exact(format.block_len()) {
                quantize_block(format, blk, &mut out);
            }
        }
    }
    Ok(out)
}

/// Value of largest magnitude (keeping its sign).
fn signed_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

fn quantize_block(format: Format, x: &[f32], out: &mut Vec<u8>) {
    match format {
        Format::Q4_0 | Format::Q5_0 => {
            let (levels, off) = if format == Format::Q4_0 {
                (8.0, 8)
            } else {
                (16.0, 16)
            };
            let d = put_f16(out, signed_amax(x) / -levels);
            let id = inv(d);
            let q: Vec<u8> = x
                .iter()
                .map(|&v| (nearest(v * id) + off).clamp(0, 2 * off - 1) as u8)
                .collect();
            push_nibbles_and_high(format == Format::Q5_0, &q, out);
        }
        Format::Q4_1 | Format::Q5_1 => {
            let max_code = if format == Format::Q4_1 { 15.0 } else { 31.0 };
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = put_f16(out, (max - min) / max_code);
            let m = put_f16(out, min);
            let id = inv(d);
            let q: Vec<u8> = x
                .iter()
                .map(|&v| nearest((v - m) * id).clamp(0, max_code as i32) as u8)
                .collect();
            push_nibbles_and_high(format == Format::Q5_1, &q, out);
        }
        Format::Q8_0 => {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = put_f16(out, amax / 127.0);
            let id = inv(d);
            out.extend(
                x.iter()
                    .map(|&v| nearest(v * id).clamp(-127, 127) as i8 as u8),
            );
        }
        Format::Q2_K => quantize_q2_k(x, out),
        Format::Q3_K => quantize_q3_k(x, out),
        Format::Q4_K | Format::Q5_K => quantize_q45_k(format == Format::Q5_K, x, out),
        Format::Q6_K => quantize_q6_k(x, out),
        Format::IQ2_XXS => quantize_iq2_xxs(x, out),
        Format::MXFP4 => quantize_mxfp4(x, out),
        Format::F32 | Format::F16 | Format::BF16 => {}
    }
}

/// Legacy layout: optional 32 high bits, then 16 bytes with element j in the low nibble and
/// element j+16 in the high nibble.
fn push_nibbles_and_high(with_high: bool, q: &[u8], out: &mut Vec<u8>) {
    if with_high {
        let qh = q
            .iter()
            .enumerate()
            .fold(0u32, |h, (j, &v)| h | (u32::from(v >> 4) << j));
        out.extend_from_slice(&qh.to_le_bytes());
    }
    for j in 0..16 {
        out.push((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    }
}

/// Per-sub-block affine fit for formats with minimums: returns (scale, min ≥ 0) with
/// `x ≈ scale·q − min`, q in 0..=max_code.
fn affine(x: &[f32], max_code: f32) -> (f32, f32) {
    let lo = x.iter().copied().fold(0.0f32, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (((hi - lo) / max_code).max(0.0), -lo)
}

fn quantize_q2_k(x: &[f32], out: &mut Vec<u8>) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(16).map(|s| affine(s, 3.0)).collect();
    let max_sc = fits.iter().fold(0.0f32, |m, f| m.max(f.0));
    let max_mn = fits.iter().fold(0.0f32, |m, f| m.max(f.1));
    let d = f16::from_f32(max_sc / 15.0).to_f32();
    let dmin = f16::from_f32(max_mn / 15.0).to_f32();
    let mut scq = [0u8; 16];
    let mut mnq = [0u8; 16];
    for (j, &(sc, mn)) in fits.iter().enumerate() {
        scq[j] = nearest(sc * inv(d)).clamp(0, 15) as u8;
        mnq[j] = nearest(mn * inv(dmin)).clamp(0, 15) as u8;
        out.push(scq[j] | (mnq[j] << 4));
    }
    let mut codes = [0u8; 256];
    for (i, &v) in x.iter().enumerate() {
        let j = i / 16;
        let dl = d * f32::from(scq[j]);
        let ml = dmin * f32::from(mnq[j]);
        codes[i] = nearest((v + ml) * inv(dl)).clamp(0, 3) as u8;
    }
    for h in 0..2 {
        for l in 0..32 {
            let mut byte = 0u8;
            for s in 0..4 {
                byte |= codes[128 * h + 32 * s + l] << (2 * s);
            }
            out.push(byte);
        }
    }
    put_f16(out, d);
    put_f16(out, dmin);
}

fn quantize_q3_k(x: &[f32], out: &mut Vec<u8>) {
    let subs: Vec<f32> = x.chunks_exact(16).map(|s| signed_amax(s) / -4.0).collect();
    let big = signed_amax(&subs);
    let d = f16::from_f32(big / -32.0).to_f32();
    let mut scq = [0i32; 16];
    for (j, &s) in subs.iter().enumerate() {
        scq[j] = nearest(s * inv(d)).clamp(-32, 31);
    }
    let mut codes = [0u8; 256];
    for (i, &v) in x.iter().enumerate() {
        let dl = d * scq[i / 16] as f32;
        codes[i] = (nearest(v * inv(dl)).clamp(-4, 3) + 4) as u8;
    }
    let mut hmask = [0u8; 32];
    let mut qs = [0u8; 64];
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let c = codes[128 * h + 32 * s + l];
                if c >= 4 {
                    hmask[l] |= 1 << (4 * h + s);
                }
                qs[32 * h + l] |= (c & 3) << (2 * s);
            }
        }
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&qs);
    let mut scales = [0u8; 12];
    for (j, &s) in scq.iter().enumerate() {
        let l = (s + 32) as u8;
        if j < 8 {
            scales[j] = l & 0xF;
        } else {
            scales[j - 8] |= (l & 0xF) << 4;
        }
        scales[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    out.extend_from_slice(&scales);
    put_f16(out, d);
}

fn quantize_q45_k(five: bool, x: &[f32], out: &mut Vec<u8>) {
    let max_code = if five { 31.0 } else { 15.0 };
    let fits: Vec<(f32, f32)> = x.chunks_exact(32).map(|s| affine(s, max_code)).collect();
    let max_sc = fits.iter().fold(0.0f32, |m, f| m.max(f.0));
    let max_mn = fits.iter().fold(0.0f32, |m, f| m.max(f.1));
    let d = put_f16(out, max_sc / 63.0);
    let dmin = put_f16(out, max_mn / 63.0);
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for (j, &(sc, mn)) in fits.iter().enumerate() {
        ls[j] = nearest(sc * inv(d)).clamp(0, 63) as u8;
        lm[j] = nearest(mn * inv(dmin)).clamp(0, 63) as u8;
    }
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            scales[j - 4] |= (ls[j] >> 4) << 6;
            scales[j] |= (lm[j] >> 4) << 6;
        }
    }
    out.extend_from_slice(&scales);
    let mut codes = [0u8; 256];
    for (i, &v) in x.iter().enumerate() {
        let j = i / 32;
        let dl = d * f32::from(ls[j]);
        let ml = dmin * f32::from(lm[j]);
        codes[i] = nearest((v + ml) * inv(dl)).clamp(0, max_code as i32) as u8;
    }
    if five {
        let mut qh = [0u8; 32];
        for j in 0..4 {
            for l in 0..32 {
                qh[l] |= (codes[64 * j + l] >> 4) << (2 * j);
                qh[l] |= (codes[64 * j + 32 + l] >> 4) << (2 * j + 1);
            }
        }
        out.extend_from_slice(&qh);
    }
    for j in 0..4 {
        for l in 0..32 {
            out.push((codes[64 * j + l] & 0xF) | ((codes[64 * j + 32 + l] & 0xF) << 4));
        }
    }
}

fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let subs: Vec<f32> = x.chunks_exact(16).map(|s| signed_amax(s) / -32.0).collect();
    let big = subs.iter().fold(0.0f32, |m, s| m.max(s.abs()));
    let d = f16::from_f32(big / 127.0).to_f32();
    let mut scq = [0i8; 16];
    for (j, &s) in subs.iter().enumerate() {
        scq[j] = nearest(s * inv(d)).clamp(-128, 127) as i8;
    }
    let mut codes = [0u8; 256];
    for (i, &v) in x.iter().enumerate() {
        let dl = d * f32::from(scq[i / 16]);
        codes[i] = (nearest(v * inv(dl)).clamp(-32, 31) + 32) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for h in 0..2 {
        for l in 0..32 {
            let c = |t: usize| codes[128 * h + 32 * t + l];
            ql[64 * h + l] = (c(0) & 0xF) | ((c(2) & 0xF) << 4);
            ql[64 * h + 32 + l] = (c(1) & 0xF) | ((c(3) & 0xF) << 4);
            qh[32 * h + l] =
                (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(scq.iter().map(|&s| s as u8));
    put_f16(out, d);
}

/// IQ2_XXS by plain search: per 32-group a scale from its largest magnitude, per 8 weights
/// the grid entry nearest to the magnitudes (least squares, first index on ties) and the
/// signs of the inputs, the smallest-magnitude sign flipped when needed for even parity.
fn quantize_iq2_xxs(x: &[f32], out: &mut Vec<u8>) {
    let subs: Vec<f32> = x
        .chunks_exact(32)
        .map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 43.0)
        .collect();
    let big = subs.iter().fold(0.0f32, |m, &s| m.max(s));
    let d = put_f16(out, big / 31.0 * 8.0);
    let unit = d * 0.125;
    for (g, sub) in x.chunks_exact(32).enumerate() {
        let s = ((subs[g] * inv(unit) - 1.0) / 2.0)
            .round_ties_even()
            .clamp(0.0, 15.0) as u32;
        let dl = unit * (2 * s + 1) as f32;
        let mut idx = 0u32;
        let mut aux = s << 28;
        for (l, grp) in sub.chunks_exact(8).enumerate() {
            let mut best = (f32::INFINITY, 0usize);
            for (i, &e) in IQ2XXS_GRID.iter().enumerate() {
                let err: f32 = e
                    .to_le_bytes()
                    .iter()
                    .zip(grp)
                    .map(|(&gv, &v)| (dl * f32::from(gv) - v.abs()).powi(2))
                    .sum();
                if err < best.0 {
                    best = (err, i);
                }
            }
            let mut signs = grp
                .iter()
                .enumerate()
                .fold(0u32, |m, (j, &v)| m | (u32::from(v < 0.0) << j));
            if signs.count_ones() % 2 == 1 {
                let smallest = (0..8)
                    .min_by(|&a, &b| grp[a].abs().total_cmp(&grp[b].abs()))
                    .unwrap_or(0);
                signs ^= 1 << smallest;
            }
            idx |= (best.1 as u32) << (8 * l);
            aux |= (signs & 127) << (7 * l);
        }
        out.extend_from_slice(&idx.to_le_bytes());
        out.extend_from_slice(&aux.to_le_bytes());
    }
}

/// MXFP4 as gguf-py quantizes it: `e = floor(log2(amax)) − 2 + 127` (0 for an all-zero
/// block), then for each weight the nearest of the 16 values `kvalue·2^(e−128)`.
fn quantize_mxfp4(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let e = if amax > 0.0 && amax.is_finite() {
        (amax.log2().floor() as i32 + 125).clamp(0, 254) as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(e);
    let code = |v: f32| {
        let mut best = (f32::INFINITY, 0u8);
        for (i, &k) in KVALUES_MXFP4.iter().enumerate() {
            let err = (d * f32::from(k) - v).abs();
            if err < best.0 {
                best = (err, i as u8);
            }
        }
        best.1
    };
    out.push(e);
    for j in 0..16 {
        out.push(code(x[j]) | (code(x[j + 16]) << 4));
    }
}
