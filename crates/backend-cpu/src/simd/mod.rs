//! x86-64 SIMD paths. Each mirrors `canon` exactly; see the crate docs for the order.

pub(crate) mod avx2;
pub(crate) mod avx512;
