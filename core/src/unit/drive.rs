//! The one driver loop. An [`Environment`] supplies inputs in (time, sequence) order and
//! carries out the unit's outputs (the simulator's virtual environment, the GPU engine, a
//! replay of a recorded run); an [`Observer`] sees every input and output (records, logs).
//! Every caller runs a unit through [`run`]; no environment has a serving loop of its own.

use crate::time::Nanos;
use crate::unit::ServingUnit;
use crate::unit::io::{Input, Output};
use crate::unit::shared::SharedCache;
use std::fmt;

/// Why a run stopped early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunError {
    /// Requests are waiting but nothing that could move them is scheduled.
    Stuck {
        at: Nanos,
        pending: u64,
        requests: Vec<u64>,
    },
    /// The environment failed (a device error, a replay that ran out of record).
    Environment(String),
    /// A consistency check failed: a bug, not bad input.
    Invariant(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Stuck {
                at,
                pending,
                requests,
            } => write!(
                f,
                "the run can make no progress at {at}: {pending} requests are waiting and nothing \
                 is scheduled that could serve them (first: {requests:?})"
            ),
            RunError::Environment(e) => write!(f, "environment: {e}"),
            RunError::Invariant(e) => write!(f, "invariant violated: {e}"),
        }
    }
}

impl std::error::Error for RunError {}

pub trait Environment {
    /// The next input and its time (never earlier than the last), or None when the run is
    /// over. An environment whose device finished a step writes its report into the unit's
    /// buffer ([`ServingUnit::launch_mut`]) before returning [`Input::StepDone`]. An environment whose only remaining events cannot serve the unit's pending
    /// requests returns [`RunError::Stuck`].
    fn next(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError>;
    /// Carries out `output`, emitted at `now`.
    fn apply(
        &mut self,
        now: Nanos,
        output: Output,
        unit: &mut ServingUnit,
        shared: &SharedCache,
    ) -> Result<(), RunError>;
    /// Applies what changed outside the unit by `now` to the caches (storage nodes that failed
    /// or came back, rebuilds that finished, the bytes the last input wrote), before the unit
    /// handles the input at `now`. Environments without such changes keep the default.
    #[inline]
    fn update_shared(&mut self, _now: Nanos, _shared: &mut SharedCache) -> Result<(), RunError> {
        Ok(())
    }
}

/// Sees the run go by; every method has an empty default.
pub trait Observer {
    #[inline]
    fn on_input(&mut self, _now: Nanos, _input: &Input) {}
    #[inline]
    fn on_output(&mut self, _now: Nanos, _output: &Output, _unit: &ServingUnit) {}
    /// After the input at `now` and every output it gave were carried out: the unit and the
    /// caches between two events (where invariant checkers look).
    #[inline]
    fn after_input(&mut self, _now: Nanos, _unit: &ServingUnit, _shared: &SharedCache) {}
}

/// Observes nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// What a finished run handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunEnd {
    /// The last input's time.
    pub end: Nanos,
    pub inputs: u64,
}

/// Runs `unit` in `env` until the environment has no more inputs.
pub fn run<E: Environment, O: Observer>(
    unit: &mut ServingUnit,
    shared: &mut SharedCache,
    env: &mut E,
    observer: &mut O,
) -> Result<RunEnd, RunError> {
    let mut outputs = Vec::new();
    let mut end = RunEnd {
        end: Nanos::ZERO,
        inputs: 0,
    };
    while let Some((now, input)) = env.next(unit)? {
        end.end = now;
        end.inputs += 1;
        step(unit, shared, env, observer, (now, input), &mut outputs)?;
    }
    Ok(end)
}

/// One input through the unit: the caches brought to `now`, the input handled, every output
/// carried out. The one step of [`run`] and [`run_cluster`], and of the parallel cluster
/// driver (`servelab_sim::cluster`).
pub fn step<E: Environment, O: Observer>(
    unit: &mut ServingUnit,
    shared: &mut SharedCache,
    env: &mut E,
    observer: &mut O,
    (now, input): (Nanos, Input),
    outputs: &mut Vec<Output>,
) -> Result<(), RunError> {
    env.update_shared(now, shared)?;
    observer.on_input(now, &input);
    unit.handle(now, input, shared, outputs);
    for output in outputs.drain(..) {
        observer.on_output(now, &output, unit);
        env.apply(now, output, unit, shared)?;
    }
    observer.after_input(now, unit, shared);
    Ok(())
}

/// An environment that can say when its next input is due without producing it.
pub trait Lookahead {
    fn next_time(&self) -> Option<Nanos>;
}

/// One serving unit of a cluster: the unit, its environment and its own SWA state cache (SPEC
/// §5: one per unit); the KV store is the cluster's.
pub struct Member<E> {
    pub unit: ServingUnit,
    pub env: E,
    pub swa: crate::swa::SwaCache,
}

/// Runs the units of a cluster over one shared store, one input at a time in (time, unit)
/// order: the unit whose next input is earliest goes next, ties to the lower index, so the run
/// is deterministic and each unit sees the store as every earlier input of every unit left it.
/// While a unit handles an input, its own SWA cache stands in `shared.swa`.
pub fn run_cluster<E: Environment + Lookahead, O: Observer>(
    members: &mut [Member<E>],
    shared: &mut SharedCache,
    observer: &mut O,
) -> Result<RunEnd, RunError> {
    let mut outputs = Vec::new();
    let mut end = RunEnd {
        end: Nanos::ZERO,
        inputs: 0,
    };
    loop {
        let next = members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.env.next_time().map(|t| (t, i)))
            .min();
        let Some((_, i)) = next else {
            return Ok(end);
        };
        let m = &mut members[i];
        let Some(timed) = m.env.next(&mut m.unit)? else {
            continue;
        };
        end.end = timed.0;
        end.inputs += 1;
        std::mem::swap(&mut shared.swa, &mut m.swa);
        let r = step(
            &mut m.unit,
            shared,
            &mut m.env,
            observer,
            timed,
            &mut outputs,
        );
        std::mem::swap(&mut shared.swa, &mut m.swa);
        r?;
    }
}
