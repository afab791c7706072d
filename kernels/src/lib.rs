//! CUDA kernels for the servelab GPU engine, with a CPU reference for each.
//!
//! The CUDA C sources live in `src/cuda/` and are embedded with `include_str!`; they are compiled
//! at run time with NVRTC for the device's compute capability (no nvcc at build time), with the
//! shape constants that make register tiling possible passed as `#define`s. [`GpuContext`] caches
//! one module per (source, defines).
//!
//! Without a GPU (no libcuda, or no device) [`GpuContext::try_new`] gives `Ok(None)` and every
//! GPU test prints `skipped: no GPU` and passes.

pub mod attention;
pub mod bandwidth;
pub mod check;
pub mod error;
pub mod fill;
pub mod gemm;
pub mod gpu;
pub mod mla_attention;
pub mod moe;
pub mod norm;
pub mod ops;
pub mod prefill_attention;
pub mod rope;
pub mod sampling;
pub mod sources;
pub mod swa;
pub mod testdata;

pub use error::KernelError;
pub use gpu::GpuContext;
