//! Test helpers: a tiny deterministic PRNG and a naive reference of the sampling rule.
#![allow(dead_code)]

use lockstep_sampling::{ChoiceContext, SamplingParams, TokenMask, gumbel};

/// SplitMix64, for test data only.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// LLM-like logits: a broad bulk around 0 and a few strong candidates.
pub fn realistic_logits(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut l: Vec<f32> = (0..n).map(|_| (rng.normal() * 2.5) as f32).collect();
    for k in 0..20 {
        let i = rng.below(n as u64) as usize;
        l[i] = 12.0 + 10.0 / (k + 1) as f32;
    }
    l
}

/// Penalties and bias, written out plainly.
pub fn reference_adjusted(logits: &[f32], ctx: &ChoiceContext<'_>, p: &SamplingParams) -> Vec<f32> {
    let mut adj = logits.to_vec();
    if p.repetition_penalty != 1.0 && p.repeat_last_n > 0 {
        let all: Vec<u32> = ctx
            .prompt_tokens
            .iter()
            .chain(ctx.generated_tokens)
            .copied()
            .collect();
        let start = all.len().saturating_sub(p.repeat_last_n);
        let mut seen = std::collections::BTreeSet::new();
        for &t in &all[start..] {
            if seen.insert(t) {
                let v = adj[t as usize];
                adj[t as usize] = if v <= 0.0 {
                    v * p.repetition_penalty
                } else {
                    v / p.repetition_penalty
                };
            }
        }
    }
    let mut counts = std::collections::BTreeMap::new();
    for &t in ctx.generated_tokens {
        *counts.entry(t).or_insert(0u32) += 1;
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&t, &c) in &counts {
            adj[t as usize] -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
    let mut bias = std::collections::BTreeMap::new();
    for &(t, b) in &p.logit_bias {
        *bias.entry(t).or_insert(0.0f32) += b;
    }
    for (&t, &b) in &bias {
        adj[t as usize] += b;
    }
    adj
}

/// The whole rule with full sorts and every token's noise evaluated.
pub fn reference_choose(
    logits: &[f32],
    ctx: &ChoiceContext<'_>,
    p: &SamplingParams,
    allowed: Option<&TokenMask>,
    never: &TokenMask,
) -> Option<u32> {
    let adj = reference_adjusted(logits, ctx, p);
    let mut cands: Vec<(f32, u32)> = (0..logits.len() as u32)
        .filter(|&t| allowed.is_none_or(|m| m.get(t)) && !never.get(t))
        .map(|t| (adj[t as usize], t))
        .filter(|&(l, _)| l > f32::NEG_INFINITY)
        .collect();
    cands.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let &(lmax, best) = cands.first()?;
    if p.temperature == 0.0 {
        return Some(best);
    }
    let t = f64::from(p.temperature);
    if p.top_k > 0 {
        cands.truncate(p.top_k);
    }
    let w = |l: f32| ((f64::from(l) - f64::from(lmax)) / t).exp();
    if p.top_p < 1.0 {
        let z: f64 = cands.iter().map(|&(l, _)| w(l)).sum();
        let mut cum = 0.0;
        let mut keep = cands.len();
        for (i, &(l, _)) in cands.iter().enumerate() {
            cum += w(l);
            if cum >= f64::from(p.top_p) * z {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep);
    }
    if p.min_p > 0.0 {
        let lm = f64::from(p.min_p).ln();
        cands.retain(|&(l, _)| (f64::from(l) - f64::from(lmax)) / t >= lm);
    }
    let mut winner: Option<(f64, u32)> = None;
    for &(l, id) in &cands {
        let v = f64::from(l) / t + gumbel(p.seed, ctx.position, id);
        if winner.is_none_or(|(bv, bid)| v > bv || (v == bv && id < bid)) {
            winner = Some((v, id));
        }
    }
    winner.map(|w| w.1)
}

/// softmax(l / T) in f64.
pub fn softmax(logits: &[f64], t: f64) -> Vec<f64> {
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|&l| ((l - m) / t).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// Pearson chi-square of observed counts against expected probabilities (zero-probability
/// cells must be empty, else infinity).
pub fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            if e == 0.0 {
                if c == 0 { 0.0 } else { f64::INFINITY }
            } else {
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}
