//! In-group voting (SPEC §6). The ranks of an EP group move in lockstep, so a mode switch that
//! changes the step's shape must be agreed by the group. Mode A switches only when every rank
//! meets the condition; mode B lets a quorum trigger it, so a few ranks with work that wants the
//! switch do not wait for all the others. Either way a switch takes effect only after it has been
//! confirmed in further rounds, because one round's votes do not prove the next round can run in
//! the new mode.

use crate::error::ConfigError;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum VoteMode {
    /// Mode A: every rank must vote yes.
    #[default]
    All,
    /// Mode B: at least `min_ranks` ranks must vote yes.
    Quorum { min_ranks: u32 },
}

impl VoteMode {
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            VoteMode::Quorum { min_ranks: 0 } => Err(ConfigError::invalid(
                "vote.quorum.min_ranks",
                "must be at least 1 (0 would switch with no rank asking)",
            )),
            _ => Ok(()),
        }
    }

    /// Whether a round with `yes` of `ranks` votes meets the condition.
    pub fn passes(self, yes: u32, ranks: u32) -> bool {
        match self {
            VoteMode::All => ranks > 0 && yes == ranks,
            VoteMode::Quorum { min_ranks } => yes >= min_ranks.min(ranks.max(1)),
        }
    }
}

/// A two-state switch driven by rounds of votes, with confirmation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupVote {
    mode: VoteMode,
    confirmation_rounds: u32,
    active: bool,
    /// Consecutive rounds whose outcome disagreed with `active`.
    streak: u32,
    switches: u64,
}

impl GroupVote {
    pub fn new(mode: VoteMode, confirmation_rounds: u32, initially_active: bool) -> Self {
        GroupVote {
            mode,
            confirmation_rounds,
            active: initially_active,
            streak: 0,
            switches: 0,
        }
    }
    pub fn active(&self) -> bool {
        self.active
    }
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// One round: `yes` of `ranks` ranks meet the condition. Returns the state in effect after
    /// the round: it flips once `1 + confirmation_rounds` consecutive rounds disagree with it.
    pub fn round(&mut self, yes: u32, ranks: u32) -> bool {
        let want = self.mode.passes(yes, ranks);
        if want == self.active {
            self.streak = 0;
        } else {
            self.streak += 1;
            if self.streak > self.confirmation_rounds {
                self.active = want;
                self.streak = 0;
                self.switches += 1;
            }
        }
        self.active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_a_needs_everyone_mode_b_a_quorum() {
        assert!(!VoteMode::All.passes(63, 64));
        assert!(VoteMode::All.passes(64, 64));
        assert!(VoteMode::Quorum { min_ranks: 8 }.passes(8, 64));
        assert!(!VoteMode::Quorum { min_ranks: 8 }.passes(7, 64));
        // A quorum larger than the group means everyone.
        assert!(VoteMode::Quorum { min_ranks: 100 }.passes(4, 4));
    }

    #[test]
    fn switch_needs_confirmation() {
        let mut v = GroupVote::new(VoteMode::All, 1, false);
        assert!(!v.round(4, 4)); // first round: not yet
        assert!(v.round(4, 4)); // confirmed
        assert!(v.round(3, 4)); // one dissent: stays
        assert!(v.round(4, 4)); // streak reset
        assert!(v.round(3, 4));
        assert!(!v.round(0, 4));
        assert_eq!(v.switches(), 2);
        let mut now = GroupVote::new(VoteMode::Quorum { min_ranks: 1 }, 0, false);
        assert!(now.round(1, 4));
    }

    #[test]
    fn zero_quorum_rejected() {
        assert!(VoteMode::Quorum { min_ranks: 0 }.validate().is_err());
    }
}
