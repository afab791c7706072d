//! The entrypoint of a serving unit (SPEC §3 steps 1–2, §4, §5): the prefix match against the
//! store, the hit rule with its SWA-state query, the prefill job it builds, and the write-back
//! of a request's blocks and SWA states.
//!
//! Per-request work does not grow with the context when most of it is a hit: the entrypoint
//! remembers, per session, how many leading blocks it found present and at which store
//! "removal generation" (evictions + expirations); while nothing was removed since, a turn only
//! looks up and writes its new blocks. Re-touching the reused run (for LRU recency and
//! last-access TTLs) is coalesced to once per `touch_coalesce` per session.

use crate::consts::ServingConstants;
use crate::content::ContentChain;
use crate::content::{BlockKey, KeyBuildHasher, hash2, prefetch_read};
use crate::engine::PrefillJob;
use crate::hit::{HitDecision, HitInputs, HitPolicy, SwaSource};
use crate::ids::{MachineId, RequestId, SessionId};
use crate::request::Request;
use crate::time::Nanos;
use crate::unit::shared::SharedCache;
use crate::unit::table::Window;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// Tags an SWA-state object in the store (SWA-on-SSD) apart from the block with that key.
const SWA_OBJECT_TAG: u64 = 0x53a5_7a7e;

/// The store key of the SWA state taken at the prefix whose key is `key` (the one key function
/// every driver uses).
pub fn swa_object_key(key: BlockKey) -> BlockKey {
    BlockKey(hash2(key.0, SWA_OBJECT_TAG))
}

#[derive(Clone, Copy, Debug)]
struct Memo {
    /// The address of the chain the memo is about ([`Slot::chain`]); [`Memo::NONE`]'s, 0,
    /// matches none.
    chain: usize,
    blocks: u32,
    generation: u64,
    touched_at: Nanos,
}

impl Memo {
    /// A session not seen yet: no chain matches it.
    const NONE: Memo = Memo {
        chain: 0,
        blocks: 0,
        generation: 0,
        touched_at: Nanos::ZERO,
    };
}

/// What the entrypoint holds of a request while the unit holds it.
#[derive(Clone, Debug)]
struct Slot {
    /// Index into the memos, or [`NO_SESSION`].
    session: u32,
    /// The address of the request's chain: chains are shared by address, and a memo keeps
    /// its chain allocated ([`Entrypoint::memo_chain`]), so no other chain takes the address
    /// while a memo names it.
    chain: usize,
    /// Every full-block key of the chain. Read through this, a chain's keys are one load
    /// away: through the request's `Arc`, its header (scattered over hundreds of MB of trace)
    /// comes first, a cache and TLB miss at every event.
    keys: Arc<[BlockKey]>,
}

/// No session (a request outside any session).
const NO_SESSION: u32 = u32::MAX;

/// The key of the prefix `[0, pos)` of a request whose chain's full-block keys are `keys`
/// ([`Request::key_at`]): a block boundary from the keys, a segment end from the chain's marks.
#[inline]
pub fn key_at(keys: &[BlockKey], r: &Request, block_tokens: u32, pos: u32) -> Option<BlockKey> {
    if pos == 0 {
        None
    } else if pos.is_multiple_of(block_tokens) {
        keys.get((pos / block_tokens) as usize - 1).copied()
    } else {
        r.key_at(pos)
    }
}

/// The keys of the full blocks inside the first `tokens` tokens, of a chain whose keys are
/// `keys`.
#[inline]
fn within(keys: &[BlockKey], block_tokens: u32, tokens: u32) -> &[BlockKey] {
    &keys[..((tokens / block_tokens) as usize).min(keys.len())]
}

/// At most how many objects a run over `reqs` writes to the store: the full blocks of every
/// distinct chain up to its longest context (a prefix shared by several chains counts once
/// per chain), plus two SWA objects per request (after prefill and after decode) when SWA
/// state lives in the store.
pub fn blocks_written_bound(reqs: &[Request], block_tokens: u32, policy: HitPolicy) -> usize {
    // Chains are shared by address; the slice keeps every one of them alive.
    let mut upto: HashMap<usize, (u32, usize), KeyBuildHasher> = HashMap::default();
    for r in reqs {
        let e = upto
            .entry(Arc::as_ptr(&r.content) as usize)
            .or_insert((0, 0));
        e.0 = e.0.max(r.context_tokens());
        e.1 = r.content.full_blocks(u32::MAX).len();
    }
    let mut blocks: usize = upto
        .values()
        .map(|&(t, keys)| ((t / block_tokens) as usize).min(keys))
        .sum();
    if policy.swa_source() == SwaSource::BlockStore {
        blocks += 2 * reqs.len();
    }
    blocks
}

/// Asks the CPU to start loading the last four cache lines of `keys`: a caller that will look
/// those keys up soon overlaps their cache misses with other work. No effect on results.
#[inline]
pub fn prefetch_tail(keys: &[BlockKey]) {
    const KEYS_PER_LINE: usize = 64 / std::mem::size_of::<BlockKey>();
    let end = keys.len();
    let start = end.saturating_sub(4 * KEYS_PER_LINE);
    for i in (start..end).step_by(KEYS_PER_LINE) {
        prefetch_read(&raw const keys[i]);
    }
    if start < end {
        prefetch_read(&raw const keys[end - 1]);
    }
}

/// What the entrypoint decided for one arrival.
#[derive(Clone, Debug)]
pub struct Admission {
    pub decision: HitDecision,
    /// The machine holding the SWA state the hit uses (host-cache rules only).
    pub swa_machine: Option<MachineId>,
    pub job: PrefillJob,
}

pub struct Entrypoint {
    constants: ServingConstants,
    policy: HitPolicy,
    touch_coalesce: Nanos,
    /// Session ids are arbitrary integers (imported traces): numbered densely, in order of
    /// first appearance.
    sessions: HashMap<SessionId, u32, KeyBuildHasher>,
    /// Per session, by dense session number: a direct index rather than a hash map keyed by
    /// session id (two cache misses per look-up in a map of tens of thousands of sessions).
    memo: Vec<Memo>,
    /// Per session, the chain its memo names, kept allocated (not its keys: a weak count
    /// keeps only the chain's header), so that its address names no other chain later.
    memo_chain: Vec<Weak<ContentChain>>,
    /// Per request held, by the unit's request number.
    slots: Window<Slot>,
    pub full_lookups: u64,
    pub memo_lookups: u64,
}

impl Entrypoint {
    pub fn new(constants: ServingConstants, policy: HitPolicy, touch_coalesce: Nanos) -> Self {
        Entrypoint {
            constants,
            policy,
            touch_coalesce,
            sessions: HashMap::default(),
            memo: Vec::new(),
            memo_chain: Vec::new(),
            slots: Window::default(),
            full_lookups: 0,
            memo_lookups: 0,
        }
    }

    /// Takes request `r` as the unit's next request (the unit's number for it is returned).
    pub fn push(&mut self, r: &Request) -> usize {
        let session = match r.session {
            Some(s) => {
                let next = self.sessions.len() as u32;
                let n = *self.sessions.entry(s).or_insert(next);
                if n == next {
                    self.memo.push(Memo::NONE);
                    self.memo_chain.push(Weak::new());
                }
                n
            }
            None => NO_SESSION,
        };
        self.slots.push(Slot {
            session,
            chain: Arc::as_ptr(&r.content) as usize,
            keys: r.content.shared_blocks(),
        })
    }

    /// Drops the oldest request held (the unit forgets it).
    pub fn forget_front(&mut self) {
        self.slots.pop_front();
    }

    pub fn policy(&self) -> HitPolicy {
        self.policy
    }

    /// Every full-block key of request `i`'s chain.
    #[inline]
    pub fn keys(&self, i: usize) -> &[BlockKey] {
        &self.slots[i].keys
    }

    /// Keys of the full blocks inside the first `tokens` tokens of request `i`'s chain.
    #[inline]
    pub fn blocks_within(&self, i: usize, tokens: u32) -> &[BlockKey] {
        within(self.keys(i), self.constants.block_tokens, tokens)
    }

    /// Leading full blocks of the prompt present in the store.
    fn cached_blocks(&mut self, now: Nanos, i: usize, r: &Request, sh: &mut SharedCache) -> u32 {
        let slot = &self.slots[i];
        let blocks = within(&slot.keys, self.constants.block_tokens, r.prompt_tokens);
        let (s, chain) = (slot.session, slot.chain);
        sh.store.advance(now);
        let generation = sh.generation();
        let start = match self.memo.get(s as usize) {
            Some(m) if m.chain == chain && m.generation == generation => {
                self.memo_lookups += 1;
                (m.blocks as usize).min(blocks.len())
            }
            _ => {
                self.full_lookups += 1;
                0
            }
        };
        let b = start + sh.store.lookup_prefix(now, &blocks[start..]);
        if let Some(m) = self.memo.get_mut(s as usize) {
            if m.chain != chain {
                m.touched_at = Nanos::ZERO;
                self.memo_chain[s as usize] = Arc::downgrade(&r.content);
            }
            m.chain = chain;
            m.blocks = b as u32;
            m.generation = generation;
        }
        b as u32
    }

    /// Where request `i`'s prefix look-up will start, by its session's memo now (a hint for
    /// prefetching: the store may change before it arrives).
    fn lookup_start_hint(&self, i: usize) -> usize {
        let Slot { session, chain, .. } = self.slots[i];
        match self.memo.get(session as usize) {
            Some(m) if m.chain == chain => m.blocks as usize,
            _ => 0,
        }
    }

    /// The hit rule on request `i` (its prefix match, SWA query and prefill job).
    pub fn admit(&mut self, now: Nanos, i: usize, r: &Request, sh: &mut SharedCache) -> Admission {
        let policy = self.policy;
        let perfect = policy.uses_perfect_cache();
        let perfect_hit = if perfect { sh.perfect.hit_tokens(r) } else { 0 };
        let cached = if perfect {
            0
        } else {
            self.cached_blocks(now, i, r, sh) * self.constants.block_tokens
        };
        let c = &self.constants;
        let inputs = HitInputs {
            prompt_tokens: r.prompt_tokens,
            cached_block_tokens: cached,
            perfect_hit_tokens: if perfect { perfect_hit } else { cached },
        };
        let mut swa_machine = None;
        let keys = self.keys(i);
        let decision = {
            let SharedCache { store, swa, .. } = sh;
            policy.decide(c, inputs, |p| {
                let Some(key) = key_at(keys, r, c.block_tokens, p) else {
                    return false;
                };
                match policy.swa_source() {
                    SwaSource::HostCache => {
                        swa_machine = swa.lookup(now, key);
                        swa_machine.is_some()
                    }
                    SwaSource::BlockStore => store.contains(now, swa_object_key(key)),
                    SwaSource::NotNeeded => true,
                }
            })
        };
        if perfect {
            sh.perfect.record_prompt(r);
        }
        Admission {
            decision,
            swa_machine: decision.swa_state_at.and(swa_machine),
            job: self.job(i, r, &decision),
        }
    }

    fn job(&self, i: usize, r: &Request, decision: &HitDecision) -> PrefillJob {
        let c = &self.constants;
        let (layers, dec_layers) = if decision.decoder_only {
            (c.total_layers(), 0)
        } else {
            (c.encoder_layers, c.decoder_layers)
        };
        PrefillJob {
            request: RequestId(i as u64),
            prompt_tokens: r.prompt_tokens,
            hit_tokens: decision.hit_tokens,
            encoder_tokens: decision.encoder_tokens,
            new_token_layers: layers,
            decoder_tokens: if decision.decoder_only {
                0
            } else {
                decision.decoder_tokens
            },
            decoder_layers: dec_layers,
            swap_in_bytes: u64::from(decision.reused_kv_tokens()) * u64::from(c.kv_bytes_per_token),
            ready: false,
            done_tokens: 0,
            first_step_at: None,
        }
    }

    /// Writes (or touches) the blocks `[0, upto)` of request `i` (`r`)'s chain; with a valid
    /// memo only the new ones, re-touching the reused run at most once per `touch_coalesce`.
    pub fn write_blocks(
        &mut self,
        now: Nanos,
        i: usize,
        r: &Request,
        upto_tokens: u32,
        sh: &mut SharedCache,
    ) {
        let slot = &self.slots[i];
        let all = within(&slot.keys, self.constants.block_tokens, upto_tokens);
        let (s, chain) = (slot.session as usize, slot.chain);
        sh.store.advance(now);
        let before = sh.generation();
        let memo = self.memo.get(s).copied();
        let start = match memo {
            Some(m)
                if m.chain == chain
                    && m.generation == before
                    && now.saturating_sub(m.touched_at) < self.touch_coalesce =>
            {
                (m.blocks as usize).min(all.len())
            }
            _ => 0,
        };
        sh.store.touch_or_insert(now, &all[start..], r.class);
        let after = sh.generation();
        if let Some(m) = self.memo.get_mut(s) {
            // (A session's first write finds no memo of its chain: start is 0.)
            if start == 0 {
                m.touched_at = now;
            }
            if m.chain != chain {
                self.memo_chain[s] = Arc::downgrade(&r.content);
            }
            m.chain = chain;
            // Removals during the write may have taken our own blocks: trust nothing then.
            m.blocks = if after == before { all.len() as u32 } else { 0 };
            m.generation = after;
        }
    }

    /// Stores the SWA state of request `i` at its last block boundary at or below `at_tokens`
    /// (SPEC §5), on `machine` for the host cache or as a store object for SWA-on-SSD.
    pub fn store_swa(
        &self,
        now: Nanos,
        i: usize,
        r: &Request,
        at_tokens: u32,
        machine: MachineId,
        sh: &mut SharedCache,
    ) {
        let bs = self.constants.block_tokens;
        let Some(key) = key_at(self.keys(i), r, bs, (at_tokens / bs) * bs) else {
            return;
        };
        match self.policy.swa_source() {
            SwaSource::HostCache => sh.swa.store(now, machine, key),
            SwaSource::BlockStore => {
                sh.store.put(
                    now,
                    swa_object_key(key),
                    self.constants.swa_state_bytes(),
                    r.class,
                );
            }
            SwaSource::NotNeeded => {}
        }
    }

    /// Records an output in the perfect cache (perfect-cache rules only).
    pub fn record_output(&self, r: &Request, sh: &mut SharedCache) {
        if self.policy.uses_perfect_cache() {
            sh.perfect.record_output(r);
        }
    }

    /// Before writing several requests' blocks: starts loading the keys below `upto` tokens,
    /// so the cache misses of the whole batch overlap.
    pub fn prefetch_chains(&self, reqs: impl Iterator<Item = (usize, u32)>) {
        for (i, upto) in reqs {
            prefetch_tail(self.blocks_within(i, upto));
        }
    }

    /// Before request `i`'s blocks below `upto` tokens are written (one request of a batch
    /// ahead: its keys, from [`Self::prefetch_chains`], have arrived by then), starts loading
    /// what the write will probe: the store slot of the first block past the session's memo
    /// and the SWA directory entry of the state stored at the last full block.
    pub fn prefetch_write(&self, i: usize, upto: u32, sh: &SharedCache) {
        let blocks = self.blocks_within(i, upto);
        if let Some(&k) = blocks.get(self.lookup_start_hint(i)) {
            sh.store.prefetch(k);
        }
        if self.policy.swa_source() == SwaSource::HostCache
            && let Some(&k) = blocks.last()
        {
            sh.swa.prefetch(k);
        }
    }

    /// Ahead of the arrival of request `i` (prompt `prompt_tokens`) starts loading what it will
    /// probe, by its session's memo now (hints: the store may change before it arrives). Two
    /// ahead (`near` false): its prompt's last keys and its session's memo. One ahead (`near`):
    /// the table slot of its look-up's first key and, under the SWA host cache, the directory
    /// entry the hit rule asks for and the keys of the fetch's stripes.
    pub fn prefetch_arrival(
        &self,
        i: usize,
        prompt_tokens: u32,
        near: bool,
        stripes: usize,
        sh: &SharedCache,
    ) {
        let blocks = self.blocks_within(i, prompt_tokens);
        if !near {
            prefetch_tail(blocks);
            if let Some(m) = self.memo.get(self.slots[i].session as usize) {
                prefetch_read(m);
            }
            return;
        }
        let start = self.lookup_start_hint(i);
        if let Some(&k) = blocks.get(start) {
            sh.store.prefetch(k);
        }
        if self.policy.swa_source() != SwaSource::HostCache {
            return;
        }
        let c = &self.constants;
        let cap = (prompt_tokens.saturating_sub(c.hit_margin_tokens()) / c.block_tokens) as usize;
        let hit = start.min(blocks.len()).min(cap);
        if hit == 0 {
            return;
        }
        sh.swa.prefetch(blocks[hit - 1]);
        let stripes = stripes.min(hit);
        for s in 0..stripes {
            prefetch_read(&raw const blocks[s * hit / stripes]);
        }
    }
}
