//! What goes into a serving unit and what comes out of it. The unit never runs anything: an
//! environment (the simulator, or the GPU engine) turns each [`Output`] into work and later
//! answers with an [`Input`].

use crate::ids::MachineId;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

/// A device of the unit: one prefill engine (one GPU), or one decode EP group (its ranks step
/// in lockstep, so the group is one device to the environment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceId {
    Prefill(u32),
    Decode(u32),
}

/// Something that happened, handed to [`crate::unit::ServingUnit::handle`] at its time.
/// Requests are named by their index in the unit's request table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Input {
    /// Request `i` arrives at the entrypoint.
    Arrival(u32),
    /// The hit prefix of request `i` (store fetch and SWA pull) is on its prefill engine.
    PrefixReady(u32),
    /// The device's step finished; its report is in the unit's report buffer for the device
    /// ([`crate::unit::ServingUnit::launch_mut`]).
    StepDone(DeviceId),
    /// Request `i`'s KV and SWA state reached the decode pool.
    HandoffDone(u32),
    /// A metrics interval ended.
    Tick,
    /// A time the unit asked for ([`Output::WakeAt`]) has come.
    WakeUp,
    /// Decode group `g` is told to shut down: it stops admitting, decodes for the grace
    /// period, then forwards its unfinished requests ([`Output::Forward`]).
    Drain(u32),
    /// A device of the unit failed ([`Fault`]).
    Fault(Fault),
    /// A failed device is back (repaired or replaced).
    Repair(Fault),
    /// A timer the unit set ([`Output::TimerAt`]) has come.
    Timer(Timer),
}

/// A failure of part of the unit's compute, as a fault schedule names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// Rank `rank` (one GPU) of decode group `group`.
    DecodeRank { group: u32, rank: u32 },
    /// Prefill engine `e` (one GPU).
    PrefillEngine(u32),
    /// The host of machine `m`: the SWA states it holds are lost.
    SwaHost(MachineId),
}

/// What a timer set by the unit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Timer {
    /// The grace period of draining decode group `g` is over.
    DrainDeadline(u32),
    /// Decode group `g`, stopped by a failed rank, restarts on its remaining ranks.
    GroupRestart(u32),
    /// A device the autoscaler added is provisioned and serves.
    Provisioned(DeviceId),
}

/// Why a request did not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// The prefill balancer's queue (`prefill.max_queued_requests`) was full.
    PrefillQueueFull,
    /// The decode rank's waiting queue was full.
    DecodeQueueFull,
    /// The context is larger than a decode rank's KV capacity.
    ContextTooLarge,
    /// No decode group could take the request (all drained or failed, none coming back).
    NoDecodeGroup,
}

impl Rejection {
    /// The reasons every report lists (with zero counts); [`Self::FAULTS`] are listed only when
    /// they happened, so that runs without faults keep their report byte for byte.
    pub const ALL: [Rejection; 3] = [
        Rejection::PrefillQueueFull,
        Rejection::DecodeQueueFull,
        Rejection::ContextTooLarge,
    ];
    pub const FAULTS: [Rejection; 1] = [Rejection::NoDecodeGroup];
    pub const COUNT: usize = 4;
    pub fn name(self) -> &'static str {
        match self {
            Rejection::PrefillQueueFull => "prefill_queue_full",
            Rejection::DecodeQueueFull => "decode_queue_full",
            Rejection::ContextTooLarge => "context_too_large",
            Rejection::NoDecodeGroup => "no_decode_group",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    Rejected(Rejection),
}

/// Work the unit asks its environment to carry out.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Output {
    /// Run the device's planned step ([`crate::unit::ServingUnit::launch_mut`]) from `start`
    /// on; answer [`Input::StepDone`] with the report filled in.
    Launch { device: DeviceId, start: Nanos },
    /// Read `reused_tokens` of request `request`'s prefix from the store onto prefill engine
    /// `engine` (0 when only the SWA state moves), and pull its SWA state from another machine
    /// when `swa_pull` is set; answer [`Input::PrefixReady`].
    Fetch {
        request: u32,
        engine: u32,
        reused_tokens: u32,
        swa_pull: bool,
    },
    /// Move request `request`'s KV and SWA state (`bytes`) from prefill machine `machine` to
    /// the decode pool; answer [`Input::HandoffDone`].
    Handoff {
        request: u32,
        machine: MachineId,
        bytes: u64,
    },
    /// Answer [`Input::WakeUp`] at this time (a balancer round that may free queued work).
    WakeAt(Nanos),
    /// Request `request` ended.
    Finished { request: u32, outcome: Outcome },
    /// Answer [`Input::Timer`] with `timer` at `at`.
    TimerAt { at: Nanos, timer: Timer },
    /// Move request `request`'s KV and SWA state (`bytes`) from decode group `group` (being
    /// drained, or stopped by a failed rank) to the decode pool over the handoff link; answer
    /// [`Input::HandoffDone`] (the balancer then picks a group that is up).
    Forward {
        request: u32,
        group: u32,
        bytes: u64,
    },
}
