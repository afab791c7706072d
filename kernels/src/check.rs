//! GPU-versus-CPU correctness checks on random inputs. The GPU tests call these one by one; the
//! `servelab-gpu test-report` command runs them all and prints a table.

use crate::error::KernelError;
use crate::gpu::GpuContext;
use crate::testdata::ErrorStats;

/// The outcome of one check.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckResult {
    pub name: String,
    /// Shapes and parameters, for the report.
    pub detail: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub rel_tol: f64,
    pub passed: bool,
}

impl CheckResult {
    pub fn from_stats(name: &str, detail: String, stats: ErrorStats, rel_tol: f64) -> Self {
        Self {
            name: name.to_string(),
            detail,
            rel_l2: stats.rel_l2,
            max_abs: stats.max_abs,
            rel_tol,
            passed: stats.within(rel_tol),
        }
    }

    /// A check whose outputs must equal the reference exactly (indices, permutations, copies).
    pub fn exact(name: &str, detail: String, mismatches: usize) -> Self {
        Self {
            name: name.to_string(),
            detail,
            rel_l2: 0.0,
            max_abs: mismatches as f64,
            rel_tol: 0.0,
            passed: mismatches == 0,
        }
    }
}

/// bf16 operands, float accumulation: errors land between 1e-3 and 1e-2 relative.
pub const BF16_TOL: f64 = 1e-2;

/// Every kernel check, with inputs drawn from `seed`.
pub fn run_all(gpu: &GpuContext, seed: u64) -> Vec<Result<CheckResult, (String, KernelError)>> {
    type CheckFn = fn(&GpuContext, u64) -> Result<Vec<CheckResult>, KernelError>;
    let checks: [(&str, CheckFn); 11] = [
        ("paged_attention", crate::attention::check_gpu),
        ("mla_attention", crate::mla_attention::check_gpu),
        ("read_stream", crate::bandwidth::check_gpu),
        ("swa_attention", crate::swa::check_gpu),
        ("rmsnorm", crate::norm::check_gpu),
        ("rope", crate::rope::check_gpu),
        ("moe", crate::moe::check_gpu),
        ("sampling", crate::sampling::check_gpu),
        ("gemm", crate::gemm::check_gpu),
        ("ops", crate::ops::check_gpu),
        ("prefill_attention", crate::prefill_attention::check_gpu),
    ];
    let mut out = Vec::new();
    for (i, (name, f)) in checks.iter().enumerate() {
        match f(gpu, seed.wrapping_add(i as u64 * 1000)) {
            Ok(rs) => out.extend(rs.into_iter().map(Ok)),
            Err(e) => out.push(Err((name.to_string(), e))),
        }
    }
    out
}

/// Asserts every result passed (used by the GPU tests).
pub fn assert_all_passed(results: &[CheckResult]) {
    for r in results {
        println!(
            "{}: {} rel_l2={:.3e} max_abs={:.3e} tol={:.0e} {}",
            r.name,
            r.detail,
            r.rel_l2,
            r.max_abs,
            r.rel_tol,
            if r.passed { "ok" } else { "FAILED" }
        );
    }
    assert!(results.iter().all(|r| r.passed), "a GPU check failed");
}
