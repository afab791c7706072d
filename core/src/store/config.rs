//! The store's configuration (SPEC §7): capacity and GC, TTLs, the storage cluster (servers,
//! erasure coding) and its failure schedule, with the checks that name the field at fault.
//!
//! Keys, under the service's `[store]` table (all optional; the defaults are SPEC §7's):
//!
//! ```toml
//! [service.store]
//! storage_nodes = 180                 # servers in the cluster
//! ec_data_shards = 10                 # 10 + 2 erasure coding over 12 consecutive nodes
//! ec_parity_shards = 2
//! gc = "global-lru"                   # or "per-node-lru": a GC worker on every node
//! high_watermark = 0.95               # of capacity_bytes (global) or of a node (per node)
//! low_watermark = 0.90
//! # capacity_bytes = 1_000_000_000    # logical bytes, global GC only
//!
//! [service.store.node]                # the recommended server
//! ssds = 20
//! ssd_bytes = 30_730_000_000_000      # 30.73 TB: a node holds 614.6 TB of shards
//! write_bytes_per_s = 5.0e9           # reads: fetch.node_read_bytes_per_s (40 GB/s)
//! charge_writes = true                # write-back occupies the nodes it writes to
//!
//! [[service.store.failures]]          # scheduled: these nodes fail together
//! nodes = [17, 18, 19]                # (or node = 17)
//! at = "300s"
//! repair_at = "900s"                  # a replacement starts rebuilding; absent = never
//!
//! [service.store.random_failures]     # every server, independently
//! mtbf = "30d"                        # mean time between failures (exponential)
//! mttr = "2h"                         # mean time to repair, until the rebuild starts
//!
//! [service.store.rebuild]
//! chunk_bytes = 67_108_864            # a rebuild moves this much per round
//! ```

use crate::error::ConfigError;
use crate::request::TrafficClass;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

/// The most storage nodes a store accounts for (a byte counter each): far beyond the 180 of
/// SPEC §7, small enough that a mistyped count cannot take the machine's memory.
pub const MAX_STORAGE_NODES: u32 = 1 << 20;

/// TTL per traffic class; a missing class never expires.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassTtl {
    #[serde(default)]
    pub agent: Option<Nanos>,
    #[serde(default)]
    pub chat: Option<Nanos>,
    #[serde(default)]
    pub other: Option<Nanos>,
}

impl ClassTtl {
    /// SPEC §7: 3 days for agent traffic, 7 days for chat. The brief is silent on other traffic
    /// (documents): 3 days, the cheaper of the two.
    pub fn published() -> Self {
        ClassTtl {
            agent: Some(Nanos::from_secs(3 * 86_400)),
            chat: Some(Nanos::from_secs(7 * 86_400)),
            other: Some(Nanos::from_secs(3 * 86_400)),
        }
    }
    pub fn none() -> Self {
        ClassTtl {
            agent: None,
            chat: None,
            other: None,
        }
    }
    pub fn uniform(ttl: Option<Nanos>) -> Self {
        ClassTtl {
            agent: ttl,
            chat: ttl,
            other: ttl,
        }
    }
    pub fn get(&self, class: TrafficClass) -> Option<Nanos> {
        match class {
            TrafficClass::Agent => self.agent,
            TrafficClass::Chat => self.chat,
            TrafficClass::Other => self.other,
        }
    }
}

impl Default for ClassTtl {
    fn default() -> Self {
        Self::published()
    }
}

/// What a TTL counts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TtlFrom {
    /// Every read or write restarts the clock (a block in constant use never expires).
    #[default]
    LastAccess,
    /// Only writes set the clock (file-age TTL on the storage side).
    Write,
}

/// Which garbage collector bounds the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum GcPolicy {
    /// One LRU over the whole store, bounded by `capacity_bytes` (logical bytes; unbounded
    /// when absent). The default: the trace-level replay, the miss-ratio curves and every
    /// shipped config are defined by one logical capacity.
    #[default]
    GlobalLru,
    /// A GC worker on every storage node (SPEC §7): past the high watermark of *that node's*
    /// capacity (`node`, physical bytes of shards), it evicts the least recently used objects
    /// with a shard on the node until the node is back at the low watermark. An evicted
    /// object is deleted from all the nodes of its group.
    PerNodeLru,
}

/// One storage server of the cluster (SPEC §7's recommended server by default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageNodeConfig {
    pub ssds: u32,
    pub ssd_bytes: u64,
    /// Write bandwidth of one node available to this unit: the write-back of prefill blocks
    /// and of every finished reply, and the rebuild of a replaced node, take their bytes
    /// over it, in the same queue as the node's reads.
    pub write_bytes_per_s: f64,
    /// Whether writes occupy the nodes (off: writes are free, as before they were modelled).
    pub charge_writes: bool,
}

impl Default for StorageNodeConfig {
    fn default() -> Self {
        StorageNodeConfig {
            ssds: 20,
            ssd_bytes: 30_730_000_000_000,
            write_bytes_per_s: 5e9,
            charge_writes: true,
        }
    }
}

impl StorageNodeConfig {
    /// Physical bytes one node holds (`ssds × ssd_bytes`; saturating, validation rejects an
    /// overflow).
    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.ssds).saturating_mul(self.ssd_bytes)
    }
}

/// Storage nodes that fail together at `at` and, unless `repair_at` is absent, get a
/// replacement at `repair_at`, which then rebuilds their shards from the survivors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduledFailure {
    /// One node (or use `nodes`).
    #[serde(default)]
    pub node: Option<u32>,
    #[serde(default)]
    pub nodes: Vec<u32>,
    pub at: Nanos,
    #[serde(default)]
    pub repair_at: Option<Nanos>,
}

impl ScheduledFailure {
    /// The nodes that fail, `node` or `nodes`.
    pub fn failed_nodes(&self) -> Vec<u32> {
        match self.node {
            Some(n) => vec![n],
            None => self.nodes.clone(),
        }
    }
}

/// Independent failures of every server: exponential times between failures (mean `mtbf`,
/// counted from the previous repair) and to repair (mean `mttr`), drawn from the run's
/// `"store.failures"` sub-seed. SPEC §7: compute nodes fail more than 10× as often as storage
/// nodes, so a storage `mtbf` should be more than 10× the GPUs'.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFailures {
    pub mtbf: Nanos,
    pub mttr: Nanos,
}

/// How a replaced node's shards are rebuilt: in rounds of `chunk_bytes` (of the new node's
/// shards), each reading from the survivors of every group it rebuilds and writing to the new
/// node, so reads queue between rounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RebuildConfig {
    pub chunk_bytes: u64,
}

impl Default for RebuildConfig {
    fn default() -> Self {
        RebuildConfig {
            chunk_bytes: 64 << 20,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Logical KV bytes the store may hold (before erasure coding); absent = unbounded.
    pub capacity_bytes: Option<u64>,
    /// GC starts evicting in LRU order when usage exceeds this share of capacity…
    pub high_watermark: f64,
    /// …and stops when usage is back at or below this share.
    pub low_watermark: f64,
    pub ttl: ClassTtl,
    pub ttl_from: TtlFrom,
    /// Storage nodes in the cluster (100 PiB / 20 × 30.73 TB ≈ 180 servers).
    pub storage_nodes: u32,
    pub ec_data_shards: u32,
    pub ec_parity_shards: u32,
    pub gc: GcPolicy,
    pub node: StorageNodeConfig,
    /// Scheduled node failures (in any order; a node's failures may not overlap).
    pub failures: Vec<ScheduledFailure>,
    pub random_failures: Option<RandomFailures>,
    pub rebuild: RebuildConfig,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            capacity_bytes: None,
            high_watermark: 0.95,
            low_watermark: 0.90,
            ttl: ClassTtl::published(),
            ttl_from: TtlFrom::LastAccess,
            storage_nodes: 180,
            ec_data_shards: 10,
            ec_parity_shards: 2,
            gc: GcPolicy::GlobalLru,
            node: StorageNodeConfig::default(),
            failures: Vec::new(),
            random_failures: None,
            rebuild: RebuildConfig::default(),
        }
    }
}

impl StoreConfig {
    /// Checks every key; an error names the field (`store.failures[2].node`).
    pub fn validate(&self, block_bytes: u64) -> Result<(), ConfigError> {
        self.validate_shape(block_bytes)?;
        self.validate_ttl()?;
        self.validate_node(block_bytes)?;
        self.validate_failures()
    }

    /// Watermarks, capacity, node count and erasure coding.
    fn validate_shape(&self, block_bytes: u64) -> Result<(), ConfigError> {
        if !(self.low_watermark > 0.0
            && self.low_watermark <= self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return bad(
                "high_watermark",
                format!(
                    "need 0 < low_watermark ({}) <= high_watermark ({}) <= 1",
                    self.low_watermark, self.high_watermark
                ),
            );
        }
        if let Some(cap) = self.capacity_bytes
            && cap < block_bytes
        {
            return bad(
                "capacity_bytes",
                format!("{cap} bytes cannot hold one block of {block_bytes} bytes"),
            );
        }
        if self.ec_data_shards == 0 {
            return bad("ec_data_shards", "must be positive".into());
        }
        if self.storage_nodes == 0 {
            return bad(
                "storage_nodes",
                "a store needs storage nodes (at least one erasure-coded group)".into(),
            );
        }
        if self.storage_nodes > MAX_STORAGE_NODES {
            return bad(
                "storage_nodes",
                format!(
                    "{} nodes is more than the {MAX_STORAGE_NODES} the store accounts for \
                     (one byte counter per node)",
                    self.storage_nodes
                ),
            );
        }
        let Some(group) = self.ec_data_shards.checked_add(self.ec_parity_shards) else {
            return bad(
                "ec_parity_shards",
                format!(
                    "{} data + {} parity shards overflows",
                    self.ec_data_shards, self.ec_parity_shards
                ),
            );
        };
        if self.storage_nodes < group {
            return bad(
                "storage_nodes",
                format!(
                    "{} nodes cannot hold a {group}-node erasure-coded group",
                    self.storage_nodes
                ),
            );
        }
        Ok(())
    }

    fn validate_ttl(&self) -> Result<(), ConfigError> {
        for class in TrafficClass::ALL {
            let field = format!("ttl.{}", class.name());
            match self.ttl.get(class) {
                Some(Nanos::ZERO) => {
                    return bad(
                        &field,
                        "a zero TTL would expire blocks as they are written".into(),
                    );
                }
                Some(t) if t > Nanos::HORIZON => {
                    return bad(
                        &field,
                        format!(
                            "{t} is beyond the horizon of 146 years: leave the class out for \
                             blocks that never expire"
                        ),
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The server, the GC that uses it and the rebuild rounds.
    fn validate_node(&self, block_bytes: u64) -> Result<(), ConfigError> {
        let n = &self.node;
        if n.ssds == 0 || n.ssd_bytes == 0 {
            let f = if n.ssds == 0 {
                "node.ssds"
            } else {
                "node.ssd_bytes"
            };
            return bad(f, "must be positive".into());
        }
        if u64::from(n.ssds).checked_mul(n.ssd_bytes).is_none() {
            return bad(
                "node.ssd_bytes",
                format!("{} SSDs of {} bytes overflow 64 bits", n.ssds, n.ssd_bytes),
            );
        }
        if !(n.write_bytes_per_s.is_finite() && n.write_bytes_per_s > 0.0) {
            return bad("node.write_bytes_per_s", "must be positive".into());
        }
        if self.gc == GcPolicy::PerNodeLru {
            if self.capacity_bytes.is_some() {
                return bad(
                    "capacity_bytes",
                    "the per-node GC bounds every node by store.node (ssds × ssd_bytes); leave \
                     capacity_bytes out or use gc = \"global-lru\""
                        .into(),
                );
            }
            let share = block_bytes.div_ceil(u64::from(self.ec_data_shards));
            if share > n.capacity_bytes() {
                return bad(
                    "node.ssd_bytes",
                    format!(
                        "a node of {} bytes cannot hold one block's shard of {share} bytes",
                        n.capacity_bytes()
                    ),
                );
            }
        }
        if self.rebuild.chunk_bytes == 0 {
            return bad("rebuild.chunk_bytes", "must be positive".into());
        }
        Ok(())
    }

    /// Scheduled failures name existing nodes, each once, repair after they fail and do not
    /// overlap another failure of the same node; random failures have positive means.
    fn validate_failures(&self) -> Result<(), ConfigError> {
        let n = self.storage_nodes;
        // (node, at, repair_at, entry) of every scheduled failure, to find overlaps.
        let mut spans: Vec<(u32, Nanos, Nanos, usize)> = Vec::new();
        for (i, f) in self.failures.iter().enumerate() {
            let (nodes, end) = failure_span(i, f, n)?;
            spans.extend(nodes.iter().map(|&node| (node, f.at, end, i)));
        }
        check_overlaps(spans)?;
        if let Some(r) = &self.random_failures {
            for (k, v) in [("mtbf", r.mtbf), ("mttr", r.mttr)] {
                if v == Nanos::ZERO || v > Nanos::HORIZON {
                    return bad(
                        &format!("random_failures.{k}"),
                        format!("{v}: must be positive and within the horizon of 146 years"),
                    );
                }
            }
        }
        Ok(())
    }

    /// Physical bytes on SSD per logical byte (12 / 10 with 10+2 coding).
    pub fn ec_overhead(&self) -> f64 {
        f64::from(self.ec_data_shards + self.ec_parity_shards) / f64::from(self.ec_data_shards)
    }

    /// Nodes of one erasure-coded group (`data + parity`).
    pub fn group_nodes(&self) -> u32 {
        self.ec_data_shards + self.ec_parity_shards
    }

    /// Whether the config schedules or draws any node failure.
    pub fn has_failures(&self) -> bool {
        !self.failures.is_empty() || self.random_failures.is_some()
    }
}

fn bad<T>(field: &str, why: String) -> Result<T, ConfigError> {
    Err(ConfigError::invalid(format!("store.{field}"), why))
}

/// Checks scheduled failure `i` on a cluster of `n` nodes; returns the nodes it fails and
/// when they are repaired ([`Nanos::NEVER`] without a repair).
fn failure_span(i: usize, f: &ScheduledFailure, n: u32) -> Result<(Vec<u32>, Nanos), ConfigError> {
    let field = |k: &str| format!("failures[{i}].{k}");
    let nodes = match (f.node, f.nodes.is_empty()) {
        (Some(_), false) => {
            return bad(&field("nodes"), "give node or nodes, not both".into());
        }
        (None, true) => return bad(&field("nodes"), "names no node".into()),
        _ => f.failed_nodes(),
    };
    if nodes.len() as u64 > u64::from(n) {
        return bad(
            &field("nodes"),
            format!("{} failures but the cluster has {n} nodes", nodes.len()),
        );
    }
    for (k, &node) in nodes.iter().enumerate() {
        let key = if f.node.is_some() {
            field("node")
        } else {
            field(&format!("nodes[{k}]"))
        };
        if node >= n {
            return bad(
                &key,
                format!("node {node} does not exist (storage_nodes = {n}: 0..{n})"),
            );
        }
        if nodes[..k].contains(&node) {
            return bad(&key, format!("node {node} is named twice"));
        }
    }
    if f.at > Nanos::HORIZON {
        return bad(
            &field("at"),
            format!("{} is beyond the horizon of 146 years", f.at),
        );
    }
    let end = match f.repair_at {
        Some(r) if r <= f.at => {
            return bad(
                &field("repair_at"),
                format!("repair at {r} is not after the failure at {}", f.at),
            );
        }
        Some(r) if r > Nanos::HORIZON => {
            return bad(
                &field("repair_at"),
                format!("{r} is beyond the horizon of 146 years"),
            );
        }
        Some(r) => r,
        None => Nanos::NEVER,
    };
    Ok((nodes, end))
}

/// Checks that no scheduled failure of a node starts while an earlier one still holds it
/// down; `spans` are (node, at, repair_at, entry).
fn check_overlaps(mut spans: Vec<(u32, Nanos, Nanos, usize)>) -> Result<(), ConfigError> {
    spans.sort_unstable();
    for w in spans.windows(2) {
        let ((node, _, end, i), (next_node, at, _, j)) = (w[0], w[1]);
        if node == next_node && at < end {
            return bad(
                &format!("failures[{j}].at"),
                format!(
                    "node {node} fails at {at} while still down from failures[{i}] (until {})",
                    if end.is_never() {
                        "never repaired".to_string()
                    } else {
                        end.to_string()
                    }
                ),
            );
        }
    }
    Ok(())
}
