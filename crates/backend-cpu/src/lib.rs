//! CPU backend: thread pool, row ops (norms, RoPE, activations), paged KV storage and
//! attention — the non-matmul half of the CPU forward pass.
//!
//! Every kernel has a scalar reference ([`canon`], [`Isa::Scalar`]) and AVX2 / AVX-512
//! paths that are bit-identical to it; the path is chosen once per process
//! ([`Isa::selected`]). A row's results never depend on the other rows it is computed
//! with or on the thread count (G1). AMX is never used.
//!
//! ```
//! use lockstep_backend_cpu::{AttnParams, AttnRow, KvCache, KvConfig, KvType, ThreadPool, attention};
//!
//! let pool = ThreadPool::new(2);
//! let cfg = KvConfig {
//!     n_kv_head: 1, head_dim: 64, block_size: 32, kv_type: KvType::F16,
//!     windows: vec![None], global_blocks: 4, sliding_blocks: 0,
//! };
//! let mut kv = KvCache::new(cfg)?;
//! let mut seq = kv.new_sequence();
//! kv.reserve(&mut seq, 1)?;
//! let rows = [AttnRow { seq: &seq, pos: 0 }];
//! kv.write_rows(0, &rows, &[0.5; 64], &[1.0; 64])?;  // write this step's K/V first
//! let q = vec![0.1f32; 2 * 64];                        // 2 query heads share the KV head
//! let mut out = vec![0.0f32; 2 * 64];
//! attention(&pool, &kv, 0, &rows, &q, &mut out, AttnParams::new(2, 64))?;
//! assert!(out.iter().all(|&x| x == 1.0));
//! # Ok::<(), lockstep_backend_cpu::Error>(())
//! ```
//!
//! # The canonical order (contract; copy into ARCHITECTURE.md)
//!
//! **Reductions.** Every row sum and dot product of f32 vectors (RMSNorm's sum of
//! squares, softmax sums, attention scores) uses 16 lane accumulators: element `i` goes
//! to lane `i % 16`; each lane starts at `+0.0` and accumulates in index order
//! (`lane = fma(a_i, b_i, lane)` for dots, `lane = lane + x_i` for sums; lanes past the
//! end receive nothing). The 16 lanes are then summed by a fixed pairwise tree:
//! `s8[j] = l[j] + l[j+8]`, `s4[j] = s8[j] + s8[j+4]`, `s2[j] = s4[j] + s4[j+2]`,
//! `s = s2[0] + s2[1]`. AVX-512 holds the lanes in one register, AVX2 in two (lanes 0–7,
//! 8–15); the scalar reference runs the same arithmetic on an array.
//!
//! **exp.** One implementation everywhere ([`canon::exp`]): NaN → NaN, `x > 89` → `+inf`,
//! `x < -104` → `+0`; else `n = round_half_even(x * log2e)`, `r = fma(-n, ln2_hi, x)`,
//! `r = fma(-n, ln2_lo, r)`, a degree-5 Horner polynomial `p` (Cephes `expf`
//! coefficients, fma steps), `p = fma(p, r*r, r) + 1`, result `(p * 2^h) * 2^(n-h)` with
//! `h = n >> 1` (overflow and gradual underflow round once, in the last multiply). Within
//! 1 ulp of the correctly rounded exp over the normal range (tested).
//!
//! **Row ops** (per row, element-wise steps exactly as written, no fma unless named):
//! - RMSNorm: `inv = 1 / sqrt(dot(x, x) / n + eps)`, `out_i = (x_i * inv) * w_i`
//!   (gemma with unshifted weights: `* (1 + w_i)`; GGUF gemma weights are already shifted).
//! - SiLU·mul: `out_i = (g_i / (1 + exp(-g_i))) * u_i`.
//! - GELU-tanh·mul: `z = (g * fma(0.044715, g*g, 1)) * 1.5957691` (`2 sqrt(2/pi)`),
//!   `out_i = (g_i / (1 + exp(-z))) * u_i` (equal to `0.5 g (1 + tanh(z/2))`).
//! - softmax: `m = max x` (index order), `e_i = exp(x_i - m)`, `s = sum(e)`,
//!   `out_i = e_i * (1 / s)`.
//! - residual add `a + b`, scale `x * s`.
//! - RoPE: `theta(p, i) = (p / factor) * base^(-2i/dims)` and its cos/sin computed in f64,
//!   rounded once to f32, stored in a [`RopeTable`]; each pair becomes
//!   `(x0*c - x1*s, x0*s + x1*c)`; pairs `(2i, 2i+1)` (normal, llama) or `(i, i + dims/2)`
//!   (neox: qwen2, gemma3).
//!
//! **KV cache.** Blocks of `B` tokens (default 32, = attention chunk size), layout
//! `[kv_head][token][head_dim]` per block and layer; f16 (round-to-nearest-even from f32,
//! as `vcvtps2ph`) or f32. A token's K/V is converted on write and only ever read back
//! from the cache.
//!
//! **Attention**, per (row at position `p`, query head `h`, KV head `h / (n_head/n_kv)`):
//! keys `lo..=p` with `lo = 0`, or `max(0, p - W + 1)` for a sliding window `W`, visited in
//! chunks `[lo, next multiple of B)`, then `[kB, (k+1)B)`, ..., ending at `p`. `m = -inf`,
//! `l = 0`, `acc = 0` (head_dim f32). Per chunk, in position order:
//! `s_j = dot(q, k_j) * scale` (canonical dot on the f32-converted cache values, then one
//! multiply); `m' = max(m, s_j...)` scanning in position order; if `m' != m`:
//! `alpha = exp(m - m')`, `l = l * alpha`, `acc_i = acc_i * alpha`, `m = m'`;
//! `e_j = exp(s_j - m)`; `l = l + e_j` sequentially in position order;
//! `acc_i = fma(e_j, v_j[i], acc_i)` for `j` in position order. Finally
//! `out_i = acc_i * (1 / l)`. One (row, head) is computed entirely by one thread.
//!
//! **Threads and denormals.** Work is split statically over contiguous ranges; no result
//! depends on the split. No thread flushes denormals (FTZ/DAZ stay clear everywhere).

pub mod attention;
pub mod canon;
pub mod error;
pub mod fpenv;
pub mod isa;
mod kernels;
pub mod kv;
pub mod ops;
pub mod pool;
pub mod rope;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use attention::{AttnParams, AttnRow, attention, attention_with};
pub use error::{Error, Result};
pub use isa::Isa;
pub use kv::{BlockAllocator, BlockTable, DEFAULT_BLOCK_SIZE, KvCache, KvConfig, KvType, SeqKv};
pub use ops::{
    Kernels, NormWeight, add, add_in_place, dot, geglu, geglu_in_place, rms_norm,
    rms_norm_in_place, rope, scale, softmax, sum, swiglu, swiglu_in_place,
};
pub use pool::ThreadPool;
pub use rope::{RopeStyle, RopeTable};
