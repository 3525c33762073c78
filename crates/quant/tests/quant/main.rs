//! Integration tests of the quantized kernels: the oracle table, the packed tiles and the
//! DeepSeek V4 formats (IQ2_XXS, MXFP4).

mod iq2_mxfp4;
mod oracle;
mod packed;
