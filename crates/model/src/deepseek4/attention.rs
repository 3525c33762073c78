//! Attention: the RoPE tables, the sink-softmax attention of one head, the attention block
//! (q-LoRA, the KV row, compressors, the lightning indexer, the grouped output projection)
//! and the compressor's row emission.

use super::*;

// ---------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------

/// Inverse frequencies of one RoPE kind (f32, as torch holds them).
#[derive(Clone, Debug)]
pub(super) struct Rope {
    pub(super) inv_freq: Vec<f32>,
}

impl Rope {
    /// `base^(−2i/dims)`, with YaRN's ramp between the interpolated (`/factor`) and the
    /// original frequencies when given (transformers `_compute_yarn_parameters`,
    /// truncate = true; the attention factor is 1).
    pub(super) fn new(base: f64, dims: usize, yarn: Option<Yarn>) -> Rope {
        let half = dims / 2;
        let base_inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f64 / dims as f64))
            .collect();
        let inv: Vec<f64> = match yarn {
            None => base_inv,
            Some(y) => {
                let d = dims as f64;
                let l0 = y.original_context as f64;
                let corr =
                    |r: f64| d * (l0 / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let low = corr(f64::from(y.beta_fast)).floor().max(0.0);
                let mut high = corr(f64::from(y.beta_slow)).ceil().min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                let f = f64::from(y.factor);
                base_inv
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extra = 1.0 - ramp;
                        (b / f) * (1.0 - extra) + b * extra
                    })
                    .collect()
            }
        };
        Rope {
            inv_freq: inv.into_iter().map(|v| v as f32).collect(),
        }
    }

    /// cos (first half) and sin (second half) of position `pos`, `dims` values.
    pub(super) fn cos_sin(&self, pos: usize, out: &mut [f32]) {
        let half = self.inv_freq.len();
        let (c, s) = out.split_at_mut(half);
        for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(&self.inv_freq) {
            let angle = f64::from(pos as f32 * f);
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }
}

/// Rotates the trailing `cs.len()` channels of every `head_dim` piece of `x` (pairs
/// `(2i, 2i+1)`); `inverse` rotates by the negated angle.
pub(super) fn rope_tail(x: &mut [f32], head_dim: usize, cs: &[f32], inverse: bool) {
    let dims = cs.len();
    let half = dims / 2;
    let (cos, sin) = cs.split_at(half);
    for head in x.chunks_exact_mut(head_dim) {
        let tail = &mut head[head_dim - dims..];
        for i in 0..half {
            let s = if inverse { -sin[i] } else { sin[i] };
            let (y0, y1) = canon::rotate(tail[2 * i], tail[2 * i + 1], cos[i], s);
            tail[2 * i] = y0;
            tail[2 * i + 1] = y1;
        }
    }
}

/// Attention of one query head `q` with a sink (ARCHITECTURE.md, attention per (row,
/// head)): scores `dot(q, key(j))·scale` for `j` in `0..total` in order;
/// `mx = max(sink, scores)`; `l = Σ exp(s_j − mx)` in that order, then `+ exp(sink − mx)`;
/// `o = fma(e_j, key(j), o)` in that order (the key is the value); `o ·= 1/l`.
pub(super) fn sink_attention<'k>(
    ops: RowOps,
    q: &[f32],
    scale: f32,
    sink: f32,
    total: usize,
    key: impl Fn(usize) -> &'k [f32],
    out: &mut [f32],
) {
    let mut sc = Vec::with_capacity(total);
    let mut mx = sink;
    for j in 0..total {
        let v = ops.dot(q, key(j)).unwrap_or(f32::NAN) * scale;
        if v > mx {
            mx = v;
        }
        sc.push(v);
    }
    let mut l = 0.0f32;
    out.fill(0.0);
    for (j, &v) in sc.iter().enumerate() {
        let e = canon::exp(v - mx);
        l += e;
        for (o, &x) in out.iter_mut().zip(key(j)) {
            *o = e.mul_add(x, *o);
        }
    }
    l += canon::exp(sink - mx);
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

impl Deepseek4 {
    pub(super) fn attention(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        states: &mut [&mut Deepseek4State],
        rows: &[BatchRow],
        li: usize,
        layer: &Layer,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let m = rows.len();
        let a = &layer.attn;
        let (hd, rd) = (cfg.head_dim, cfg.n_rot);
        let qd = cfg.n_head * hd;
        self.hc_pre(cx, s, &layer.hc_attn, m)?;
        rms_rows(cx, &s.x, &a.norm, &mut s.xn, m)?;
        {
            let mut jobs: Vec<(&Matrix, &mut [f32])> =
                vec![(&a.wq_a, &mut s.qr[..]), (&a.wkv, &mut s.kv[..])];
            if let Some(c) = &a.comp {
                jobs.push((&c.wkv, &mut s.cc[..]));
                jobs.push((&c.wgate, &mut s.cz[..]));
            }
            if let Some(ix) = &a.indexer {
                jobs.push((&ix.comp.wkv, &mut s.ic[..]));
                jobs.push((&ix.comp.wgate, &mut s.iz[..]));
                jobs.push((&ix.proj, &mut s.wts[..]));
            }
            matmul(cx, &mut s.acts, &mut s.tmp, &s.xn, m, &mut jobs)?;
        }
        rms_pieces(cx, &mut s.qr, cfg.q_lora_rank, &a.q_a_norm, m)?;
        {
            let mut jobs: Vec<(&Matrix, &mut [f32])> = vec![(&a.wq_b, &mut s.q[..])];
            if let Some(ix) = &a.indexer {
                jobs.push((&ix.wq_b, &mut s.qi[..]));
            }
            matmul(cx, &mut s.acts, &mut s.tmp, &s.qr, m, &mut jobs)?;
        }
        let cs = if a.kind == V4Attention::Sliding {
            &s.cs_main
        } else {
            &s.cs_comp
        };
        // Queries: unweighted RMSNorm per head, then RoPE; the KV row: weighted RMSNorm, RoPE.
        let (ops, eps) = (cx.ops, cfg.rms_eps);
        let ones_hd = &self.ones[..hd];
        // (`rms_norm_in_place` with a head-sized weight normalises each head separately.)
        for_rows(cx.pool, &mut s.q[..m * qd], qd, |_, row| {
            ops.rms_norm_in_place(row, ones_hd, eps, NormWeight::Plain)
        })?;
        for_rows(cx.pool, &mut s.q[..m * qd], qd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        rms_pieces(cx, &mut s.kv, hd, &a.kv_norm, m)?;
        for_rows(cx.pool, &mut s.kv[..m * hd], hd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], false);
            Ok::<(), ModelError>(())
        })?;
        if a.indexer.is_some() {
            let (ni, di) = (cfg.indexer_heads, cfg.indexer_dim);
            for_rows(cx.pool, &mut s.qi[..m * ni * di], ni * di, |r, row| {
                rope_tail(row, di, &cs[r * rd..(r + 1) * rd], false);
                Ok::<(), ModelError>(())
            })?;
            let sc = (ni as f32).powf(-0.5);
            for v in &mut s.wts[..m * ni] {
                *v *= sc;
            }
        }
        // Append every row to its sequence's state (rows of a sequence are in position
        // order), emitting compressed rows as windows complete.
        let mut row_buf = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let ls = &mut states[row.seq].layers[li];
            ls.kv.push(&s.kv[r * hd..(r + 1) * hd]);
            if let (Some(w), Some(st)) = (&a.comp, ls.comp.as_mut()) {
                push_token(
                    cx,
                    w,
                    st,
                    &self.rope_comp,
                    row.pos,
                    &s.cc,
                    &s.cz,
                    r,
                    &mut row_buf,
                )?;
            }
            if let (Some(ix), Some(st)) = (&a.indexer, ls.index.as_mut()) {
                push_token(
                    cx,
                    &ix.comp,
                    st,
                    &self.rope_comp,
                    row.pos,
                    &s.ic,
                    &s.iz,
                    r,
                    &mut row_buf,
                )?;
            }
        }
        let states: &[&mut Deepseek4State] = states;
        // The indexer's choice per row (CSA).
        if let V4Attention::Csa { ratio } = a.kind {
            let (ni, di, k) = (cfg.indexer_heads, cfg.indexer_dim, cfg.indexer_top_k);
            let (qi, wts) = (&s.qi, &s.wts);
            let scale = (di as f32).powf(-0.5);
            let ops = cx.ops;
            let sel = &mut s.sel[..m];
            cx.pool.for_chunks_mut(sel, 1, |r, out| {
                let row = &rows[r];
                let keys = match &states[row.seq].layers[li].index {
                    Some(c) => &c.rows,
                    None => return,
                };
                let vis = (row.pos + 1) / ratio;
                let chosen = &mut out[0];
                chosen.clear();
                if vis <= k {
                    chosen.extend(0..vis as u32);
                    return;
                }
                let q = &qi[r * ni * di..(r + 1) * ni * di];
                let w = &wts[r * ni..(r + 1) * ni];
                let mut scored: Vec<(f32, u32)> = (0..vis)
                    .map(|t| {
                        let key = keys.row(t);
                        let mut acc = 0.0f32;
                        for h in 0..ni {
                            let dot = ops.dot(&q[h * di..(h + 1) * di], key).unwrap_or(f32::NAN);
                            acc = w[h].mul_add(dot.max(0.0) * scale, acc);
                        }
                        (acc, t as u32)
                    })
                    .collect();
                scored.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                chosen.extend(scored[..k].iter().map(|&(_, t)| t));
                chosen.sort_unstable();
            });
            if let Some(tr) = &mut s.trace {
                for (r, row) in rows.iter().enumerate() {
                    if (row.pos + 1) / ratio > k {
                        tr.indexer.push((li, row.seq, row.pos, s.sel[r].clone()));
                    }
                }
            }
        }
        // Attention per (row, head).
        {
            let (q, sel) = (&s.q, &s.sel);
            let nh = cfg.n_head;
            let scale = (hd as f32).powf(-0.5);
            let window = cfg.window;
            let ops = cx.ops;
            let kind = a.kind;
            let sinks = &a.sinks;
            cx.pool.for_chunks_mut(&mut s.att[..m * qd], hd, |rh, out| {
                let (r, h) = (rh / nh, rh % nh);
                let row = &rows[r];
                let ls = &states[row.seq].layers[li];
                let t = row.pos;
                let qh = &q[r * qd + h * hd..r * qd + (h + 1) * hd];
                let lo = (t + 1).saturating_sub(window);
                let comp_rows: &[u32] = match kind {
                    V4Attention::Csa { .. } => &sel[r],
                    _ => &[],
                };
                let n_hca = match kind {
                    V4Attention::Hca { ratio } => (t + 1) / ratio,
                    _ => 0,
                };
                let comp = ls.comp.as_ref().map(|c| &c.rows);
                let key = |j: usize| -> &[f32] {
                    let nw = t + 1 - lo;
                    if j < nw {
                        ls.kv.row(lo + j)
                    } else {
                        let c = j - nw;
                        let idx = if comp_rows.is_empty() {
                            c
                        } else {
                            comp_rows[c] as usize
                        };
                        comp.map_or(&[][..], |l| l.row(idx))
                    }
                };
                let total = (t + 1 - lo) + comp_rows.len() + n_hca;
                sink_attention(ops, qh, scale, sinks[h], total, key, out);
            });
        }
        self.attn_project(cx, s, a, m)
    }

    /// The attention block's tail: the output in `s.att` rotated back by each query's
    /// position, the grouped low-rank projection into `s.a`, then the HC update.
    pub(super) fn attn_project(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        a: &Attn,
        m: usize,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let (hd, rd) = (cfg.head_dim, cfg.n_rot);
        let qd = cfg.n_head * hd;
        let cs = if a.kind == V4Attention::Sliding {
            &s.cs_main
        } else {
            &s.cs_comp
        };
        // Rotate the output back by the query's position, then the grouped projection.
        for_rows(cx.pool, &mut s.att[..m * qd], qd, |r, row| {
            rope_tail(row, hd, &cs[r * rd..(r + 1) * rd], true);
            Ok::<(), ModelError>(())
        })?;
        let (g, rk) = (cfg.o_groups, cfg.o_lora_rank);
        let gw = qd / g;
        for (gi, wa) in a.wo_a.iter().enumerate() {
            for r in 0..m {
                s.grp[r * gw..(r + 1) * gw]
                    .copy_from_slice(&s.att[r * qd + gi * gw..r * qd + (gi + 1) * gw]);
            }
            matmul(
                cx,
                &mut s.acts,
                &mut s.tmp,
                &s.grp,
                m,
                &mut [(wa, &mut s.zg[..])],
            )?;
            for r in 0..m {
                s.zo[r * g * rk + gi * rk..r * g * rk + (gi + 1) * rk]
                    .copy_from_slice(&s.zg[r * rk..(r + 1) * rk]);
            }
        }
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.zo,
            m,
            &mut [(&a.wo_b, &mut s.a[..])],
        )?;
        self.hc_post(cx, s, m)
    }
}

/// Appends row `r`'s projected token (`c`, and `z` plus the window offset's `ape`) to a
/// compressor's state and emits the window's row when the token completes it.
#[allow(clippy::too_many_arguments)]
pub(super) fn push_token(
    cx: &Cx<'_>,
    w: &Compressor,
    st: &mut CompState,
    rope: &Rope,
    pos: usize,
    c: &[f32],
    z: &[f32],
    r: usize,
    buf: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let cw = w.cw();
    let m = w.ratio;
    let off = pos % m;
    buf.clear();
    buf.extend_from_slice(&c[r * cw..(r + 1) * cw]);
    buf.extend(
        z[r * cw..(r + 1) * cw]
            .iter()
            .zip(&w.ape[off * cw..(off + 1) * cw])
            .map(|(&zv, &a)| zv + a),
    );
    st.tokens.push(buf);
    if off + 1 == m {
        let win = pos / m;
        let mut out = vec![0.0f32; w.width];
        emit_row(cx, w, st, rope, win, &mut out)?;
        st.rows.push(&out);
    }
    Ok(())
}

/// Compressed row `win` from the token log: per channel a softmax over the window's slots
/// (CSA: series A of window `win − 1`, then series B of window `win`), the gated sum, then
/// RMSNorm and RoPE at position `win·m`.
pub(super) fn emit_row(
    cx: &Cx<'_>,
    w: &Compressor,
    st: &CompState,
    rope: &Rope,
    win: usize,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let (m, width, cw) = (w.ratio, w.width, w.cw());
    // (window, offset into a token row of `c`) of each slot; `z` sits `cw` further.
    let mut slots: Vec<(usize, usize)> = Vec::with_capacity(2 * m);
    if w.overlap {
        if win > 0 {
            slots.extend((0..m).map(|j| ((win - 1) * m + j, 0)));
        }
        slots.extend((0..m).map(|j| (win * m + j, width)));
    } else {
        slots.extend((0..m).map(|j| (win * m + j, 0)));
    }
    let mut rows: Vec<&[f32]> = Vec::with_capacity(slots.len());
    for &(t, _) in &slots {
        let row = st.tokens.row(t);
        if row.len() != 2 * cw {
            return Err(ModelError::Batch(format!(
                "compressor state lost token {t} needed by row {win}"
            )));
        }
        rows.push(row);
    }
    let mut es = vec![0.0f32; slots.len()];
    for (ch, o) in out.iter_mut().enumerate() {
        let z = |i: usize| rows[i][cw + slots[i].1 + ch];
        let mx = (0..slots.len()).fold(f32::NEG_INFINITY, |a, i| if z(i) > a { z(i) } else { a });
        let mut sum = 0.0f32;
        for (i, e) in es.iter_mut().enumerate() {
            *e = canon::exp(z(i) - mx);
            sum += *e;
        }
        let inv = 1.0 / sum;
        let mut acc = 0.0f32;
        for (i, &e) in es.iter().enumerate() {
            acc = (e * inv).mul_add(rows[i][slots[i].1 + ch], acc);
        }
        *o = acc;
    }
    cx.ops
        .rms_norm_in_place(out, &w.norm, cx.cfg.rms_eps, NormWeight::Plain)?;
    let mut cs = vec![0.0f32; cx.cfg.n_rot];
    rope.cos_sin(win * m, &mut cs);
    rope_tail(out, width, &cs, false);
    Ok(())
}
