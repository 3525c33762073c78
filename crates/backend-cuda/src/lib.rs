//! The CUDA backend: the same engine on an NVIDIA GPU, with the same guarantees.
//!
//! With the `cuda` feature this crate holds:
//! - [`Device`]: one GPU through `cudarc` (the driver and NVRTC are loaded at run time, so
//!   building needs no CUDA toolkit); the kernels in `kernels.cu` are compiled by NVRTC
//!   on first use and cached on disk per device and source hash
//!   (`$LOCKSTEP_HOME/cuda/<sha256>.ptx`);
//! - the operations of the llama/qwen2 forward on device buffers (`Device::matmul`,
//!   `Device::rms_norm`, …), each reproducing the CPU reference arithmetic **bit for
//!   bit**: the same activation quantizer (ties to even), exact integer sums inside each
//!   weight block and `fmaf` across blocks in block order, canon's 16-lane dot and tree
//!   sum, the one `exp`, attention in chunks ending at block boundaries with the CPU's
//!   online softmax. NVRTC runs with `--fmad=false` and IEEE division and square root,
//!   so no product is fused unless the source says `fmaf`;
//! - [`CudaModel`] / [`CudaBackend`]: the llama/qwen2 forward over a paged f16 KV cache in
//!   device memory, as the engine's `ForwardBackend`.
//!
//! Without the feature only [`synth`] (synthetic model files) and the probes
//! ([`cuda_built`], [`cuda_device_count`], [`open_error`]) exist, so the default workspace build needs nothing
//! of CUDA.

mod error;
pub mod synth;

pub use error::CudaError;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod forward;
#[cfg(feature = "cuda")]
mod ops;

#[cfg(feature = "cuda")]
pub use device::{
    Buf, Device, KERNEL_SOURCE, MMA_MIN_ROWS_DEFAULT, compile_ptx, device_count, driver_present,
    nvrtc_present,
};
#[cfg(feature = "cuda")]
pub use forward::{
    ATT_SPLIT_MIN_KEYS, CudaBackend, CudaModel, SUMMARY_MIN_ROWS, StepOptions, load_backend,
};
#[cfg(feature = "cuda")]
pub use ops::{ArgmaxParts, DevActs, DevMatrix, MvStyle};

/// Whether this build includes the CUDA backend (the `cuda` feature).
pub fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

/// CUDA devices present (0 without the `cuda` feature or without a driver).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Why CUDA device `ordinal` cannot be used, or `None` when it can (the device opens and
/// the kernels compile).
pub fn open_error(ordinal: usize) -> Option<CudaError> {
    #[cfg(feature = "cuda")]
    {
        Device::new(ordinal).err()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Some(CudaError::NotBuilt)
    }
}
