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
//!
//! Threads: the caller and `threads - 1` scoped workers, each with a fixed share of the
//! units, meet at a barrier at each window's start and end (see [`Crew`]); the caller alone
//! opens the windows and merges them. With one thread everything runs on the caller.

use crate::cluster::ClusterRun;
use crate::env::VirtualEnv;
use crate::service::ServiceError;
use servelab_core::store::window::{StoreWindow, merge};
use servelab_core::unit::drive::{Lookahead, NoObserver, RunError, step};
use servelab_core::unit::shared::StoreAccess;
use servelab_core::unit::{Environment, Member, ServingUnit, SharedCache};
use servelab_core::{KvStore, Nanos, PerfectCache};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// A unit with the caches it reaches in a window: its view of the store, its own SWA state
/// cache and perfect cache.
struct Windowed {
    unit: ServingUnit,
    env: VirtualEnv,
    cache: SharedCache,
}

impl Windowed {
    /// The member with its SWA cache moved into a window cache of its own.
    fn new(m: Member<VirtualEnv>) -> Self {
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
    fn into_member(self) -> Member<VirtualEnv> {
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
pub(crate) fn run(
    members: Vec<Member<VirtualEnv>>,
    store: KvStore,
    how: ClusterRun,
) -> Result<(Vec<Member<VirtualEnv>>, KvStore), ServiceError> {
    let units: Vec<Mutex<Windowed>> = members
        .into_iter()
        .map(|m| Mutex::new(Windowed::new(m)))
        .collect();
    let threads = (how.threads as usize).clamp(1, units.len().max(1));
    let store = if threads == 1 {
        run_windows(&units, store, how.window.0, &Crew::new(1))?
    } else {
        let crew = Crew::new(threads);
        std::thread::scope(|scope| {
            let workers = (1..threads)
                .map(|worker| {
                    let (crew, units) = (&crew, &units);
                    scope
                        .spawn(move || crew.work(worker, units))
                        .thread()
                        .clone()
                })
                .collect();
            crew.workers.get_or_init(|| workers);
            // Stops the workers however this closure ends: the scope waits for them, so a
            // panic here would otherwise wait forever on workers spinning for a window.
            let _stop = StopOnDrop(&crew);
            run_windows(&units, store, how.window.0, &crew)
        })?
    };
    Ok((
        units
            .into_iter()
            .map(|u| lock(u.into_inner()).into_member())
            .collect(),
        store,
    ))
}

/// A poisoned lock means a worker panicked: the panic itself is what the caller sees (the
/// scope re-raises it), so the unit is taken as it was.
fn lock<T>(r: Result<T, std::sync::PoisonError<T>>) -> T {
    r.unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The threads of a parallel run and the barrier that starts and ends each window. Worker
/// `k` of `n` runs units `k`, `k + n`, ...; worker 0 is the calling thread, which also opens
/// the windows and merges them. A window of a production-size unit holds tens of
/// microseconds of work, so the workers wait for the next one spinning (then yielding)
/// rather than sleeping: waking a parked thread takes as long as the window's work.
struct Crew {
    threads: usize,
    /// Bumped to start a window (or to stop, with `stopping` set).
    generation: AtomicU64,
    /// The window's end, for the workers to read once `generation` moved.
    end: AtomicU64,
    /// Workers other than 0 that finished the current window.
    finished: AtomicUsize,
    stopping: AtomicBool,
    /// The first error a worker's unit returned in the current window.
    error: Mutex<Option<RunError>>,
    /// The threads to wake: worker 0's (the caller's), and the others' once spawned.
    coordinator: Thread,
    workers: OnceLock<Vec<Thread>>,
}

impl Crew {
    fn new(threads: usize) -> Self {
        Crew {
            threads,
            generation: AtomicU64::new(0),
            end: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            error: Mutex::new(None),
            coordinator: std::thread::current(),
            workers: OnceLock::new(),
        }
    }

    /// Runs worker `worker`'s units to `end` (worker 0's from the calling thread).
    fn run_share(&self, worker: usize, units: &[Mutex<Windowed>], end: Nanos) {
        for u in units.iter().skip(worker).step_by(self.threads) {
            // A panic on a worker would leave the others waiting for it: it becomes the
            // window's error instead.
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| lock(u.lock()).run_until(end)))
                .unwrap_or_else(|p| {
                    let what = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    Err(RunError::Invariant(format!("a unit panicked: {what}")))
                });
            if let Err(e) = ran {
                lock(self.error.lock()).get_or_insert(e);
            }
        }
    }

    /// Runs one window: worker 0's share here, the others' on their threads; returns when all
    /// are done, with the first error any unit returned.
    fn window(&self, units: &[Mutex<Windowed>], end: Nanos) -> Result<(), RunError> {
        self.finished.store(0, Ordering::Relaxed);
        self.end.store(end.0, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Release);
        self.wake_workers();
        self.run_share(0, units, end);
        wait_until(|| self.finished.load(Ordering::Acquire) == self.threads - 1);
        lock(self.error.lock()).take().map_or(Ok(()), Err)
    }

    /// A worker's loop: each window, its units; until [`Crew::stop`].
    fn work(&self, worker: usize, units: &[Mutex<Windowed>]) {
        let mut seen = 0;
        loop {
            wait_until(|| self.generation.load(Ordering::Acquire) != seen);
            seen = self.generation.load(Ordering::Acquire);
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            self.run_share(worker, units, Nanos(self.end.load(Ordering::Relaxed)));
            self.finished.fetch_add(1, Ordering::Release);
            self.coordinator.unpark();
        }
    }

    fn wake_workers(&self) {
        for t in self.workers.get().into_iter().flatten() {
            t.unpark();
        }
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::Release);
        self.wake_workers();
    }
}

struct StopOnDrop<'c>(&'c Crew);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Waits for `done`: spinning for up to [`SPIN`], then parked until woken (each waker
/// unparks the thread after changing what `done` reads). A window of a production-size unit
/// holds tens of microseconds of work, so most waits end while spinning: waking a parked
/// thread takes about as long as the window. Past that the core is given back, so a busy
/// host (or a thread count above its cores) does not spin against the units' own work.
fn wait_until(done: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            // The timeout only bounds the cost of a wake-up lost to a bug; none is expected.
            std::thread::park_timeout(Duration::from_millis(1));
        }
    }
}

/// How long a waiting thread spins before it parks.
const SPIN: Duration = Duration::from_micros(50);

fn run_windows(
    units: &[Mutex<Windowed>],
    mut store: KvStore,
    w: u64,
    crew: &Crew,
) -> Result<KvStore, ServiceError> {
    loop {
        let next = units.iter().filter_map(|u| lock(u.lock()).env.next_time());
        let Some(first) = next.min() else {
            return Ok(store);
        };
        // The window holding the earliest input: boundaries at multiples of `window`, so
        // they fall where they fall whatever the thread count.
        let end = Nanos((first.0 / w).saturating_add(1).saturating_mul(w));
        let base = Arc::new(store);
        for u in units {
            lock(u.lock()).window().open(base.clone());
        }
        let ran = crew.window(units, end);
        let mut guards: Vec<_> = units.iter().map(|u| lock(u.lock())).collect();
        for g in guards.iter_mut() {
            g.window().close();
        }
        store = Arc::try_unwrap(base)
            .map_err(|_| RunError::Invariant("a store window outlived its window".to_string()))?;
        ran?;
        let mut windows: Vec<&mut StoreWindow> = guards.iter_mut().map(|g| g.window()).collect();
        merge(&mut store, &mut windows, end);
    }
}
