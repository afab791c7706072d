//! When requests reach the unit: at the workload's times (open loop), or, for the later turns
//! of a session, when the previous reply ended plus the user's think time (closed loop).
//!
//! The requests come either as a table the unit was given whole, or as a stream
//! ([`RequestFeed`]) read a few requests ahead of the clock and handed to the unit one at a
//! time, so that a run's memory does not grow with its length (open loop only: a closed-loop
//! turn's time depends on the trace's next turn of the session, which a stream has not read).

use crate::service::Arrivals;
use servelab_core::content::{KeyBuildHasher, prefetch_read};
use servelab_core::unit::{RunError, ServingUnit};
use servelab_core::{ConfigError, Nanos, Request, SessionId};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

const NONE: u32 = u32::MAX;

/// Requests in arrival order, one at a time (a workload stream, a trace read as it goes).
pub type RequestFeed = Box<dyn Iterator<Item = Result<Request, ConfigError>> + Send>;

/// A table given up to the run, as a feed: each request is handed over in turn, and the unit
/// drops it once served. The unit's first reads of a request are its chain's header and keys,
/// a cache miss each in a trace generated long before the request arrives, so the feed starts
/// loading them a few requests ahead (a hint only: it changes no result).
pub fn table_feed(requests: Vec<Request>) -> RequestFeed {
    Box::new(TableFeed {
        rest: requests.into_iter(),
    })
}

struct TableFeed {
    rest: std::vec::IntoIter<Request>,
}

/// How many requests ahead the feed starts loading a request's chain header, and its keys
/// (whose address is in the header, so loaded a few requests after it).
const CHAIN_AHEAD: usize = 8;
const KEYS_AHEAD: usize = 4;

impl Iterator for TableFeed {
    type Item = Result<Request, ConfigError>;

    fn next(&mut self) -> Option<Self::Item> {
        let ahead = self.rest.as_slice();
        if let Some(r) = ahead.get(CHAIN_AHEAD) {
            prefetch_read(Arc::as_ptr(&r.content));
        }
        if let Some(r) = ahead.get(KEYS_AHEAD) {
            prefetch_read(r.content.full_blocks(u32::MAX).as_ptr());
        }
        self.rest.next().map(Ok)
    }
}

/// How many requests past the one arriving the unit is given (it prefetches what the next
/// two arrivals will read).
const GIVEN_AHEAD: u32 = 2;

pub struct ArrivalSource {
    /// Requests that arrive at their own time, in order, with their times (all of them in
    /// open loop; a table only).
    open: Vec<(Nanos, u32)>,
    cursor: usize,
    /// Per request: the session's next turn (closed loop), or [`NONE`].
    next_turn: Vec<u32>,
    /// Per request: its trace arrival and output length (closed loop).
    timing: Vec<(Nanos, u32)>,
    /// The pacing the workload assumed for a reply: (TTFT, tokens per second).
    pacing: Option<(Nanos, f64)>,
    stream: Option<Streamed>,
}

/// A stream's requests read and not yet given to the unit.
struct Streamed {
    feed: RequestFeed,
    read: VecDeque<Request>,
    /// How many requests were read from the feed.
    count: u32,
    last_arrival: Nanos,
}

impl Streamed {
    /// Reads the feed's next request into `read`; false when the feed is done.
    fn read_one(&mut self) -> Result<bool, RunError> {
        let Some(r) = self.feed.next() else {
            return Ok(false);
        };
        let r = r.map_err(|e| RunError::Environment(format!("workload: {e}")))?;
        if r.arrival < self.last_arrival {
            return Err(RunError::Environment(format!(
                "workload: requests not sorted by arrival at {} ({} after {})",
                r.id, r.arrival, self.last_arrival
            )));
        }
        if self.count == NONE - 1 {
            return Err(RunError::Environment(
                "workload: a unit serves fewer than 2^32 - 1 requests".into(),
            ));
        }
        self.last_arrival = r.arrival;
        self.count += 1;
        self.read.push_back(r);
        Ok(true)
    }
}

impl ArrivalSource {
    /// The arrivals of `reqs`, a table the unit holds whole.
    pub fn new(cfg: &Arrivals, reqs: &[Request]) -> Self {
        let n = reqs.len();
        let Arrivals::ClosedLoop {
            ttft,
            decode_tokens_per_s,
        } = *cfg
        else {
            return ArrivalSource {
                open: reqs
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.arrival, i as u32))
                    .collect(),
                cursor: 0,
                next_turn: Vec::new(),
                timing: Vec::new(),
                pacing: None,
                stream: None,
            };
        };
        let mut next_turn = vec![NONE; n];
        let mut is_open = vec![true; n];
        let mut last: HashMap<SessionId, u32, KeyBuildHasher> = HashMap::default();
        for (i, r) in reqs.iter().enumerate() {
            if let Some(s) = r.session
                && let Some(prev) = last.insert(s, i as u32)
            {
                next_turn[prev as usize] = i as u32;
                is_open[i] = false;
            }
        }
        let open = (0..n)
            .filter(|&i| is_open[i])
            .map(|i| (reqs[i].arrival, i as u32))
            .collect();
        ArrivalSource {
            open,
            cursor: 0,
            next_turn,
            timing: reqs.iter().map(|r| (r.arrival, r.output_tokens)).collect(),
            pacing: Some((ttft, decode_tokens_per_s)),
            stream: None,
        }
    }

    /// The arrivals of a stream, each request at its own time (open loop).
    pub fn streamed(feed: RequestFeed) -> Self {
        ArrivalSource {
            open: Vec::new(),
            cursor: 0,
            next_turn: Vec::new(),
            timing: Vec::new(),
            pacing: None,
            stream: Some(Streamed {
                feed,
                read: VecDeque::new(),
                count: 0,
                last_arrival: Nanos::ZERO,
            }),
        }
    }

    /// Whether request `i` arrives at its own time (the next open arrival follows it).
    pub fn is_open(&self, i: u32) -> bool {
        // Closed loop: a request is open unless it is a session's later turn.
        self.stream.is_some()
            || self.pacing.is_none()
            || self.open.binary_search_by_key(&i, |&(_, j)| j).is_ok()
    }

    /// The next request that arrives at its own time. A stream's may already be in `unit`
    /// (given ahead), which is `None` only before the run starts.
    pub fn next_open(
        &mut self,
        unit: Option<&ServingUnit>,
    ) -> Result<Option<(Nanos, u32)>, RunError> {
        let Some(s) = self.stream.as_mut() else {
            let next = self.open.get(self.cursor).copied();
            self.cursor += 1;
            return Ok(next);
        };
        let i = self.cursor as u32;
        let given = s.count - s.read.len() as u32;
        let arrival = if i < given {
            let r = unit.and_then(|u| u.request(i)).ok_or_else(|| {
                RunError::Invariant(format!("request {i} was given and is not held"))
            })?;
            r.arrival
        } else {
            let k = (i - given) as usize;
            while s.read.len() <= k {
                if !s.read_one()? {
                    return Ok(None);
                }
            }
            s.read[k].arrival
        };
        self.cursor += 1;
        Ok(Some((arrival, i)))
    }

    /// Request `i` is about to arrive: the unit is given it, and the next few (a stream only;
    /// a table's unit holds them all).
    pub fn give(&mut self, i: u32, unit: &mut ServingUnit) -> Result<(), RunError> {
        let Some(s) = self.stream.as_mut() else {
            return Ok(());
        };
        while unit.requests_given() <= i + GIVEN_AHEAD {
            if s.read.is_empty() && !s.read_one()? {
                break;
            }
            let r = s.read.pop_front().expect("a request was read");
            unit.push_request(r)
                .map_err(|e| RunError::Environment(format!("workload: {e}")))?;
        }
        Ok(())
    }

    /// Request `i` ended at `now`: when its session's next turn arrives (closed loop only).
    pub fn follow(&self, now: Nanos, i: u32) -> Option<(Nanos, u32)> {
        let (ttft, rate) = self.pacing?;
        let next = *self.next_turn.get(i as usize)?;
        if next == NONE {
            return None;
        }
        let ((arrival, output), (next_arrival, _)) =
            (self.timing[i as usize], self.timing[next as usize]);
        let assumed = ttft + Nanos::from_secs_f64(f64::from(output) / rate);
        let think = next_arrival.saturating_sub(arrival).saturating_sub(assumed);
        Some((now + think, next))
    }
}
