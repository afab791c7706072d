//! Hardware profiles: the coefficients of the cost model, read from a TOML file. The shipped
//! `sm100-published` profile (`sim/profiles/sm100-published.toml`) is fitted to SPEC §11 and
//! §10; a profile measured on a GPU is loaded the same way with [`ProfileFiles::load`].

use servelab_core::ConfigError;
use std::path::Path;

/// The shipped profile fitted to the published operating points.
pub const SM100_PUBLISHED: &str = include_str!("../profiles/sm100-published.toml");

/// The profile types are core's (data, no I/O); this module loads them from files.
pub use servelab_core::profile::{HardwareProfile, TransferProfile};

/// Loading a [`HardwareProfile`] from TOML text, a file or a shipped name (an extension trait:
/// the type lives in `servelab_core`, which does no I/O).
pub trait ProfileFiles: Sized {
    /// Parses a profile; `origin` names the file in errors.
    fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError>;
    fn load(path: &Path) -> Result<Self, ConfigError>;
    /// A shipped profile by name, or a path to a profile file (anything ending in `.toml`).
    fn resolve(spec: &str) -> Result<Self, ConfigError>;
}

impl ProfileFiles for HardwareProfile {
    fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let p: HardwareProfile = toml::from_str(text)
            .map_err(|e| ConfigError::invalid(origin, e.to_string().trim_end().to_string()))?;
        p.validate()?;
        Ok(p)
    }

    fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::invalid(path.display().to_string(), e.to_string()))?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    fn resolve(spec: &str) -> Result<Self, ConfigError> {
        match spec {
            "sm100-published" => Self::from_toml_str(SM100_PUBLISHED, "sm100-published"),
            s if s.ends_with(".toml") => Self::load(Path::new(s)),
            other => Err(ConfigError::invalid(
                "profile",
                format!(
                    "unknown profile `{other}` (shipped: sm100-published; or give a path to a .toml file)"
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profile_loads() {
        let p = HardwareProfile::resolve("sm100-published").unwrap();
        assert_eq!(p.name, "sm100-published");
        assert!(
            HardwareProfile::resolve("h100-imagined")
                .unwrap_err()
                .to_string()
                .contains("unknown profile")
        );
    }

    #[test]
    fn bad_profiles_name_the_field() {
        let text =
            SM100_PUBLISHED.replace("swap_in_bytes_per_s = 5.0e10", "swap_in_bytes_per_s = -1.0");
        assert_ne!(text, SM100_PUBLISHED);
        let e = HardwareProfile::from_toml_str(&text, "x.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("swap_in_bytes_per_s"), "{e}");
        let e =
            HardwareProfile::from_toml_str(&format!("{SM100_PUBLISHED}\nextra = 1\n"), "x.toml")
                .unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
    }

    /// The fit documented in the profile: prefill at 131K context, 4,096- and 32,768-token
    /// steps, gives 60,000 and 89,500 tokens/s per GPU.
    #[test]
    fn prefill_fit_reproduces_published_range() {
        let p = HardwareProfile::resolve("sm100-published").unwrap();
        let ctx = 131_072u32;
        for (n, want) in [(4096u32, 60_000.0), (32_768, 89_500.0)] {
            let mut t = 0.0;
            let mut done = 0;
            while done < ctx {
                let c = servelab_core::engine::PrefillChunk {
                    request: servelab_core::RequestId(0),
                    new_tokens: n,
                    prefix_tokens: done,
                    new_token_layers: 20,
                    decoder_tokens: 0,
                    decoder_layers: 20,
                    swap_in_bytes: 0,
                };
                t += p.prefill.step_ns(&[c], p.prefill.reference_imbalance);
                done += n;
            }
            let rate = f64::from(ctx) / (t / 1e9);
            assert!((rate / want - 1.0).abs() < 0.01, "{n}: {rate}");
        }
    }
}
