//! Hyper-connections: the Sinkhorn-normalised mixing weights, the HC collapse and update
//! around each block, the HyperHead, and the captured stream averages.

use super::*;

/// Pre (N), post (N) and the Sinkhorn-normalised C (N×N) of one row from its mix.
pub(super) fn hc_weights(cfg: &Deepseek4Config, hc: &Hc, mix: &[f32], out: &mut [f32]) {
    let n = cfg.hc_streams;
    let eps = cfg.hc_eps;
    let (pre, rest) = out.split_at_mut(n);
    let (post, c) = rest.split_at_mut(n);
    for j in 0..n {
        pre[j] = sigmoid(mix[j] * hc.scale[0] + hc.base[j]) + eps;
        post[j] = 2.0 * sigmoid(mix[n + j] * hc.scale[1] + hc.base[n + j]);
    }
    for j in 0..n {
        let row = &mut c[j * n..(j + 1) * n];
        for (k, v) in row.iter_mut().enumerate() {
            let i = 2 * n + j * n + k;
            *v = mix[i] * hc.scale[2] + hc.base[i];
        }
        let mx = row
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let mut s = 0.0f32;
        for v in row.iter_mut() {
            *v = canon::exp(*v - mx);
            s += *v;
        }
        let inv = 1.0 / s;
        for v in row.iter_mut() {
            *v = *v * inv + eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let mut s = 0.0f32;
            for j in 0..n {
                s += c[j * n + k];
            }
            let den = s + eps;
            for j in 0..n {
                c[j * n + k] /= den;
            }
        }
    };
    cols(c);
    for _ in 1..cfg.hc_iters {
        for j in 0..n {
            let row = &mut c[j * n..(j + 1) * n];
            let mut s = 0.0f32;
            for &v in row.iter() {
                s += v;
            }
            let den = s + eps;
            for v in row.iter_mut() {
                *v /= den;
            }
        }
        cols(c);
    }
}

/// The HC collapse of one row (ARCHITECTURE.md: `collapsed = fma(pre_j, h_j, ·)` over j in
/// order): `out[i] = Σ_j pre[j]·h[j·d + i]` for the `pre.len()` streams of `h` (`d` each).
pub(super) fn hc_collapse(pre: &[f32], h: &[f32], d: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (j, &p) in pre.iter().enumerate() {
            acc = p.mul_add(h[j * d + i], acc);
        }
        *o = acc;
    }
}

/// The HyperHead of `m` rows: from each row's mix (`N` values) the weights
/// `pre_j = sigmoid(mix_j·scale_0 + base_j) + eps`, then the HC collapse of the row's
/// streams in `h` into `out` (`D` values a row).
pub(super) fn hyper_head(
    cx: &Cx<'_>,
    hc: &Hc,
    h: &[f32],
    mix: &[f32],
    out: &mut [f32],
    m: usize,
) -> Result<(), ModelError> {
    let (n, d, eps) = (cx.cfg.hc_streams, cx.cfg.n_embd, cx.cfg.hc_eps);
    let nd = n * d;
    for_rows(cx.pool, &mut out[..m * d], d, |i, o| {
        let mx = &mix[i * n..(i + 1) * n];
        let pre: Vec<f32> = (0..n)
            .map(|j| sigmoid(mx[j] * hc.scale[0] + hc.base[j]) + eps)
            .collect();
        hc_collapse(&pre, &h[i * nd..(i + 1) * nd], d, o);
        Ok::<(), ModelError>(())
    })
}

impl Deepseek4 {
    /// HC before a block: the weights of every row into `s.hcw` and the collapsed stream
    /// into `s.x`.
    pub(super) fn hc_pre(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        hc: &Hc,
        m: usize,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (n, d) = (cfg.hc_streams, cfg.n_embd);
        let nd = n * d;
        let ones = &self.ones[..nd];
        rms_rows(cx, &s.h, ones, &mut s.flat, m)?;
        let nm = cfg.hc_mix();
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.flat,
            m,
            &mut [(&hc.mix, &mut s.mix[..])],
        )?;
        let hw = 2 * n + n * n;
        let mix = &s.mix;
        for_rows(cx.pool, &mut s.hcw[..m * hw], hw, |r, out| {
            hc_weights(cfg, hc, &mix[r * nm..(r + 1) * nm], out);
            Ok::<(), ModelError>(())
        })?;
        let (h, hcw) = (&s.h, &s.hcw);
        for_rows(cx.pool, &mut s.x[..m * d], d, |r, out| {
            hc_collapse(&hcw[r * hw..r * hw + n], &h[r * nd..(r + 1) * nd], d, out);
            Ok::<(), ModelError>(())
        })
    }

    /// HC after a block: `h[k] = post[k]·a + Σ_j C[j,k]·h[j]` with the block output in `s.a`.
    pub(super) fn hc_post(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        m: usize,
    ) -> Result<(), ModelError> {
        let (n, d) = (cx.cfg.hc_streams, cx.cfg.n_embd);
        let nd = n * d;
        let hw = 2 * n + n * n;
        let (h, hcw, a) = (&s.h, &s.hcw, &s.a);
        for_rows(cx.pool, &mut s.h2[..m * nd], nd, |r, out| {
            let post = &hcw[r * hw + n..r * hw + 2 * n];
            let c = &hcw[r * hw + 2 * n..(r + 1) * hw];
            let hr = &h[r * nd..(r + 1) * nd];
            let ar = &a[r * d..(r + 1) * d];
            for k in 0..n {
                for i in 0..d {
                    let mut acc = post[k] * ar[i];
                    for j in 0..n {
                        acc = c[j * n + k].mul_add(hr[j * d + i], acc);
                    }
                    out[k * d + i] = acc;
                }
            }
            Ok::<(), ModelError>(())
        })?;
        std::mem::swap(&mut s.h, &mut s.h2);
        Ok(())
    }
}

/// Stores, for every row whose sequence captures layer `li`, the layer's input averaged over
/// the HC streams (`Σ_j h_j` in stream order, then `/ N`) into its piece of `s.cap` (row
/// stride `cap_w`, pieces in ascending layer order).
pub(super) fn capture_rows(
    cfg: &Deepseek4Config,
    s: &mut Deepseek4Scratch,
    states: &[&mut Deepseek4State],
    rows: &[BatchRow],
    li: usize,
    cap_w: usize,
) {
    let (n, d) = (cfg.hc_streams, cfg.n_embd);
    let nd = n * d;
    let n_f = n as f32;
    for (r, row) in rows.iter().enumerate() {
        let Some(c) = states.get(row.seq).and_then(|st| st.capture.as_ref()) else {
            continue;
        };
        let Some(t) = c.layers.iter().position(|&l| l == li) else {
            continue;
        };
        let h = &s.h[r * nd..(r + 1) * nd];
        let out = &mut s.cap[r * cap_w + t * d..r * cap_w + (t + 1) * d];
        for (i, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for j in 0..n {
                acc += h[j * d + i];
            }
            *o = acc / n_f;
        }
    }
}
