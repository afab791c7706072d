//! Errors from kernel compilation, launch and shape validation.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC compile of {name}: {log}")]
    Compile { name: String, log: String },
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("invalid shape: {0}")]
    Shape(String),
    #[error("{0} shared library not found (is the CUDA toolkit on LD_LIBRARY_PATH?)")]
    MissingLibrary(&'static str),
}

impl KernelError {
    pub fn shape(msg: impl Into<String>) -> Self {
        KernelError::Shape(msg.into())
    }
}

/// Returns a shape error unless `cond` holds.
pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), KernelError> {
    if cond {
        Ok(())
    } else {
        Err(KernelError::Shape(msg()))
    }
}
