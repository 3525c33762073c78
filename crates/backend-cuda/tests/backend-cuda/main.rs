//! Integration tests of the CUDA backend: the oracles against the CPU reference (compiled
//! only with `--features cuda`; they need an NVIDIA GPU).

mod oracle;
