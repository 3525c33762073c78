//! The forward's reusable buffers ([`Deepseek4Scratch`]) and its optional trace.

use super::*;

/// Buffers reused across [`Deepseek4::forward`] calls (grown on demand, never shrunk).
#[derive(Debug, Default)]
pub struct Deepseek4Scratch {
    /// Streams `m × N × D`, and the next streams.
    pub(super) h: Vec<f32>,
    pub(super) h2: Vec<f32>,
    /// Normed flattened streams `m × N·D`.
    pub(super) flat: Vec<f32>,
    /// HC mix `m × (2+N)·N`.
    pub(super) mix: Vec<f32>,
    /// Per row: pre (N), post (N), C (N²).
    pub(super) hcw: Vec<f32>,
    /// Collapsed stream, normed input, block output: `m × D`.
    pub(super) x: Vec<f32>,
    pub(super) xn: Vec<f32>,
    pub(super) a: Vec<f32>,
    pub(super) qr: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) kv: Vec<f32>,
    pub(super) cc: Vec<f32>,
    pub(super) cz: Vec<f32>,
    pub(super) ic: Vec<f32>,
    pub(super) iz: Vec<f32>,
    pub(super) qi: Vec<f32>,
    pub(super) wts: Vec<f32>,
    pub(super) att: Vec<f32>,
    pub(super) grp: Vec<f32>,
    pub(super) zg: Vec<f32>,
    pub(super) zo: Vec<f32>,
    pub(super) rl: Vec<f32>,
    pub(super) sg: Vec<f32>,
    pub(super) su: Vec<f32>,
    pub(super) ys: Vec<f32>,
    pub(super) xe: Vec<f32>,
    pub(super) ge: Vec<f32>,
    pub(super) ue: Vec<f32>,
    pub(super) ye: Vec<f32>,
    pub(super) head: Vec<f32>,
    pub(super) cs_main: Vec<f32>,
    pub(super) cs_comp: Vec<f32>,
    /// Captured rows (DSpark) of this forward, `m × width`.
    pub(super) cap: Vec<f32>,
    /// Per row of a CSA layer: the compressed rows kept by the indexer.
    pub(super) sel: Vec<Vec<u32>>,
    /// Per row: (expert, gate) of its `k` routed experts.
    pub(super) route: Vec<(u32, f32)>,
    pub(super) tmp: Vec<f32>,
    pub(super) acts: ActsCache,
    pub(super) trace: Option<Deepseek4Trace>,
}

/// The top-k decisions of the forwards run with tracing on
/// ([`Deepseek4Scratch::set_trace`]), for comparison with a reference.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Deepseek4Trace {
    /// `(layer, sequence, position, kept rows ascending)` for every CSA query that sees
    /// more compressed rows than the indexer keeps.
    pub indexer: Vec<(usize, usize, usize, Vec<u32>)>,
    /// `(layer, sequence, position, experts ascending)` for every row of every
    /// learned-routing layer.
    pub router: Vec<(usize, usize, usize, Vec<u32>)>,
}

pub(super) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

impl Deepseek4Scratch {
    /// Starts (or stops) recording the top-k decisions of later forwards.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on.then(Deepseek4Trace::default);
    }

    /// The decisions recorded since tracing started or was last taken (empty when off).
    pub fn take_trace(&mut self) -> Deepseek4Trace {
        match &mut self.trace {
            Some(t) => std::mem::take(t),
            None => Deepseek4Trace::default(),
        }
    }

    pub(super) fn prepare(&mut self, c: &Deepseek4Config, m: usize) {
        let (d, n) = (c.n_embd, c.hc_streams);
        let qd = c.n_head * c.head_dim;
        let hd = c.head_dim;
        let di2 = 2 * c.indexer_dim;
        for (v, len) in [
            (&mut self.h, m * n * d),
            (&mut self.h2, m * n * d),
            (&mut self.flat, m * n * d),
            (&mut self.mix, m * c.hc_mix()),
            (&mut self.hcw, m * (2 * n + n * n)),
            (&mut self.x, m * d),
            (&mut self.xn, m * d),
            (&mut self.a, m * d),
            (&mut self.qr, m * c.q_lora_rank),
            (&mut self.q, m * qd),
            (&mut self.kv, m * hd),
            (&mut self.cc, m * 2 * hd),
            (&mut self.cz, m * 2 * hd),
            (&mut self.ic, m * di2),
            (&mut self.iz, m * di2),
            (&mut self.qi, m * c.indexer_heads * c.indexer_dim),
            (&mut self.wts, m * c.indexer_heads),
            (&mut self.att, m * qd),
            (&mut self.grp, m * qd / c.o_groups),
            (&mut self.zg, m * c.o_lora_rank),
            (&mut self.zo, m * c.o_groups * c.o_lora_rank),
            (&mut self.rl, m * c.n_expert),
            (&mut self.sg, m * c.n_ff_exp * c.n_expert_shared.max(1)),
            (&mut self.su, m * c.n_ff_exp * c.n_expert_shared.max(1)),
            (&mut self.ys, m * c.n_expert_used * d),
            (&mut self.cs_main, m * c.n_rot),
            (&mut self.cs_comp, m * c.n_rot),
        ] {
            grow(v, len);
        }
        if self.sel.len() < m {
            self.sel.resize(m, Vec::new());
        }
        self.route.clear();
        self.route.resize(m * c.n_expert_used, (0, 0.0));
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.h, &self.h2, &self.flat, &self.mix, &self.hcw, &self.x, &self.xn, &self.a,
            &self.qr, &self.q, &self.kv, &self.cc, &self.cz, &self.ic, &self.iz, &self.qi,
            &self.wts, &self.att, &self.grp, &self.zg, &self.zo, &self.rl, &self.sg, &self.su,
            &self.ys, &self.xe, &self.ge, &self.ue, &self.ye, &self.head, &self.tmp, &self.cap,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>();
        f * 4 + self.acts.bytes()
    }
}
