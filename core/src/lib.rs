//! servelab-core: the sans-IO policies that the simulator and the GPU engine both drive.
//!
//! Nothing here reads a clock, draws from a thread RNG, prints, or iterates a hash map in a way
//! that decides anything: every function takes `now` and returns decisions.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod consts;
pub mod content;
pub mod econ;
pub mod engine;
pub mod eplb;
pub mod error;
pub mod hit;
pub mod ids;
pub mod perfect;
pub mod profile;
pub mod request;
pub mod seed;
pub mod store;
pub mod swa;
pub mod time;
pub mod unit;

pub use consts::ServingConstants;
pub use content::{BlockKey, ChainBuilder, ContentChain, Mark, SegmentId};
pub use error::ConfigError;
pub use hit::{HitDecision, HitInputs, HitPolicy, HitReason, SwaSource};
pub use ids::{EngineId, MachineId, RequestId, SessionId, StorageNodeId};
pub use perfect::PerfectCache;
pub use request::{Request, TrafficClass};
pub use store::{ClassTtl, GcPolicy, KvStore, StoreConfig, StoreStats, TtlFrom};
pub use swa::{SwaCache, SwaConfig, SwaStats};
pub use time::{Nanos, parse_duration};
