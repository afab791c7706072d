//! Seeded generators for the workloads of SPEC §13: agent sessions, chat sessions and fresh
//! documents. Every parameter is a config value; the defaults are the ones chosen to reproduce
//! the published table (see `experiments/configs/cache-policy.toml` for why).
//!
//! Sessions start as a Poisson process. A turn's successor arrives after the turn would have
//! finished (estimated TTFT + output at the per-request decode rate) plus a think time (tool
//! execution for agents, the user for chat), so a turn never arrives before its predecessor's
//! output exists. Each session draws from its own RNG stream (seeded from the run seed, the
//! class and the session index), so changing the number of sessions does not change the others.

use crate::dist::Dist;
use crate::{MAX_GENERATED_REQUESTS, Trace};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::content::hash2;
use servelab_core::seed::sub_seed;
use servelab_core::{
    ChainBuilder, ConfigError, Nanos, Request, RequestId, SegmentId, SessionId, TrafficClass,
};
use std::sync::Arc;

/// Which workloads to generate and how. Absent sections generate nothing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadConfig {
    #[serde(default)]
    pub agent: Option<AgentConfig>,
    #[serde(default)]
    pub chat: Option<ChatConfig>,
    #[serde(default)]
    pub documents: Option<DocumentConfig>,
    /// Daily load shape applied to every arrival process (absent = constant rate).
    #[serde(default)]
    pub diurnal: Option<Diurnal>,
}

/// A diurnal arrival rate: rate(t) = mean × (1 + amplitude × cos(2π (t − peak_at) / period)).
/// The mean rate is the configured one; arrivals are drawn by thinning a Poisson process at the
/// peak rate, so the count of sessions or requests stays as configured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Diurnal {
    /// 0 = flat, 0.5 = peak 1.5× and trough 0.5× the mean.
    pub amplitude: f64,
    #[serde(default = "one_day")]
    pub period: Nanos,
    /// Time of the peak from the start of the trace.
    #[serde(default)]
    pub peak_at: Nanos,
}

fn one_day() -> Nanos {
    Nanos::from_secs(86_400)
}

impl Diurnal {
    /// Rate multiplier at `t_s` seconds.
    pub fn factor(&self, t_s: f64) -> f64 {
        let phase = (t_s - self.peak_at.as_secs_f64()) / self.period.as_secs_f64();
        1.0 + self.amplitude * (std::f64::consts::TAU * phase).cos()
    }
}

/// How long a turn occupies the service before its successor can be sent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pacing {
    /// Time to first token, seconds (SPEC §11: 400 ms average).
    pub ttft_s: f64,
    /// Generation speed per request, tokens/s (SPEC §11: 230).
    pub decode_tokens_per_s: f64,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            ttft_s: 0.4,
            decode_tokens_per_s: 230.0,
        }
    }
}

impl Pacing {
    fn service(&self, output_tokens: u32) -> f64 {
        self.ttft_s + f64::from(output_tokens) / self.decode_tokens_per_s
    }
    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if !(self.ttft_s.is_finite() && self.ttft_s >= 0.0) {
            return Err(ConfigError::invalid(
                format!("{field}.ttft_s"),
                "must be >= 0",
            ));
        }
        if !(self.decode_tokens_per_s.is_finite() && self.decode_tokens_per_s > 0.0) {
            return Err(ConfigError::invalid(
                format!("{field}.decode_tokens_per_s"),
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// Agent sessions: a task, then turns that each append the model's reply and a tool result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub sessions: u32,
    /// Poisson rate of session starts.
    pub session_rate_per_s: f64,
    pub turns: Dist,
    /// Distinct system prompts (tenants/tools); a session picks one uniformly.
    pub system_prompts: u32,
    pub system_prompt_tokens: Dist,
    pub task_tokens: Dist,
    /// The model's reply per turn (its output), tokens.
    pub reply_tokens: Dist,
    /// Tool result appended after each reply, tokens (SPEC §13: 200–4,000).
    pub tool_result_tokens: Dist,
    /// Tool execution time between a reply and the next turn, seconds.
    pub think_time_s: Dist,
    #[serde(default)]
    pub compaction: Option<Compaction>,
    #[serde(default)]
    pub pacing: Pacing,
}

/// Context compaction: the context is replaced by the system prompt and a shorter summary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compaction {
    /// Compact when the next prompt would exceed this many tokens.
    pub above_tokens: u32,
    /// Also compact with this probability at each turn (0 = only by size).
    #[serde(default)]
    pub probability: f64,
    pub summary_tokens: Dist,
}

/// Chat sessions: short user messages and replies over a shared system prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatConfig {
    pub sessions: u32,
    pub session_rate_per_s: f64,
    pub turns: Dist,
    pub system_prompts: u32,
    pub system_prompt_tokens: Dist,
    pub user_tokens: Dist,
    pub reply_tokens: Dist,
    /// The user's time between a reply and the next message, seconds.
    pub think_time_s: Dist,
    #[serde(default)]
    pub pacing: Pacing,
}

/// Fresh documents: single requests over a long document, some of which repeat earlier ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentConfig {
    pub requests: u32,
    pub rate_per_s: f64,
    pub system_prompts: u32,
    pub system_prompt_tokens: Dist,
    /// SPEC §13: 20,000–200,000 tokens.
    pub document_tokens: Dist,
    pub question_tokens: Dist,
    pub answer_tokens: Dist,
    /// Probability that a request is about a document seen before (drawn uniformly from them).
    pub repeat_probability: f64,
}

impl WorkloadConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.diurnal {
            if !(0.0..1.0).contains(&d.amplitude) {
                return Err(ConfigError::invalid(
                    "workload.diurnal.amplitude",
                    format!("{} is not in [0, 1)", d.amplitude),
                ));
            }
            if d.period == Nanos::ZERO {
                return Err(ConfigError::invalid(
                    "workload.diurnal.period",
                    "must be positive",
                ));
            }
        }
        if let Some(a) = &self.agent {
            let f = |n: &str| format!("workload.agent.{n}");
            rate(a.session_rate_per_s, &f("session_rate_per_s"))?;
            at_most_generated(a.sessions, &f("sessions"))?;
            positive(a.system_prompts, &f("system_prompts"))?;
            at_most_generated(a.system_prompts, &f("system_prompts"))?;
            a.turns.validate(&f("turns"))?;
            a.system_prompt_tokens
                .validate(&f("system_prompt_tokens"))?;
            a.task_tokens.validate(&f("task_tokens"))?;
            a.reply_tokens.validate(&f("reply_tokens"))?;
            a.tool_result_tokens.validate(&f("tool_result_tokens"))?;
            a.think_time_s.validate(&f("think_time_s"))?;
            a.pacing.validate(&f("pacing"))?;
            if let Some(c) = &a.compaction {
                c.summary_tokens.validate(&f("compaction.summary_tokens"))?;
                probability(c.probability, &f("compaction.probability"))?;
                positive(c.above_tokens, &f("compaction.above_tokens"))?;
            }
        }
        if let Some(c) = &self.chat {
            let f = |n: &str| format!("workload.chat.{n}");
            rate(c.session_rate_per_s, &f("session_rate_per_s"))?;
            at_most_generated(c.sessions, &f("sessions"))?;
            positive(c.system_prompts, &f("system_prompts"))?;
            at_most_generated(c.system_prompts, &f("system_prompts"))?;
            c.turns.validate(&f("turns"))?;
            c.system_prompt_tokens
                .validate(&f("system_prompt_tokens"))?;
            c.user_tokens.validate(&f("user_tokens"))?;
            c.reply_tokens.validate(&f("reply_tokens"))?;
            c.think_time_s.validate(&f("think_time_s"))?;
            c.pacing.validate(&f("pacing"))?;
        }
        if let Some(d) = &self.documents {
            let f = |n: &str| format!("workload.documents.{n}");
            rate(d.rate_per_s, &f("rate_per_s"))?;
            at_most_generated(d.requests, &f("requests"))?;
            positive(d.system_prompts, &f("system_prompts"))?;
            at_most_generated(d.system_prompts, &f("system_prompts"))?;
            d.system_prompt_tokens
                .validate(&f("system_prompt_tokens"))?;
            d.document_tokens.validate(&f("document_tokens"))?;
            d.question_tokens.validate(&f("question_tokens"))?;
            d.answer_tokens.validate(&f("answer_tokens"))?;
            probability(d.repeat_probability, &f("repeat_probability"))?;
        }
        Ok(())
    }
}

fn rate(v: f64, field: &str) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("{v} is not a positive rate"),
        ))
    }
}
fn positive(v: u32, field: &str) -> Result<(), ConfigError> {
    if v > 0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, "must be positive"))
    }
}
/// A count of sessions, requests or system prompts: at most what a generator makes.
fn at_most_generated(v: u32, field: &str) -> Result<(), ConfigError> {
    if u64::from(v) > MAX_GENERATED_REQUESTS {
        return Err(ConfigError::invalid(
            field,
            format!("{v} is more than the {MAX_GENERATED_REQUESTS} a workload may generate"),
        ));
    }
    Ok(())
}
fn probability(v: f64, field: &str) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("{v} is not a probability in [0, 1]"),
        ))
    }
}

/// A request before ids are assigned.
struct Draft {
    session: Option<u64>,
    turn: u32,
    class: TrafficClass,
    arrival: Nanos,
    prompt_tokens: u32,
    output_tokens: u32,
    content: Arc<servelab_core::ContentChain>,
}

/// Generates the configured workloads into one trace, keyed at `block_tokens`.
pub fn generate(cfg: &WorkloadConfig, seed: u64, block_tokens: u32) -> Result<Trace, ConfigError> {
    cfg.validate()?;
    if block_tokens == 0 {
        return Err(ConfigError::invalid(
            "constants.block_tokens",
            "must be positive",
        ));
    }
    let mut out = Out::default();
    let mut next_session = 0u64;
    if let Some(a) = &cfg.agent {
        gen_agent(
            a,
            sub_seed(seed, "workload.agent"),
            block_tokens,
            cfg.diurnal.as_ref(),
            &mut next_session,
            &mut out,
        )?;
    }
    if let Some(c) = &cfg.chat {
        gen_chat(
            c,
            sub_seed(seed, "workload.chat"),
            block_tokens,
            cfg.diurnal.as_ref(),
            &mut next_session,
            &mut out,
        )?;
    }
    if let Some(d) = &cfg.documents {
        gen_documents(
            d,
            sub_seed(seed, "workload.documents"),
            block_tokens,
            cfg.diurnal.as_ref(),
            &mut out,
        )?;
    }
    let mut drafts = out.drafts;
    // Ids follow arrival order; ties by class, session and turn, so they are stable.
    drafts.sort_by_key(|d| (d.arrival, d.class, d.session, d.turn));
    let requests = drafts
        .into_iter()
        .enumerate()
        .map(|(i, d)| Request {
            id: RequestId(i as u64),
            session: d.session.map(SessionId),
            class: d.class,
            arrival: d.arrival,
            prompt_tokens: d.prompt_tokens,
            output_tokens: d.output_tokens,
            content: d.content,
        })
        .collect();
    Ok(Trace::new(block_tokens, requests))
}

/// What the generators emit, and what it costs: refused past [`MAX_GENERATED_REQUESTS`]
/// requests or [`crate::MAX_TRACE_BLOCKS`] block keys, so no config can ask for unbounded work.
#[derive(Default)]
struct Out {
    drafts: Vec<Draft>,
    blocks: crate::BlockBudget,
}

impl Out {
    fn push(&mut self, d: Draft, field: &str) -> Result<(), ConfigError> {
        if self.drafts.len() as u64 >= MAX_GENERATED_REQUESTS {
            return Err(ConfigError::invalid(
                field,
                format!(
                    "the workload makes more than {MAX_GENERATED_REQUESTS} requests: lower the \
                     sessions, requests or turns"
                ),
            ));
        }
        self.drafts.push(d);
        Ok(())
    }
    fn charge(
        &mut self,
        chain: &servelab_core::ContentChain,
        field: &str,
    ) -> Result<(), ConfigError> {
        self.blocks
            .charge(chain)
            .map_err(|e| ConfigError::invalid(field, e))
    }
}

/// A generated time, refused past the horizon (a tiny rate or a long think time would
/// otherwise saturate, and a saturated time breaks every TTL).
fn arrival(t_s: f64, field: &str) -> Result<Nanos, ConfigError> {
    Nanos::try_from_secs_f64(t_s).map_err(|e| {
        ConfigError::invalid(
            field,
            format!("a generated arrival at {e}: raise the rate or shorten the think times"),
        )
    })
}

/// Appends a segment, refusing a context past what a chain holds.
fn push_segment(
    chain: &mut ChainBuilder,
    id: SegmentId,
    tokens: u32,
    field: &str,
) -> Result<(), ConfigError> {
    chain.try_push(id, tokens).map(|_| ()).map_err(|e| {
        ConfigError::invalid(
            field,
            format!("{e}: the token distributions draw a context that long"),
        )
    })
}

/// Session start times: a Poisson process from its own stream.
fn poisson_starts(n: u32, rate_per_s: f64, seed: u64, diurnal: Option<&Diurnal>) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let peak = 1.0 + diurnal.map_or(0.0, |d| d.amplitude);
    let exp = Dist::Exponential {
        mean: 1.0 / (rate_per_s * peak),
    };
    let mut t = 0.0;
    let mut starts = Vec::with_capacity(n as usize);
    while starts.len() < n as usize {
        t += exp.sample(&mut rng);
        // Thinning: keep a candidate with probability rate(t) / peak rate.
        let keep = diurnal.is_none_or(|d| rng.random::<f64>() * peak < d.factor(t));
        if keep {
            starts.push(t);
        }
    }
    starts
}

fn fresh(rng: &mut ChaCha8Rng) -> SegmentId {
    SegmentId(rng.random())
}

/// One growing context: turns are recorded as (prompt, output) lengths until the epoch's chain
/// is frozen, then emitted as requests sharing it.
struct Epoch {
    chain: ChainBuilder,
    turns: Vec<(u32, u32, Nanos, u32)>, // prompt, output, arrival, turn index
    /// The config section, for errors.
    field: &'static str,
}

impl Epoch {
    fn new(block_tokens: u32, field: &'static str) -> Self {
        Epoch {
            chain: ChainBuilder::new(block_tokens),
            turns: Vec::new(),
            field,
        }
    }
    fn push(&mut self, id: SegmentId, tokens: u32) -> Result<(), ConfigError> {
        push_segment(&mut self.chain, id, tokens, self.field)
    }
    fn turn(&mut self, prompt: u32, reply: u32, t_s: f64, turn: u32) -> Result<(), ConfigError> {
        let at = arrival(t_s, self.field)?;
        self.turns.push((prompt, reply, at, turn));
        Ok(())
    }
    fn flush(self, session: u64, class: TrafficClass, out: &mut Out) -> Result<(), ConfigError> {
        let chain = self.chain.finish();
        out.charge(&chain, self.field)?;
        let content = Arc::new(chain);
        for (p, o, arrival, turn) in self.turns {
            out.push(
                Draft {
                    session: Some(session),
                    turn,
                    class,
                    arrival,
                    prompt_tokens: p,
                    output_tokens: o,
                    content: content.clone(),
                },
                self.field,
            )?;
        }
        Ok(())
    }
}

/// System prompt lengths are a property of the prompt, not of the session: drawn once per
/// prompt from their own stream.
fn system_prompt_lengths(n: u32, dist: &Dist, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(hash2(seed, 0x5c));
    (0..n).map(|_| dist.tokens(&mut rng, 1)).collect()
}

fn system_segment(tag: &str, k: u64) -> SegmentId {
    SegmentId(hash2(sub_seed(0, tag), k))
}

/// What every session starts with: its id, its own RNG stream, its system prompt (pushed as the
/// first segment of its first epoch) and its number of turns.
struct SessionStart {
    session: u64,
    rng: ChaCha8Rng,
    sys: usize,
    turns: u32,
    epoch: Epoch,
}

impl SessionStart {
    fn new(
        seed: u64,
        index: usize,
        next_session: &mut u64,
        turns: &Dist,
        system_tag: &str,
        sys_len: &[u32],
        mut epoch: Epoch,
    ) -> Result<Self, ConfigError> {
        let session = *next_session;
        *next_session += 1;
        let mut rng = ChaCha8Rng::seed_from_u64(hash2(seed, index as u64));
        let sys = rng.random_range(0..sys_len.len() as u32) as usize;
        let turns = turns.tokens(&mut rng, 1);
        epoch.push(system_segment(system_tag, sys as u64), sys_len[sys])?;
        Ok(SessionStart {
            session,
            rng,
            sys,
            turns,
            epoch,
        })
    }
}

fn gen_agent(
    c: &AgentConfig,
    seed: u64,
    bs: u32,
    diurnal: Option<&Diurnal>,
    next_session: &mut u64,
    out: &mut Out,
) -> Result<(), ConfigError> {
    const F: &str = "workload.agent";
    let starts = poisson_starts(c.sessions, c.session_rate_per_s, hash2(seed, 0xa5), diurnal);
    let sys_len = system_prompt_lengths(c.system_prompts, &c.system_prompt_tokens, seed);
    for (si, &start) in starts.iter().enumerate() {
        let SessionStart {
            session,
            mut rng,
            sys,
            turns,
            mut epoch,
        } = SessionStart::new(
            seed,
            si,
            next_session,
            &c.turns,
            "agent.system",
            &sys_len,
            Epoch::new(bs, F),
        )?;
        epoch.push(fresh(&mut rng), c.task_tokens.tokens(&mut rng, 1))?;
        let mut t = start;
        for turn in 0..turns {
            let prompt = epoch.chain.total_tokens();
            let reply = c.reply_tokens.tokens(&mut rng, 1);
            epoch.turn(prompt, reply, t, turn)?;
            epoch.push(fresh(&mut rng), reply)?;
            t += c.pacing.service(reply) + c.think_time_s.sample(&mut rng);
            if turn + 1 == turns {
                break;
            }
            let tool = c.tool_result_tokens.tokens(&mut rng, 1);
            let compact = c.compaction.as_ref().is_some_and(|k| {
                epoch.chain.total_tokens().saturating_add(tool) > k.above_tokens
                    || (k.probability > 0.0 && rng.random_bool(k.probability))
            });
            if let (true, Some(k)) = (compact, c.compaction.as_ref()) {
                let summary = k.summary_tokens.tokens(&mut rng, 1);
                let old = std::mem::replace(&mut epoch, Epoch::new(bs, F));
                old.flush(session, TrafficClass::Agent, out)?;
                epoch.push(system_segment("agent.system", sys as u64), sys_len[sys])?;
                epoch.push(fresh(&mut rng), summary)?;
            }
            epoch.push(fresh(&mut rng), tool)?;
        }
        epoch.flush(session, TrafficClass::Agent, out)?;
    }
    Ok(())
}

fn gen_chat(
    c: &ChatConfig,
    seed: u64,
    bs: u32,
    diurnal: Option<&Diurnal>,
    next_session: &mut u64,
    out: &mut Out,
) -> Result<(), ConfigError> {
    const F: &str = "workload.chat";
    let starts = poisson_starts(c.sessions, c.session_rate_per_s, hash2(seed, 0xa5), diurnal);
    let sys_len = system_prompt_lengths(c.system_prompts, &c.system_prompt_tokens, seed);
    for (si, &start) in starts.iter().enumerate() {
        let SessionStart {
            session,
            mut rng,
            turns,
            mut epoch,
            ..
        } = SessionStart::new(
            seed,
            si,
            next_session,
            &c.turns,
            "chat.system",
            &sys_len,
            Epoch::new(bs, F),
        )?;
        let mut t = start;
        for turn in 0..turns {
            epoch.push(fresh(&mut rng), c.user_tokens.tokens(&mut rng, 1))?;
            let prompt = epoch.chain.total_tokens();
            let reply = c.reply_tokens.tokens(&mut rng, 1);
            epoch.turn(prompt, reply, t, turn)?;
            epoch.push(fresh(&mut rng), reply)?;
            t += c.pacing.service(reply) + c.think_time_s.sample(&mut rng);
        }
        epoch.flush(session, TrafficClass::Chat, out)?;
    }
    Ok(())
}

fn gen_documents(
    c: &DocumentConfig,
    seed: u64,
    bs: u32,
    diurnal: Option<&Diurnal>,
    out: &mut Out,
) -> Result<(), ConfigError> {
    const F: &str = "workload.documents";
    let starts = poisson_starts(c.requests, c.rate_per_s, hash2(seed, 0xa5), diurnal);
    let sys_len = system_prompt_lengths(c.system_prompts, &c.system_prompt_tokens, seed);
    // Documents seen so far: (segment, tokens, system prompt it was sent with).
    let mut seen: Vec<(SegmentId, u32, usize)> = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(hash2(seed, 0xd0));
    for (i, &start) in starts.iter().enumerate() {
        let repeat = !seen.is_empty() && rng.random_bool(c.repeat_probability);
        let (doc, doc_len, sys) = if repeat {
            seen[rng.random_range(0..seen.len())]
        } else {
            let d = (
                fresh(&mut rng),
                c.document_tokens.tokens(&mut rng, 1),
                rng.random_range(0..c.system_prompts) as usize,
            );
            seen.push(d);
            d
        };
        let mut chain = ChainBuilder::new(bs);
        push_segment(
            &mut chain,
            system_segment("documents.system", sys as u64),
            sys_len[sys],
            F,
        )?;
        push_segment(&mut chain, doc, doc_len, F)?;
        push_segment(
            &mut chain,
            fresh(&mut rng),
            c.question_tokens.tokens(&mut rng, 1),
            F,
        )?;
        let prompt = chain.total_tokens();
        let answer = c.answer_tokens.tokens(&mut rng, 1);
        push_segment(&mut chain, fresh(&mut rng), answer, F)?;
        let chain = chain.finish();
        out.charge(&chain, F)?;
        out.push(
            Draft {
                session: None,
                turn: i as u32,
                class: TrafficClass::Other,
                arrival: arrival(start, F)?,
                prompt_tokens: prompt,
                output_tokens: answer,
                content: Arc::new(chain),
            },
            F,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(min: f64, max: f64) -> Dist {
        Dist::Uniform { min, max }
    }
    fn fixed(v: f64) -> Dist {
        Dist::Fixed { value: v }
    }

    fn agent() -> AgentConfig {
        AgentConfig {
            sessions: 3,
            session_rate_per_s: 0.1,
            turns: fixed(5.0),
            system_prompts: 1,
            system_prompt_tokens: fixed(1000.0),
            task_tokens: fixed(300.0),
            reply_tokens: fixed(200.0),
            tool_result_tokens: u(200.0, 4000.0),
            think_time_s: fixed(2.0),
            compaction: None,
            pacing: Pacing::default(),
        }
    }

    #[test]
    fn agent_turns_grow_and_share_prefixes() {
        let cfg = WorkloadConfig {
            agent: Some(agent()),
            ..Default::default()
        };
        let t = generate(&cfg, 7, 128).unwrap();
        assert_eq!(t.len(), 15);
        let s0: Vec<&Request> = t
            .requests
            .iter()
            .filter(|r| r.session == Some(SessionId(0)))
            .collect();
        assert_eq!(s0.len(), 5);
        assert_eq!(s0[0].prompt_tokens, 1300);
        for w in s0.windows(2) {
            // Next prompt = previous prompt + reply + tool result; arrives after the reply.
            assert!(w[1].prompt_tokens >= w[0].context_tokens() + 200);
            let n = w[0].prompt_blocks().len();
            assert_eq!(&w[1].prompt_blocks()[..n], w[0].prompt_blocks());
            let done = w[0].arrival.as_secs_f64() + 0.4 + 200.0 / 230.0;
            assert!(w[1].arrival.as_secs_f64() >= done);
        }
        // All sessions share the system prompt's full blocks (1000 tokens → 7 blocks).
        let other = t
            .requests
            .iter()
            .find(|r| r.session == Some(SessionId(1)))
            .unwrap();
        assert_eq!(&other.prompt_blocks()[..7], &s0[0].prompt_blocks()[..7]);
    }

    #[test]
    fn compaction_starts_a_new_chain() {
        let mut a = agent();
        a.turns = fixed(30.0);
        a.compaction = Some(Compaction {
            above_tokens: 20_000,
            probability: 0.0,
            summary_tokens: fixed(2000.0),
        });
        let t = generate(
            &WorkloadConfig {
                agent: Some(a),
                ..Default::default()
            },
            3,
            128,
        )
        .unwrap();
        assert!(t.requests.iter().all(|r| r.prompt_tokens <= 20_000));
        assert!(
            t.requests
                .iter()
                .any(|r| r.prompt_tokens < 7_000 && r.prompt_tokens > 3_000)
        );
    }

    #[test]
    fn same_seed_same_trace_other_seed_differs() {
        let cfg = WorkloadConfig {
            agent: Some(agent()),
            chat: Some(ChatConfig {
                sessions: 4,
                session_rate_per_s: 1.0,
                turns: fixed(8.0),
                system_prompts: 2,
                system_prompt_tokens: u(500.0, 2000.0),
                user_tokens: u(20.0, 200.0),
                reply_tokens: u(50.0, 400.0),
                think_time_s: Dist::Exponential { mean: 30.0 },
                pacing: Pacing::default(),
            }),
            documents: Some(DocumentConfig {
                requests: 10,
                rate_per_s: 0.5,
                system_prompts: 1,
                system_prompt_tokens: fixed(500.0),
                document_tokens: u(20_000.0, 200_000.0),
                question_tokens: fixed(50.0),
                answer_tokens: fixed(300.0),
                repeat_probability: 0.3,
            }),
            diurnal: None,
        };
        let sig = |t: &Trace| {
            t.requests
                .iter()
                .map(|r| {
                    (
                        r.id,
                        r.arrival,
                        r.prompt_tokens,
                        r.output_tokens,
                        r.prompt_blocks().to_vec(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let a = generate(&cfg, 11, 128).unwrap();
        let b = generate(&cfg, 11, 128).unwrap();
        let c = generate(&cfg, 12, 128).unwrap();
        assert_eq!(sig(&a), sig(&b));
        assert_ne!(sig(&a), sig(&c));
        assert_eq!(a.len(), 15 + 32 + 10);
        assert!(a.requests.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    }

    #[test]
    fn diurnal_thinning_follows_the_rate() {
        let d = Diurnal {
            amplitude: 0.8,
            period: Nanos::from_secs(1000),
            peak_at: Nanos::from_secs(250),
        };
        let starts = poisson_starts(20_000, 10.0, 3, Some(&d));
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

    /// Issue 16: a document longer than 2^32 tokens with its system prompt used to wrap to a
    /// short prompt; a tiny session rate saturated arrival times (and with them every TTL).
    /// Both are now errors naming the section.
    #[test]
    fn overflowing_contexts_and_times_are_refused() {
        let docs = DocumentConfig {
            requests: 2,
            rate_per_s: 1.0,
            system_prompts: 1,
            system_prompt_tokens: fixed(1000.0),
            document_tokens: fixed(4_294_967_000.0),
            question_tokens: fixed(50.0),
            answer_tokens: fixed(300.0),
            repeat_probability: 0.0,
        };
        let e = generate(
            &WorkloadConfig {
                documents: Some(docs),
                ..Default::default()
            },
            1,
            1 << 20,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("workload.documents") && e.contains("longer than a chain holds"),
            "{e}"
        );
        let mut a = agent();
        a.session_rate_per_s = 1e-300;
        let e = generate(
            &WorkloadConfig {
                agent: Some(a),
                ..Default::default()
            },
            1,
            128,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("workload.agent") && e.contains("horizon"), "{e}");
        let mut a = agent();
        a.sessions = u32::MAX;
        let e = generate(
            &WorkloadConfig {
                agent: Some(a),
                ..Default::default()
            },
            1,
            128,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("workload.agent.sessions"), "{e}");
    }

    #[test]
    fn bad_parameters_name_the_field() {
        let mut a = agent();
        a.session_rate_per_s = 0.0;
        let e = generate(
            &WorkloadConfig {
                agent: Some(a),
                ..Default::default()
            },
            1,
            128,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("workload.agent.session_rate_per_s"),
            "{e}"
        );
    }
}
