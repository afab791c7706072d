//! Compiles every kernel source with NVRTC (no GPU needed), so syntax and type errors in the
//! CUDA C show up on any machine that has libnvrtc.

use crate::error::KernelError;
use crate::gpu::compile;

/// (name, source, defines) of one compiled variant.
pub type Variant = (String, String, Vec<(&'static str, usize)>);

/// Every variant the crate's checks and benchmarks compile.
pub fn all_variants() -> Vec<Variant> {
    let mut v = Vec::new();
    push_paged_attention_variants(&mut v);
    push_prefill_attention_variants(&mut v);
    push_mla_variants(&mut v);
    push_fixed_variants(&mut v);
    v
}

/// The paged-attention shapes compiled: head widths of 64 to 576, one to eight KV heads,
/// 16- and 128-token blocks.
const PAGED_SHAPES: [crate::attention::PagedAttentionShape; 6] = {
    use crate::attention::PagedAttentionShape as P;
    [
        P {
            num_kv_heads: 2,
            group: 4,
            d_qk: 128,
            d_v: 128,
            block_size: 128,
        },
        P {
            num_kv_heads: 1,
            group: 8,
            d_qk: 192,
            d_v: 128,
            block_size: 128,
        },
        P {
            num_kv_heads: 1,
            group: 2,
            d_qk: 576,
            d_v: 512,
            block_size: 128,
        },
        P {
            num_kv_heads: 2,
            group: 1,
            d_qk: 64,
            d_v: 64,
            block_size: 16,
        },
        P {
            num_kv_heads: 4,
            group: 2,
            d_qk: 256,
            d_v: 256,
            block_size: 128,
        },
        P {
            num_kv_heads: 8,
            group: 4,
            d_qk: 128,
            d_v: 128,
            block_size: 128,
        },
    ]
};

/// The paged-attention kernels at every checked shape: the CUDA-core kernel, and the
/// tensor-core one (plain and swapped operands) where the shape takes it.
fn push_paged_attention_variants(v: &mut Vec<Variant>) {
    for s in PAGED_SHAPES {
        v.push((
            format!("paged_attention {s:?}"),
            crate::attention::source_for(&s),
            crate::attention::defines(&s).to_vec(),
        ));
        if let Some(cfg) = crate::attention::mma_config(&s) {
            v.push((
                format!("paged_attention_mma {s:?}"),
                crate::attention::MMA_SOURCE.to_string(),
                crate::attention::mma_defines(&s, &cfg),
            ));
            // the swapped-operand kernel, padded and swizzled rows
            for swizzle in [false, true] {
                let sw = crate::attention::MmaConfig {
                    swap_operands: true,
                    swizzle,
                    ..cfg
                };
                if sw.validate_for(&s) {
                    v.push((
                        format!("paged_attention_mma_t swizzle {swizzle} {s:?}"),
                        crate::attention::MMA_SOURCE.to_string(),
                        crate::attention::mma_defines(&s, &sw),
                    ));
                }
            }
        }
    }
}

/// The tensor-core prefill kernel at its default tiles.
fn push_prefill_attention_variants(v: &mut Vec<Variant>) {
    use crate::attention::PagedAttentionShape as P;
    for s in [
        P {
            num_kv_heads: 4,
            group: 8,
            d_qk: 128,
            d_v: 128,
            block_size: 128,
        },
        P {
            num_kv_heads: 2,
            group: 2,
            d_qk: 256,
            d_v: 256,
            block_size: 128,
        },
    ] {
        if let Some(t) = crate::prefill_attention::default_tiles(&s) {
            v.push((
                format!("prefill_attention {s:?}"),
                crate::prefill_attention::SRC.to_string(),
                crate::prefill_attention::defines(&s, &t),
            ));
        }
    }
}

/// The MLA kernel at its default tiles and swapped with Q in registers.
fn push_mla_variants(v: &mut Vec<Variant>) {
    for (s, rows) in [
        (crate::mla_attention::spec_shape(16), 16),
        (crate::mla_attention::spec_shape(16), 96),
        (crate::mla_attention::spec_shape(8), 48),
    ] {
        if let Some(c) = crate::mla_attention::default_config(&s, rows) {
            v.push((
                format!("mla_attention {s:?} {c:?}"),
                crate::mla_attention::SRC.to_string(),
                crate::mla_attention::defines(&s, &c),
            ));
        }
        // the swapped kernel with Q in registers
        let c = crate::mla_attention::MlaConfig::swapped_for(rows, 4, 16, 2, 1, true);
        v.push((
            format!("mla_attention swapped {s:?} {c:?}"),
            crate::mla_attention::SRC.to_string(),
            crate::mla_attention::defines(&s, &c),
        ));
    }
}

/// The SWA kernel and the kernels without compile-time shapes.
fn push_fixed_variants(v: &mut Vec<Variant>) {
    let sw = crate::swa::SwaShape {
        num_kv_heads: 2,
        group: 4,
        head_dim: 64,
    };
    v.push((
        format!("swa_attention {sw:?}"),
        crate::swa::SOURCE.to_string(),
        crate::swa::defines(&sw).to_vec(),
    ));
    for (name, src) in [
        ("fill", crate::fill::SRC),
        ("rmsnorm", crate::norm::SRC),
        ("rope", crate::rope::SRC),
        ("moe", crate::moe::SRC),
        ("sampling", crate::sampling::SRC),
        ("ops", crate::ops::SRC),
        ("bandwidth", crate::bandwidth::SRC),
    ] {
        v.push((name.to_string(), src.to_string(), Vec::new()));
    }
}

/// Compiles every variant for `cc`; returns the PTX size of each.
pub fn compile_all(cc: (i32, i32)) -> Result<Vec<(String, usize)>, KernelError> {
    all_variants()
        .into_iter()
        .map(|(name, src, defs)| {
            let ptx = compile(&name, &src, &defs, cc)?;
            Ok((name, ptx.to_src().len()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_compiles_for_sm90() {
        // SAFETY: library probe only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: no NVRTC");
            return;
        }
        for (name, bytes) in compile_all((9, 0)).unwrap_or_else(|e| panic!("{e}")) {
            assert!(bytes > 0, "{name}");
        }
    }
}
