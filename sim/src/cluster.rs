//! A cluster of serving units behind one entrypoint, all sharing one KV store (SPEC §7: every
//! prefill machine can hit any prefix), each with its own balancers, devices and SWA state
//! cache (SPEC §5). The cluster entrypoint routes whole sessions: a session (or a request
//! outside any) goes to a unit by a hash of its id, with probability in proportion to the
//! unit's GPUs, so a session's turns always meet the SWA state its earlier turns left.
//!
//! The units run through [`servelab_core::unit::run_cluster`]: one input at a time in (time,
//! unit) order over the shared store, on one thread.

use crate::cost::CostModel;
use crate::env::VirtualEnv;
use crate::profile::{HardwareProfile, ProfileFiles};
use crate::service::{ServiceConfig, ServiceError};
use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::content::hash2;
use servelab_core::seed::sub_seed;
use servelab_core::swa::SwaCache;
use servelab_core::unit::drive::NoObserver;
use servelab_core::unit::shared::StoreAccess;
use servelab_core::unit::{Member, ServiceReport, ServingUnit, SharedCache};
use servelab_core::{ConfigError, Request};

/// One unit's size; everything else is the cluster's `[service]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitSize {
    pub name: String,
    pub prefill_gpus: u32,
    pub decode_groups: u32,
}

/// What a cluster run measured: each unit's report, and the store they shared.
pub struct ClusterReport {
    pub units: Vec<(String, ServiceReport)>,
    pub store_used_bytes: u64,
    pub store_peak_bytes: u64,
}

impl ClusterReport {
    pub fn hit_rate(&self) -> f64 {
        let (hit, input) = self.units.iter().fold((0u64, 0u64), |(h, i), (_, r)| {
            (h + r.hit_tokens, i + r.input_tokens)
        });
        hit as f64 / input.max(1) as f64
    }
}

/// The service config of unit `u`: the cluster's, with the unit's engines and groups and the
/// machines that hold its SWA state.
pub fn unit_service(base: &ServiceConfig, u: &UnitSize) -> Result<ServiceConfig, ConfigError> {
    if u.prefill_gpus == 0 || u.decode_groups == 0 {
        return Err(ConfigError::invalid(
            "cluster.units",
            format!("unit `{}` needs prefill GPUs and decode groups", u.name),
        ));
    }
    let mut s = base.clone();
    s.prefill.gpus = u.prefill_gpus;
    s.decode.groups = u.decode_groups;
    s.swa.machines = u32::try_from(s.machines()).map_err(|_| {
        ConfigError::invalid(
            "cluster.units",
            format!("unit `{}` has more machines than a unit can number", u.name),
        )
    })?;
    s.validate()?;
    Ok(s)
}

/// The unit each request goes to: by a hash of its session (or, outside any, its id), in
/// proportion to the units' GPUs.
pub fn route(requests: &[Request], services: &[ServiceConfig], seed: u64) -> Vec<Vec<Request>> {
    let weights: Vec<u64> = services.iter().map(|s| u64::from(s.gpus())).collect();
    let total: u64 = weights.iter().sum();
    let salt = sub_seed(seed, "cluster.route");
    let mut out = vec![Vec::new(); services.len()];
    for r in requests {
        let id = r.session.map_or(r.id.0 ^ (1 << 63), |s| s.0);
        let mut x = hash2(salt, id) % total.max(1);
        let u = weights
            .iter()
            .position(|&w| {
                let hit = x < w;
                x = x.saturating_sub(w);
                hit
            })
            .unwrap_or(0);
        out[u].push(r.clone());
    }
    out
}

/// How a cluster's units are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterRun {
    /// 0: one input at a time in (time, unit) order, every write visible to every unit at
    /// once. Otherwise the units run side by side in windows of this length: a unit sees the
    /// others' writes from the next window boundary on ([`servelab_core::store::window`]).
    #[serde(default)]
    pub window: Nanos,
    /// Threads for the windows (1 or more; results do not depend on it).
    #[serde(default = "one_thread")]
    pub threads: u32,
}

fn one_thread() -> u32 {
    1
}

impl Default for ClusterRun {
    fn default() -> Self {
        ClusterRun {
            window: Nanos::ZERO,
            threads: 1,
        }
    }
}

impl ClusterRun {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.threads == 0 {
            return Err(ConfigError::invalid("cluster.threads", "at least 1"));
        }
        if self.window == Nanos::ZERO && self.threads > 1 {
            return Err(ConfigError::invalid(
                "cluster.threads",
                "more than one thread needs a window (cluster.window > 0)",
            ));
        }
        Ok(())
    }
}

/// Runs the cluster of `units` (sizes) over `requests` (sorted by arrival), every unit's
/// devices on the cost model of `base.profile`, all of them sharing `base.store`, one input
/// at a time.
pub fn run(
    base: &ServiceConfig,
    units: &[UnitSize],
    requests: &[Request],
    seed: u64,
) -> Result<ClusterReport, ServiceError> {
    run_with(base, units, requests, seed, ClusterRun::default())
}

/// [`run`] as `how` says.
pub fn run_with(
    base: &ServiceConfig,
    units: &[UnitSize],
    requests: &[Request],
    seed: u64,
    how: ClusterRun,
) -> Result<ClusterReport, ServiceError> {
    how.validate()?;
    let services = check_cluster(base, units)?;
    let tables = route(requests, &services, seed);
    let profile = HardwareProfile::resolve(&base.profile)?;
    let mut shared = SharedCache::new(
        base.store.clone(),
        services[0].swa.clone(),
        base.constants.block_bytes(),
    )?;
    let mut members = Vec::with_capacity(units.len());
    for (k, (s, reqs)) in services.iter().zip(&tables).enumerate() {
        // Unit 0 runs on the run's seed, so that a cluster of one unit is that unit.
        let unit_seed = if k == 0 { seed } else { hash2(seed, k as u64) };
        members.push(member(s, &profile, reqs, unit_seed, &mut shared)?);
    }
    if how.window == Nanos::ZERO {
        servelab_core::unit::run_cluster(&mut members, &mut shared, &mut NoObserver)?;
    } else {
        let store = std::mem::replace(&mut shared.store, StoreAccess::Window(Default::default()));
        let (ran, store) = crate::windows::run(members, store.into_owned(), how)?;
        members = ran;
        shared.store = StoreAccess::Owned(store);
    }
    report(units, members, shared)
}

/// The units' service configs, after the checks a cluster adds.
fn check_cluster(
    base: &ServiceConfig,
    units: &[UnitSize],
) -> Result<Vec<ServiceConfig>, ServiceError> {
    if units.is_empty() {
        return Err(ConfigError::invalid("cluster.units", "at least one unit").into());
    }
    if base.store.has_failures() || !base.faults.is_default() || base.autoscale.is_some() {
        return Err(ConfigError::invalid(
            "service",
            "a cluster's units share one store: its failures, the fault schedules and the \
             autoscaler are not modelled across units",
        )
        .into());
    }
    Ok(units
        .iter()
        .map(|u| unit_service(base, u))
        .collect::<Result<_, _>>()?)
}

/// One unit of the cluster, on its own seed, over its routed requests.
fn member(
    s: &ServiceConfig,
    profile: &HardwareProfile,
    reqs: &[Request],
    unit_seed: u64,
    shared: &mut SharedCache,
) -> Result<Member<VirtualEnv>, ServiceError> {
    let mut unit = ServingUnit::new(s.unit_config(profile), reqs)?;
    unit.set_fetch_stripes(s.fetch.stripes as usize);
    shared.store.reserve(unit.store_objects_bound());
    let backend = CostModel::new(
        profile.clone(),
        &s.acceptance,
        s.constants.draft_tokens,
        s.swap_in,
        unit_seed,
    );
    let env = VirtualEnv::new(s, backend, reqs, unit_seed)?;
    let swa = SwaCache::new(s.swa.clone())?;
    Ok(Member { unit, env, swa })
}

/// Each unit's report, each unit reading the store the run left (and its own SWA cache).
fn report(
    units: &[UnitSize],
    members: Vec<Member<VirtualEnv>>,
    mut shared: SharedCache,
) -> Result<ClusterReport, ServiceError> {
    let mut reports = Vec::with_capacity(members.len());
    for (u, mut m) in units.iter().zip(members) {
        std::mem::swap(&mut shared.swa, &mut m.swa);
        let mut rep = m.unit.finish(&shared, m.env.now(), m.env.events())?;
        rep.moe_reassignments = m.env.moe().reassignments;
        rep.moe_reassignment_s = m.env.moe().reassignment_ns as f64 / 1e9;
        rep.storage = m.env.storage_mut().finish(&mut shared.store);
        reports.push((u.name.clone(), rep));
    }
    Ok(ClusterReport {
        units: reports,
        store_used_bytes: shared.store.used_bytes(),
        store_peak_bytes: shared.store.stats().peak_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_core::unit::Histogram;
    use servelab_workloads::dist::Dist;
    use servelab_workloads::generate::{ChatConfig, Pacing, WorkloadConfig, generate};

    fn small() -> (ServiceConfig, Vec<Request>) {
        let mut s = ServiceConfig::default();
        s.prefill.gpus = 4;
        s.prefill.gpus_per_machine = 2;
        s.decode.groups = 2;
        s.decode.ranks = 2;
        s.decode.gpus_per_machine = 2;
        s.swa.machines = 4;
        s.series_interval = servelab_core::Nanos::from_secs(10);
        s.warmup = servelab_core::Nanos::ZERO;
        let fixed = |v| Dist::Fixed { value: v };
        let w = WorkloadConfig {
            chat: Some(ChatConfig {
                sessions: 120,
                session_rate_per_s: 4.0,
                turns: fixed(4.0),
                system_prompts: 3,
                system_prompt_tokens: fixed(2000.0),
                user_tokens: Dist::Uniform {
                    min: 20.0,
                    max: 400.0,
                },
                reply_tokens: fixed(150.0),
                think_time_s: fixed(5.0),
                pacing: Pacing::default(),
                revisits: None,
            }),
            ..Default::default()
        };
        (s, generate(&w, 3, 128).unwrap().requests)
    }

    #[test]
    fn a_cluster_of_one_unit_is_the_unit() {
        let (s, reqs) = small();
        let alone = crate::service::run(&s, &reqs, 7).unwrap();
        let one = UnitSize {
            name: "a".into(),
            prefill_gpus: 4,
            decode_groups: 2,
        };
        let c = run(&s, &[one], &reqs, 7).unwrap();
        let rep = &c.units[0].1;
        assert_eq!(rep.arrivals, alone.arrivals);
        assert_eq!(rep.completed, alone.completed);
        assert_eq!(rep.hit_tokens, alone.hit_tokens);
        assert!(rep.hit_tokens > 0);
        assert_eq!(rep.events, alone.events);
        assert_eq!(rep.all.ttft_ns, alone.all.ttft_ns);
        assert_eq!(rep.all.tpot_ns, alone.all.tpot_ns);
        assert_eq!(
            c.store_peak_bytes,
            alone.store_used_bytes.max(c.store_peak_bytes)
        );
    }

    #[test]
    fn units_share_the_store_and_keep_their_sessions() {
        let (s, reqs) = small();
        let units = two_units();
        let c = run(&s, &units, &reqs, 7).unwrap();
        let n: u64 = c.units.iter().map(|(_, r)| r.arrivals).sum();
        assert_eq!(n, reqs.len() as u64);
        // GPUs 8 and 4: about two thirds of the sessions on the big unit.
        let big = c.units[0].1.arrivals as f64 / n as f64;
        assert!((0.5..0.8).contains(&big), "{big}");
        // Sticky sessions: no session on two units.
        let services: Vec<ServiceConfig> =
            units.iter().map(|u| unit_service(&s, u).unwrap()).collect();
        let tables = route(&reqs, &services, 7);
        let sessions = |t: &[Request]| {
            t.iter()
                .filter_map(|r| r.session)
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert!(sessions(&tables[0]).is_disjoint(&sessions(&tables[1])));
        // The system prompts written by one unit are hits for the other: the small unit's
        // sessions find them from their first turn. Same inputs, each unit on its own store:
        let own: u64 = services
            .iter()
            .zip(&tables)
            .map(|(sv, t)| crate::service::run(sv, t, 7).unwrap().hit_tokens)
            .sum();
        let shared: u64 = c.units.iter().map(|(_, r)| r.hit_tokens).sum();
        assert!(shared > own, "shared {shared} own {own}");
        // Deterministic.
        let again = run(&s, &units, &reqs, 7).unwrap();
        assert_eq!(again.hit_rate(), c.hit_rate());
        assert_eq!(again.store_peak_bytes, c.store_peak_bytes);
    }

    fn two_units() -> [UnitSize; 2] {
        [
            UnitSize {
                name: "big".into(),
                prefill_gpus: 4,
                decode_groups: 2,
            },
            UnitSize {
                name: "small".into(),
                prefill_gpus: 2,
                decode_groups: 1,
            },
        ]
    }

    fn windowed(ms: u64, threads: u32) -> ClusterRun {
        ClusterRun {
            window: servelab_core::Nanos::from_millis(ms),
            threads,
        }
    }

    /// Everything a unit's report says about its requests.
    fn fingerprint(c: &ClusterReport) -> Vec<(u64, u64, u64, u64, Histogram, Histogram)> {
        c.units
            .iter()
            .map(|(_, r)| {
                (
                    r.arrivals,
                    r.completed,
                    r.hit_tokens,
                    r.events,
                    r.all.ttft_ns.clone(),
                    r.all.tpot_ns.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn windowed_runs_do_not_depend_on_the_thread_count() {
        let (s, reqs) = small();
        let units = two_units();
        let one = run_with(&s, &units, &reqs, 7, windowed(20, 1)).unwrap();
        let two = run_with(&s, &units, &reqs, 7, windowed(20, 2)).unwrap();
        let three = run_with(&s, &units, &reqs, 7, windowed(20, 3)).unwrap();
        assert_eq!(fingerprint(&one), fingerprint(&two));
        assert_eq!(fingerprint(&one), fingerprint(&three));
        assert_eq!(one.store_peak_bytes, two.store_peak_bytes);
        assert_eq!(one.store_used_bytes, three.store_used_bytes);
        assert!(one.hit_rate() > 0.0);
    }

    #[test]
    fn three_units_on_two_threads_are_three_units_on_one() {
        // Worker 0 runs units 0 and 2, worker 1 unit 1: an uneven share still merges in
        // unit order.
        let (s, reqs) = small();
        let mut units = two_units().to_vec();
        units.push(UnitSize {
            name: "third".into(),
            prefill_gpus: 2,
            decode_groups: 1,
        });
        let one = run_with(&s, &units, &reqs, 7, windowed(20, 1)).unwrap();
        let two = run_with(&s, &units, &reqs, 7, windowed(20, 2)).unwrap();
        assert_eq!(fingerprint(&one), fingerprint(&two));
        assert_eq!(one.store_peak_bytes, two.store_peak_bytes);
        assert_eq!(one.units.len(), 3);
    }

    #[test]
    fn one_unit_in_windows_is_the_unit_run_alone() {
        // Without charged writes nothing reaches a unit a window late: its own writes are in
        // its overlay at once, so windows change nothing for a unit alone.
        let (mut s, reqs) = small();
        s.store.node.charge_writes = false;
        let one = [UnitSize {
            name: "a".into(),
            prefill_gpus: 4,
            decode_groups: 2,
        }];
        let exact = run(&s, &one, &reqs, 7).unwrap();
        let w = run_with(&s, &one, &reqs, 7, windowed(5, 1)).unwrap();
        assert_eq!(fingerprint(&exact), fingerprint(&w));
        assert_eq!(exact.store_used_bytes, w.store_used_bytes);
    }

    #[test]
    fn short_windows_stay_close_to_the_sequential_run() {
        let (s, reqs) = small();
        let units = two_units();
        let exact = run(&s, &units, &reqs, 7).unwrap();
        let w = run_with(&s, &units, &reqs, 7, windowed(1, 2)).unwrap();
        let d = (w.hit_rate() - exact.hit_rate()).abs();
        assert!(
            d < 0.005,
            "hit rate {} against {}",
            w.hit_rate(),
            exact.hit_rate()
        );
        let n = |c: &ClusterReport| c.units.iter().map(|(_, r)| r.completed).sum::<u64>();
        assert_eq!(n(&exact), n(&w));
    }

    #[test]
    fn thread_counts_need_a_window() {
        let (s, reqs) = small();
        let bad = ClusterRun {
            window: servelab_core::Nanos::ZERO,
            threads: 2,
        };
        let e = run_with(&s, &two_units(), &reqs, 7, bad).err().unwrap();
        assert!(e.to_string().contains("cluster.threads"), "{e}");
    }
}
