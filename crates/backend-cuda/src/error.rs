//! Errors of the CUDA backend.

/// What went wrong on the CUDA side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// This binary was built without the `cuda` feature.
    #[error("this lockstep was built without CUDA support (rebuild with `--features cuda`)")]
    NotBuilt,
    /// No usable driver, library or device.
    #[error("CUDA is not usable here: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// NVRTC could not compile the kernels.
    #[error("NVRTC failed to compile the kernels: {0}")]
    Compile(String),
    /// A shape or size mismatch.
    #[error("CUDA op shape error: {0}")]
    Shape(String),
    /// Something the CUDA backend does not implement.
    #[error("not supported by the CUDA backend: {0}")]
    Unsupported(String),
    /// The model file does not fit the architecture.
    #[error("model: {0}")]
    Model(String),
}
