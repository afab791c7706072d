//! Seeded generators for the workloads of SPEC §13: agent sessions, chat sessions and fresh
//! documents. Every parameter is a config value; the defaults are the ones chosen to reproduce
//! the published table (see `experiments/configs/cache-policy.toml` for why).
//!
//! Sessions start as a Poisson process. A turn's successor arrives after the turn would have
//! finished (estimated TTFT + output at the per-request decode rate) plus a think time (tool
//! execution for agents, the user for chat), so a turn never arrives before its predecessor's
//! output exists. Each session draws from its own RNG stream (seeded from the run seed, the
//! class and the session index), so changing the number of sessions does not change the others.
//! Sessions may come back after hours or days ([`Revisits`]) and continue their context.
//!
//! The requests are drawn by [`crate::stream::Stream`], one at a time in trace order; a
//! [`Trace`] is that stream collected.

use crate::dist::Dist;
use crate::stream::{SessionSample, Stream};
pub use crate::visit::Revisits;
use crate::{MAX_GENERATED_REQUESTS, Trace};
use serde::{Deserialize, Serialize};
use servelab_core::{ConfigError, Nanos};

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
    pub(crate) fn service(&self, output_tokens: u32) -> f64 {
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
    /// Tasks the session comes back with later (absent: never).
    #[serde(default)]
    pub revisits: Option<Revisits>,
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
    /// The user coming back to the conversation later (absent: never).
    #[serde(default)]
    pub revisits: Option<Revisits>,
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
    /// A repeat asks about a document first seen at most this long ago (absent: any document
    /// seen). Over days, a window keeps repeats on documents still in use rather than on
    /// every document since the start.
    #[serde(default)]
    pub repeat_within: Option<Nanos>,
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
            if let Some(r) = &a.revisits {
                r.validate(&f("revisits"))?;
            }
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
            if let Some(r) = &c.revisits {
                r.validate(&f("revisits"))?;
            }
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

/// Generates the configured workloads into one trace, keyed at `block_tokens`: the
/// [`Stream`] of the config, collected (refused past [`MAX_GENERATED_REQUESTS`] requests or
/// [`crate::MAX_TRACE_BLOCKS`] block keys, so no config can ask for unbounded work).
pub fn generate(cfg: &WorkloadConfig, seed: u64, block_tokens: u32) -> Result<Trace, ConfigError> {
    generate_sampled(cfg, seed, block_tokens, None)
}

/// [`generate`] keeping the sessions (and documents) `sample` keeps.
pub fn generate_sampled(
    cfg: &WorkloadConfig,
    seed: u64,
    block_tokens: u32,
    sample: Option<SessionSample>,
) -> Result<Trace, ConfigError> {
    let mut stream = Stream::new(cfg, seed, block_tokens, sample)?.with_block_budget();
    let mut requests = Vec::new();
    while let Some(r) = stream.next_request()? {
        if requests.len() as u64 >= MAX_GENERATED_REQUESTS {
            return Err(ConfigError::invalid(
                "workload",
                format!(
                    "the workload makes more than {MAX_GENERATED_REQUESTS} requests: lower the \
                     sessions, requests, turns or returns"
                ),
            ));
        }
        requests.push(r);
    }
    Ok(Trace::new(block_tokens, requests))
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_core::{Request, SessionId};

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
            revisits: None,
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
                revisits: None,
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
                repeat_within: None,
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
            repeat_within: None,
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
