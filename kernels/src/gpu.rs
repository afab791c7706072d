//! The GPU context: device, stream, cuBLAS handle and a cache of NVRTC-compiled modules.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::error::KernelError;

/// Prepended to every kernel source (bf16 helpers, warp reductions).
const COMMON_SRC: &str = include_str!("cuda/common.cuh");

/// Where NVRTC looks for CUDA headers. The kernels include none, but the path is passed so that
/// future sources may (`CUDA_HOME`/`CUDA_PATH` override the default).
fn cuda_include_path() -> String {
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = std::env::var(var) {
            return format!("{root}/include");
        }
    }
    "/usr/local/cuda/include".to_string()
}

pub struct GpuContext {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    compute_capability: (i32, i32),
    /// Shared with the contexts [`Self::on_new_stream`] derives, which load the same modules.
    modules: Arc<Mutex<HashMap<String, Arc<CudaModule>>>>,
    /// The cuBLAS workspace of a derived context (kept alive while its handle uses it).
    _blas_workspace: Option<cudarc::driver::CudaSlice<u8>>,
}

/// cuBLAS workspace of a derived context: set explicitly so that GEMMs captured into a CUDA
/// graph never make cuBLAS allocate during the capture (32 MiB is what NVIDIA suggests for
/// Hopper).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl GpuContext {
    /// `Ok(None)` when this machine has no CUDA driver library or no device; `Err` when a GPU is
    /// there but something it needs (NVRTC, cuBLAS, the context) fails.
    pub fn try_new() -> Result<Option<Self>, KernelError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Ok(None);
        }
        match CudaContext::device_count() {
            Ok(n) if n > 0 => {}
            _ => return Ok(None),
        }
        Self::new(0).map(Some)
    }

    /// Opens device `ordinal`. Panics inside cudarc if libcuda is missing: use [`Self::try_new`].
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        // SAFETY: library probes only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(KernelError::MissingLibrary("nvrtc"));
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(KernelError::MissingLibrary("cublas"));
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        let compute_capability = ctx.compute_capability()?;
        Ok(Self {
            ctx,
            stream,
            blas,
            compute_capability,
            modules: Arc::new(Mutex::new(HashMap::new())),
            _blas_workspace: None,
        })
    }

    /// The same device and module cache on a new stream of its own, with its own cuBLAS handle
    /// bound to that stream. [`Self::new`] works on the legacy default stream, which cannot be
    /// captured into a CUDA graph; work that is captured runs on a derived context. The new
    /// stream does not synchronise implicitly with the default one (it is non-blocking):
    /// callers order the two themselves.
    pub fn on_new_stream(&self) -> Result<Self, KernelError> {
        let stream = self.ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let ws = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            use cudarc::driver::DevicePtr;
            let (ptr, _g) = ws.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both in the returned context)
            // and is used only on the handle's stream.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        stream.synchronize()?;
        Ok(Self {
            ctx: self.ctx.clone(),
            stream,
            blas,
            compute_capability: self.compute_capability,
            modules: self.modules.clone(),
            _blas_workspace: Some(ws),
        })
    }

    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|_| "unknown GPU".to_string())
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// CUDA driver version as reported by `cuDriverGetVersion` (e.g. 13000).
    pub fn driver_version(&self) -> i32 {
        let mut v = 0;
        // SAFETY: writes one int.
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        v
    }

    /// Compiles (once per distinct `defines`) and loads `src`, returning the named functions.
    pub fn functions(
        &self,
        name: &str,
        src: &str,
        defines: &[(&str, usize)],
        fns: &[&str],
    ) -> Result<Vec<CudaFunction>, KernelError> {
        let mut key = name.to_string();
        for (k, v) in defines {
            key.push_str(&format!(" {k}={v}"));
        }
        let module = {
            let mut cache = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match cache.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let ptx = compile(name, src, defines, self.compute_capability)?;
                    let m = self.ctx.load_module(ptx)?;
                    cache.insert(key, m.clone());
                    m
                }
            }
        };
        fns.iter()
            .map(|f| module.load_function(f).map_err(KernelError::from))
            .collect()
    }
}

/// Compiles `src` (after the common helpers and `#define`s) to PTX for compute capability `cc`.
/// Needs only NVRTC, not a GPU.
pub fn compile(
    name: &str,
    src: &str,
    defines: &[(&str, usize)],
    cc: (i32, i32),
) -> Result<Ptx, KernelError> {
    // SAFETY: library probe only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::MissingLibrary("nvrtc"));
    }
    let mut header = String::new();
    for (k, v) in defines {
        header.push_str(&format!("#define {k} {v}\n"));
    }
    let opts = CompileOptions {
        include_paths: vec![cuda_include_path()],
        options: vec![
            format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
            "-std=c++17".into(),
        ],
        name: Some(format!(
            "{}.cu",
            name.split_whitespace().next().unwrap_or("kernel")
        )),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(format!("{COMMON_SRC}\n{header}\n{src}"), opts)
        .map_err(|e| compile_error(name, e))
}

fn compile_error(name: &str, e: CompileError) -> KernelError {
    let log = match &e {
        CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    };
    KernelError::Compile {
        name: name.to_string(),
        log,
    }
}

/// Test helper: the GPU if there is one, `None` (after printing `skipped: no GPU`) otherwise.
/// A GPU that is present but fails to initialise fails the test.
pub fn gpu_or_skip() -> Option<GpuContext> {
    match GpuContext::try_new() {
        Ok(Some(g)) => Some(g),
        Ok(None) => {
            println!("skipped: no GPU");
            None
        }
        Err(e) => panic!("GPU present but unusable: {e}"),
    }
}

/// Lanes per token and 16-byte chunks per lane for a row of `d` bf16 values: a token's row is
/// spread over the fewest power-of-two lanes (at most a warp) that cover its 16-byte chunks.
pub(crate) fn lane_split(d: usize) -> (usize, usize) {
    let chunks = d / 8;
    if chunks <= 32 {
        (chunks.next_power_of_two(), 1)
    } else {
        (32, chunks.div_ceil(32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_split_covers_every_chunk_with_at_most_a_warp() {
        assert_eq!(lane_split(128), (16, 1));
        assert_eq!(lane_split(64), (8, 1));
        assert_eq!(lane_split(8), (1, 1));
        assert_eq!(lane_split(320), (32, 2));
        assert_eq!(lane_split(576), (32, 3));
        for d in (8..=1024).step_by(8) {
            let (lpt, cpl) = lane_split(d);
            assert!(lpt.is_power_of_two() && lpt <= 32);
            assert!(lpt * cpl >= d / 8, "d={d}");
        }
    }
}
