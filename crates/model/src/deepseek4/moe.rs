//! The mixture of experts: hash or learned routing, the routed experts and the shared one.

use super::*;

impl Deepseek4 {
    pub(super) fn moe(
        &self,
        cx: &Cx<'_>,
        s: &mut Deepseek4Scratch,
        rows: &[BatchRow],
        li: usize,
        layer: &Layer,
    ) -> Result<(), ModelError> {
        let cfg = cx.cfg;
        let m = rows.len();
        let moe = &layer.moe;
        let (d, e, k) = (cfg.n_embd, cfg.n_expert, cfg.n_expert_used);
        self.hc_pre(cx, s, &layer.hc_ffn, m)?;
        rms_rows(cx, &s.x, &moe.norm, &mut s.xn, m)?;
        matmul(
            cx,
            &mut s.acts,
            &mut s.tmp,
            &s.xn,
            m,
            &mut [(&moe.router, &mut s.rl[..])],
        )?;
        // Routing: sqrt(softplus) scores, the row's k experts and their gates.
        for (r, row) in rows.iter().enumerate() {
            let l = &s.rl[r * e..(r + 1) * e];
            let sc: Vec<f32> = l
                .iter()
                .map(|&x| {
                    let sp = if x > 20.0 { x } else { canon::exp(x).ln_1p() };
                    sp.sqrt()
                })
                .collect();
            let route = &mut s.route[r * k..(r + 1) * k];
            match &moe.routing {
                Routing::Hash(table) => {
                    let t = row.token as usize;
                    for (slot, &x) in route.iter_mut().zip(&table[t * k..(t + 1) * k]) {
                        slot.0 = x;
                    }
                }
                Routing::Learned(bias) => {
                    let mut order: Vec<(f32, u32)> = sc
                        .iter()
                        .zip(bias)
                        .enumerate()
                        .map(|(i, (&v, &b))| (v + b, i as u32))
                        .collect();
                    order.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                    for (slot, &(_, i)) in route.iter_mut().zip(&order) {
                        slot.0 = i;
                    }
                    if let Some(tr) = &mut s.trace {
                        let mut chosen: Vec<u32> = route.iter().map(|x| x.0).collect();
                        chosen.sort_unstable();
                        tr.router.push((li, row.seq, row.pos, chosen));
                    }
                }
            }
            for slot in route.iter_mut() {
                slot.1 = sc[slot.0 as usize];
            }
            if cfg.expert_weights_norm {
                let mut sum = 0.0f32;
                for slot in route.iter() {
                    sum += slot.1;
                }
                let den = sum + 1e-20;
                for slot in route.iter_mut() {
                    slot.1 /= den;
                }
            }
            for slot in route.iter_mut() {
                slot.1 *= cfg.expert_weights_scale;
            }
        }
        // The shared expert over every row (its output goes to `s.a`).
        let limit = moe.limit;
        match &moe.shared {
            Some(f) => {
                run_ffn(
                    cx,
                    &mut s.acts,
                    &mut s.tmp,
                    f,
                    &s.xn,
                    m,
                    limit,
                    &mut s.sg,
                    &mut s.su,
                    &mut s.a,
                )?;
            }
            None => s.a[..m * d].fill(0.0),
        }
        // Routed experts: the rows of each expert together.
        let ff = cfg.n_ff_exp;
        for (ei, f) in moe.experts.iter().enumerate() {
            let picks: Vec<(usize, usize)> = (0..m)
                .flat_map(|r| (0..k).map(move |j| (r, j)))
                .filter(|&(r, j)| s.route[r * k + j].0 as usize == ei)
                .collect();
            if picks.is_empty() {
                continue;
            }
            let ne = picks.len();
            grow(&mut s.xe, ne * d);
            grow(&mut s.ge, ne * ff);
            grow(&mut s.ue, ne * ff);
            grow(&mut s.ye, ne * d);
            for (i, &(r, _)) in picks.iter().enumerate() {
                s.xe[i * d..(i + 1) * d].copy_from_slice(&s.xn[r * d..(r + 1) * d]);
            }
            run_ffn(
                cx,
                &mut s.acts,
                &mut s.tmp,
                f,
                &s.xe,
                ne,
                limit,
                &mut s.ge,
                &mut s.ue,
                &mut s.ye,
            )?;
            for (i, &(r, j)) in picks.iter().enumerate() {
                s.ys[(r * k + j) * d..(r * k + j + 1) * d]
                    .copy_from_slice(&s.ye[i * d..(i + 1) * d]);
            }
        }
        let (ys, route) = (&s.ys, &s.route);
        for_rows(cx.pool, &mut s.a[..m * d], d, |r, out| {
            for (i, o) in out.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for j in 0..k {
                    acc = route[r * k + j].1.mul_add(ys[(r * k + j) * d + i], acc);
                }
                *o += acc;
            }
            Ok::<(), ModelError>(())
        })?;
        // `*o += acc` above is `shared + routed`: the routed sum first, then one add.
        self.hc_post(cx, s, m)
    }
}

/// One gated expert over `m` rows of `x`: `down(silu(min(gate, L)) · clamp(up, −L, L))`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_ffn(
    cx: &Cx<'_>,
    acts: &mut ActsCache,
    tmp: &mut Vec<f32>,
    f: &Ffn,
    x: &[f32],
    m: usize,
    limit: f32,
    g: &mut Vec<f32>,
    u: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let fw = f.gate.n;
    grow(g, m * fw);
    grow(u, m * fw);
    matmul(
        cx,
        acts,
        tmp,
        x,
        m,
        &mut [(&f.gate, &mut g[..]), (&f.up, &mut u[..])],
    )?;
    if limit.is_finite() {
        for v in &mut g[..m * fw] {
            *v = v.min(limit);
        }
        for v in &mut u[..m * fw] {
            *v = v.clamp(-limit, limit);
        }
    }
    let ops = cx.ops;
    let up: &[f32] = u;
    for_rows(cx.pool, &mut g[..m * fw], fw, |i, gr| {
        ops.swiglu_in_place(gr, &up[i * fw..(i + 1) * fw])
    })?;
    matmul(cx, acts, tmp, g, m, &mut [(&f.down, out)])
}
