//! The seeded swarm (VOPR-style): hundreds of small random units, workloads, stores and
//! storage-node failure schedules, each checked after every event (servelab_tests::swarm).
//!
//! `cargo test -p servelab-tests --test swarm` runs the seeds `0..SWARM_SEEDS` (default 256) in
//! four shards; `SWARM_SEED=N` runs seed N alone and prints its scenario and summary.

use servelab_sim::profile::{HardwareProfile, ProfileFiles};
use servelab_tests::swarm::{Checker, Generator, Scenario, run_scenario};

const SHARDS: u64 = 4;

fn profile() -> HardwareProfile {
    HardwareProfile::resolve("sm100-published").unwrap()
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("SWARM_SEED") {
        return vec![s.parse().expect("SWARM_SEED is a number")];
    }
    let n =
        std::env::var("SWARM_SEEDS").map_or(256, |s| s.parse().expect("SWARM_SEEDS is a number"));
    (0..n).collect()
}

fn run_one(seed: u64, generator: &Generator, profile: &HardwareProfile) -> Scenario {
    let s = generator.draw(seed);
    if let Err(e) = run_scenario(&s, profile) {
        panic!(
            "swarm seed {seed} failed: {e}\nreproduce: SWARM_SEED={seed} cargo test -p \
             servelab-tests --test swarm\nscenario: {s:#?}"
        );
    }
    s
}

fn shard(k: u64) {
    let (generator, profile) = (Generator::standard(), profile());
    let single = std::env::var("SWARM_SEED").is_ok();
    for seed in seeds().into_iter().filter(|s| single || s % SHARDS == k) {
        if single && k != 0 {
            return;
        }
        println!("swarm seed {seed}");
        let s = run_one(seed, &generator, &profile);
        if single {
            println!("{s:#?}\n{:#?}", run_scenario(&s, &profile));
        }
    }
}

#[test]
fn swarm_shard_0() {
    shard(0);
}
#[test]
fn swarm_shard_1() {
    shard(1);
}
#[test]
fn swarm_shard_2() {
    shard(2);
}
#[test]
fn swarm_shard_3() {
    shard(3);
}

/// The seeds exercise what they are for: node failures, lost groups, degraded reads,
/// rebuilds, decode drains, GPU failures and displaced sequences all happen in the first 64
/// seeds, and every scenario is the same when drawn again.
#[test]
fn the_swarm_covers_its_faults_and_reproduces() {
    let (generator, profile) = (Generator::standard(), profile());
    let mut total = servelab_tests::swarm::RunSummary::default();
    for seed in 0..64 {
        let s = generator.draw(seed);
        let a = run_scenario(&s, &profile).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        total.node_failures += a.node_failures;
        total.group_losses += a.group_losses;
        total.lost_objects += a.lost_objects;
        total.degraded_stripe_reads += a.degraded_stripe_reads;
        total.rebuilds_completed += a.rebuilds_completed;
        total.rejected += a.rejected;
        total.drains += a.drains;
        total.gpu_failures += a.gpu_failures;
        total.forwarded += a.forwarded;
        total.reprefilled += a.reprefilled;
    }
    assert!(
        total.node_failures > 0 && total.group_losses > 0,
        "{total:?}"
    );
    assert!(
        total.lost_objects > 0 && total.degraded_stripe_reads > 0,
        "{total:?}"
    );
    assert!(total.rebuilds_completed > 0, "{total:?}");
    assert!(total.drains > 0 && total.gpu_failures > 0, "{total:?}");
    // The swarm's replies are short (at most 120 tokens, a fraction of a second of decode), so
    // a drain rarely catches a sequence; `compute_faults.rs` times the forward by hand.
    assert!(total.forwarded + total.reprefilled > 0, "{total:?}");
    let a = format!("{:?}", generator.draw(17));
    assert_eq!(a, format!("{:?}", generator.draw(17)));
    assert_ne!(a, format!("{:?}", generator.draw(18)));
}

/// The checker catches what it is for: a request that arrives twice, one that never ends, an
/// end without an arrival, and a hit on a lost group's block decided after the loss.
#[test]
fn the_checker_catches_broken_invariants() {
    use servelab_core::Nanos;
    let mut c = Checker::new(3);
    c.arrival(Nanos(1), 0);
    c.arrival(Nanos(2), 0);
    assert!(c.violation.take().unwrap().contains("arrived twice"));
    c.ended(Nanos(3), 2);
    assert!(
        c.violation
            .take()
            .unwrap()
            .contains("without being pending")
    );
    let rep = servelab_sim::service::run(&Default::default(), &[], 1).unwrap();
    let e = c.finish(&rep).unwrap_err();
    assert!(
        e.contains("request 0 neither completed nor rejected"),
        "{e}"
    );
    // Nodes 0, 1, 2 of 12 down: the one group (10 + 2) lost its objects. A hit decided now
    // that reads one of its blocks is a read from a lost group.
    use servelab_core::{BlockKey, StorageNodeId, StoreConfig, SwaConfig, TrafficClass};
    let store = StoreConfig {
        storage_nodes: 12,
        ..Default::default()
    };
    let mut sh = servelab_core::unit::SharedCache::new(store, SwaConfig::default(), 100).unwrap();
    sh.store
        .put(Nanos(1), BlockKey(5), 100, TrafficClass::Agent);
    for n in 0..3 {
        sh.store
            .owned_mut()
            .expect("a unit alone owns its store")
            .fail_node(Nanos(2), StorageNodeId(n));
    }
    let mut c = Checker::new(2);
    c.arrival(Nanos(3), 1);
    c.fetch(Nanos(3), 1, &[BlockKey(5)], &sh);
    let v = c.violation.take().unwrap();
    assert!(
        v.contains("reads block") && v.contains("lost its objects"),
        "{v}"
    );
}
