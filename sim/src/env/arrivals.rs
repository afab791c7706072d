//! When requests reach the unit: at the workload's times (open loop), or, for the later turns
//! of a session, when the previous reply ended plus the user's think time (closed loop).

use crate::service::Arrivals;
use servelab_core::content::KeyBuildHasher;
use servelab_core::{Nanos, Request, SessionId};
use std::collections::HashMap;

const NONE: u32 = u32::MAX;

pub struct ArrivalSource {
    /// Requests that arrive at their own time, in order (all of them in open loop).
    open: Vec<u32>,
    cursor: usize,
    /// Per request: the session's next turn (closed loop), or [`NONE`].
    next_turn: Vec<u32>,
    /// Per request: it arrives at its own time.
    is_open: Vec<bool>,
    /// The pacing the workload assumed for a reply: (TTFT, tokens per second).
    pacing: Option<(Nanos, f64)>,
}

impl ArrivalSource {
    pub fn new(cfg: &Arrivals, reqs: &[Request]) -> Self {
        let n = reqs.len();
        let Arrivals::ClosedLoop {
            ttft,
            decode_tokens_per_s,
        } = *cfg
        else {
            return ArrivalSource {
                open: (0..n as u32).collect(),
                cursor: 0,
                next_turn: Vec::new(),
                is_open: vec![true; n],
                pacing: None,
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
        let open = (0..n as u32).filter(|&i| is_open[i as usize]).collect();
        ArrivalSource {
            open,
            cursor: 0,
            next_turn,
            is_open,
            pacing: Some((ttft, decode_tokens_per_s)),
        }
    }

    pub fn is_open(&self, i: u32) -> bool {
        self.is_open[i as usize]
    }

    /// The next request that arrives at its own time.
    pub fn next_open(&mut self, reqs: &[Request]) -> Option<(Nanos, u32)> {
        let i = *self.open.get(self.cursor)?;
        self.cursor += 1;
        Some((reqs[i as usize].arrival, i))
    }

    /// Request `i` ended at `now`: when its session's next turn arrives (closed loop only).
    pub fn follow(&self, now: Nanos, i: u32, reqs: &[Request]) -> Option<(Nanos, u32)> {
        let (ttft, rate) = self.pacing?;
        let next = *self.next_turn.get(i as usize)?;
        if next == NONE {
            return None;
        }
        let (r, n) = (&reqs[i as usize], &reqs[next as usize]);
        let assumed = ttft + Nanos::from_secs_f64(f64::from(r.output_tokens) / rate);
        let think = n.arrival.saturating_sub(r.arrival).saturating_sub(assumed);
        Some((now + think, next))
    }
}
