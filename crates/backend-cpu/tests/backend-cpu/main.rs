//! Integration tests of the CPU backend: attention batch invariance, SIMD kernels against
//! the scalar references, paged KV bookkeeping and the thread pool.

mod attention;
mod common;
mod kernels;
mod kv;
mod pool;
