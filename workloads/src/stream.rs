//! The generated workloads as a stream: requests drawn as they are needed, in the order of a
//! generated trace (arrival, then class, session and turn), so a run of days does not hold
//! its requests in memory. What is held is what is still to come: one visit per session that
//! is in the middle of one, the context of every session that will return, the next start of
//! each class, and the documents seen so far (a segment id and a length each).
//!
//! Every entry of the queue is keyed by the key of the first request it will release, and
//! what it releases is never earlier: so popping in key order releases requests in key order,
//! and a request is released only when nothing still to be drawn can come before it.
//! [`crate::generate::generate`] is this stream collected, so a trace and a stream of the
//! same config and seed hold the same requests.
//!
//! Sampling ([`SessionSample`]) keeps one session in `one_in`, by a hash of its id, before it
//! is drawn: a sampled stream costs what its sample holds. Documents are sampled by a hash of
//! the document, so that every request about a kept document is kept.

use crate::BlockBudget;
use crate::dist::Dist;
use crate::generate::{AgentConfig, ChatConfig, Diurnal, DocumentConfig, WorkloadConfig};
use crate::visit::{
    Draft, Epoch, Key, Revisits, Session, Visit, agent_visit, arrival, chat_visit, fresh,
    push_segment, system_prompt_lengths, system_segment,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::content::hash2;
use servelab_core::seed::sub_seed;
use servelab_core::{
    ChainBuilder, ConfigError, Nanos, Request, RequestId, SegmentId, SessionId, TrafficClass,
};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::sync::Arc;

/// Keep one session (or document) in `one_in`, chosen by a hash of its id and `seed`: the
/// spatial sampling SHARDS uses for caches, applied to whole sessions so that a kept session
/// keeps every turn and every return.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionSample {
    pub one_in: u32,
    #[serde(default)]
    pub seed: u64,
}

impl SessionSample {
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if self.one_in == 0 {
            return Err(ConfigError::invalid(
                format!("{field}.one_in"),
                "must be at least 1 (1 keeps every session)",
            ));
        }
        Ok(())
    }
    pub fn keeps(&self, id: u64) -> bool {
        self.one_in <= 1
            || hash2(self.seed ^ 0x5a3b_1e55, id).is_multiple_of(u64::from(self.one_in))
    }
}

/// Session start times (or document arrivals) of one class: a Poisson process from its own
/// stream, thinned to the diurnal rate, drawn one at a time.
struct Starts {
    rng: ChaCha8Rng,
    t_s: f64,
    left: u32,
    exp: Dist,
    peak: f64,
    diurnal: Option<Diurnal>,
}

impl Starts {
    fn new(n: u32, rate_per_s: f64, seed: u64, diurnal: Option<&Diurnal>) -> Self {
        let peak = 1.0 + diurnal.map_or(0.0, |d| d.amplitude);
        Starts {
            rng: ChaCha8Rng::seed_from_u64(seed),
            t_s: 0.0,
            left: n,
            exp: Dist::Exponential {
                mean: 1.0 / (rate_per_s * peak),
            },
            peak,
            diurnal: diurnal.cloned(),
        }
    }
    fn next(&mut self) -> Option<f64> {
        while self.left > 0 {
            self.t_s += self.exp.sample(&mut self.rng);
            // Thinning: keep a candidate with probability rate(t) / peak rate.
            let t = self.t_s;
            let keep = self
                .diurnal
                .as_ref()
                .is_none_or(|d| self.rng.random::<f64>() * self.peak < d.factor(t));
            if keep {
                self.left -= 1;
                return Some(t);
            }
        }
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SessionClass {
    Agent,
    Chat,
}

impl SessionClass {
    fn of(class: TrafficClass) -> Self {
        if class == TrafficClass::Agent {
            SessionClass::Agent
        } else {
            SessionClass::Chat
        }
    }
    fn traffic(self) -> TrafficClass {
        match self {
            SessionClass::Agent => TrafficClass::Agent,
            SessionClass::Chat => TrafficClass::Chat,
        }
    }
    /// The config section, for errors.
    fn field(self) -> &'static str {
        match self {
            SessionClass::Agent => "workload.agent",
            SessionClass::Chat => "workload.chat",
        }
    }
    fn revisits_field(self) -> &'static str {
        match self {
            SessionClass::Agent => "workload.agent.revisits",
            SessionClass::Chat => "workload.chat.revisits",
        }
    }
    fn system_tag(self) -> &'static str {
        match self {
            SessionClass::Agent => "agent.system",
            SessionClass::Chat => "chat.system",
        }
    }
}

/// The sessions of one class: their starts, system prompts and numbering.
struct SessionSource {
    seed: u64,
    sys_len: Vec<u32>,
    starts: Starts,
    /// The index of the next session to start, and the id of session 0.
    next_index: u64,
    first_id: u64,
}

/// The documents: one stream for all of them, since a repeat draws from those seen before.
struct DocumentSource {
    cfg: DocumentConfig,
    rng: ChaCha8Rng,
    sys_len: Vec<u32>,
    starts: Starts,
    next_index: u32,
    /// Documents seen so far: (segment, tokens, system prompt it was sent with), and when each
    /// was first seen (seconds).
    seen: Vec<(SegmentId, u32, usize)>,
    seen_at: Vec<f64>,
}

enum What {
    /// The next session of a class starts.
    Start(SessionClass),
    /// A visit's requests, the next last.
    Turns(Vec<Draft>, Box<Session>),
    /// A session comes back.
    Return(SessionClass, Box<Session>),
    Document,
}

struct Pending {
    key: Key,
    /// When a start, a return or a document begins, in seconds (the generators' own clock, so
    /// the turns after it are drawn exactly as a whole trace draws them); unused by `Turns`.
    start_s: f64,
    what: What,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.cmp(&other.key)
    }
}

/// What a stream holds, to show that it does not grow with the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    pub released: u64,
    /// Sessions waiting to return, now and at most.
    pub returning: u64,
    pub returning_peak: u64,
    /// Entries in the queue at most.
    pub queue_peak: u64,
}

/// The configured workloads, released one request at a time in trace order.
pub struct Stream {
    agent_cfg: Option<AgentConfig>,
    chat_cfg: Option<ChatConfig>,
    block_tokens: u32,
    agent: Option<SessionSource>,
    chat: Option<SessionSource>,
    documents: Option<DocumentSource>,
    queue: BinaryHeap<Reverse<Pending>>,
    sample: Option<SessionSample>,
    until: Option<Nanos>,
    budget: Option<BlockBudget>,
    stats: StreamStats,
}

impl Stream {
    /// The stream of `cfg` with `seed`, keyed at `block_tokens`, keeping the sessions
    /// `sample` keeps (all when `None`).
    pub fn new(
        cfg: &WorkloadConfig,
        seed: u64,
        block_tokens: u32,
        sample: Option<SessionSample>,
    ) -> Result<Self, ConfigError> {
        cfg.validate()?;
        if block_tokens == 0 {
            return Err(ConfigError::invalid(
                "constants.block_tokens",
                "must be positive",
            ));
        }
        if let Some(s) = &sample {
            s.validate("sample")?;
        }
        let d = cfg.diurnal.as_ref();
        let agent = cfg.agent.as_ref().map(|a| {
            let seed = sub_seed(seed, "workload.agent");
            SessionSource {
                seed,
                sys_len: system_prompt_lengths(a.system_prompts, &a.system_prompt_tokens, seed),
                starts: Starts::new(a.sessions, a.session_rate_per_s, hash2(seed, 0xa5), d),
                next_index: 0,
                first_id: 0,
            }
        });
        let agent_sessions = cfg.agent.as_ref().map_or(0, |a| u64::from(a.sessions));
        let chat = cfg.chat.as_ref().map(|c| {
            let seed = sub_seed(seed, "workload.chat");
            SessionSource {
                seed,
                sys_len: system_prompt_lengths(c.system_prompts, &c.system_prompt_tokens, seed),
                starts: Starts::new(c.sessions, c.session_rate_per_s, hash2(seed, 0xa5), d),
                next_index: 0,
                first_id: agent_sessions,
            }
        });
        let documents = cfg.documents.as_ref().map(|c| {
            let seed = sub_seed(seed, "workload.documents");
            DocumentSource {
                cfg: c.clone(),
                rng: ChaCha8Rng::seed_from_u64(hash2(seed, 0xd0)),
                sys_len: system_prompt_lengths(c.system_prompts, &c.system_prompt_tokens, seed),
                starts: Starts::new(c.requests, c.rate_per_s, hash2(seed, 0xa5), d),
                next_index: 0,
                seen: Vec::new(),
                seen_at: Vec::new(),
            }
        });
        let mut s = Stream {
            agent_cfg: cfg.agent.clone(),
            chat_cfg: cfg.chat.clone(),
            block_tokens,
            agent,
            chat,
            documents,
            queue: BinaryHeap::new(),
            sample,
            until: None,
            budget: None,
            stats: StreamStats::default(),
        };
        s.queue_start(SessionClass::Agent)?;
        s.queue_start(SessionClass::Chat)?;
        s.queue_document()?;
        Ok(s)
    }

    /// Ends the stream at `until`: no request arriving later is released.
    pub fn until(mut self, until: Nanos) -> Self {
        self.until = Some(until);
        self
    }

    /// Holds the stream to the block budget of a whole trace ([`crate::MAX_TRACE_BLOCKS`]).
    pub(crate) fn with_block_budget(mut self) -> Self {
        self.budget = Some(BlockBudget::default());
        self
    }

    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    /// The next request, or `None` when every source is exhausted (or past [`Self::until`]).
    pub fn next_request(&mut self) -> Result<Option<Request>, ConfigError> {
        loop {
            let Some(Reverse(p)) = self.queue.pop() else {
                return Ok(None);
            };
            if self.until.is_some_and(|u| p.key.0 > u) {
                self.queue.clear();
                return Ok(None);
            }
            if let Some(d) = self.handle(p)? {
                return Ok(Some(self.release(d)));
            }
        }
    }

    fn release(&mut self, d: Draft) -> Request {
        let id = RequestId(self.stats.released);
        self.stats.released += 1;
        Request {
            id,
            session: d.session.map(SessionId),
            class: d.class,
            arrival: d.arrival,
            prompt_tokens: d.prompt_tokens,
            output_tokens: d.output_tokens,
            content: d.content,
        }
    }

    fn push(&mut self, key: Key, start_s: f64, what: What) {
        self.queue.push(Reverse(Pending { key, start_s, what }));
        self.stats.queue_peak = self.stats.queue_peak.max(self.queue.len() as u64);
    }

    /// Carries out one entry of the queue; a request when it releases one.
    fn handle(&mut self, p: Pending) -> Result<Option<Draft>, ConfigError> {
        match p.what {
            What::Start(class) => {
                let session = self.start_session(class)?;
                self.queue_start(class)?;
                if let Some(s) = session {
                    self.visit(class, s, p.start_s)?;
                }
                Ok(None)
            }
            What::Return(class, s) => {
                self.stats.returning -= 1;
                self.visit(class, s, p.start_s)?;
                Ok(None)
            }
            What::Turns(mut drafts, s) => {
                let d = drafts.pop().expect("a visit is queued with its requests");
                match drafts.last() {
                    Some(next) => {
                        let key = next.key();
                        self.push(key, 0.0, What::Turns(drafts, s));
                    }
                    None => self.queue_return(s)?,
                }
                Ok(Some(d))
            }
            What::Document => {
                let d = self.draw_document(p.start_s)?;
                self.queue_document()?;
                Ok(d)
            }
        }
    }

    fn source(&mut self, class: SessionClass) -> Option<&mut SessionSource> {
        match class {
            SessionClass::Agent => self.agent.as_mut(),
            SessionClass::Chat => self.chat.as_mut(),
        }
    }

    /// The first visit's turns and the returns of a session class's config.
    fn session_config(&self, class: SessionClass) -> (&Dist, Option<&Revisits>) {
        match class {
            SessionClass::Agent => {
                let a = self
                    .agent_cfg
                    .as_ref()
                    .expect("agent sessions are configured");
                (&a.turns, a.revisits.as_ref())
            }
            SessionClass::Chat => {
                let c = self
                    .chat_cfg
                    .as_ref()
                    .expect("chat sessions are configured");
                (&c.turns, c.revisits.as_ref())
            }
        }
    }

    /// Queues the class's next session start, if one is left.
    fn queue_start(&mut self, class: SessionClass) -> Result<(), ConfigError> {
        let Some(src) = self.source(class) else {
            return Ok(());
        };
        let Some(t) = src.starts.next() else {
            return Ok(());
        };
        let id = src.first_id + src.next_index;
        let key = (arrival(t, class.field())?, class.traffic(), Some(id), 0);
        self.push(key, t, What::Start(class));
        Ok(())
    }

    /// The session whose start was due, unless the sample leaves it out.
    fn start_session(&mut self, class: SessionClass) -> Result<Option<Box<Session>>, ConfigError> {
        let sample = self.sample;
        let bs = self.block_tokens;
        let turns = self.session_config(class).0.clone();
        let src = self.source(class).expect("the class has a source");
        let index = src.next_index;
        src.next_index += 1;
        let id = src.first_id + index;
        if sample.is_some_and(|s| !s.keeps(id)) {
            return Ok(None);
        }
        let epoch = Epoch::new(bs, class.field());
        let (tc, tag) = (class.traffic(), class.system_tag());
        Session::start(src.seed, index, id, tc, &turns, tag, &src.sys_len, epoch)
            .map(|s| Some(Box::new(s)))
    }

    /// Draws session `s`'s visit from `start_s` and queues its requests.
    fn visit(
        &mut self,
        class: SessionClass,
        mut s: Box<Session>,
        start_s: f64,
    ) -> Result<(), ConfigError> {
        let mut out = Visit {
            drafts: Vec::new(),
            budget: self.budget.as_mut(),
        };
        match class {
            SessionClass::Agent => {
                let a = self
                    .agent_cfg
                    .as_ref()
                    .expect("agent sessions are configured");
                let sys_len = &self.agent.as_ref().expect("agent source").sys_len;
                agent_visit(a, sys_len, &mut s, start_s, &mut out)?;
            }
            SessionClass::Chat => {
                let c = self
                    .chat_cfg
                    .as_ref()
                    .expect("chat sessions are configured");
                chat_visit(c, &mut s, start_s, &mut out)?;
            }
        }
        let mut drafts = out.drafts;
        drafts.reverse();
        if let Some(first) = drafts.last() {
            let key = first.key();
            self.push(key, 0.0, What::Turns(drafts, s));
        }
        Ok(())
    }

    /// After a session's visit: queues its return, if it comes back.
    fn queue_return(&mut self, mut s: Box<Session>) -> Result<(), ConfigError> {
        let class = SessionClass::of(s.class);
        let revisits = self.session_config(class).1;
        let Some(at_s) = s.next_visit(revisits) else {
            return Ok(());
        };
        let key = (
            arrival(at_s, class.revisits_field())?,
            class.traffic(),
            Some(s.id),
            s.turns_sent,
        );
        self.stats.returning += 1;
        self.stats.returning_peak = self.stats.returning_peak.max(self.stats.returning);
        self.push(key, at_s, What::Return(class, s));
        Ok(())
    }

    fn queue_document(&mut self) -> Result<(), ConfigError> {
        let Some(src) = self.documents.as_mut() else {
            return Ok(());
        };
        let Some(t) = src.starts.next() else {
            return Ok(());
        };
        let key = (
            arrival(t, "workload.documents")?,
            TrafficClass::Other,
            None,
            src.next_index,
        );
        self.push(key, t, What::Document);
        Ok(())
    }

    /// The next document request (a new document, or one seen before), unless the sample
    /// leaves its document out.
    fn draw_document(&mut self, start_s: f64) -> Result<Option<Draft>, ConfigError> {
        const F: &str = "workload.documents";
        let bs = self.block_tokens;
        let src = self.documents.as_mut().expect("documents are configured");
        let c = &src.cfg;
        let rng = &mut src.rng;
        // The documents a repeat may ask about: those first seen within the window (in order of
        // first appearance, so a suffix of `seen`).
        let first = c.repeat_within.map_or(0, |w| {
            let since = start_s - w.as_secs_f64();
            src.seen_at.partition_point(|&t| t < since)
        });
        let repeat = first < src.seen.len() && rng.random_bool(c.repeat_probability);
        let (doc, doc_len, sys) = if repeat {
            src.seen[rng.random_range(first..src.seen.len())]
        } else {
            let d = (
                fresh(rng),
                c.document_tokens.tokens(rng, 1),
                rng.random_range(0..c.system_prompts) as usize,
            );
            src.seen.push(d);
            src.seen_at.push(start_s);
            d
        };
        let mut chain = ChainBuilder::new(bs);
        push_segment(
            &mut chain,
            system_segment("documents.system", sys as u64),
            src.sys_len[sys],
            F,
        )?;
        push_segment(&mut chain, doc, doc_len, F)?;
        push_segment(&mut chain, fresh(rng), c.question_tokens.tokens(rng, 1), F)?;
        let prompt = chain.total_tokens();
        let answer = c.answer_tokens.tokens(rng, 1);
        push_segment(&mut chain, fresh(rng), answer, F)?;
        let index = src.next_index;
        src.next_index += 1;
        if self.sample.is_some_and(|s| !s.keeps(doc.0)) {
            return Ok(None);
        }
        let chain = chain.finish();
        if let Some(b) = self.budget.as_mut() {
            b.charge(&chain).map_err(|e| ConfigError::invalid(F, e))?;
        }
        Ok(Some(Draft {
            session: None,
            turn: index,
            class: TrafficClass::Other,
            arrival: arrival(start_s, F)?,
            prompt_tokens: prompt,
            output_tokens: answer,
            content: Arc::new(chain),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Pacing, generate};
    use std::collections::BTreeMap;

    fn fixed(v: f64) -> Dist {
        Dist::Fixed { value: v }
    }

    /// Chat sessions of 3 turns that come back (with probability `p`) a day later, and
    /// agent sessions that come back an hour later.
    fn returning(p: f64) -> WorkloadConfig {
        let chat = ChatConfig {
            sessions: 200,
            session_rate_per_s: 0.01,
            turns: fixed(3.0),
            system_prompts: 4,
            system_prompt_tokens: fixed(1000.0),
            user_tokens: Dist::Uniform {
                min: 20.0,
                max: 300.0,
            },
            reply_tokens: fixed(200.0),
            think_time_s: Dist::Exponential { mean: 20.0 },
            pacing: Pacing::default(),
            revisits: Some(Revisits {
                probability: p,
                gap_s: Dist::Lognormal {
                    median: 86_400.0,
                    sigma: 1.0,
                    min: None,
                    max: None,
                },
                turns: fixed(2.0),
                max_visits: 3,
            }),
        };
        let agent = AgentConfig {
            sessions: 20,
            session_rate_per_s: 0.002,
            turns: fixed(5.0),
            system_prompts: 2,
            system_prompt_tokens: fixed(1500.0),
            task_tokens: fixed(300.0),
            reply_tokens: fixed(100.0),
            tool_result_tokens: fixed(1000.0),
            think_time_s: fixed(2.0),
            compaction: None,
            pacing: Pacing::default(),
            revisits: Some(Revisits {
                probability: p,
                gap_s: fixed(3600.0),
                turns: fixed(4.0),
                max_visits: 2,
            }),
        };
        WorkloadConfig {
            agent: Some(agent),
            chat: Some(chat),
            documents: Some(DocumentConfig {
                requests: 50,
                rate_per_s: 0.002,
                system_prompts: 2,
                system_prompt_tokens: fixed(500.0),
                document_tokens: fixed(20_000.0),
                question_tokens: fixed(50.0),
                answer_tokens: fixed(100.0),
                repeat_probability: 0.5,
                repeat_within: None,
            }),
            diurnal: None,
        }
    }

    fn drain(mut s: Stream) -> Vec<Request> {
        std::iter::from_fn(|| s.next_request().unwrap()).collect()
    }

    fn same(a: &Request, b: &Request) -> bool {
        a.session == b.session
            && a.class == b.class
            && a.arrival == b.arrival
            && a.prompt_tokens == b.prompt_tokens
            && a.output_tokens == b.output_tokens
            && a.content.full_blocks(u32::MAX) == b.content.full_blocks(u32::MAX)
    }

    #[test]
    fn a_stream_is_the_trace_in_trace_order() {
        let cfg = returning(0.6);
        let t = generate(&cfg, 5, 128).unwrap();
        let s = drain(Stream::new(&cfg, 5, 128, None).unwrap());
        assert_eq!(t.len(), s.len());
        assert!(
            t.requests
                .iter()
                .zip(&s)
                .all(|(a, b)| a.id == b.id && same(a, b))
        );
        let key = |r: &Request| (r.arrival, r.class, r.session);
        assert!(s.windows(2).all(|w| key(&w[0]) <= key(&w[1])));
        // Cut at a time: exactly the requests arriving by then.
        let cut = s[s.len() / 2].arrival;
        let head = drain(Stream::new(&cfg, 5, 128, None).unwrap().until(cut));
        assert_eq!(head.len(), s.iter().filter(|r| r.arrival <= cut).count());
    }

    #[test]
    fn returning_sessions_continue_their_context_after_the_gap() {
        let none = drain(Stream::new(&returning(0.0), 9, 128, None).unwrap());
        let back = drain(Stream::new(&returning(1.0), 9, 128, None).unwrap());
        let mut by_session: BTreeMap<u64, Vec<&Request>> = BTreeMap::new();
        for r in back.iter().filter(|r| r.class == TrafficClass::Chat) {
            by_session.entry(r.session.unwrap().0).or_default().push(r);
        }
        assert_eq!(by_session.len(), 200);
        for turns in by_session.values() {
            // 3 turns, then 2 per return, up to 3 visits.
            assert_eq!(turns.len(), 3 + 2 + 2);
            for w in turns.windows(2) {
                // Every turn's prompt extends the context before it, blocks included.
                assert!(w[1].prompt_tokens > w[0].context_tokens());
                let n = w[0].content.full_blocks(w[0].context_tokens()).len();
                assert_eq!(
                    &w[1].prompt_blocks()[..n],
                    &w[0].content.full_blocks(w[0].context_tokens())[..n]
                );
            }
            // The returns come hours or days later (a lognormal of median one day).
            assert!(turns[3].arrival.as_secs_f64() - turns[2].arrival.as_secs_f64() > 600.0);
        }
        // First visits are the sessions without returns, draw for draw.
        let first: Vec<&Request> = none
            .iter()
            .filter(|r| r.class == TrafficClass::Chat)
            .collect();
        for r in &first {
            let t = by_session[&r.session.unwrap().0]
                .iter()
                .find(|x| x.arrival == r.arrival)
                .expect("the first visit is unchanged");
            assert_eq!(t.prompt_tokens, r.prompt_tokens);
        }
        let agents = back
            .iter()
            .filter(|r| r.class == TrafficClass::Agent)
            .count();
        assert_eq!(agents, 20 * (5 + 4));
    }

    #[test]
    fn a_sample_keeps_whole_sessions_and_documents() {
        let cfg = returning(0.7);
        let all = drain(Stream::new(&cfg, 3, 128, None).unwrap());
        let sample = SessionSample { one_in: 4, seed: 1 };
        let kept = drain(Stream::new(&cfg, 3, 128, Some(sample)).unwrap());
        // A document request's system prompt and document end at its second mark.
        let doc = |r: &Request| r.content.marks()[1].key;
        let kept_docs: std::collections::BTreeSet<_> = kept
            .iter()
            .filter(|r| r.session.is_none())
            .map(doc)
            .collect();
        assert!(!kept_docs.is_empty());
        let keeps = |r: &Request| match r.session {
            Some(s) => sample.keeps(s.0),
            None => kept_docs.contains(&doc(r)),
        };
        let expect: Vec<&Request> = all.iter().filter(|r| keeps(r)).collect();
        assert_eq!(expect.len(), kept.len());
        assert!(expect.iter().zip(&kept).all(|(a, b)| same(a, b)));
        // About a quarter, and ids are dense in the sample.
        let share = kept.len() as f64 / all.len() as f64;
        assert!((0.1..0.45).contains(&share), "{share}");
        assert!(kept.iter().enumerate().all(|(i, r)| r.id.0 == i as u64));
        let bad = Stream::new(&cfg, 3, 128, Some(SessionSample { one_in: 0, seed: 0 }));
        assert!(bad.err().unwrap().to_string().contains("sample.one_in"));
    }

    #[test]
    fn the_queue_holds_what_is_still_to_come_not_the_run() {
        let mut cfg = returning(0.5);
        cfg.chat.as_mut().unwrap().sessions = 20_000;
        cfg.chat.as_mut().unwrap().session_rate_per_s = 0.05;
        cfg.agent = None;
        cfg.documents = None;
        let mut s = Stream::new(&cfg, 1, 128, None).unwrap();
        while s.next_request().unwrap().is_some() {}
        let st = s.stats();
        assert!(st.released > 60_000, "{st:?}");
        // Returns a day or so later at 0.05 sessions/s: a few thousand wait at a time.
        assert!(st.returning_peak < 15_000, "{st:?}");
        assert!(st.queue_peak < 20_000, "{st:?}");
        assert_eq!(st.returning, 0);
    }

    #[test]
    fn repeats_within_a_window_ask_about_recent_documents_only() {
        let mut cfg = returning(0.0);
        cfg.agent = None;
        cfg.chat = None;
        let docs = cfg.documents.as_mut().unwrap();
        docs.requests = 400;
        docs.rate_per_s = 0.01;
        docs.repeat_probability = 0.5;
        let first_seen = |reqs: &[Request]| {
            let mut seen = std::collections::BTreeMap::new();
            reqs.iter()
                .map(|r| {
                    let doc = r.content.marks()[1].key;
                    let at = *seen.entry(doc).or_insert(r.arrival);
                    r.arrival.saturating_sub(at).as_secs_f64()
                })
                .fold(0.0f64, f64::max)
        };
        let any = drain(Stream::new(&cfg, 2, 128, None).unwrap());
        cfg.documents.as_mut().unwrap().repeat_within = Some(Nanos::from_secs(3600));
        let recent = drain(Stream::new(&cfg, 2, 128, None).unwrap());
        // 400 documents at 0.01/s span 11 hours: without a window a repeat reaches back hours,
        // with one of an hour never more than that.
        assert!(first_seen(&any) > 3.0 * 3600.0, "{}", first_seen(&any));
        assert!(first_seen(&recent) <= 3600.0, "{}", first_seen(&recent));
        assert_eq!(any.len(), recent.len());
    }

    #[test]
    fn bad_revisits_name_the_field() {
        let mut cfg = returning(0.5);
        cfg.chat
            .as_mut()
            .unwrap()
            .revisits
            .as_mut()
            .unwrap()
            .probability = 1.5;
        let e = Stream::new(&cfg, 1, 128, None).err().unwrap().to_string();
        assert!(e.contains("workload.chat.revisits.probability"), "{e}");
        let mut cfg = returning(0.5);
        cfg.agent
            .as_mut()
            .unwrap()
            .revisits
            .as_mut()
            .unwrap()
            .max_visits = 0;
        let e = Stream::new(&cfg, 1, 128, None).err().unwrap().to_string();
        assert!(e.contains("workload.agent.revisits.max_visits"), "{e}");
    }

    #[test]
    fn diurnal_thinning_follows_the_rate() {
        let d = Diurnal {
            amplitude: 0.8,
            period: Nanos::from_secs(1000),
            peak_at: Nanos::from_secs(250),
        };
        let mut src = Starts::new(20_000, 10.0, 3, Some(&d));
        let starts: Vec<f64> = std::iter::from_fn(|| src.next()).collect();
        assert_eq!(starts.len(), 20_000);
        // Mean rate preserved: 20,000 arrivals at 10/s take about 2,000 s.
        let span = starts[starts.len() - 1];
        assert!((1800.0..2200.0).contains(&span), "span {span}");
        // Peak quarter (around 250 s mod 1000) holds far more than the trough (around 750 s).
        let count = |lo: f64, hi: f64| {
            starts
                .iter()
                .filter(|&&t| (lo..hi).contains(&(t % 1000.0)))
                .count()
        };
        let (peak, trough) = (count(125.0, 375.0), count(625.0, 875.0));
        assert!(
            peak as f64 > 3.0 * trough as f64,
            "peak {peak} trough {trough}"
        );
        let bad = WorkloadConfig {
            diurnal: Some(Diurnal {
                amplitude: 1.5,
                ..d
            }),
            ..Default::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("amplitude")
        );
    }
}
