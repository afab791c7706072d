//! Per-request state inside a serving unit, from arrival to its outcome.

use crate::ids::MachineId;
use crate::time::Nanos;
use crate::unit::io::Rejection;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Not arrived yet.
    Future,
    Pending,
    Done,
    Rejected(Rejection),
}

#[derive(Clone, Copy, Debug)]
pub struct RequestState {
    pub status: Status,
    pub arrival: Nanos,
    pub hit_tokens: u32,
    pub encoder_tokens: u32,
    /// The prefill engine the request was assigned to.
    pub engine: u32,
    pub swa_machine: Option<MachineId>,
    /// Start of its first prefill step (0: none yet; a step at time 0 is recorded as 1 ns).
    pub first_step: Nanos,
    pub first_token: Nanos,
    pub last_token: Nanos,
    pub max_gap: Nanos,
    pub emitted: u32,
    pub decode_group: u32,
    /// Prefilled again after its KV died with a decode rank (its first token is long out).
    pub reprefill: bool,
    /// Answers of prefix fetches for a job taken off a failed prefill engine, still to come
    /// and to be ignored.
    pub stale_ready: u8,
}

impl RequestState {
    pub const NEW: RequestState = RequestState {
        status: Status::Future,
        arrival: Nanos::ZERO,
        hit_tokens: 0,
        encoder_tokens: 0,
        engine: 0,
        swa_machine: None,
        first_step: Nanos::ZERO,
        first_token: Nanos::ZERO,
        last_token: Nanos::ZERO,
        max_gap: Nanos::ZERO,
        emitted: 0,
        decode_group: 0,
        reprefill: false,
        stale_ready: 0,
    };
}
