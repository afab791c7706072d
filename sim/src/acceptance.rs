//! The draft-acceptance model behind DSpark in the simulator.
//!
//! Each step, a sequence's drafts have a latent per-position acceptance probability
//! `q_i = σ(z + ε_i − decay·i)`, `z ~ N(mean_logit, seq_sigma)` (how predictable the text is
//! now), `ε_i ~ N(0, token_sigma)`. The confidence head reports `c_i = σ(logit(q_i) + η_i)`,
//! `η_i ~ N(0, confidence_noise)` (calibrated up to noise). Drafts are accepted left to right,
//! so P(at least j accepted) is the cumulative product of q — one uniform draw per sequence
//! decides how many drafts are accepted. To keep a 64 × 60-sequence step cheap, the model is
//! tabulated: `profiles` draws of (q, c) are made once per run from the seed and every
//! sequence-step picks one at random. The defaults were fitted together with the decode cost
//! of `sm100-published` (see that file).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};
use servelab_core::ConfigError;
use servelab_core::engine::dspark::CONFIDENCE_BINS;
use servelab_core::engine::{ConfidenceHistogram, DecodeSeq, SeqOutcome};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AcceptanceModel {
    pub mean_logit: f64,
    pub seq_sigma: f64,
    pub token_sigma: f64,
    pub position_decay: f64,
    pub confidence_noise: f64,
    /// Tabulated draws (the split is O(drafts of the step) whatever the table size).
    pub profiles: u32,
}

impl Default for AcceptanceModel {
    fn default() -> Self {
        AcceptanceModel {
            mean_logit: 1.1658,
            seq_sigma: 1.8718,
            token_sigma: 0.7017,
            position_decay: 0.0411,
            confidence_noise: 0.0934,
            // Large enough that results do not depend on which profiles a seed draws (64
            // gave accepted lengths 3.44 vs 3.31 between seeds); the split costs the same.
            profiles: 4096,
        }
    }
}

impl AcceptanceModel {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (f, v) in [
            ("seq_sigma", self.seq_sigma),
            ("token_sigma", self.token_sigma),
            ("confidence_noise", self.confidence_noise),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::invalid(
                    format!("acceptance.{f}"),
                    "must be finite and non-negative",
                ));
            }
        }
        if !self.mean_logit.is_finite() || !self.position_decay.is_finite() {
            return Err(ConfigError::invalid(
                "acceptance.mean_logit",
                "must be finite",
            ));
        }
        if self.profiles == 0 || self.profiles > 1 << 16 {
            return Err(ConfigError::invalid(
                "acceptance.profiles",
                "must lie in [1, 65536]",
            ));
        }
        Ok(())
    }
}

/// Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9).
#[allow(clippy::excessive_precision)] // the published coefficients, kept as printed
pub fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383577518672690e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The tabulated model for `drafts` positions.
#[derive(Clone, Debug)]
pub struct AcceptanceTable {
    pub drafts: usize,
    pub profiles: usize,
    /// Per-position conditional confidences, profile-major.
    pub conf: Vec<f64>,
    /// Cumulative products of the confidences.
    pub cum_conf: Vec<f64>,
    /// Cumulative products of the true acceptance probabilities.
    pub cum_true: Vec<f64>,
    /// Dense rank of each (profile, position)'s cumulative confidence, 0 = highest; equal
    /// values share a rank, so (rank, sequence, position) orders drafts exactly as the split
    /// kernel does (cumulative confidence descending, then sequence, then position).
    rank: Vec<u32>,
    /// The rank's coarse bucket (one of at most [`RANK_BUCKETS`]) per (profile, position):
    /// [`Self::split`]'s counting pass.
    bucket: Vec<u8>,
    bin: Vec<u8>,
    /// Per profile, for rows of at most [`RECORD_DRAFTS`] drafts: what a sequence-step reads
    /// except the histogram bins, in one cache line that [`Self::step_rank`] prefetches a few
    /// sequences ahead (the 4,096-profile table does not stay cached between steps).
    records: Vec<Record>,
    /// Per profile, with `records`: the drafts' histogram bins, byte `i` for draft `i` (the
    /// bytes past the row are 0), so [`Self::step_rank`] compares a row with the cut's bin in
    /// a few word operations.
    bin_rows: Vec<u64>,
}

/// Drafts a [`Record`] holds.
const RECORD_DRAFTS: usize = 5;

/// One profile's row in one cache line. A draw `x` (32 bits, the uniform `x / 2^32`) accepts
/// draft `i` iff `cum_true[i] > x / 2^32`, i.e. iff `x < ceil(cum_true[i] · 2^32)` (exact: the
/// scaling is by a power of two): stored as `accept_upto[i] = ceil(…) − 1` (accept iff
/// `x <= accept_upto[i]`), with the first draft whose ceiling is 0 (never accepted) in
/// `accept_cap`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Record {
    cum_conf: [f64; RECORD_DRAFTS],
    accept_upto: [u32; RECORD_DRAFTS],
    accept_cap: u8,
}

/// Ranks of at most this many sequences merge only the histogram bins their drafts touched.
const SMALL_RANK_SEQS: usize = 8;

/// How many sequences ahead [`AcceptanceTable::step_rank`] prefetches profile records.
const PREFETCH_AHEAD: usize = 8;

#[inline]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86_64 baseline, and a prefetch never dereferences its
    // address architecturally: it cannot fault and only warms the cache.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Scratch of [`AcceptanceTable::step_rank`], reused between calls (no allocation per step).
#[derive(Clone, Debug)]
pub struct RankScratch {
    /// Per sequence: uniform word (low 32 bits), profile (bits 32..48), drafts allowed
    /// (bits 48..56), drafts the uniform accepts out of all `drafts` (bits 56..64).
    packed: Vec<u64>,
    /// Per sequence (rows of [`RECORD_DRAFTS`] drafts): its bin row (see `bin_rows`) with the
    /// bytes of drafts it may not verify cleared, so the second pass reads it in order.
    rows: Vec<u64>,
    /// Sequences with drafts in the cut's bin (a prefix of it, the rest stale).
    at_cut: Vec<u32>,
    keys: Vec<u64>,
    /// Histogram counts and sums, all zero between calls. The sums go to interleaved lanes
    /// (consecutive sequences to different lanes, merged at the end as `fill_histogram` does):
    /// most drafts land in the same few high-confidence bins, and a single accumulator per
    /// bin would chain every floating-point add on the previous one through memory. The
    /// counts stay in one lane: four lanes measured slower, their merge costing more than the
    /// chained increments.
    count: [u32; CONFIDENCE_BINS],
    sum: [[f64; CONFIDENCE_BINS]; RankScratch::LANES],
}

impl RankScratch {
    const LANES: usize = 4;
}

impl Default for RankScratch {
    fn default() -> Self {
        RankScratch {
            packed: Vec::new(),
            rows: Vec::new(),
            at_cut: Vec::new(),
            keys: Vec::new(),
            count: [0; CONFIDENCE_BINS],
            sum: [[0.0; CONFIDENCE_BINS]; RankScratch::LANES],
        }
    }
}

/// What [`AcceptanceTable::step_rank`] reports for one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankStep {
    /// KV tokens summed over the rank's sequences.
    pub kv_tokens: u64,
    /// KV tokens of the rank's longest sequence.
    pub max_kv_tokens: u64,
    /// Drafts verified in total.
    pub verified: u32,
}

/// Coarse rank buckets of [`AcceptanceTable::split`]'s counting pass: few enough to count
/// per call, many enough that the bucket holding the cut has only a handful of drafts.
const RANK_BUCKETS: usize = 256;

/// The most drafts per sequence-step the tabulated model handles (its rows pack counts in a
/// byte; DSpark drafts 5): the bound `constants.draft_tokens` is validated against.
pub const MAX_DRAFTS: u32 = servelab_core::consts::MAX_DRAFT_TOKENS;

/// Refuses a draft count the model cannot tabulate: zero (there is nothing to accept, and the
/// rows would be empty) or more than [`MAX_DRAFTS`]. `field` names the config key.
pub fn validate_drafts(drafts: u32, field: &str) -> Result<(), ConfigError> {
    if drafts == 0 || drafts > MAX_DRAFTS {
        return Err(ConfigError::invalid(
            field,
            format!("{drafts} drafts per step: the acceptance model takes 1 to {MAX_DRAFTS}"),
        ));
    }
    Ok(())
}

/// The `k` profiles of `d` drafts each, row-major: each draft's confidence, and the cumulative
/// products of the confidences and of the true acceptance probabilities. The draws come from
/// one generator seeded with `seed`, two per draft in row order.
fn draw_profiles(
    m: &AcceptanceModel,
    k: usize,
    d: usize,
    seed: u64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let std = Normal::new(0.0, 1.0).expect("unit normal");
    let (mut conf, mut cum_conf, mut cum_true) =
        (vec![0.0; k * d], vec![0.0; k * d], vec![0.0; k * d]);
    for p in 0..k {
        // Stratified over the sequence-level draw, so a small table keeps the mean.
        let z = m.mean_logit + m.seq_sigma * inverse_normal_cdf((p as f64 + 0.5) / k as f64);
        let (mut cq, mut cc) = (1.0, 1.0);
        for i in 0..d {
            let l = z + m.token_sigma * std.sample(&mut rng) - m.position_decay * i as f64;
            let c = sigmoid(l + m.confidence_noise * std.sample(&mut rng));
            cq *= sigmoid(l);
            cc *= c;
            conf[p * d + i] = c;
            cum_true[p * d + i] = cq;
            cum_conf[p * d + i] = cc;
        }
    }
    (conf, cum_conf, cum_true)
}

/// The dense rank of each cumulative confidence (0 = highest, equal values share a rank), and
/// its coarse bucket: the ranks shifted right until they fit in [`RANK_BUCKETS`].
fn confidence_ranks(cum_conf: &[f64]) -> (Vec<u32>, Vec<u8>) {
    let mut order: Vec<u32> = (0..cum_conf.len() as u32).collect();
    order.sort_by(|&a, &b| cum_conf[b as usize].total_cmp(&cum_conf[a as usize]));
    let mut rank = vec![0; cum_conf.len()];
    let mut r = 0u32;
    for (j, &x) in order.iter().enumerate() {
        if j > 0 && cum_conf[x as usize] != cum_conf[order[j - 1] as usize] {
            r += 1;
        }
        rank[x as usize] = r;
    }
    let mut rank_shift = 0;
    while (r >> rank_shift) as usize >= RANK_BUCKETS {
        rank_shift += 1;
    }
    let bucket: Vec<u8> = rank.iter().map(|&r| (r >> rank_shift) as u8).collect();
    (rank, bucket)
}

/// One [`Record`] per profile, for rows of at most [`RECORD_DRAFTS`] drafts.
fn profile_records(k: usize, d: usize, cum_conf: &[f64], cum_true: &[f64]) -> Vec<Record> {
    (0..k)
        .map(|p| {
            let mut r = Record {
                accept_cap: d as u8,
                ..Record::default()
            };
            for i in (0..d).rev() {
                r.cum_conf[i] = cum_conf[p * d + i];
                let ceil = (cum_true[p * d + i] * 4_294_967_296.0).ceil() as u64;
                match ceil.checked_sub(1) {
                    Some(upto) => r.accept_upto[i] = upto as u32,
                    None => r.accept_cap = i as u8,
                }
            }
            r
        })
        .collect()
}

/// Each profile's histogram bins in one word, byte `i` for draft `i`.
fn packed_bin_rows(k: usize, d: usize, bin: &[u8]) -> Vec<u64> {
    (0..k)
        .map(|p| {
            let row = &bin[p * d..(p + 1) * d];
            row.iter()
                .enumerate()
                .fold(0u64, |w, (i, &b)| w | u64::from(b) << (8 * i))
        })
        .collect()
}

/// A packed word's profile (see [`RankScratch`]'s `packed`).
#[inline(always)]
fn word_profile(w: u64) -> usize {
    ((w >> 32) & 0xffff) as usize
}

/// Bins are below 64: masking an index with this is a no-op that spares bounds checks.
const BIN_MASK: usize = CONFIDENCE_BINS - 1;

/// Every sequence verifies all the drafts it is allowed; returns the drafts verified in all.
#[inline(always)]
fn verify_all(packed: &[u64], out: &mut [SeqOutcome]) -> u32 {
    let mut verified = 0u32;
    for (o, &w) in out.iter_mut().zip(packed.iter()) {
        let (m, a) = ((w >> 48) as u8, (w >> 56) as u8);
        verified += u32::from(m);
        *o = SeqOutcome {
            verified: m,
            accepted: a.min(m),
        };
    }
    verified
}

/// The cut's bin `cut`: fewer than `budget` drafts lie above it, at least that many in it and
/// above (the budget is below the total, so the scan stops at a bin); with the drafts above.
#[inline(always)]
fn cut_bin(hist: &ConfidenceHistogram, budget: usize) -> (usize, usize) {
    let (mut cut, mut above) = (CONFIDENCE_BINS - 1, 0usize);
    while above + hist.count[cut] as usize <= budget {
        above += hist.count[cut] as usize;
        cut -= 1;
    }
    (cut, above)
}

/// Verifies the first `need` drafts of `keys` in (rank, sequence, position) order, one more
/// on its sequence each; returns the drafts added.
#[inline(always)]
fn verify_best_at_cut(
    keys: &mut [u64],
    need: usize,
    packed: &[u64],
    out: &mut [SeqOutcome],
) -> u32 {
    keys.select_nth_unstable(need - 1);
    for &k in &keys[..need] {
        let s = ((k >> 8) & 0xff_ffff) as usize;
        let a = (packed[s] >> 56) as u8;
        let o = &mut out[s];
        o.verified += 1;
        o.accepted = a.min(o.verified);
    }
    need as u32
}

impl AcceptanceTable {
    /// [`Self::new`] for inputs that come from a config: the model and the draft count are
    /// validated first.
    pub fn try_new(m: &AcceptanceModel, drafts: u32, seed: u64) -> Result<Self, ConfigError> {
        m.validate()?;
        validate_drafts(drafts, "constants.draft_tokens")?;
        Ok(Self::new(m, drafts, seed))
    }

    /// # Panics
    /// If `drafts` is 0 or above [`MAX_DRAFTS`] (configs go through [`validate_drafts`] or
    /// [`Self::try_new`] first).
    pub fn new(m: &AcceptanceModel, drafts: u32, seed: u64) -> Self {
        if let Err(e) = validate_drafts(drafts, "draft_tokens") {
            panic!("{e}");
        }
        let d = drafts as usize;
        let k = m.profiles as usize;
        let (conf, cum_conf, cum_true) = draw_profiles(m, k, d, seed);
        let (rank, bucket) = confidence_ranks(&cum_conf);
        let bin: Vec<u8> = cum_conf
            .iter()
            .map(|&c| ConfidenceHistogram::bin(c) as u8)
            .collect();
        let (records, bin_rows) = if d <= RECORD_DRAFTS {
            (
                profile_records(k, d, &cum_conf, &cum_true),
                packed_bin_rows(k, d, &bin),
            )
        } else {
            (Vec::new(), Vec::new())
        };
        AcceptanceTable {
            drafts: d,
            profiles: k,
            conf,
            cum_conf,
            cum_true,
            rank,
            bucket,
            bin,
            records,
            bin_rows,
        }
    }

    /// One rank's decode step in two passes over its sequences: draws each sequence's
    /// (profile, uniform) from `next_word` in order, splits `budget` (None: every sequence
    /// verifies its `max_drafts`) exactly as [`Self::split`] does, writes each sequence's
    /// verified and accepted drafts to `out` and the drafts' confidences to `hist` exactly as
    /// [`Self::fill_histogram`] does into an empty histogram. The first pass fills the
    /// histogram; the second takes each sequence's prefix above the cut. Same draws, same
    /// results as draw + [`Self::split`] + [`Self::accepted`] + [`Self::fill_histogram`],
    /// without their intermediate vectors and extra passes.
    ///
    /// The cut is found on the histogram itself: a draft's bin is a non-decreasing function
    /// of its cumulative confidence, so drafts in bins above the cut's bin rank before every
    /// draft in it, and only the cut's bin needs the exact (rank, sequence, position) order.
    /// The histogram is counted anyway, so the split costs no counting of its own.
    pub fn step_rank(
        &self,
        seqs: &[DecodeSeq],
        budget: Option<u32>,
        next_word: impl FnMut() -> u64,
        scratch: &mut RankScratch,
        out: &mut [SeqOutcome],
        hist: &mut ConfidenceHistogram,
    ) -> RankStep {
        // DSpark drafts 5 tokens: with the row length known the per-draft loops unroll.
        if self.drafts == RECORD_DRAFTS {
            self.step_rank_d::<RECORD_DRAFTS>(seqs, budget, next_word, scratch, out, hist)
        } else {
            self.step_rank_d::<0>(seqs, budget, next_word, scratch, out, hist)
        }
    }

    /// [`Self::step_rank`] for rows of `D` drafts read from `records` (`D` = [`RECORD_DRAFTS`]),
    /// or (`D` = 0) of `self.drafts` drafts read from the per-quantity tables. Each phase is an
    /// `#[inline(always)]` helper called once, so the phases compile into one loop nest as a
    /// single function would.
    fn step_rank_d<const D: usize>(
        &self,
        seqs: &[DecodeSeq],
        budget: Option<u32>,
        next_word: impl FnMut() -> u64,
        scratch: &mut RankScratch,
        out: &mut [SeqOutcome],
        hist: &mut ConfidenceHistogram,
    ) -> RankStep {
        let n = seqs.len();
        let out = &mut out[..n];
        let RankScratch {
            packed,
            rows,
            at_cut,
            keys,
            count,
            sum,
        } = scratch;
        let (kv, max_kv, total) = self.count_drafts::<D>(seqs, next_word, packed, rows, count, sum);
        self.merge_histogram::<D>(packed, count, sum, hist);
        hist.seqs = n as u32;
        let budget = match budget {
            Some(b) if (b as usize) < total => b as usize,
            // Everything allowed is verified.
            _ => {
                return RankStep {
                    kv_tokens: kv,
                    max_kv_tokens: u64::from(max_kv),
                    verified: verify_all(packed, out),
                };
            }
        };
        let (cut, above) = cut_bin(hist, budget);
        let (mut verified, n_cut) = self.verify_above_cut::<D>(packed, rows, cut, at_cut, out);
        self.cut_keys::<D>(packed, &at_cut[..n_cut], cut, out, keys);
        let need = budget - above;
        if need > 0 {
            verified += verify_best_at_cut(keys, need, packed, out);
        }
        RankStep {
            kv_tokens: kv,
            max_kv_tokens: u64::from(max_kv),
            verified,
        }
    }

    /// Drafts per row: `D`, or `self.drafts` when `D` is 0.
    #[inline(always)]
    fn row_len<const D: usize>(&self) -> usize {
        if D > 0 { D } else { self.drafts }
    }

    /// Prefetches what the first pass reads of the packed word `w`'s profile.
    #[inline(always)]
    fn prefetch_row<const D: usize>(&self, w: u64) {
        let p = word_profile(w);
        if D == RECORD_DRAFTS {
            prefetch((&raw const self.records[p]).cast());
            prefetch((&raw const self.bin_rows[p]).cast());
        } else {
            prefetch((&raw const self.bin[p * self.row_len::<D>()]).cast());
        }
    }

    /// The first pass: draws every sequence's word first (in sequence order, as the unfused
    /// path, so the records can be prefetched ahead of use), then packs each with its drafts
    /// allowed and accepted and counts its drafts into the lanes' bins. Returns the KV tokens,
    /// the longest KV and the drafts allowed in all.
    #[inline(always)]
    fn count_drafts<const D: usize>(
        &self,
        seqs: &[DecodeSeq],
        mut next_word: impl FnMut() -> u64,
        packed: &mut Vec<u64>,
        rows: &mut Vec<u64>,
        count: &mut [u32; CONFIDENCE_BINS],
        sum: &mut [[f64; CONFIDENCE_BINS]; RankScratch::LANES],
    ) -> (u64, u32, usize) {
        let d = self.row_len::<D>();
        let n = seqs.len();
        packed.clear();
        if D == RECORD_DRAFTS {
            rows.resize(n, 0);
        }
        packed.extend((0..n).map(|_| {
            let x = next_word();
            x & 0xffff_ffff | u64::from(self.draw_from_word(x).0) << 32
        }));
        for &w in &packed[..n.min(PREFETCH_AHEAD)] {
            self.prefetch_row::<D>(w);
        }
        let (mut kv, mut total) = (0u64, 0usize);
        let mut max_kv = 0u32;
        for s in 0..n {
            if let Some(&w) = packed.get(s + PREFETCH_AHEAD) {
                self.prefetch_row::<D>(w);
            }
            let q = &seqs[s];
            let w = packed[s];
            let m = (q.max_drafts as usize).min(d);
            kv += u64::from(q.kv_tokens);
            max_kv = max_kv.max(q.kv_tokens);
            total += m;
            let p = word_profile(w);
            let accepts = self.accepts::<D>(p, w);
            packed[s] = w | (m as u64) << 48 | u64::from(accepts) << 56;
            let sum = &mut sum[s % RankScratch::LANES];
            if D == RECORD_DRAFTS {
                let (r, row) = (&self.records[p], self.bin_rows[p]);
                rows[s] = row & ((1u64 << (8 * m)) - 1);
                for i in 0..D {
                    if i < m {
                        let b = (row >> (8 * i)) as usize & BIN_MASK;
                        count[b] += 1;
                        sum[b] += r.cum_conf[i];
                    }
                }
            } else {
                let base = p * d;
                for (&b, &c) in self.bin[base..base + m]
                    .iter()
                    .zip(&self.cum_conf[base..base + m])
                {
                    let b = b as usize & BIN_MASK;
                    count[b] += 1;
                    sum[b] += c;
                }
            }
        }
        (kv, max_kv, total)
    }

    /// The drafts of profile `p` that the packed word `w`'s uniform accepts, out of the whole
    /// row: entries above the uniform are a prefix of the non-increasing row (see `accepted`).
    #[inline(always)]
    fn accepts<const D: usize>(&self, p: usize, w: u64) -> u8 {
        if D == RECORD_DRAFTS {
            let r = &self.records[p];
            let x = w as u32;
            let n: u8 = r.accept_upto.iter().map(|&t| u8::from(x <= t)).sum();
            n.min(r.accept_cap)
        } else {
            let d = self.row_len::<D>();
            let u = (w & 0xffff_ffff) as f64 / 4_294_967_296.0;
            self.cum_true[p * d..(p + 1) * d]
                .iter()
                .map(|&c| u8::from(c > u))
                .sum()
        }
    }

    /// Every bin at once (vector adds, no record of which bins were touched): what
    /// `fill_histogram` leaves in an empty histogram, the lanes reset for the next call.
    #[inline(always)]
    fn merge_histogram<const D: usize>(
        &self,
        packed: &[u64],
        count: &mut [u32; CONFIDENCE_BINS],
        sum: &mut [[f64; CONFIDENCE_BINS]; RankScratch::LANES],
        hist: &mut ConfidenceHistogram,
    ) {
        hist.count.resize(CONFIDENCE_BINS, 0);
        hist.sum.resize(CONFIDENCE_BINS, 0.0);
        let (hist_count, hist_sum) = (
            &mut hist.count[..CONFIDENCE_BINS],
            &mut hist.sum[..CONFIDENCE_BINS],
        );
        let [s0, s1, s2, s3] = sum;
        if packed.len() <= SMALL_RANK_SEQS {
            // A rank of a few sequences touches a few bins: merging all 64 cost more than its
            // drafts did (+8 % on the small-unit bench). Same bits: untouched bins are zero
            // either way, touched ones are summed in the same order.
            let mut touched = self.touched_bins::<D>(packed);
            hist_count.fill(0);
            hist_sum.fill(0.0);
            while touched != 0 {
                let b = touched.trailing_zeros() as usize;
                touched &= touched - 1;
                hist_count[b] = std::mem::take(&mut count[b]);
                hist_sum[b] = ((s0[b] + s1[b]) + s2[b]) + s3[b];
                (s0[b], s1[b], s2[b], s3[b]) = (0.0, 0.0, 0.0, 0.0);
            }
        } else {
            for b in 0..CONFIDENCE_BINS {
                hist_count[b] = std::mem::take(&mut count[b]);
                hist_sum[b] = ((s0[b] + s1[b]) + s2[b]) + s3[b];
                (s0[b], s1[b], s2[b], s3[b]) = (0.0, 0.0, 0.0, 0.0);
            }
        }
    }

    /// The bins the allowed drafts of the packed words fall in, bit `b` for bin `b`.
    #[inline(always)]
    fn touched_bins<const D: usize>(&self, packed: &[u64]) -> u64 {
        let d = self.row_len::<D>();
        let mut touched = 0u64;
        for &w in packed.iter() {
            let (p, m) = (word_profile(w), ((w >> 48) & 0xff) as usize);
            if D == RECORD_DRAFTS {
                let row = self.bin_rows[p];
                for i in 0..m {
                    touched |= 1 << ((row >> (8 * i)) as usize & BIN_MASK);
                }
            } else {
                for &b in &self.bin[p * d..p * d + m] {
                    touched |= 1 << (b as usize & BIN_MASK);
                }
            }
        }
        touched
    }

    /// The second pass: each sequence verifies its drafts in bins above the cut; the sequences
    /// with drafts in the cut's bin are listed in `at_cut`. Returns the drafts verified and
    /// the number listed.
    #[inline(always)]
    fn verify_above_cut<const D: usize>(
        &self,
        packed: &[u64],
        rows: &[u64],
        cut: usize,
        at_cut: &mut Vec<u32>,
        out: &mut [SeqOutcome],
    ) -> (u32, usize) {
        let d = self.row_len::<D>();
        let mut verified = 0u32;
        // Per byte of a bin row: adding `0x7f - cut` sets the byte's top bit iff its bin lies
        // above the cut (bins are below 64, so no byte carries into the next).
        const ONES: u64 = 0x0101_0101_0101_0101;
        let over = ONES * (0x7f - cut as u64);
        // Sequences at the cut are listed without a branch (they are few and unpredictable).
        at_cut.resize(packed.len(), 0);
        let mut n_cut = 0;
        for (s, (o, &w)) in out.iter_mut().zip(packed.iter()).enumerate() {
            let (m, a) = (((w >> 48) & 0xff) as usize, (w >> 56) as u8);
            // Bins never rise along a sequence: those above the cut are a prefix, and the
            // ones in the cut's bin follow it.
            let (l, next) = if D == RECORD_DRAFTS {
                let row = rows[s];
                let above = ((row + over) >> 7) & ONES;
                let l = (above.wrapping_mul(ONES) >> 56) as usize;
                (l, (row >> (8 * l)) as u8)
            } else {
                let p = word_profile(w);
                let row = &self.bin[p * d..p * d + m];
                let l = row.iter().map(|&b| usize::from(b as usize > cut)).sum();
                (l, row.get(l).copied().unwrap_or(0))
            };
            at_cut[n_cut] = s as u32;
            n_cut += usize::from(l < m && next as usize == cut);
            verified += l as u32;
            *o = SeqOutcome {
                verified: l as u8,
                accepted: a.min(l as u8),
            };
        }
        (verified, n_cut)
    }

    /// The drafts in the cut's bin of the sequences `at_cut`, as (rank, sequence, position)
    /// keys into `keys`.
    #[inline(always)]
    fn cut_keys<const D: usize>(
        &self,
        packed: &[u64],
        at_cut: &[u32],
        cut: usize,
        out: &[SeqOutcome],
        keys: &mut Vec<u64>,
    ) {
        let d = self.row_len::<D>();
        keys.clear();
        for &s in at_cut {
            let w = packed[s as usize];
            let (m, l) = (
                ((w >> 48) & 0xff) as usize,
                out[s as usize].verified as usize,
            );
            let base = word_profile(w) * d;
            let at = self.bin[base..base + m].iter().enumerate().skip(l);
            for (i, _) in at.take_while(|&(_, &b)| b as usize == cut) {
                keys.push(u64::from(self.rank[base + i]) << 32 | u64::from(s) << 8 | i as u64);
            }
        }
    }

    /// Draws (profile, uniform) for one sequence-step from one random word.
    #[inline]
    pub fn draw(&self, rng: &mut impl Rng) -> (u32, f64) {
        self.draw_from_word(rng.random())
    }

    /// [`Self::draw`] from a random word the caller already has.
    #[inline]
    pub fn draw_from_word(&self, x: u64) -> (u32, f64) {
        let p = (((x >> 32) * self.profiles as u64) >> 32) as u32;
        let u = (x & 0xffff_ffff) as f64 / 4_294_967_296.0;
        (p, u)
    }

    /// Drafts accepted out of the first `len` when the uniform draw is `u`.
    #[inline]
    pub fn accepted(&self, profile: u32, len: u8, u: f64) -> u8 {
        let row = &self.cum_true[profile as usize * self.drafts..][..len as usize];
        // The cumulative row never increases, so the entries above `u` are a prefix: counting
        // them without an early exit gives the same answer and no branch per draft.
        row.iter().map(|&c| u8::from(c > u)).sum()
    }

    /// Splits `budget` over sequences with profiles `prof` and limits `max_drafts`, exactly as
    /// [`servelab_core::engine::dspark::split_budget`] would on the tabulated confidences, in
    /// O(sequences × drafts) whatever the table size. Each candidate draft has the key
    /// (confidence rank, sequence, position) and the `budget` smallest keys are taken: a
    /// counting pass over coarse rank buckets finds the bucket where the cut falls, drafts in
    /// lower buckets are all taken, and only the few in the cut's bucket are ordered exactly.
    /// `keys` is scratch.
    pub fn split(
        &self,
        prof: &[u32],
        max_drafts: &[u32],
        budget: u32,
        keys: &mut Vec<u64>,
        lens: &mut [u8],
    ) {
        let d = self.drafts;
        let mut total = 0usize;
        for (l, &m) in lens.iter_mut().zip(max_drafts) {
            let m = (m as usize).min(d);
            *l = m as u8;
            total += m;
        }
        let budget = budget as usize;
        if budget >= total {
            return;
        }
        let lens = &mut lens[..prof.len()];
        lens.iter_mut().for_each(|l| *l = 0);
        if budget == 0 {
            return;
        }
        let mut count = [0u32; RANK_BUCKETS];
        for (&p, &m) in prof.iter().zip(max_drafts) {
            let m = (m as usize).min(d);
            for &b in &self.bucket[p as usize * d..p as usize * d + m] {
                count[b as usize] += 1;
            }
        }
        // The cut's bucket `cut`: fewer than `budget` drafts lie below it, at least that many
        // up to and including it.
        let (mut cut, mut below) = (0usize, 0usize);
        while below + count[cut] as usize <= budget {
            below += count[cut] as usize;
            cut += 1;
            if cut == RANK_BUCKETS {
                break;
            }
        }
        keys.clear();
        for (s, ((&p, &m), l)) in prof.iter().zip(max_drafts).zip(lens.iter_mut()).enumerate() {
            let m = (m as usize).min(d);
            // Ranks never fall along a sequence (cumulative confidence never rises), so the
            // drafts below the cut are a prefix and those in the cut's bucket follow it.
            let base = p as usize * d;
            for (i, &b) in self.bucket[base..base + m].iter().enumerate() {
                let b = b as usize;
                if b < cut {
                    *l += 1;
                } else if b == cut {
                    let r = self.rank[base + i];
                    keys.push(u64::from(r) << 32 | (s as u64) << 8 | i as u64);
                } else {
                    break;
                }
            }
        }
        let need = budget - below;
        if need == 0 {
            return;
        }
        keys.select_nth_unstable(need - 1);
        // Ties go to the earlier position, so a sequence's selected drafts in the cut's bucket
        // continue its prefix: count them.
        for &k in &keys[..need] {
            lens[((k >> 8) & 0xff_ffff) as usize] += 1;
        }
    }

    /// Adds every sequence's first `max_drafts[s]` drafts (profiles `prof`) to `h`, which must
    /// be empty. Consecutive sequences go to four interleaved lanes merged at the end: most
    /// drafts land in the same few high-confidence bins, and a single accumulator per bin
    /// would chain every add on the previous one through memory.
    pub fn fill_histogram(&self, h: &mut ConfidenceHistogram, prof: &[u32], max_drafts: &[u32]) {
        const LANES: usize = 4;
        let mut count = [[0u32; CONFIDENCE_BINS]; LANES];
        let mut sum = [[0.0f64; CONFIDENCE_BINS]; LANES];
        let d = self.drafts;
        for (s, (&p, &m)) in prof.iter().zip(max_drafts).enumerate() {
            let base = p as usize * d;
            let m = (m as usize).min(d);
            let (c, t) = (&mut count[s % LANES], &mut sum[s % LANES]);
            for (&b, &x) in self.bin[base..base + m]
                .iter()
                .zip(&self.cum_conf[base..base + m])
            {
                c[b as usize] += 1;
                t[b as usize] += x;
            }
        }
        for b in 0..CONFIDENCE_BINS {
            h.count[b] += count.iter().map(|c| c[b]).sum::<u32>();
            h.sum[b] += ((sum[0][b] + sum[1][b]) + sum[2][b]) + sum[3][b];
        }
        h.seqs += prof.len() as u32;
    }

    /// Adds a sequence's first `m` drafts to a confidence histogram.
    #[inline]
    pub fn add_to_histogram(&self, h: &mut ConfidenceHistogram, profile: u32, m: u32) {
        let base = profile as usize * self.drafts;
        for i in 0..(m as usize).min(self.drafts) {
            let b = self.bin[base + i] as usize;
            h.count[b] += 1;
            h.sum[b] += self.cum_conf[base + i];
        }
        h.seqs += 1;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zero_and_too_many_drafts_are_refused() {
        for d in [0, MAX_DRAFTS + 1, u32::MAX] {
            let e = validate_drafts(d, "point.draft_tokens")
                .unwrap_err()
                .to_string();
            assert!(e.contains("point.draft_tokens"), "{e}");
            assert!(AcceptanceTable::try_new(&AcceptanceModel::default(), d, 1).is_err());
        }
        assert!(AcceptanceTable::try_new(&AcceptanceModel::default(), 1, 1).is_ok());
    }

    use super::*;
    use proptest::prelude::*;
    use servelab_core::engine::dspark::split_budget;

    #[test]
    fn normal_quantiles() {
        assert!(inverse_normal_cdf(0.5).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.975) - 1.959_964).abs() < 1e-5);
        assert!((inverse_normal_cdf(0.01) + 2.326_348).abs() < 1e-5);
    }

    #[test]
    fn small_table_keeps_the_mean() {
        let t = AcceptanceTable::new(&AcceptanceModel::default(), 5, 1);
        let mean: f64 = (0..t.profiles)
            .map(|p| 1.0 + t.cum_true[p * 5..p * 5 + 5].iter().sum::<f64>())
            .sum::<f64>()
            / t.profiles as f64;
        assert!((mean - 3.29).abs() < 0.08, "{mean}");
    }

    #[test]
    fn default_model_accepts_about_3_29_with_fixed_five() {
        let t = AcceptanceTable::new(
            &AcceptanceModel {
                profiles: 4096,
                ..Default::default()
            },
            5,
            1,
        );
        let mean: f64 = (0..t.profiles)
            .map(|p| 1.0 + t.cum_true[p * 5..p * 5 + 5].iter().sum::<f64>())
            .sum::<f64>()
            / t.profiles as f64;
        assert!((mean - 3.29).abs() < 0.08, "{mean}");
    }

    proptest! {
        /// The interleaved histogram fill counts exactly what per-sequence adds count, and its
        /// sums differ only by rounding.
        #[test]
        fn fill_histogram_matches_per_sequence_adds(seed in 0u64..1000, prof in proptest::collection::vec(0u32..64, 0..90),
                                                    maxes in proptest::collection::vec(0u32..7, 90)) {
            let t = AcceptanceTable::new(&AcceptanceModel { profiles: 64, ..Default::default() }, 5, seed);
            let n = prof.len();
            let mut want = ConfidenceHistogram::default();
            for (&p, &m) in prof.iter().zip(&maxes[..n]) {
                t.add_to_histogram(&mut want, p, m);
            }
            let mut got = ConfidenceHistogram::default();
            t.fill_histogram(&mut got, &prof, &maxes[..n]);
            prop_assert_eq!(got.seqs, want.seqs);
            prop_assert_eq!(&got.count, &want.count);
            for (a, b) in got.sum.iter().zip(&want.sum) {
                prop_assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{} vs {}", a, b);
            }
        }

        /// The fused rank step gives exactly (bit for bit) what the separate draw, split,
        /// accepted-length and histogram passes give on the same draws, on the 5-draft record
        /// path and the generic one, with and without a budget, saturated confidences included.
        #[test]
        fn step_rank_matches_the_separate_passes(seed in 0u64..1000, drafts in prop_oneof![Just(5u32), 1u32..8],
                                                 saturated in any::<bool>(),
                                                 maxes in proptest::collection::vec(0u32..8, 0..70),
                                                 budget in proptest::option::of(0u32..300), words_seed in any::<u64>()) {
            let m = if saturated {
                AcceptanceModel { mean_logit: 30.0, seq_sigma: 20.0, token_sigma: 5.0, profiles: 512, ..Default::default() }
            } else {
                AcceptanceModel { profiles: 512, ..Default::default() }
            };
            let t = AcceptanceTable::new(&m, drafts, seed);
            let d = drafts;
            let seqs: Vec<DecodeSeq> = maxes.iter().enumerate().map(|(i, &x)| DecodeSeq {
                request: servelab_core::RequestId(i as u64),
                kv_tokens: 1000 + i as u32,
                max_drafts: x,
                slot: i as u32,
            }).collect();
            let mut state = words_seed;
            let mut word = move || {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                state ^ (state >> 29)
            };
            let words: Vec<u64> = (0..seqs.len()).map(|_| word()).collect();
            // Reference: the separate passes.
            let draws: Vec<(u32, f64)> = words.iter().map(|&w| t.draw_from_word(w)).collect();
            let prof: Vec<u32> = draws.iter().map(|x| x.0).collect();
            let lim: Vec<u32> = seqs.iter().map(|s| s.max_drafts.min(d)).collect();
            let mut lens = vec![0u8; seqs.len()];
            match budget {
                Some(b) => t.split(&prof, &lim, b, &mut Vec::new(), &mut lens),
                None => lens.iter_mut().zip(&lim).for_each(|(l, &x)| *l = x as u8),
            }
            let want: Vec<SeqOutcome> = (0..seqs.len()).map(|i| SeqOutcome {
                verified: lens[i],
                accepted: t.accepted(prof[i], lens[i], draws[i].1),
            }).collect();
            let mut want_hist = ConfidenceHistogram::default();
            t.fill_histogram(&mut want_hist, &prof, &lim);
            // Fused, reusing scratch and histogram from an unrelated earlier call.
            let mut scratch = RankScratch::default();
            let mut hist = ConfidenceHistogram::default();
            let mut out = vec![SeqOutcome::default(); seqs.len()];
            let mut other = words.iter().rev().copied();
            t.step_rank(&seqs, Some(7), || other.next().unwrap_or(3), &mut scratch, &mut out, &mut hist);
            let mut it = words.iter().copied();
            let got = t.step_rank(&seqs, budget, || it.next().expect("one word per sequence"), &mut scratch, &mut out, &mut hist);
            prop_assert_eq!(&out, &want);
            prop_assert_eq!(got.verified, lens.iter().map(|&l| u32::from(l)).sum::<u32>());
            prop_assert_eq!(got.kv_tokens, seqs.iter().map(|s| u64::from(s.kv_tokens)).sum::<u64>());
            prop_assert_eq!(got.max_kv_tokens, seqs.iter().map(|s| u64::from(s.kv_tokens)).max().unwrap_or(0));
            prop_assert_eq!(hist.seqs, want_hist.seqs);
            prop_assert_eq!(&hist.count, &want_hist.count);
            let bits = |h: &ConfidenceHistogram| h.sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&hist), bits(&want_hist));
        }

        #[test]
        fn fast_split_matches_the_kernel(seed in 0u64..1000, prof in proptest::collection::vec(0u32..16, 1..40),
                                         maxes in proptest::collection::vec(0u32..6, 40), budget in 0u32..250) {
            let t = AcceptanceTable::new(&AcceptanceModel { profiles: 16, ..Default::default() }, 5, seed);
            let n = prof.len();
            let conf: Vec<f64> = prof.iter().flat_map(|&p| t.conf[p as usize * 5..p as usize * 5 + 5].to_vec()).collect();
            let mut want = vec![0u8; n];
            split_budget(&conf, 5, &maxes[..n], budget, &mut want);
            let mut got = vec![0u8; n];
            t.split(&prof, &maxes[..n], budget, &mut Vec::new(), &mut got);
            prop_assert_eq!(got, want);
        }

        /// A large table with saturated confidences (many exact ties at 1.0 across profiles)
        /// still splits exactly as the kernel does.
        #[test]
        fn fast_split_matches_the_kernel_with_ties(seed in 0u64..1000, prof in proptest::collection::vec(0u32..4096, 1..80),
                                                   maxes in proptest::collection::vec(0u32..6, 80), budget in 0u32..400) {
            let m = AcceptanceModel { mean_logit: 30.0, seq_sigma: 20.0, token_sigma: 5.0, profiles: 4096, ..Default::default() };
            let t = AcceptanceTable::new(&m, 5, seed);
            let n = prof.len();
            let conf: Vec<f64> = prof.iter().flat_map(|&p| t.conf[p as usize * 5..p as usize * 5 + 5].to_vec()).collect();
            let mut want = vec![0u8; n];
            split_budget(&conf, 5, &maxes[..n], budget, &mut want);
            let mut got = vec![0u8; n];
            t.split(&prof, &maxes[..n], budget, &mut Vec::new(), &mut got);
            prop_assert_eq!(got, want);
        }
    }
}
