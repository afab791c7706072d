//! Hardware profiles: the coefficients of the cost models, as data. Parsing and file loading
//! stay with the callers that read files (`servelab_sim::profile` for the shipped profiles and
//! profile paths, `servelab_hw` for the profile text a GPU record carries), so this crate does
//! no I/O and needs no TOML parser.

use crate::engine::{DecodeTimeModel, PrefillCostModel};
use crate::{ConfigError, Nanos};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    pub name: String,
    /// Where the numbers come from and how well they fit.
    #[serde(default)]
    pub description: String,
    /// One prefill DP rank (one GPU of an EP4/DP4 instance).
    pub prefill: PrefillCostModel,
    /// One decode DP rank of a lockstep EP group.
    pub decode: DecodeTimeModel,
    pub transfer: TransferProfile,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferProfile {
    /// Host → HBM swap-in over the RDMA NIC, bytes per second per GPU.
    pub swap_in_bytes_per_s: f64,
    /// CPU time between decode steps under synchronous scheduling (planning and
    /// post-processing that async scheduling hides behind the GPU).
    pub sync_gap: Nanos,
}

impl HardwareProfile {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.prefill.validate("profile.prefill")?;
        self.decode.validate("profile.decode")?;
        let bw = self.transfer.swap_in_bytes_per_s;
        if !(bw.is_finite() && bw > 0.0) {
            return Err(ConfigError::invalid(
                "profile.transfer.swap_in_bytes_per_s",
                "must be positive",
            ));
        }
        Ok(())
    }
}
