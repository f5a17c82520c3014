//! Why the next quorum is, or is not yet, ready ([`Verdict`]), and the read-only view of the
//! engine the status pages show ([`Snapshot`]).

use std::fmt;
use std::time::{Duration, Instant};

use super::{EarlierLife, QuorumEngine};
use crate::lighthouse::health::hang::Hung;
use crate::proto::QuorumMember;

/// Why the next quorum is, or is not yet, ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every member of the previous quorum asked again (and min/majority hold).
    FastPath,
    /// Every healthy replica group is asking.
    AllHealthyJoined,
    /// The join timeout of the round passed with enough replica groups.
    JoinTimeout,
    /// Nobody is asking.
    NoParticipants,
    /// Fewer candidates than `min_replicas`.
    BelowMinReplicas {
        /// Candidates after shrink-only filtering.
        candidates: usize,
        /// The configured minimum.
        min_replicas: u64,
    },
    /// The candidates are not a strict majority of the healthy replica groups.
    NoMajority {
        /// Candidates after shrink-only filtering.
        candidates: usize,
        /// Healthy replica groups (as of the last prune).
        healthy: usize,
    },
    /// Enough replica groups, waiting for healthy stragglers until the join timeout.
    WaitingForStragglers {
        /// Healthy replica groups that are not asking yet.
        missing: usize,
        /// Time left until the join timeout.
        remaining: Duration,
    },
    /// The lighthouse (re)started recently: a replica still heartbeating may not have been
    /// heard yet, so the first quorum waits.
    StartupHold {
        /// Time left until the first quorum may be issued.
        remaining: Duration,
        /// How the lighthouse knows it restarted.
        why: EarlierLife,
    },
    /// Every candidate is behind a replica that may still come back: waiting for it.
    WaitingForProgress {
        /// The replica holding the best step.
        holder: String,
        /// Its committed step.
        step: i64,
        /// The best step among the candidates.
        candidates_step: i64,
        /// Time left until the round gives up on it (`progress_wait` after the round began).
        remaining: Duration,
    },
}

impl Verdict {
    /// True when a quorum is issued on this verdict.
    pub fn is_ready(&self) -> bool {
        matches!(
            self,
            Verdict::FastPath | Verdict::AllHealthyJoined | Verdict::JoinTimeout
        )
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::FastPath => write!(f, "ready: every member of the previous quorum is asking"),
            Verdict::AllHealthyJoined => write!(f, "ready: every healthy replica is asking"),
            Verdict::JoinTimeout => write!(f, "ready: join timeout passed with enough replicas"),
            Verdict::NoParticipants => write!(f, "no replica is asking for a quorum"),
            Verdict::BelowMinReplicas {
                candidates,
                min_replicas,
            } => {
                let more = min_replicas.saturating_sub(*candidates as u64);
                let s = if more == 1 { "" } else { "s" };
                write!(
                    f,
                    "waiting for {more} more replica{s} to reach min_replicas={min_replicas}"
                )
            }
            Verdict::NoMajority {
                candidates,
                healthy,
            } => write!(
                f,
                "waiting for a strict majority: {candidates} asking of {healthy} healthy replicas"
            ),
            Verdict::WaitingForStragglers { missing, remaining } => write!(
                f,
                "waiting up to {:.1}s for {missing} healthy replica(s) not asking yet",
                remaining.as_secs_f64()
            ),
            Verdict::StartupHold { remaining, why } => write!(
                f,
                "lighthouse restarted ({why}): holding the first quorum {:.1}s more so every \
                 replica still heartbeating is heard",
                remaining.as_secs_f64()
            ),
            Verdict::WaitingForProgress {
                holder,
                step,
                candidates_step,
                remaining,
            } => write!(
                f,
                "waiting up to {:.1}s for {holder} (at step {step}): the candidates are \
                 behind, at step {candidates_step}",
                remaining.as_secs_f64()
            ),
        }
    }
}

/// A read-only view of the engine for status pages.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Id of the last issued quorum, if any.
    pub quorum_id: Option<i64>,
    /// The configured minimum.
    pub min_replicas: u64,
    /// Members of the last issued quorum.
    pub members: Vec<QuorumMember>,
    /// Known replica ids with the time since they were last seen, and whether healthy.
    pub heartbeats: Vec<(String, Duration, bool)>,
    /// Replica ids asking in the current round (sorted).
    pub participants: Vec<String>,
    /// Why the next quorum is or is not ready.
    pub verdict: Verdict,
    /// While a restarted lighthouse may still hold its first quorum: how it knows it
    /// restarted, and the time left.
    pub startup_hold: Option<(EarlierLife, Duration)>,
    /// While a round is open: healthy replicas not asking (sorted, at most 64).
    pub healthy_not_asking: Vec<String>,
    /// How long the current round has been open (None while nobody asks).
    pub round_age: Option<Duration>,
    /// Replica groups hung now (see [`crate::lighthouse::health::hang`]), by id.
    pub hung: Vec<Hung>,
    /// The hang timeout now, and how it was chosen.
    pub hang_timeout: (Duration, String),
    /// The runtime state parity check (see [`crate::lighthouse::health::parity`]).
    pub parity: ParitySnapshot,
    /// Groups dropped from the quorum as lasting stragglers: id, why, time left (sorted).
    pub dropped: Vec<(String, String, Duration)>,
}

/// The runtime state parity check's state, as the status pages show it (`/status` serves
/// it as is; see docs/telemetry.md).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ParitySnapshot {
    /// Steps whose state digests were compared across at least two groups.
    pub checks: u64,
    /// Groups found diverged (`replica_diverged` events; each group at each step once).
    pub diverged_total: u64,
    /// The last step compared (null before the first comparison).
    pub last_checked_step: Option<i64>,
    /// Groups whose state differed from the agreeing majority's, healing from it (sorted).
    pub healing: Vec<String>,
    /// Groups stopped: their state differs with no majority (sorted).
    pub stopped: Vec<String>,
}

impl QuorumEngine {
    /// Why the next quorum is or is not ready, from the counters (O(1)).
    pub fn verdict(&self, now: Instant) -> Verdict {
        let asking = self.participants.len();
        if asking == 0 {
            return Verdict::NoParticipants;
        }
        let candidates = if self.shrinking() {
            self.prev_participating
        } else {
            asking
        };
        // Hung groups (alive, training loop away; see `super::health::hang`) and groups dropped as
        // lasting stragglers are not waited for.
        let dropped = self
            .dropped
            .keys()
            .filter(|id| {
                !self.hang.is_hung(id) && self.heartbeats.get(*id).is_some_and(|r| r.counted)
            })
            .count();
        let healthy = self
            .healthy
            .saturating_sub(self.hang.count() + dropped)
            .max(asking);
        if (candidates as u64) < self.opts.min_replicas {
            return Verdict::BelowMinReplicas {
                candidates,
                min_replicas: self.opts.min_replicas,
            };
        }
        if candidates * 2 <= healthy {
            return Verdict::NoMajority {
                candidates,
                healthy,
            };
        }
        let ready = if !self.previous_ids.is_empty()
            && self.prev_participating == self.previous_ids.len()
        {
            Verdict::FastPath
        } else if asking >= healthy {
            Verdict::AllHealthyJoined
        } else {
            let started = self.round_started.unwrap_or(now);
            let missing = healthy - asking;
            match started.checked_add(self.opts.join_timeout) {
                Some(deadline) if now >= deadline => Verdict::JoinTimeout,
                Some(deadline) => {
                    return Verdict::WaitingForStragglers {
                        missing,
                        remaining: deadline - now,
                    }
                }
                None => {
                    return Verdict::WaitingForStragglers {
                        missing,
                        remaining: Duration::MAX,
                    }
                }
            }
        };
        self.hold_for_progress(now).unwrap_or(ready)
    }

    /// A read-only view for status pages (O(n)).
    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let timeout = self.opts.heartbeat_timeout;
        let mut heartbeats: Vec<(String, Duration, bool)> = self
            .heartbeats
            .iter()
            .map(|(id, rec)| {
                let age = now.saturating_duration_since(rec.last_seen);
                let healthy = age <= timeout || self.participants.contains_key(id);
                (id.clone(), age, healthy)
            })
            .collect();
        heartbeats.sort_by(|a, b| a.0.cmp(&b.0));
        let mut participants: Vec<String> = self.participants.keys().cloned().collect();
        participants.sort();
        Snapshot {
            quorum_id: self.previous.as_ref().map(|q| q.quorum_id),
            min_replicas: self.opts.min_replicas,
            members: self
                .previous
                .as_ref()
                .map(|q| q.participants.clone())
                .unwrap_or_default(),
            heartbeats,
            participants,
            verdict: self.verdict(now),
            startup_hold: self
                .startup_hold_until(now)
                .zip(self.earlier_life.clone())
                .map(|(end, why)| (why, end - now)),
            healthy_not_asking: if self.participants.is_empty() {
                Vec::new()
            } else {
                self.healthy_not_asking(now, 64)
            },
            round_age: self.round_started.map(|t| now.saturating_duration_since(t)),
            hung: self.hang.hung().cloned().collect(),
            hang_timeout: (self.hang.timeout(), self.hang.timeout_rule()),
            parity: ParitySnapshot {
                checks: self.parity.checks,
                diverged_total: self.parity.diverged_total,
                last_checked_step: self.parity.last_checked,
                healing: self.parity.healing(),
                stopped: self.parity.stopped_ids(),
            },
            dropped: {
                let mut d: Vec<(String, String, Duration)> = self
                    .dropped
                    .iter()
                    .map(|(id, (until, why))| {
                        (
                            id.clone(),
                            why.clone(),
                            until.saturating_duration_since(now),
                        )
                    })
                    .collect();
                d.sort();
                d
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::testkit::*;
    use super::super::*;
    use super::*;

    #[test]
    fn verdict_messages_are_readable() {
        let v = Verdict::BelowMinReplicas {
            candidates: 1,
            min_replicas: 2,
        };
        assert_eq!(
            v.to_string(),
            "waiting for 1 more replica to reach min_replicas=2"
        );
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        assert_eq!(e.snapshot(t).verdict, Verdict::NoParticipants);
        e.join(member("a"), t).unwrap();
        let s = e.snapshot(t);
        assert_eq!(s.participants, ["a"]);
        assert_eq!(
            s.verdict.to_string(),
            "waiting for 1 more replica to reach min_replicas=2"
        );
    }
}
