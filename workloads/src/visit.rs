//! One visit of a session: the turns an agent task or a chat user sends in one sitting, drawn
//! from the session's own random stream and appended to the session's context. A session's
//! first visit starts from its system prompt; a returning visit ([`Revisits`]) continues the
//! context the last visit left, so its first prompt extends everything said before.

use crate::BlockBudget;
use crate::dist::Dist;
use crate::generate::{AgentConfig, ChatConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::content::hash2;
use servelab_core::seed::sub_seed;
use servelab_core::{ChainBuilder, ConfigError, ContentChain, Nanos, SegmentId, TrafficClass};
use std::sync::Arc;

/// Sessions that come back: after each visit, a session returns with `probability` after a
/// gap drawn from `gap_s` (seconds from the end of the visit), for `turns` more turns, up to
/// `max_visits` visits in all (the first included).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Revisits {
    pub probability: f64,
    pub gap_s: Dist,
    pub turns: Dist,
    pub max_visits: u32,
}

impl Revisits {
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.probability) {
            return Err(ConfigError::invalid(
                format!("{field}.probability"),
                format!("{} is not a probability in [0, 1]", self.probability),
            ));
        }
        self.gap_s.validate(&format!("{field}.gap_s"))?;
        self.turns.validate(&format!("{field}.turns"))?;
        if self.max_visits == 0 {
            return Err(ConfigError::invalid(
                format!("{field}.max_visits"),
                "must be at least 1 (the first visit)",
            ));
        }
        Ok(())
    }
}

/// A request before ids are assigned.
pub(crate) struct Draft {
    pub session: Option<u64>,
    pub turn: u32,
    pub class: TrafficClass,
    pub arrival: Nanos,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub content: Arc<ContentChain>,
}

impl Draft {
    /// The order requests are released in: arrival, then class, session and turn, so that
    /// ties are broken the same way whatever the order they were drawn in.
    pub fn key(&self) -> Key {
        (self.arrival, self.class, self.session, self.turn)
    }
}

/// (arrival, class, session, turn): the order of a generated trace.
pub(crate) type Key = (Nanos, TrafficClass, Option<u64>, u32);

/// A generated time, refused past the horizon (a tiny rate or a long think time would
/// otherwise saturate, and a saturated time breaks every TTL).
pub(crate) fn arrival(t_s: f64, field: &str) -> Result<Nanos, ConfigError> {
    Nanos::try_from_secs_f64(t_s).map_err(|e| {
        ConfigError::invalid(
            field,
            format!("a generated arrival at {e}: raise the rate or shorten the think times"),
        )
    })
}

/// Appends a segment, refusing a context past what a chain holds.
pub(crate) fn push_segment(
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

pub(crate) fn fresh(rng: &mut ChaCha8Rng) -> SegmentId {
    SegmentId(rng.random())
}

pub(crate) fn system_segment(tag: &str, k: u64) -> SegmentId {
    SegmentId(hash2(sub_seed(0, tag), k))
}

/// System prompt lengths are a property of the prompt, not of the session: drawn once per
/// prompt from their own stream.
pub(crate) fn system_prompt_lengths(n: u32, dist: &Dist, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(hash2(seed, 0x5c));
    (0..n).map(|_| dist.tokens(&mut rng, 1)).collect()
}

/// One growing context: turns are recorded as (prompt, output, arrival, turn) until the
/// context is frozen into a chain, then emitted as requests sharing it.
pub(crate) struct Epoch {
    pub chain: ChainBuilder,
    block_tokens: u32,
    turns: Vec<(u32, u32, Nanos, u32)>,
    /// The config section, for errors.
    field: &'static str,
}

impl Epoch {
    pub fn new(block_tokens: u32, field: &'static str) -> Self {
        Epoch {
            chain: ChainBuilder::new(block_tokens),
            block_tokens,
            turns: Vec::new(),
            field,
        }
    }
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    pub fn push(&mut self, id: SegmentId, tokens: u32) -> Result<(), ConfigError> {
        push_segment(&mut self.chain, id, tokens, self.field)
    }
    fn turn(&mut self, prompt: u32, reply: u32, t_s: f64, turn: u32) -> Result<(), ConfigError> {
        let at = arrival(t_s, self.field)?;
        self.turns.push((prompt, reply, at, turn));
        Ok(())
    }
    /// Emits the recorded turns over the context so far; the context stays open, so a later
    /// visit can extend it.
    fn flush(
        &mut self,
        session: u64,
        class: TrafficClass,
        out: &mut Visit<'_>,
    ) -> Result<(), ConfigError> {
        if self.turns.is_empty() {
            return Ok(());
        }
        let chain = self.chain.clone().finish();
        if let Some(b) = out.budget.as_deref_mut() {
            b.charge(&chain)
                .map_err(|e| ConfigError::invalid(self.field, e))?;
        }
        let content = Arc::new(chain);
        for (p, o, arrival, turn) in self.turns.drain(..) {
            out.drafts.push(Draft {
                session: Some(session),
                turn,
                class,
                arrival,
                prompt_tokens: p,
                output_tokens: o,
                content: content.clone(),
            });
        }
        Ok(())
    }
}

/// Where a session stands between visits: what its next visit continues from.
pub(crate) struct Session {
    pub id: u64,
    pub class: TrafficClass,
    pub rng: ChaCha8Rng,
    /// Its system prompt (an index into the class's prompts).
    pub sys: usize,
    /// Turns of its first visit.
    pub first_turns: u32,
    pub epoch: Epoch,
    /// Turns sent so far (numbering the next visit's turns).
    pub turns_sent: u32,
    pub visits: u32,
    /// When the last visit ended (its last reply plus the think time after it), seconds.
    pub end_s: f64,
}

impl Session {
    /// A session's start: its own stream (from the class seed and its index), its system
    /// prompt (the first segment of its context) and the turns of its first visit.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        seed: u64,
        index: u64,
        id: u64,
        class: TrafficClass,
        turns: &Dist,
        system_tag: &str,
        sys_len: &[u32],
        mut epoch: Epoch,
    ) -> Result<Self, ConfigError> {
        let mut rng = ChaCha8Rng::seed_from_u64(hash2(seed, index));
        let sys = rng.random_range(0..sys_len.len() as u32) as usize;
        let first_turns = turns.tokens(&mut rng, 1);
        epoch.push(system_segment(system_tag, sys as u64), sys_len[sys])?;
        Ok(Session {
            id,
            class,
            rng,
            sys,
            first_turns,
            epoch,
            turns_sent: 0,
            visits: 0,
            end_s: 0.0,
        })
    }

    /// When the session comes back (seconds), if it does: drawn after its visit.
    pub fn next_visit(&mut self, revisits: Option<&Revisits>) -> Option<f64> {
        let r = revisits?;
        if self.visits >= r.max_visits || !self.rng.random_bool(r.probability) {
            return None;
        }
        Some(self.end_s + r.gap_s.sample(&mut self.rng))
    }
}

/// Where a visit's requests go: the drafts, and the block budget a whole trace is held to.
pub(crate) struct Visit<'a> {
    pub drafts: Vec<Draft>,
    pub budget: Option<&'a mut BlockBudget>,
}

/// An agent visit from `start_s`: on the first, the task; on a return, a follow-up task; then
/// turns that each append the model's reply and, but for the last, a tool result, compacting
/// the context when it grows past the configured size.
pub(crate) fn agent_visit(
    c: &AgentConfig,
    sys_len: &[u32],
    s: &mut Session,
    start_s: f64,
    out: &mut Visit<'_>,
) -> Result<(), ConfigError> {
    const F: &str = "workload.agent";
    let turns = visit_turns(s, c.revisits.as_ref());
    let bs = s.epoch.block_tokens();
    // Drawn in this order (segment id, then length) to keep the traces of earlier versions.
    let task_id = fresh(&mut s.rng);
    let task = c.task_tokens.tokens(&mut s.rng, 1);
    s.epoch.push(task_id, task)?;
    let mut t = start_s;
    for turn in 0..turns {
        let prompt = s.epoch.chain.total_tokens();
        let reply = c.reply_tokens.tokens(&mut s.rng, 1);
        s.epoch.turn(prompt, reply, t, s.turns_sent + turn)?;
        s.epoch.push(fresh(&mut s.rng), reply)?;
        t += c.pacing.service(reply) + c.think_time_s.sample(&mut s.rng);
        if turn + 1 == turns {
            break;
        }
        let tool = c.tool_result_tokens.tokens(&mut s.rng, 1);
        let compact = c.compaction.as_ref().is_some_and(|k| {
            s.epoch.chain.total_tokens().saturating_add(tool) > k.above_tokens
                || (k.probability > 0.0 && s.rng.random_bool(k.probability))
        });
        if let (true, Some(k)) = (compact, c.compaction.as_ref()) {
            let summary = k.summary_tokens.tokens(&mut s.rng, 1);
            s.epoch.flush(s.id, TrafficClass::Agent, out)?;
            s.epoch = Epoch::new(bs, F);
            s.epoch
                .push(system_segment("agent.system", s.sys as u64), sys_len[s.sys])?;
            s.epoch.push(fresh(&mut s.rng), summary)?;
        }
        s.epoch.push(fresh(&mut s.rng), tool)?;
    }
    end_visit(s, turns, t, TrafficClass::Agent, out)
}

/// A chat visit from `start_s`: turns of a user message and a reply, appended to the
/// conversation so far.
pub(crate) fn chat_visit(
    c: &ChatConfig,
    s: &mut Session,
    start_s: f64,
    out: &mut Visit<'_>,
) -> Result<(), ConfigError> {
    let turns = visit_turns(s, c.revisits.as_ref());
    let mut t = start_s;
    for turn in 0..turns {
        let user_id = fresh(&mut s.rng);
        let user = c.user_tokens.tokens(&mut s.rng, 1);
        s.epoch.push(user_id, user)?;
        let prompt = s.epoch.chain.total_tokens();
        let reply = c.reply_tokens.tokens(&mut s.rng, 1);
        s.epoch.turn(prompt, reply, t, s.turns_sent + turn)?;
        s.epoch.push(fresh(&mut s.rng), reply)?;
        t += c.pacing.service(reply) + c.think_time_s.sample(&mut s.rng);
    }
    end_visit(s, turns, t, TrafficClass::Chat, out)
}

/// The first visit's turns were drawn at the start; a return draws its own.
fn visit_turns(s: &mut Session, revisits: Option<&Revisits>) -> u32 {
    match (s.visits, revisits) {
        (0, _) | (_, None) => s.first_turns,
        (_, Some(r)) => r.turns.tokens(&mut s.rng, 1),
    }
}

fn end_visit(
    s: &mut Session,
    turns: u32,
    end_s: f64,
    class: TrafficClass,
    out: &mut Visit<'_>,
) -> Result<(), ConfigError> {
    s.epoch.flush(s.id, class, out)?;
    s.turns_sent += turns;
    s.visits += 1;
    s.end_s = end_s;
    Ok(())
}
