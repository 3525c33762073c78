//! Quantized block formats: dequantization and canonical-order dot kernels (scalar, AVX2, AVX-512).
