//! The parallel cluster driver: the units of a cluster side by side on several threads, in
//! windows of simulated time, over one shared store (SPEC §7).
//!
//! Synchronisation: windows are fixed multiples of `window` on the simulated clock. In each,
//! every unit handles its inputs before the window's end through the same
//! [`servelab_core::unit::drive::step`] as a sequential run, reading the store as the last
//! merge left it plus its own writes ([`servelab_core::store::window`]); then, on one thread,
//! the units' writes are applied to the store in (time, unit, sequence) order. A unit's inputs
//! depend only on its own state and on the store at the window's start, so each unit's run,
//! and the merged store, are the same on any number of threads. What the window changes
//! against a sequential run: a block one unit writes becomes visible to the others at the next
//! boundary, up to one window later (the KV of a prefill takes longer than that to be written
//! to SSD and published in the store's index anyway); the node writes a unit's blocks cause
//! reach its storage-node model at the next window.

use crate::cluster::ClusterRun;
use crate::env::VirtualEnv;
use crate::service::ServiceError;
use rayon::prelude::*;
use servelab_core::store::window::{StoreWindow, merge};
use servelab_core::unit::drive::{Lookahead, NoObserver, RunError, step};
use servelab_core::unit::shared::StoreAccess;
use servelab_core::unit::{Environment, Member, ServingUnit, SharedCache};
use servelab_core::{KvStore, Nanos, PerfectCache};
use std::sync::Arc;

/// A unit with the caches it reaches in a window: its view of the store, its own SWA state
/// cache and perfect cache.
struct Windowed<'a> {
    unit: ServingUnit<'a>,
    env: VirtualEnv,
    cache: SharedCache,
}

impl<'a> Windowed<'a> {
    /// The member with its SWA cache moved into a window cache of its own.
    fn new(m: Member<'a, VirtualEnv>) -> Self {
        Windowed {
            unit: m.unit,
            env: m.env,
            cache: SharedCache {
                store: StoreAccess::Window(StoreWindow::default()),
                swa: m.swa,
                perfect: PerfectCache::new(),
            },
        }
    }

    /// The member again, its SWA cache back in place.
    fn into_member(self) -> Member<'a, VirtualEnv> {
        Member {
            unit: self.unit,
            env: self.env,
            swa: self.cache.swa,
        }
    }

    fn window(&mut self) -> &mut StoreWindow {
        self.cache
            .store
            .window_mut()
            .expect("a windowed unit reads the store through a window")
    }

    /// Handles the unit's inputs due before `end`.
    fn run_until(&mut self, end: Nanos) -> Result<(), RunError> {
        let mut outputs = Vec::new();
        while self.env.next_time().is_some_and(|t| t < end) {
            let Some(timed) = self.env.next(&mut self.unit)? else {
                break;
            };
            step(
                &mut self.unit,
                &mut self.cache,
                &mut self.env,
                &mut NoObserver,
                timed,
                &mut outputs,
            )?;
        }
        Ok(())
    }
}

/// Runs `members` over `store` in windows of `how.window` on `how.threads` threads; returns
/// the members and the store the run left. Each member's SWA cache is its own throughout.
pub(crate) fn run<'a>(
    members: Vec<Member<'a, VirtualEnv>>,
    store: KvStore,
    how: ClusterRun,
) -> Result<(Vec<Member<'a, VirtualEnv>>, KvStore), ServiceError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(how.threads as usize)
        .build()
        .map_err(|e| RunError::Environment(format!("cluster threads: {e}")))?;
    let mut units: Vec<Windowed<'a>> = members.into_iter().map(Windowed::new).collect();
    let store = run_windows(&mut units, store, how, &pool)?;
    Ok((
        units.into_iter().map(Windowed::into_member).collect(),
        store,
    ))
}

fn run_windows(
    units: &mut [Windowed<'_>],
    mut store: KvStore,
    how: ClusterRun,
    pool: &rayon::ThreadPool,
) -> Result<KvStore, ServiceError> {
    let w = how.window.0;
    loop {
        let Some(first) = units.iter().filter_map(|u| u.env.next_time()).min() else {
            return Ok(store);
        };
        // The window holding the earliest input: boundaries at multiples of `window`, so
        // they fall where they fall whatever the thread count.
        let end = Nanos((first.0 / w).saturating_add(1).saturating_mul(w));
        let base = Arc::new(store);
        for u in units.iter_mut() {
            u.window().open(base.clone());
        }
        let ran = pool.install(|| units.par_iter_mut().try_for_each(|u| u.run_until(end)));
        for u in units.iter_mut() {
            u.window().close();
        }
        store = Arc::try_unwrap(base)
            .map_err(|_| RunError::Invariant("a store window outlived its window".to_string()))?;
        ran?;
        let mut windows: Vec<&mut StoreWindow> = units
            .iter_mut()
            .map(|u| {
                u.cache
                    .store
                    .window_mut()
                    .expect("a windowed unit reads the store through a window")
            })
            .collect();
        merge(&mut store, &mut windows, end);
    }
}
