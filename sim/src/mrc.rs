//! One-pass hit-rate curves of the block store: the token and block hit rate of a trace at every
//! store capacity (LRU stack distances) and at every TTL (reuse times), per traffic class.
//!
//! # What the curves mean
//!
//! The curves describe exactly what [`crate::replay::block_replay`] measures, for two store
//! configurations:
//!
//! - **capacity**: an LRU store of `C` blocks with no TTL and watermarks 1.0 / 1.0 (a write into
//!   a full store evicts exactly the least recently used block). With the default watermarks
//!   (evict from 95 % down to 90 %) the store holds a varying number of blocks, so no single
//!   stack distance decides a hit and the curve does not apply exactly;
//! - **TTL**: an unbounded store where every block lives `T` after its last access (a touch or a
//!   write; lookups do not count), the same `T` for every class.
//!
//! A request looks up its prompt's full blocks and its partial tail block, hits on the leading
//! run found, then touches them all in order (and its output blocks, if outputs are cached).
//! Because the hit is a *leading run*, a block counts as hit at capacity `C` only if every block
//! before it in the same prompt is also held: the distance that decides it is the running
//! maximum of the prompt's stack distances (likewise the running maximum of its reuse times).
//! Every lookup of a request is answered from the store as it was before the request, so all its
//! distances are taken before any of its touches.
//!
//! # How
//!
//! A block's stack distance (its position in the LRU order, 1 = most recent) is the number of
//! distinct blocks accessed since its last access, itself included. [`LruStack`] keeps a Fenwick
//! tree over access times with a 1 at each block's last access, so a distance is one prefix sum
//! and an access two point updates: O(log n) each, O(n log n) for the trace, where a list walk
//! would be O(n · m). Reuse times come from the same map (key → last access position and time).
//!
//! # Sampling
//!
//! For traces too large for one map entry per distinct block, [`Sampler`] keeps a block only if
//! a hash of its key falls below a threshold (SHARDS-style spatial sampling, rate `R`): every
//! access to a kept block is seen, none to the others. A stack distance among the kept blocks
//! estimates the true one times `R`, so a kept block hits at capacity `C` when its distance is at
//! most `C · R`. Rates are ratios over the kept blocks (tokens or blocks hit over tokens or blocks
//! looked up). The running maximum within a prompt is then taken over its kept blocks only; since
//! a prompt touches its blocks in order, an earlier block of a prompt is at most a few positions
//! further down the LRU order than a later one, so the error this adds is a few blocks of
//! distance. Reuse times need no scaling.
//!
//! Spatial sampling samples keys, not accesses: when a few keys carry much of the trace's hits
//! (every Mooncake prompt starts with the same 512-token block), whether the hash keeps them
//! shifts the whole curve by their share. The error is therefore measured against an unsampled
//! pass wherever both fit (`servelab mrc` does so by default).

use servelab_core::content::{hash2, mix64};
use servelab_core::{BlockKey, ConfigError, Nanos, Request, TrafficClass};
use servelab_workloads::Trace;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Keys are already uniform hashes: one SplitMix finaliser spreads them over the map instead of
/// SipHash (most of the pass is map probes).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; this keeps the hasher correct for any input.
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = mix64(x);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// Fenwick (binary indexed) tree of counts over positions `0..len`.
#[derive(Clone, Debug, Default)]
struct Fenwick {
    /// 1-based: `tree[i]` sums positions `(i - lowbit(i), i]` of the 1-based array.
    tree: Vec<u32>,
}

impl Fenwick {
    /// A tree whose first `ones` positions hold 1 and the rest 0, built in O(len).
    fn with_leading_ones(len: usize, ones: usize) -> Self {
        let mut tree = vec![0u32; len + 1];
        for t in tree.iter_mut().skip(1).take(ones) {
            *t = 1;
        }
        for i in 1..=len {
            let j = i + (i & i.wrapping_neg());
            if j <= len {
                tree[j] += tree[i];
            }
        }
        Fenwick { tree }
    }
    fn len(&self) -> usize {
        self.tree.len().saturating_sub(1)
    }
    fn add(&mut self, pos: usize, delta: i32) {
        let mut i = pos + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }
    /// Sum over positions `0..=pos`.
    fn prefix(&self, pos: usize) -> u32 {
        let mut i = pos + 1;
        let mut s = 0u32;
        while i > 0 {
            s += self.tree[i];
            i &= i - 1;
        }
        s
    }
}

/// A block's last access: its position in the access sequence and its time.
#[derive(Clone, Copy, Debug)]
struct Last {
    pos: u32,
    time: Nanos,
}

/// What the stack knows of a block that was accessed before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Stack distance: 1 + the number of distinct blocks accessed since this one's last access.
    /// An LRU store of `C` blocks holds the block exactly when `distance <= C`.
    pub distance: u64,
    /// Time of the last access.
    pub last: Nanos,
}

/// LRU stack distances and last-access times in O(log n) per access.
///
/// Positions are access numbers; the tree holds a 1 at every block's last access, so the blocks
/// accessed at or after a position are `live − prefix(pos − 1)`. When positions run out the live
/// ones are renumbered densely (keeping their order), so memory stays proportional to the
/// number of distinct blocks, not to the trace length.
#[derive(Clone, Debug)]
pub struct LruStack {
    map: KeyMap<Last>,
    tree: Fenwick,
    /// Which positions are some block's last access (rebuilt on renumbering).
    live_pos: Vec<u64>,
    clock: u32,
    live: u32,
}

impl Default for LruStack {
    fn default() -> Self {
        Self::new()
    }
}

impl LruStack {
    const MIN_POSITIONS: usize = 1024;

    pub fn new() -> Self {
        Self::with_positions(Self::MIN_POSITIONS)
    }

    /// A stack with room for `n` accesses before its first renumbering (a hint).
    pub fn with_positions(n: usize) -> Self {
        let n = n.max(Self::MIN_POSITIONS);
        LruStack {
            map: KeyMap::default(),
            tree: Fenwick::with_leading_ones(n, 0),
            live_pos: vec![0; n.div_ceil(64)],
            clock: 0,
            live: 0,
        }
    }

    /// Distinct blocks seen so far.
    pub fn distinct(&self) -> u64 {
        u64::from(self.live)
    }

    /// The block's stack distance and last access time, or None if it was never accessed.
    #[inline]
    pub fn lookup(&self, key: BlockKey) -> Option<Seen> {
        let l = self.map.get(&key.0)?;
        // Blocks whose last access is at or after `l.pos`: all live ones minus those before.
        let before = if l.pos == 0 {
            0
        } else {
            self.tree.prefix(l.pos as usize - 1)
        };
        Some(Seen {
            distance: u64::from(self.live - before),
            last: l.time,
        })
    }

    /// Records an access of `key` at `now` (it becomes the most recent block).
    #[inline]
    pub fn access(&mut self, key: BlockKey, now: Nanos) {
        if self.clock as usize == self.tree.len() {
            self.renumber();
        }
        let pos = self.clock;
        self.clock += 1;
        match self.map.get_mut(&key.0) {
            Some(l) => {
                let old = l.pos as usize;
                l.pos = pos;
                l.time = now;
                self.tree.add(old, -1);
                self.live_pos[old / 64] &= !(1 << (old % 64));
            }
            None => {
                self.map.insert(key.0, Last { pos, time: now });
                self.live += 1;
            }
        }
        self.tree.add(pos as usize, 1);
        self.live_pos[pos as usize / 64] |= 1 << (pos % 64);
    }

    /// Renumbers the live positions 0..live in order and leaves room for as many accesses again
    /// (amortised O(1) per access). The new numbers are a function of the old ones only, so the
    /// map's iteration order decides nothing.
    #[cold]
    fn renumber(&mut self) {
        let old_len = self.tree.len();
        let mut remap = vec![u32::MAX; old_len];
        let mut next = 0u32;
        for (w, &word) in self.live_pos.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                remap[w * 64 + b] = next;
                next += 1;
            }
        }
        debug_assert_eq!(next, self.live);
        for l in self.map.values_mut() {
            l.pos = remap[l.pos as usize];
        }
        let live = self.live as usize;
        let len = (2 * live).max(Self::MIN_POSITIONS);
        self.tree = Fenwick::with_leading_ones(len, live);
        self.live_pos = vec![0; len.div_ceil(64)];
        for p in 0..live {
            self.live_pos[p / 64] |= 1 << (p % 64);
        }
        self.clock = self.live;
    }
}

/// SHARDS-style spatial sampling: a block is kept when a hash of its key is below a threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampler {
    /// Kept when the top [`Sampler::BITS`] bits of the hash are below this.
    threshold: u64,
}

impl Sampler {
    /// Resolution of the rate: 2^-24.
    pub const BITS: u32 = 24;
    const SCALE: u64 = 1 << Self::BITS;
    /// Salt so the sample is independent of any other use of the same hash of the key.
    const SALT: u64 = 0x5a4d_5243_5348_5244;

    /// Keeps about `rate` of all blocks (0 < rate ≤ 1, at least 2^-24).
    pub fn new(rate: f64) -> Result<Self, ConfigError> {
        if !(rate.is_finite() && rate > 0.0 && rate <= 1.0) {
            return Err(ConfigError::invalid(
                "sample_rate",
                format!("{rate} is not in (0, 1]"),
            ));
        }
        let threshold = (rate * Self::SCALE as f64).round() as u64;
        if threshold == 0 {
            return Err(ConfigError::invalid(
                "sample_rate",
                format!("{rate} is below the sampler's resolution of 2^-24"),
            ));
        }
        Ok(Sampler { threshold })
    }
    /// Keeps every block.
    pub fn all() -> Self {
        Sampler {
            threshold: Self::SCALE,
        }
    }
    /// The rate actually used (the requested one rounded to a multiple of 2^-24).
    pub fn rate(&self) -> f64 {
        self.threshold as f64 / Self::SCALE as f64
    }
    pub fn is_exact(&self) -> bool {
        self.threshold == Self::SCALE
    }
    #[inline]
    pub fn keeps(&self, key: BlockKey) -> bool {
        self.is_exact() || (mix64(key.0 ^ Self::SALT) >> (64 - Self::BITS)) < self.threshold
    }
    /// The largest sampled stack distance that still hits at `capacity_blocks`:
    /// floor(capacity × rate), in integers so the unsampled curve is exact.
    pub fn scaled_capacity(&self, capacity_blocks: u64) -> u64 {
        ((u128::from(capacity_blocks) * u128::from(self.threshold)) >> Self::BITS) as u64
    }
}

/// Options of a one-pass run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MrcOptions {
    /// Share of blocks kept by spatial sampling (1.0: every block, exact curves).
    pub sample_rate: f64,
    /// Also touch each request's output blocks after its prompt, as
    /// `block_replay(.., cache_outputs = true)` does.
    pub cache_outputs: bool,
}

impl Default for MrcOptions {
    fn default() -> Self {
        MrcOptions {
            sample_rate: 1.0,
            cache_outputs: false,
        }
    }
}

/// Counts of one class while the pass runs.
#[derive(Clone, Debug, Default)]
struct ClassBins {
    requests: u64,
    input_tokens: u64,
    blocks: u64,
    counted_tokens: u64,
    counted_blocks: u64,
    /// Tokens and blocks whose deciding (running-maximum) stack distance is the index.
    dist_tokens: Vec<u64>,
    dist_blocks: Vec<u64>,
    /// (deciding reuse time, tokens, blocks), runs of equal times within a request merged.
    reuse: Vec<(Nanos, u64, u64)>,
}

impl ClassBins {
    fn add_distance(&mut self, d: u64, tokens: u64) {
        let d = d as usize;
        if d >= self.dist_tokens.len() {
            let n = (d + 1).max(2 * self.dist_tokens.len());
            self.dist_tokens.resize(n, 0);
            self.dist_blocks.resize(n, 0);
        }
        self.dist_tokens[d] += tokens;
        self.dist_blocks[d] += 1;
    }

    /// Adds one block of `tokens` at deciding reuse time `t`, merged into the last run when
    /// that has the same time.
    #[inline]
    fn add_reuse(&mut self, t: Nanos, tokens: u64) {
        match self.reuse.last_mut() {
            Some((last, tok, blk)) if *last == t => {
                *tok += tokens;
                *blk += 1;
            }
            _ => self.reuse.push((t, tokens, 1)),
        }
    }
}

/// The one-pass computation, fed one request at a time in arrival order (sans-IO: the caller
/// reads the trace).
#[derive(Clone, Debug)]
pub struct OnePass {
    opts: MrcOptions,
    sampler: Sampler,
    block_tokens: u32,
    stack: LruStack,
    bins: [ClassBins; 3],
    keys: Vec<BlockKey>,
    /// Per kept key of the current prompt: (index in the prompt, lookup result).
    seen: Vec<(usize, Option<Seen>)>,
    accesses: u64,
}

impl OnePass {
    const UNCOVERED_SALT: u64 = 0x7a11_70ce_0000_0001;

    pub fn new(block_tokens: u32, opts: MrcOptions) -> Result<Self, ConfigError> {
        if block_tokens == 0 {
            return Err(ConfigError::invalid("block_tokens", "must be positive"));
        }
        Ok(OnePass {
            sampler: Sampler::new(opts.sample_rate)?,
            opts,
            block_tokens,
            stack: LruStack::new(),
            bins: Default::default(),
            keys: Vec::new(),
            seen: Vec::new(),
            accesses: 0,
        })
    }

    /// Accesses of kept blocks so far (lookups not counted).
    pub fn accesses(&self) -> u64 {
        self.accesses
    }

    /// Adds one request (requests must come in arrival order).
    pub fn push(&mut self, req: &Request) {
        let now = req.arrival;
        self.keys.clear();
        self.keys.extend_from_slice(req.prompt_blocks());
        self.keys.extend(req.tail_key());
        // Every lookup sees the store as it was before this request: all of them first.
        self.seen.clear();
        for (i, &k) in self.keys.iter().enumerate() {
            if self.sampler.keeps(k) {
                self.seen.push((i, self.stack.lookup(k)));
            }
        }
        self.count_prompt(req);
        self.access_kept(now);
        if self.opts.cache_outputs {
            // The same blocks as `block_replay` writes back: full output blocks and the partial
            // block at the end of the context.
            self.keys.clear();
            self.keys.extend_from_slice(req.output_blocks());
            if !req.context_tokens().is_multiple_of(self.block_tokens) {
                self.keys.extend(req.key_at(req.context_tokens()));
            }
            self.access_kept(now);
        }
    }

    /// Counts the prompt in `keys` into its class's bins, from the lookups in `seen`: each kept
    /// block of the leading run of hits at its deciding stack distance and reuse time.
    #[inline]
    fn count_prompt(&mut self, req: &Request) {
        let now = req.arrival;
        let bs = u64::from(self.block_tokens);
        let len = u64::from(req.prompt_tokens);
        let b = &mut self.bins[req.class.index()];
        b.requests += 1;
        b.input_tokens += len;
        b.blocks += self.keys.len() as u64;
        let (mut max_dist, mut max_reuse) = (0u64, Nanos::ZERO);
        let mut cold = false;
        for &(i, s) in &self.seen {
            // A hit covers min(block × run, L) tokens: this block adds the part up to L.
            let i = i as u64;
            let tokens = (bs * (i + 1)).min(len) - (bs * i).min(len);
            b.counted_tokens += tokens;
            b.counted_blocks += 1;
            // A block never seen before misses at any capacity and TTL, and so does every block
            // after it in the leading run.
            match s {
                Some(s) if !cold => {
                    max_dist = max_dist.max(s.distance);
                    max_reuse = max_reuse.max(now.saturating_sub(s.last));
                    b.add_distance(max_dist, tokens);
                    b.add_reuse(max_reuse, tokens);
                }
                _ => cold = true,
            }
        }
        // Tokens past the last key (a prompt ending inside a segment has no key for its tail)
        // are looked up by no block and never hit, but they count as input. Sampled runs count
        // them when a per-request pseudo key is kept, so the ratio estimate stays unbiased.
        let covered = (bs * self.keys.len() as u64).min(len);
        if covered < len
            && self
                .sampler
                .keeps(BlockKey(hash2(req.id.0, Self::UNCOVERED_SALT)))
        {
            b.counted_tokens += len - covered;
        }
    }

    /// Accesses every kept key of `keys`, in order, at `now`.
    #[inline]
    fn access_kept(&mut self, now: Nanos) {
        for i in 0..self.keys.len() {
            let k = self.keys[i];
            if self.sampler.keeps(k) {
                self.stack.access(k, now);
                self.accesses += 1;
            }
        }
    }

    pub fn finish(self) -> Curves {
        let mut classes = Vec::new();
        let mut all = ClassBins::default();
        for (c, b) in TrafficClass::ALL.into_iter().zip(self.bins) {
            if b.requests == 0 {
                continue;
            }
            all.requests += b.requests;
            all.input_tokens += b.input_tokens;
            all.blocks += b.blocks;
            all.counted_tokens += b.counted_tokens;
            all.counted_blocks += b.counted_blocks;
            if all.dist_tokens.len() < b.dist_tokens.len() {
                all.dist_tokens.resize(b.dist_tokens.len(), 0);
                all.dist_blocks.resize(b.dist_blocks.len(), 0);
            }
            for (i, (&t, &k)) in b.dist_tokens.iter().zip(&b.dist_blocks).enumerate() {
                all.dist_tokens[i] += t;
                all.dist_blocks[i] += k;
            }
            all.reuse.extend_from_slice(&b.reuse);
            classes.push(ClassCurve::from_bins(Some(c), b));
        }
        Curves {
            block_tokens: self.block_tokens,
            sampler: self.sampler,
            distinct_blocks: self.stack.distinct(),
            all: ClassCurve::from_bins(None, all),
            classes,
        }
    }
}

/// Both curves of one traffic class (or of all requests).
#[derive(Clone, Debug, PartialEq)]
pub struct ClassCurve {
    /// None: every request.
    pub class: Option<TrafficClass>,
    pub requests: u64,
    pub input_tokens: u64,
    /// Blocks looked up (full prompt blocks plus partial tails).
    pub blocks: u64,
    /// Tokens and blocks of the sampled keys (all of them without sampling): the rates'
    /// denominators.
    pub counted_tokens: u64,
    pub counted_blocks: u64,
    /// Cumulative: tokens and blocks hit with a deciding (sampled) distance ≤ the index.
    cum_dist_tokens: Vec<u64>,
    cum_dist_blocks: Vec<u64>,
    /// Distinct deciding reuse times, ascending, with cumulative tokens and blocks up to each.
    reuse: Vec<(Nanos, u64, u64)>,
}

/// Hits at one capacity or TTL.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Hit tokens and blocks among the counted (sampled) keys: exact hit counts when unsampled.
    pub hit_tokens: u64,
    pub hit_blocks: u64,
    pub token_hit_rate: f64,
    pub block_hit_rate: f64,
}

impl ClassCurve {
    fn from_bins(class: Option<TrafficClass>, mut b: ClassBins) -> Self {
        let mut acc = (0, 0);
        for (t, k) in b.dist_tokens.iter_mut().zip(b.dist_blocks.iter_mut()) {
            acc = (acc.0 + *t, acc.1 + *k);
            (*t, *k) = acc;
        }
        // Trim the tail the doubling growth left with nothing in it.
        let keep = b
            .dist_blocks
            .iter()
            .rposition(|&k| k != acc.1)
            .map_or(1, |i| i + 2)
            .min(b.dist_blocks.len());
        b.dist_tokens.truncate(keep);
        b.dist_blocks.truncate(keep);
        b.reuse.sort_unstable_by_key(|r| r.0);
        let mut reuse: Vec<(Nanos, u64, u64)> = Vec::new();
        let (mut t, mut k) = (0, 0);
        for (time, tok, blk) in b.reuse {
            t += tok;
            k += blk;
            match reuse.last_mut() {
                Some(last) if last.0 == time => *last = (time, t, k),
                _ => reuse.push((time, t, k)),
            }
        }
        ClassCurve {
            class,
            requests: b.requests,
            input_tokens: b.input_tokens,
            blocks: b.blocks,
            counted_tokens: b.counted_tokens,
            counted_blocks: b.counted_blocks,
            cum_dist_tokens: b.dist_tokens,
            cum_dist_blocks: b.dist_blocks,
            reuse,
        }
    }

    pub fn name(&self) -> &'static str {
        self.class.map_or("all", TrafficClass::name)
    }

    fn point(&self, hit_tokens: u64, hit_blocks: u64) -> Point {
        Point {
            hit_tokens,
            hit_blocks,
            token_hit_rate: crate::replay::ratio(hit_tokens, self.counted_tokens),
            block_hit_rate: crate::replay::ratio(hit_blocks, self.counted_blocks),
        }
    }

    /// Hits in an LRU store of `sampled_capacity` blocks (a capacity already scaled by the
    /// sampling rate; see [`Curves::at_capacity`]).
    fn at_sampled_capacity(&self, sampled_capacity: u64) -> Point {
        if self.cum_dist_tokens.is_empty() {
            return self.point(0, 0);
        }
        let i = (sampled_capacity as usize).min(self.cum_dist_tokens.len() - 1);
        self.point(self.cum_dist_tokens[i], self.cum_dist_blocks[i])
    }

    /// Hits in an unbounded store whose blocks live `ttl` after their last access: a block is
    /// found when its reuse time is strictly below the TTL (the store deletes an object once
    /// `now ≥ last access + TTL`).
    pub fn at_ttl(&self, ttl: Nanos) -> Point {
        let n = self.reuse.partition_point(|r| r.0 < ttl);
        match n {
            0 => self.point(0, 0),
            n => self.point(self.reuse[n - 1].1, self.reuse[n - 1].2),
        }
    }

    /// Hits with no limit at all (every block seen before is found): the curves' ceiling.
    pub fn unbounded(&self) -> Point {
        match self.reuse.last() {
            Some(&(_, t, k)) => self.point(t, k),
            None => self.point(0, 0),
        }
    }

    /// The largest deciding sampled stack distance: capacities from here on (scaled back by the
    /// rate) hit as an unbounded store does.
    pub fn max_sampled_distance(&self) -> u64 {
        self.cum_dist_tokens.len().saturating_sub(1) as u64
    }

    /// The largest deciding reuse time: TTLs above it hit as an unbounded store does.
    pub fn max_reuse(&self) -> Nanos {
        self.reuse.last().map_or(Nanos::ZERO, |r| r.0)
    }

    /// Every distinct deciding reuse time, ascending: the TTL curve steps just above each.
    pub fn reuse_times(&self) -> impl Iterator<Item = Nanos> + '_ {
        self.reuse.iter().map(|r| r.0)
    }
}

/// The result of a pass: a curve per traffic class present and one over all requests.
#[derive(Clone, Debug, PartialEq)]
pub struct Curves {
    pub block_tokens: u32,
    pub sampler: Sampler,
    /// Distinct blocks kept by the sampler.
    pub distinct_blocks: u64,
    pub all: ClassCurve,
    /// In [`TrafficClass::ALL`] order, only classes with requests.
    pub classes: Vec<ClassCurve>,
}

impl Curves {
    /// `all` followed by the classes.
    pub fn curves(&self) -> impl Iterator<Item = &ClassCurve> {
        std::iter::once(&self.all).chain(&self.classes)
    }
    pub fn class(&self, c: TrafficClass) -> Option<&ClassCurve> {
        self.classes.iter().find(|x| x.class == Some(c))
    }
    /// Hits of `curve`'s requests in a shared LRU store of `capacity_blocks` blocks.
    pub fn at_capacity(&self, curve: &ClassCurve, capacity_blocks: u64) -> Point {
        curve.at_sampled_capacity(self.sampler.scaled_capacity(capacity_blocks))
    }
    /// The estimated capacity (in blocks) past which more capacity adds no hits.
    pub fn saturating_capacity(&self) -> u64 {
        let d = self.all.max_sampled_distance();
        ((u128::from(d) << Sampler::BITS).div_ceil(u128::from(self.sampler.threshold))) as u64
    }
}

/// Runs the pass over a whole trace.
pub fn curves(trace: &Trace, opts: MrcOptions) -> Result<Curves, ConfigError> {
    let mut p = OnePass::new(trace.block_tokens, opts)?;
    for r in &trace.requests {
        p.push(r);
    }
    Ok(p.finish())
}

/// `n` capacities per decade from 1 block up to `max` (and `max` itself), distinct, ascending.
pub fn log_grid(max: u64, per_decade: u32) -> Vec<u64> {
    let max = max.max(1);
    let mut out = Vec::new();
    let steps = (max as f64).log10() * f64::from(per_decade.max(1));
    for i in 0..=steps.ceil() as u64 {
        let v = 10f64.powf(i as f64 / f64::from(per_decade.max(1))).round() as u64;
        let v = v.clamp(1, max);
        if out.last() != Some(&v) {
            out.push(v);
        }
    }
    if out.last() != Some(&max) {
        out.push(max);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::block_replay;
    use proptest::prelude::*;
    use servelab_core::{ChainBuilder, ClassTtl, RequestId, SegmentId, StoreConfig};
    use std::sync::Arc;

    /// The O(n · m) reference: an explicit recency list, most recent first.
    struct NaiveStack(Vec<u64>);
    impl NaiveStack {
        fn distance(&self, k: u64) -> Option<u64> {
            self.0.iter().position(|&x| x == k).map(|p| p as u64 + 1)
        }
        fn access(&mut self, k: u64) {
            if let Some(p) = self.0.iter().position(|&x| x == k) {
                self.0.remove(p);
            }
            self.0.insert(0, k);
        }
    }

    #[test]
    fn fenwick_prefix_sums() {
        let mut f = Fenwick::with_leading_ones(10, 3);
        assert_eq!(f.prefix(0), 1);
        assert_eq!(f.prefix(9), 3);
        f.add(5, 1);
        f.add(0, -1);
        assert_eq!(f.prefix(4), 2);
        assert_eq!(f.prefix(5), 3);
        assert_eq!(f.prefix(9), 3);
    }

    #[test]
    fn distances_by_hand() {
        let mut s = LruStack::new();
        let k = |x| BlockKey(x);
        for x in [1, 2, 3] {
            s.access(k(x), Nanos(x));
        }
        assert_eq!(s.lookup(k(3)).unwrap().distance, 1);
        assert_eq!(s.lookup(k(1)).unwrap().distance, 3);
        s.access(k(1), Nanos(9));
        // Order now 1, 3, 2 (most recent first).
        assert_eq!(s.lookup(k(2)).unwrap().distance, 3);
        assert_eq!(
            s.lookup(k(1)).unwrap(),
            Seen {
                distance: 1,
                last: Nanos(9)
            }
        );
        assert_eq!(s.lookup(k(4)), None);
        assert_eq!(s.distinct(), 3);
    }

    #[test]
    fn sampler_rates() {
        assert!(Sampler::new(0.0).is_err());
        assert!(Sampler::new(1.5).is_err());
        assert!(Sampler::new(f64::NAN).is_err());
        assert!(Sampler::new(1e-9).is_err());
        assert!(Sampler::new(1.0).unwrap().is_exact());
        let s = Sampler::new(0.1).unwrap();
        let kept = (0..100_000u64)
            .filter(|&i| s.keeps(BlockKey(mix64(i))))
            .count();
        // Binomial(100k, 0.1): sd ≈ 95, so ±600 fails only on a broken hash.
        assert!((9_400..=10_600).contains(&kept), "{kept}");
        assert_eq!(Sampler::all().scaled_capacity(77), 77);
        assert_eq!(Sampler::new(0.5).unwrap().scaled_capacity(77), 38);
    }

    #[test]
    fn log_grid_shape() {
        assert_eq!(log_grid(1, 10), vec![1]);
        let g = log_grid(1000, 3);
        assert_eq!(g, vec![1, 2, 5, 10, 22, 46, 100, 215, 464, 1000]);
        assert!(g.windows(2).all(|w| w[0] < w[1]));
    }

    /// A trace of `reqs` (chain, prompt tokens, output tokens, class, gap ms) over a few chains
    /// sharing leading segments, so prompts share prefixes at and between block boundaries.
    fn trace(block: u32, reqs: &[(usize, u32, u32, u8, u64)]) -> Trace {
        let seg = |ids: &[(u64, u32)]| {
            let mut b = ChainBuilder::new(block);
            for &(id, t) in ids {
                b.push(SegmentId(id), t);
            }
            Arc::new(b.finish())
        };
        let chains = [
            seg(&[(1, 300), (2, 500), (3, 900)]),
            seg(&[(1, 300), (2, 500), (4, 700)]),
            seg(&[(1, 300), (5, 1400)]),
            seg(&[(6, 64), (7, 1600)]),
            seg(&[(8, 1700)]),
        ];
        let mut now = 0;
        let requests = reqs
            .iter()
            .enumerate()
            .map(|(i, &(c, p, o, class, gap))| {
                now += gap;
                let chain = chains[c % chains.len()].clone();
                let total = chain.total_tokens();
                let p = 1 + p % (total - 1);
                Request {
                    id: RequestId(i as u64),
                    session: None,
                    class: TrafficClass::ALL[class as usize % 3],
                    arrival: Nanos::from_millis(now),
                    prompt_tokens: p,
                    output_tokens: o.min(total - p),
                    content: chain,
                }
            })
            .collect();
        Trace::new(block, requests)
    }

    fn lru_only(blocks: u64, block_bytes: u64) -> StoreConfig {
        StoreConfig {
            capacity_bytes: Some(blocks * block_bytes),
            high_watermark: 1.0,
            low_watermark: 1.0,
            ttl: ClassTtl::none(),
            ..Default::default()
        }
    }

    fn ttl_only(ttl: Nanos) -> StoreConfig {
        StoreConfig {
            capacity_bytes: None,
            ttl: ClassTtl::uniform(Some(ttl)),
            ..Default::default()
        }
    }

    fn check_point(
        curves: &Curves,
        rep: &crate::replay::BlockReplayReport,
        p: impl Fn(&ClassCurve) -> Point,
    ) -> Result<(), TestCaseError> {
        let a = p(&curves.all);
        prop_assert_eq!(a.hit_tokens, rep.hit_tokens);
        prop_assert_eq!(a.hit_blocks, rep.block_hits);
        prop_assert_eq!(curves.all.counted_tokens, rep.input_tokens);
        prop_assert_eq!(curves.all.counted_blocks, rep.blocks);
        for c in &curves.classes {
            let want = &rep.per_class[c.name()];
            prop_assert_eq!(p(c).hit_tokens, want.hit_tokens);
            prop_assert_eq!(c.input_tokens, want.input_tokens);
        }
        Ok(())
    }

    proptest! {
        /// The Fenwick stack agrees with an explicit recency list, across renumberings (a small
        /// key space and many accesses force several).
        #[test]
        fn stack_matches_a_list(ops in proptest::collection::vec(0u64..40, 1..3000)) {
            let mut s = LruStack::new();
            let mut naive = NaiveStack(Vec::new());
            for (t, &k) in ops.iter().enumerate() {
                prop_assert_eq!(s.lookup(BlockKey(k)).map(|x| x.distance), naive.distance(k));
                s.access(BlockKey(k), Nanos(t as u64));
                naive.access(k);
            }
            prop_assert_eq!(s.distinct(), naive.0.len() as u64);
        }

    }

    proptest! {
        // Each case replays the trace once per capacity and TTL: fewer, larger cases.
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// Without sampling, every point of both curves equals a point replay through the store,
        /// in total and per class, with and without written-back outputs.
        #[test]
        fn curves_equal_point_replays(
            reqs in proptest::collection::vec((0usize..5, 0u32..4000, 0u32..600, 0u8..3, 0u64..4000), 1..60),
            block in prop::sample::select(vec![32u32, 64, 128]),
            cache_outputs in any::<bool>(),
        ) {
            let t = trace(block, &reqs);
            let curves = curves(&t, MrcOptions { sample_rate: 1.0, cache_outputs }).unwrap();
            let bb = u64::from(block) * 890;
            let max = curves.saturating_capacity() + 2;
            for cap in 1..=max {
                let rep = block_replay(&t, &lru_only(cap, bb), bb, cache_outputs).unwrap();
                check_point(&curves, &rep, |c| curves.at_capacity(c, cap))?;
            }
            // TTLs at, just below and just above every step of the curve, and past the end.
            let mut ttls: Vec<Nanos> = curves.all.reuse_times()
                .flat_map(|r| [r, Nanos(r.0 + 1), Nanos(r.0.saturating_sub(1))])
                .filter(|t| t.0 > 0)
                .collect();
            ttls.extend([Nanos(1), Nanos::from_secs(1_000_000)]);
            ttls.sort();
            ttls.dedup();
            for ttl in ttls {
                let rep = block_replay(&t, &ttl_only(ttl), bb, cache_outputs).unwrap();
                check_point(&curves, &rep, |c| c.at_ttl(ttl))?;
            }
            let unbounded = StoreConfig { capacity_bytes: None, ttl: ClassTtl::none(), ..Default::default() };
            let rep = block_replay(&t, &unbounded, bb, cache_outputs).unwrap();
            check_point(&curves, &rep, |c| c.unbounded())?;
        }

    }

    proptest! {
        /// Hit rates never fall as capacity or TTL grows, and never exceed the unbounded store.
        #[test]
        fn curves_are_monotone(
            reqs in proptest::collection::vec((0usize..5, 0u32..4000, 0u32..600, 0u8..3, 0u64..4000), 1..60),
            rate in prop::sample::select(vec![1.0, 0.5, 0.25]),
        ) {
            let t = trace(64, &reqs);
            let c = curves(&t, MrcOptions { sample_rate: rate, cache_outputs: false }).unwrap();
            let top = c.all.unbounded();
            let mut prev = c.at_capacity(&c.all, 1);
            for cap in 2..c.saturating_capacity() + 3 {
                let p = c.at_capacity(&c.all, cap);
                prop_assert!(p.hit_tokens >= prev.hit_tokens && p.hit_blocks >= prev.hit_blocks);
                prop_assert!(p.hit_tokens <= top.hit_tokens);
                prev = p;
            }
            prop_assert_eq!(prev, top);
            prop_assert_eq!(c.all.at_ttl(Nanos(c.all.max_reuse().0 + 1)), top);
        }
    }

    /// On a trace with thousands of distinct blocks, a 10 % sample stays within a few points of
    /// the exact capacity curve.
    #[test]
    fn sampled_curve_is_close() {
        let reqs: Vec<_> = (0..3000u64)
            .map(|i| {
                let x = mix64(i);
                // Chain index over many distinct documents, so distances span thousands.
                (
                    (x % 400) as usize,
                    (x >> 20) as u32 % 4000,
                    0,
                    (x >> 40) as u8,
                    10,
                )
            })
            .collect();
        // Documents: the five chains of `trace`, but give each document index its own content.
        let block = 16;
        let requests: Vec<Request> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(doc, p, _, class, _))| {
                let mut b = ChainBuilder::new(block);
                b.push(SegmentId(1), 200)
                    .push(SegmentId(100 + doc as u64), 1000 + 7 * doc as u32);
                let chain = Arc::new(b.finish());
                Request {
                    id: RequestId(i as u64),
                    session: None,
                    class: TrafficClass::ALL[class as usize % 3],
                    arrival: Nanos::from_millis(i as u64 * 10),
                    prompt_tokens: 1 + p % (chain.total_tokens() - 1),
                    output_tokens: 0,
                    content: chain,
                }
            })
            .collect();
        let t = Trace::new(block, requests);
        let exact = curves(&t, MrcOptions::default()).unwrap();
        let sampled = curves(
            &t,
            MrcOptions {
                sample_rate: 0.1,
                cache_outputs: false,
            },
        )
        .unwrap();
        assert!(exact.distinct_blocks > 10_000, "{}", exact.distinct_blocks);
        let mut worst = 0f64;
        for cap in log_grid(exact.saturating_capacity(), 20) {
            let e = exact.at_capacity(&exact.all, cap).token_hit_rate;
            let s = sampled.at_capacity(&sampled.all, cap).token_hit_rate;
            worst = worst.max((e - s).abs());
        }
        assert!(worst < 0.05, "worst error {worst}");
        let e = exact.all.at_ttl(Nanos::from_secs(5)).token_hit_rate;
        let s = sampled.all.at_ttl(Nanos::from_secs(5)).token_hit_rate;
        assert!((e - s).abs() < 0.05, "{e} vs {s}");
    }
}
