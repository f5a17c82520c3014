//! The pure quorum engine: `(state, now, options) → decision`, with no I/O and no clock.
//!
//! Every method takes the current time as an argument, so the rules are tested with virtual
//! time. Joins, leaves and heartbeats cost O(1) amortised: the engine keeps incremental
//! counters (participants, participants that were in the previous quorum, shrink-only
//! requests, healthy replicas as of the last prune) and only builds a quorum (O(n)) once it
//! has decided to issue one. Heartbeat expiry and pruning happen in [`QuorumEngine::tick`].
//!
//! Rules (see the design notes, "Lighthouse quorum rules"):
//! - healthy = heartbeated or asked within `heartbeat_timeout` (a waiting participant is
//!   healthy: its request is live);
//! - a quorum needs ≥ `min_replicas` members and a strict majority of all healthy replicas,
//!   on the fast path too;
//! - fast path: every member of the previous quorum asks again → answer at once;
//! - otherwise answer once every healthy replica asks, or `join_timeout` after the round's
//!   first joiner;
//! - `shrink_only` (any participant) keeps only members of the previous quorum;
//! - the id changes when the member set changes or a member reports commit failures.
//!
//! Loss (see the design notes, "Failure detection"): [`QuorumEngine::lost`] records that a
//! replica group died (its session with the lighthouse ended): it stops counting as healthy
//! at once, so the next round does not wait `heartbeat_timeout` for it. At tick time a member
//! of the last quorum whose heartbeat expired (a hang) is declared lost too. Each loss of a
//! member of the last quorum is reported once through [`QuorumEngine::take_lost`].
//!
//! No progress regression (see the design notes, "Lighthouse quorum rules"): the engine knows
//! each replica's committed step (from its requests and heartbeats). A round that is otherwise
//! ready, but whose candidates are all behind a replica that may still come back (heartbeating,
//! or with its session open even if silent), waits for that replica until `progress_wait`
//! after the round's first request. A fresh job's first quorum is issued under the join
//! rules alone, at once. An engine that knows it restarted — it continues a previous life
//! (its durable state), or a replica reported a quorum id it holds from an earlier life —
//! issues no first quorum before `min(heartbeat_timeout, progress_wait)` after its start,
//! so every replica that is still heartbeating has been heard; a restored engine ends that
//! hold early when every member of the quorum it remembers asks at or above the best step
//! it remembers: nobody outside that quorum can be ahead of it then. A quorum issued behind the best step
//! known anyway (the holders died, or the wait ran out) is reported once through
//! [`QuorumEngine::take_regressions`]; a holder given up on at a step is not waited for
//! again at that step.
//!
//! The engine's pieces, each with its own tests: this module holds the round itself (joins,
//! leaves, the quorum issued); `liveness` who is alive (heartbeats, sessions, losses,
//! hangs, drops); `progress` the no-regression rules and the startup hold; `commit`
//! write-ahead commits and the durable state; `verdict` why a round is ready or not, and
//! the read-only view for the status pages.

use crate::ids::{IdMap, IdSet};
use std::time::Instant;

use super::health::hang::HangWatch;
use super::health::parity::{Diverged, Parity};
pub use super::health::Regression;
use super::LighthouseOptions;
use crate::client::compact;
use crate::error::{ensure, Error, Result};
use crate::proto::{Quorum, QuorumMember, StateDigest};

mod commit;
mod liveness;
mod progress;
mod verdict;

pub use commit::{CommitVerdict, Durable, MAX_DURABLE_OTHERS};
pub use liveness::{LostMember, PRUNE_AFTER_TIMEOUTS};
pub use progress::EarlierLife;
pub use verdict::{ParitySnapshot, Snapshot, Verdict};

use liveness::HeartbeatRecord;

/// One replica group waiting in the current round.
#[derive(Debug, Clone)]
struct Participant {
    member: QuorumMember,
    generation: u64,
}

/// Outcome of [`QuorumEngine::join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joined {
    /// Identifies this request; pass it to [`QuorumEngine::leave`] so a stale request of the
    /// same replica cannot remove a newer one.
    pub generation: u64,
    /// The generation of an earlier, still waiting request of the same replica that this one
    /// replaced (that waiter should be told it was superseded).
    pub replaced: Option<u64>,
}

/// The lighthouse's quorum state machine. Pure: the caller supplies `now` everywhere.
#[derive(Debug)]
pub struct QuorumEngine {
    opts: LighthouseOptions,
    /// Id given to the next quorum whose membership changed.
    next_id: i64,
    previous: Option<Quorum>,
    previous_ids: IdSet,
    participants: IdMap<Participant>,
    round_started: Option<Instant>,
    next_generation: u64,
    /// Participants that are members of the previous quorum.
    prev_participating: usize,
    /// Participants that asked for shrink_only.
    shrink_only: usize,
    heartbeats: IdMap<HeartbeatRecord>,
    /// Records with `counted`: a superset of the healthy replicas (exact after a prune).
    healthy: usize,
    /// Revision of the last issued quorum (a counter of issued quorums, 0 before the first).
    revision: u64,
    /// Revision since which every issued quorum had the last one's id and member fields
    /// except steps (0 before the first quorum).
    stable_since: u64,
    /// Members of the last quorum already declared lost (each is reported once).
    lost_reported: IdSet,
    /// Losses not yet collected by [`QuorumEngine::take_lost`].
    pending_lost: Vec<LostMember>,
    /// When this engine started (after a restart, the first quorum is held until it has
    /// heard every replica still heartbeating).
    started: Instant,
    /// How this engine knows the job ran before it started; None for a fresh job, whose
    /// first quorum is not held.
    earlier_life: Option<EarlierLife>,
    /// The best committed step known (quorums, requests, heartbeats), excluding holders given
    /// up on; None before any report.
    high_water: Option<i64>,
    /// Holders given up on: replica id → the step they held then (not waited for again at
    /// that step).
    waived: IdMap<i64>,
    /// Records restored from the state file and still waited for as such, by group (base
    /// id): not heard from yet, or the one incarnation of the group heard since. A new
    /// incarnation's arrival finds its group's old ones here instead of scanning every
    /// record (which made a first round of n groups O(n²)).
    restored_by_group: IdMap<Vec<String>>,
    /// Regressions not yet collected by [`QuorumEngine::take_regressions`].
    pending_regressions: Vec<Regression>,
    /// The last quorum of the previous life of the lighthouse (id, members), until this life
    /// issues its first.
    restored_quorum: Option<(i64, IdSet)>,
    /// Bumped whenever [`QuorumEngine::durable`] may have changed.
    durable_revision: u64,
    /// The training loops' visits and the groups found hung (see [`crate::lighthouse::health::hang`]).
    hang: HangWatch,
    /// The groups' state digests, compared step by step (see [`crate::lighthouse::health::parity`]).
    parity: Parity,
    /// Groups dropped from the quorum as lasting stragglers, until when, and why: not
    /// counted as healthy, and their requests wait in `parked` until then.
    dropped: IdMap<(Instant, String)>,
    /// Requests of dropped groups, joining the round when their drop ends.
    parked: IdMap<Participant>,
    /// Replicas whose session ended, and when: a heartbeat sent before the end can still
    /// arrive after it, and must not make a dead group healthy again. Their heartbeats are
    /// ignored for one heartbeat timeout, or until they open a session or ask.
    ended: IdMap<Instant>,
}

/// Rejects members the engine cannot reason about; nothing is changed on error.
pub fn validate_member(member: &QuorumMember) -> Result<()> {
    let id = &member.replica_id;
    ensure!(!id.trim().is_empty(), "replica_id must not be empty");
    ensure!(
        member.step >= 0,
        "step must not be negative (replica {id:?} sent {})",
        member.step
    );
    ensure!(
        member.world_size > 0,
        "world_size must be at least 1 (replica {id:?} sent 0)"
    );
    ensure!(
        member.commit_failures >= 0,
        "commit_failures must not be negative (replica {id:?} sent {})",
        member.commit_failures
    );
    ensure!(
        member.data.is_empty()
            || serde_json::from_str::<serde::de::IgnoredAny>(&member.data).is_ok(),
        "data of replica {id:?} is not valid JSON"
    );
    Ok(())
}

impl QuorumEngine {
    /// A fresh engine, started at `now`, whose first quorum gets `initial_quorum_id` (at
    /// least 1).
    ///
    /// Passing e.g. the start time in microseconds keeps ids strictly increasing across
    /// lighthouse restarts while the engine itself stays free of clocks.
    pub fn new(opts: LighthouseOptions, initial_quorum_id: i64, now: Instant) -> Self {
        Self {
            next_id: initial_quorum_id.max(1),
            previous: None,
            previous_ids: Default::default(),
            participants: Default::default(),
            round_started: None,
            next_generation: 1,
            prev_participating: 0,
            shrink_only: 0,
            heartbeats: Default::default(),
            healthy: 0,
            revision: 0,
            stable_since: 0,
            lost_reported: Default::default(),
            pending_lost: Vec::new(),
            started: now,
            earlier_life: None,
            high_water: None,
            waived: Default::default(),
            restored_by_group: Default::default(),
            pending_regressions: Vec::new(),
            restored_quorum: None,
            durable_revision: 0,
            hang: HangWatch::new(opts.hang_timeout),
            parity: Parity::default(),
            dropped: Default::default(),
            parked: Default::default(),
            ended: Default::default(),
            opts,
        }
    }

    /// The options the engine decides with.
    pub fn options(&self) -> &LighthouseOptions {
        &self.opts
    }

    /// The last issued quorum, if any.
    pub fn previous(&self) -> Option<&Quorum> {
        self.previous.as_ref()
    }

    /// Revision of the last issued quorum (0 before the first): counts issued quorums.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The revision since which every issued quorum had the same quorum_id and the same
    /// members with the same fields except `step` as the last one (0 before the first).
    ///
    /// A requester that holds any quorum of revision ≥ this (and the same id) can rebuild the
    /// last quorum from its compact form. Maintained in O(n) per issued quorum, O(1) state.
    pub fn stable_since(&self) -> u64 {
        self.stable_since
    }

    /// When the current round's first request arrived (None while nobody asks).
    pub fn round_started(&self) -> Option<Instant> {
        self.round_started
    }

    /// True if `replica_id` is asking in the current round.
    pub fn is_asking(&self, replica_id: &str) -> bool {
        self.participants.contains_key(replica_id)
    }

    /// Number of replica groups asking in the current round.
    pub fn num_participants(&self) -> usize {
        self.participants.len()
    }

    /// True if `replica_id` is waiting in the current round with this `generation`.
    pub fn is_waiting(&self, replica_id: &str, generation: u64) -> bool {
        self.participants
            .get(replica_id)
            .or_else(|| self.parked.get(replica_id))
            .is_some_and(|p| p.generation == generation)
    }

    /// Adds `member` to the current round (replacing an earlier request of the same replica).
    ///
    /// Does not decide: call [`QuorumEngine::poll`] afterwards.
    pub fn join(&mut self, member: QuorumMember, now: Instant) -> Result<Joined> {
        validate_member(&member)?;
        if let Some(why) = self.parity.stopped(&member.replica_id) {
            return Err(Error::Diverged(why.to_string()));
        }
        self.ended.remove(&member.replica_id);
        self.note_step(&member.replica_id, Some(member.step), now);
        self.hang.asked(&member.replica_id, now);
        let generation = self.next_generation;
        self.next_generation += 1;
        if self.dropped.contains_key(&member.replica_id) {
            // Dropped as a straggler: the request waits until the drop ends.
            let replaced = self
                .parked
                .insert(
                    member.replica_id.clone(),
                    Participant { member, generation },
                )
                .map(|p| p.generation);
            return Ok(Joined {
                generation,
                replaced,
            });
        }
        Ok(self.enter_round(Participant { member, generation }, now))
    }

    /// Puts a request into the current round (replacing an earlier one of its replica).
    fn enter_round(&mut self, participant: Participant, now: Instant) -> Joined {
        let generation = participant.generation;
        let member = participant.member;
        let shrink = member.shrink_only;
        let in_previous = self.previous_ids.contains(&member.replica_id);
        let replaced = match self.participants.insert(
            member.replica_id.clone(),
            Participant { member, generation },
        ) {
            Some(old) => {
                if old.member.shrink_only {
                    self.shrink_only -= 1;
                }
                Some(old.generation)
            }
            None => {
                if in_previous {
                    self.prev_participating += 1;
                }
                None
            }
        };
        if shrink {
            self.shrink_only += 1;
        }
        if self.round_started.is_none() {
            self.round_started = Some(now);
        }
        Joined {
            generation,
            replaced,
        }
    }

    /// Removes the request `generation` of `replica_id` from the round (cancelled or timed
    /// out). Returns false if that request is no longer waiting (answered or replaced).
    pub fn leave(&mut self, replica_id: &str, generation: u64) -> bool {
        if !self.is_waiting(replica_id, generation) {
            return false;
        }
        if self
            .parked
            .get(replica_id)
            .is_some_and(|p| p.generation == generation)
        {
            self.parked.remove(replica_id);
            return true;
        }
        if let Some(p) = self.participants.remove(replica_id) {
            if p.member.shrink_only {
                self.shrink_only -= 1;
            }
            if self.previous_ids.contains(replica_id) {
                self.prev_participating -= 1;
            }
        }
        if self.participants.is_empty() {
            self.round_started = None;
        }
        true
    }

    fn shrinking(&self) -> bool {
        self.shrink_only > 0 && self.previous.is_some()
    }

    /// Issues a quorum if the round is ready (call after every join).
    ///
    /// The returned quorum has no `created` timestamp: wall-clock time is the caller's.
    pub fn poll(&mut self, now: Instant) -> Option<Quorum> {
        if self.verdict(now).is_ready() {
            Some(self.issue(now))
        } else {
            None
        }
    }

    /// Expires heartbeats, forgets long-gone replicas, declares members of the last quorum
    /// whose heartbeat expired lost (see [`QuorumEngine::take_lost`]), then decides like
    /// [`QuorumEngine::poll`].
    pub fn tick(&mut self, now: Instant) -> Option<Quorum> {
        self.prune(now);
        self.expire_members();
        self.poll(now)
    }

    fn issue(&mut self, now: Instant) -> Quorum {
        self.hang.round_issued(now);
        // Decided while the members are still in the round: who is ahead of this quorum.
        let to_step = self.candidates_step();
        let mut ahead: Vec<(String, i64)> = self
            .holders_ahead(to_step, now)
            .map(|(id, s)| (id.to_string(), s))
            .collect();
        // Holders remembered from a previous life and waited out: not known to be dead.
        ahead.extend(self.heartbeats.iter().filter_map(|(id, rec)| {
            let waited_out = rec.restored_until.is_some_and(|until| now >= until)
                && !rec.may_come_back(now, self.opts.heartbeat_timeout);
            let held = rec.step.filter(|s| *s > to_step)?;
            let waived = self.waived.get(id).is_some_and(|w| held <= *w);
            (waited_out && !waived).then(|| (id.clone(), held))
        }));
        ahead.sort();
        let shrinking = self.shrinking();
        let mut members: Vec<QuorumMember> = if shrinking {
            let ids: Vec<String> = self
                .participants
                .keys()
                .filter(|id| self.previous_ids.contains(*id))
                .cloned()
                .collect();
            ids.iter()
                .filter_map(|id| self.participants.remove(id))
                .map(|p| p.member)
                .collect()
        } else {
            self.participants.drain().map(|(_, p)| p.member).collect()
        };
        members.sort_unstable_by(|a, b| a.replica_id.cmp(&b.replica_id));
        self.present_diverged(&mut members);

        let same_members = self.previous.is_some()
            && members.len() == self.previous_ids.len()
            && members
                .iter()
                .all(|m| self.previous_ids.contains(&m.replica_id));
        let failures = members.iter().any(|m| m.commit_failures > 0);
        let quorum_id = match &self.previous {
            Some(prev) if same_members && !failures => prev.quorum_id,
            _ => {
                let id = self.next_id;
                self.next_id += 1;
                id
            }
        };

        if !same_members {
            self.previous_ids = members.iter().map(|m| m.replica_id.clone()).collect();
        }
        // Every member of a new quorum is alive as it is issued.
        self.lost_reported.clear();
        if self.restored_quorum.take().is_some()
            || self.previous.as_ref().map(|q| q.quorum_id) != Some(quorum_id)
        {
            self.durable_revision += 1;
        }
        let fresh = members.iter().any(|m| m.step == 0);
        self.account_progress(quorum_id, to_step, ahead, fresh);
        self.revision += 1;
        let quorum = Quorum {
            quorum_id,
            participants: members,
            created: None,
            revision: self.revision,
            compact: None,
            sparse: None,
        };
        let steps_only = self
            .previous
            .as_ref()
            .is_some_and(|prev| compact::only_steps_changed(prev, &quorum));
        if !steps_only {
            self.stable_since = self.revision;
        }
        self.previous = Some(quorum.clone());

        // Whoever was not selected (newcomers under shrink_only) waits for the next round.
        self.prev_participating = self
            .participants
            .keys()
            .filter(|id| self.previous_ids.contains(*id))
            .count();
        self.shrink_only = self
            .participants
            .values()
            .filter(|p| p.member.shrink_only)
            .count();
        self.round_started = if self.participants.is_empty() {
            None
        } else {
            Some(now)
        };
        quorum
    }

    /// Presents each member marked to heal by the parity check one step behind the best
    /// agreeing member, so every manager (ours or upstream's) makes it heal from an agreeing
    /// group. The mark goes once the group commits a step past the heal it was given.
    fn present_diverged(&mut self, members: &mut [QuorumMember]) {
        let marks = self.parity.heal_marks();
        if marks.is_empty() {
            return;
        }
        let mut cleared = Vec::new();
        for m in members.iter() {
            if let Some(mark) = marks.get(&m.replica_id) {
                if mark.healing_to.is_some_and(|to| m.step > to) {
                    cleared.push(m.replica_id.clone());
                }
            }
        }
        for id in &cleared {
            marks.remove(id);
        }
        let best_agreeing = members
            .iter()
            .filter(|m| !marks.contains_key(&m.replica_id))
            .map(|m| m.step)
            .max();
        let Some(best) = best_agreeing.filter(|b| *b >= 1) else {
            return;
        };
        for m in members.iter_mut() {
            if let Some(mark) = marks.get_mut(&m.replica_id) {
                m.step = m.step.min(best - 1);
                mark.healing_to = Some(best);
            }
        }
    }

    /// Takes group `replica_id`'s digests of its committed state after a step (see
    /// [`crate::lighthouse::health::parity`]) and decides the steps that are ready; returns the step to
    /// acknowledge.
    pub fn offer_digest(
        &mut self,
        replica_id: &str,
        digest: StateDigest,
        now: Instant,
    ) -> Result<i64> {
        Self::check_id(replica_id)?;
        let ack = self.parity.offer(replica_id, digest, now)?;
        self.parity.evaluate(self.previous_ids.len(), now);
        Ok(ack)
    }

    /// The groups found diverged since the last call.
    pub fn take_diverged(&mut self) -> Vec<Diverged> {
        self.parity.take_verdicts()
    }

    /// Why `replica_id` is stopped by the parity check, if it is.
    pub fn parity_stopped(&self, replica_id: &str) -> Option<&str> {
        self.parity.stopped(replica_id)
    }

    /// What the parity checks say of `replica_id`'s committed states.
    pub fn parity_mark(&self, replica_id: &str) -> crate::lighthouse::health::parity::ParityMark {
        self.parity.mark(replica_id)
    }

    /// The parity check's counters and marks.
    pub fn parity(&self) -> &Parity {
        &self.parity
    }
}

#[cfg(test)]
mod testkit;

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::testkit::*;
    use super::*;
    use crate::lighthouse::health::hang;
    use Ev::*;

    #[test]
    fn first_round_waits_for_all_healthy() {
        run(
            1,
            &[
                Heartbeat("b"),
                Join("a"),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
            ],
        );
    }

    #[test]
    fn min_replicas_blocks_small_rounds() {
        run(
            3,
            &[
                Join("a"),
                Nothing,
                Join("b"),
                Nothing,
                Advance(61_000),
                Tick,
                Nothing,
                Join("c"),
                Issued(&["a", "b", "c"]),
            ],
        );
        run(
            3,
            &[Join("a"), Join("b"), Join("c"), Issued(&["a", "b", "c"])],
        );
    }

    #[test]
    fn join_timeout_issues_without_stragglers() {
        run(
            1,
            &[
                Heartbeat("c"),
                Join("a"),
                Join("b"),
                Nothing,
                Advance(3_000),
                Heartbeat("c"),
                Tick,
                Nothing,
                Advance(3_000),
                Heartbeat("c"),
                Advance(55_000),
                Heartbeat("c"),
                Tick,
                Issued(&["a", "b"]),
            ],
        );
    }

    #[test]
    fn a_diverged_group_is_presented_behind_until_it_commits_past_its_heal() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        quorum_of(&mut e, &["a", "b", "c"], t);
        e.offer_digest("a", digest(10, 7), t).unwrap();
        e.offer_digest("b", digest(10, 8), t).unwrap();
        assert!(e.take_diverged().is_empty(), "c has not sent step 10 yet");
        assert_eq!(e.offer_digest("c", digest(10, 7), t).unwrap(), 10);
        let v = e.take_diverged();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].replica_id.as_str(), v[0].step), ("b", 10));
        // b asks at step 12 like the others: the quorum shows it behind, so it heals.
        let q = round_at(&mut e, &["a", "b", "c"], 12, t);
        assert_eq!(
            q,
            vec![("a".into(), 12), ("b".into(), 11), ("c".into(), 12)]
        );
        // Its heal failed: it asks again at 12 and is shown behind again.
        let q = round_at(&mut e, &["a", "b", "c"], 12, t);
        assert_eq!(q[1], ("b".into(), 11));
        // It committed 13 after the heal: the mark is gone.
        let q = round_at(&mut e, &["a", "b", "c"], 13, t);
        assert_eq!(q[1], ("b".into(), 13));
        assert!(e.snapshot(t).parity.healing.is_empty());
        assert_eq!(e.snapshot(t).parity.diverged_total, 1);
    }

    #[test]
    fn two_groups_that_differ_are_stopped_their_joins_and_commits_refused() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        let q = quorum_of(&mut e, &["a", "b"], t);
        e.offer_digest("a", digest(5, 1), t).unwrap();
        e.offer_digest("b", digest(5, 2), t).unwrap();
        let v = e.take_diverged();
        assert_eq!(v.len(), 2);
        assert!(v
            .iter()
            .all(|d| d.action == super::super::health::parity::Action::Stop));
        assert!(e.parity_stopped("a").unwrap().contains("no majority"));
        assert!(matches!(e.join(member("a"), t), Err(Error::Diverged(_))));
        assert!(matches!(
            e.commit("b", q.quorum_id, 6, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.snapshot(t).parity.stopped, vec!["a", "b"]);
        // A dead process's stop goes with it (a new process has a new id).
        e.lost("a", t);
        assert_eq!(e.snapshot(t).parity.stopped, vec!["b"]);
    }

    #[test]
    fn majority_required() {
        // 2 asking of 4 healthy is not a strict majority, even after the join timeout.
        run(
            1,
            &[
                Heartbeat("c"),
                Heartbeat("d"),
                Join("a"),
                Join("b"),
                Advance(4_000),
                Heartbeat("c"),
                Heartbeat("d"),
                Advance(1_000),
                Tick,
                Nothing,
                Join("c"),
                Nothing,
                Advance(57_000),
                Heartbeat("d"),
                Tick,
                Issued(&["a", "b", "c"]),
            ],
        );
    }

    #[test]
    fn fast_path_answers_at_once_and_keeps_id() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                Heartbeat("c"),
                Join("a"),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
                SameId,
            ],
        );
    }

    #[test]
    fn fast_path_includes_newcomers_and_changes_id() {
        run(
            1,
            &[
                Join("a"),
                Issued(&["a"]),
                Join("b"),
                Nothing, // b alone is 1 of 2 healthy: no majority yet
                Join("a"),
                Issued(&["a", "b"]),
                NewId,
            ],
        );
    }

    #[test]
    fn fast_path_does_not_bypass_min_replicas_after_shrink() {
        // Previous quorum {a, b, c}; min 3. a and b ask again with shrink_only, c is gone but
        // newcomer d asks: fast path must not fire with 2 < min_replicas members.
        let mut e = QuorumEngine::new(opts(3), 1, Instant::now());
        let t = Instant::now();
        for id in ["a", "b", "c"] {
            e.join(member(id), t).unwrap();
        }
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["a", "b", "c"]);
        let t = t + Duration::from_secs(6);
        e.join(shrink("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        e.join(member("d"), t).unwrap();
        assert!(e.tick(t).is_none(), "quorum below min_replicas issued");
        assert!(matches!(
            e.verdict(t),
            Verdict::BelowMinReplicas { candidates: 2, .. }
        ));
    }

    #[test]
    fn fast_path_does_not_bypass_majority() {
        // Previous quorum {a}; now a asks but b, c, d are healthy: 1 of 4 is no majority.
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_some());
        for id in ["b", "c", "d"] {
            e.heartbeat(id, t).unwrap();
        }
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        assert_eq!(
            e.verdict(t),
            Verdict::NoMajority {
                candidates: 1,
                healthy: 4
            }
        );
    }

    #[test]
    fn shrink_only_keeps_previous_members() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                Join("c"),
                Nothing,
                JoinWith(shrink("a")),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
                SameId,
            ],
        );
    }

    #[test]
    fn shrink_only_leftover_waits_for_next_round() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        e.poll(t).unwrap();
        e.join(member("c"), t).unwrap();
        e.join(shrink("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["a", "b"]);
        assert_eq!(e.num_participants(), 1);
        // The next round includes c once a and b ask again.
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        let q2 = e.poll(t).unwrap();
        assert_eq!(ids(&q2), ["a", "b", "c"]);
        assert!(q2.quorum_id > q.quorum_id);
    }

    #[test]
    fn lagging_waiter_survives_many_quorums() {
        // A newcomer kept out by shrink_only stays waiting however many quorums are issued,
        // and is included once the previous members stop shrinking.
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        e.join(member("b"), t).unwrap();
        e.join(member("c"), t).unwrap();
        let first = e.poll(t).unwrap();
        let a = e.join(member("a"), t).unwrap();
        for _ in 0..1_000 {
            e.join(shrink("b"), t).unwrap();
            e.join(member("c"), t).unwrap();
            let q = e.poll(t).unwrap();
            assert_eq!(ids(&q), ["b", "c"]);
            assert_eq!(q.quorum_id, first.quorum_id);
            assert!(e.is_waiting("a", a.generation));
        }
        e.join(member("b"), t).unwrap();
        e.join(member("c"), t).unwrap();
        assert_eq!(ids(&e.poll(t).unwrap()), ["a", "b", "c"]);
    }

    #[test]
    fn commit_failures_bump_id() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                JoinWith(failing("a")),
                Join("b"),
                Issued(&["a", "b"]),
                NewId,
            ],
        );
    }

    #[test]
    fn cancelled_request_leaves_round() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        let a = e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        assert!(e.leave("a", a.generation));
        assert_eq!(e.num_participants(), 0);
        // b alone must not be put in a quorum with the departed a.
        e.join(member("b"), t).unwrap();
        assert!(e.poll(t).is_none());
        e.join(member("c"), t).unwrap();
        // a was seen recently, so the round waits for it as a healthy straggler ...
        assert!(e.poll(t).is_none());
        // ... and once its heartbeat expires the quorum forms without it.
        let q = e.tick(t + Duration::from_secs(6)).unwrap();
        assert_eq!(ids(&q), ["b", "c"]);
    }

    #[test]
    fn stale_leave_does_not_remove_newer_request() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        let old = e.join(member("a"), t).unwrap();
        let new = e.join(member("a"), t).unwrap();
        assert_eq!(new.replaced, Some(old.generation));
        assert!(!e.leave("a", old.generation));
        assert!(e.is_waiting("a", new.generation));
        assert_eq!(e.num_participants(), 1);
        assert!(e.leave("a", new.generation));
    }

    #[test]
    fn ids_start_at_initial_and_increase_across_restarts() {
        let t = Instant::now();
        let mut e1 = QuorumEngine::new(opts(1), 1_000, Instant::now());
        e1.join(member("a"), t).unwrap();
        let q1 = e1.poll(t).unwrap();
        assert_eq!(q1.quorum_id, 1_000);
        e1.join(member("b"), t).unwrap();
        e1.join(member("a"), t).unwrap();
        let q2 = e1.poll(t).unwrap();
        assert_eq!(q2.quorum_id, 1_001);
        // A restart seeds with a later clock reading.
        let mut e2 = QuorumEngine::new(opts(1), 2_000, Instant::now());
        e2.join(member("a"), t).unwrap();
        assert!(e2.poll(t).unwrap().quorum_id > q2.quorum_id);
        assert_eq!(QuorumEngine::new(opts(1), -5, Instant::now()).next_id, 1);
    }

    #[test]
    fn invalid_members_rejected_state_unchanged() {
        let cases: Vec<(QuorumMember, &str)> = vec![
            (
                QuorumMember {
                    replica_id: String::new(),
                    ..member("x")
                },
                "replica_id",
            ),
            (
                QuorumMember {
                    replica_id: "  ".into(),
                    ..member("x")
                },
                "replica_id",
            ),
            (
                QuorumMember {
                    step: -1,
                    ..member("x")
                },
                "step",
            ),
            (
                QuorumMember {
                    world_size: 0,
                    ..member("x")
                },
                "world_size",
            ),
            (
                QuorumMember {
                    commit_failures: -3,
                    ..member("x")
                },
                "commit_failures",
            ),
            (
                QuorumMember {
                    data: "{not json".into(),
                    ..member("x")
                },
                "JSON",
            ),
        ];
        let t = Instant::now();
        for (m, what) in cases {
            let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
            let err = e.join(m, t).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(msg) if msg.contains(what)),
                "{err}"
            );
            assert_eq!(e.num_participants(), 0);
            assert_eq!(e.num_heartbeat_records(), 0);
            assert!(e.poll(t).is_none());
        }
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        assert!(e.heartbeat("", t).is_err());
        assert_eq!(e.num_heartbeat_records(), 0);
    }

    #[test]
    fn randomized_invariants() {
        for seed in 1..=200u64 {
            let mut rng = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let min = 1 + rng.below(3);
            let o = LighthouseOptions {
                min_replicas: min,
                join_timeout: Duration::from_millis(500 + rng.below(2000)),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000 + rng.below(3000)),
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            };
            let mut e = QuorumEngine::new(o.clone(), 1 + rng.below(1000) as i64, Instant::now());
            let t0 = Instant::now();
            let mut now = t0;
            let mut gens: HashMap<String, u64> = HashMap::new();
            // Exact liveness model, independent of the engine's counters.
            let mut seen: HashMap<String, Instant> = HashMap::new();
            let mut asked_at: HashMap<String, Instant> = HashMap::new();
            let mut sets: HashMap<i64, Vec<String>> = HashMap::new();
            let mut last_id = i64::MIN;
            for _ in 0..400 {
                let id = format!("r{}", rng.below(7));
                let issued = match rng.below(8) {
                    0..=2 => {
                        let m = QuorumMember {
                            shrink_only: rng.below(10) == 0,
                            commit_failures: if rng.below(10) == 0 { 1 } else { 0 },
                            ..member(&id)
                        };
                        let j = e.join(m, now).unwrap();
                        gens.insert(id.clone(), j.generation);
                        seen.insert(id.clone(), now);
                        asked_at.insert(id.clone(), now);
                        e.poll(now)
                    }
                    3 => {
                        if let Some(g) = gens.remove(&id) {
                            e.leave(&id, g);
                        }
                        None
                    }
                    4 => {
                        e.heartbeat(&id, now).unwrap();
                        seen.insert(id.clone(), now);
                        None
                    }
                    5 | 6 => {
                        now += Duration::from_millis(rng.below(1500));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                let members = ids(&q);
                // Issued members no longer wait.
                for m in &members {
                    gens.remove(m);
                }
                assert!(
                    members.len() as u64 >= min,
                    "seed {seed}: below min_replicas"
                );
                // Hung groups (asked before, silent in the loop past the hang timeout since
                // their last request: the only visits this model makes) are not counted.
                let healthy = seen
                    .iter()
                    .filter(|(id, t)| {
                        now.saturating_duration_since(**t) <= o.heartbeat_timeout
                            || e.participants.contains_key(*id)
                            || members.contains(id)
                    })
                    .filter(|(id, _)| {
                        let Some(h) = e.is_hung(id) else {
                            return true;
                        };
                        let away = asked_at.get(*id).map(|t| now.saturating_duration_since(*t));
                        assert!(
                            away.is_some_and(|a| a > h.timeout && h.timeout >= hang::HANG_FLOOR),
                            "seed {seed}: {id} held hung after {away:?} away ({h:?})"
                        );
                        false
                    })
                    .count();
                assert!(
                    members.len() * 2 > healthy,
                    "seed {seed}: no strict majority"
                );
                assert!(q.quorum_id >= last_id, "seed {seed}: id went backwards");
                if let Some(prev) = sets.get(&q.quorum_id) {
                    assert_eq!(prev, &members, "seed {seed}: two member sets for one id");
                    assert_eq!(q.quorum_id, last_id, "seed {seed}: old id reused");
                }
                sets.insert(q.quorum_id, members);
                last_id = q.quorum_id;
            }
        }
    }

    #[test]
    fn revision_counts_quorums_and_stable_since_marks_non_step_changes() {
        type Edit = fn(&mut Vec<QuorumMember>);
        // (what changes, edit of the previous round's members, expect the same id,
        //  expect only steps changed)
        let cases: Vec<(&str, Edit, bool, bool)> = vec![
            ("steps advance", |_| {}, true, true),
            ("one member lags", |ms| ms[1].step -= 1, true, true),
            (
                "data changes",
                |ms| ms[0].data = "{\"k\":1}".into(),
                true,
                false,
            ),
            (
                "address changes",
                |ms| ms[2].address = "http://moved:1".into(),
                true,
                false,
            ),
            (
                "store changes",
                |ms| ms[2].store_address = "moved:2".into(),
                true,
                false,
            ),
            ("world size changes", |ms| ms[1].world_size = 3, true, false),
            (
                "commit failures",
                |ms| ms[0].commit_failures = 2,
                false,
                false,
            ),
            (
                "shrink_only asked",
                |ms| ms[0].shrink_only = true,
                true,
                false,
            ),
            (
                "a member joins",
                |ms| ms.insert(0, member("a0")),
                false,
                false,
            ),
            (
                "a member leaves",
                |ms| {
                    ms.pop();
                },
                false,
                false,
            ),
        ];
        for (name, edit, same_id, steps_only) in cases {
            let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
            let t0 = Instant::now();
            let mut ms = at_steps(&["b", "c", "d"], 1);
            let q1 = full_round(&mut e, &ms, t0);
            assert_eq!(
                (q1.revision, e.revision(), e.stable_since()),
                (1, 1, 1),
                "{name}"
            );
            for m in &mut ms {
                m.step += 1;
            }
            let q2 = full_round(&mut e, &ms, t0);
            assert_eq!(
                (q2.revision, e.stable_since()),
                (2, 1),
                "{name}: steps only"
            );
            for m in &mut ms {
                m.step += 1;
                m.shrink_only = false;
            }
            edit(&mut ms);
            // Newcomers ask first so the fast path does not leave them out.
            ms.sort_by_key(|m| q2.participants.iter().any(|p| p.replica_id == m.replica_id));
            let q3 = full_round(&mut e, &ms, t0);
            assert_eq!(q3.revision, 3, "{name}");
            assert_eq!(q3.quorum_id == q2.quorum_id, same_id, "{name}: id");
            let expected = if steps_only { 1 } else { 3 };
            assert_eq!(e.stable_since(), expected, "{name}: stable_since");
            // What each holder gets: compact exactly when it rebuilds the quorum.
            for known in [&q1, &q2] {
                let applies = compact::compact_applies(
                    &q3,
                    e.stable_since(),
                    known.quorum_id,
                    known.revision,
                );
                assert_eq!(
                    applies, steps_only,
                    "{name}: compact for revision {}",
                    known.revision
                );
                if applies {
                    let rebuilt = compact::expand(Some(known), compact::compact_form(&q3));
                    assert_eq!(rebuilt.unwrap(), q3, "{name}");
                }
            }
            // A requester without a cache, or an old-style request, gets the full form.
            assert!(
                !compact::compact_applies(&q3, e.stable_since(), 0, 0),
                "{name}"
            );
        }
    }

    #[test]
    fn shrink_only_round_with_unchanged_members_is_not_compact_for_older_holders() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t0 = Instant::now();
        let q1 = full_round(&mut e, &at_steps(&["a", "b"], 1), t0);
        let mut ms = at_steps(&["a", "b"], 2);
        ms[1].shrink_only = true;
        let q2 = full_round(&mut e, &ms, t0);
        assert_eq!(q2.quorum_id, q1.quorum_id);
        assert!(!compact::compact_applies(
            &q2,
            e.stable_since(),
            q1.quorum_id,
            q1.revision
        ));
        // The next steady round is compact for a holder of q2, not of q1.
        let q3 = full_round(&mut e, &at_steps(&["a", "b"], 3), t0);
        assert!(!compact::compact_applies(
            &q3,
            e.stable_since(),
            q1.quorum_id,
            q1.revision
        ));
        let q4 = full_round(&mut e, &at_steps(&["a", "b"], 4), t0);
        assert!(compact::compact_applies(
            &q4,
            e.stable_since(),
            q3.quorum_id,
            q3.revision
        ));
    }

    #[test]
    fn randomized_expanded_quorum_equals_the_full_one() {
        let (mut compact_used, mut delta_used) = (0, 0);
        for seed in 1..=150u64 {
            let mut rng = XorShift(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
            let o = LighthouseOptions {
                min_replicas: 1 + rng.below(2),
                join_timeout: Duration::from_millis(300),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000),
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            };
            let mut e = QuorumEngine::new(o, 1 + rng.below(100) as i64, Instant::now());
            let mut now = Instant::now();
            let mut steps: HashMap<String, i64> = HashMap::new();
            let mut history: Vec<Quorum> = Vec::new();
            for _ in 0..300 {
                let id = format!("r{}", rng.below(6));
                let step = steps.entry(id.clone()).or_insert(0);
                if rng.below(3) > 0 {
                    *step += 1;
                }
                let issued = match rng.below(10) {
                    0..=5 => {
                        let m = QuorumMember {
                            step: *step,
                            data: match rng.below(40) {
                                0 => "{\"x\":1}".into(),
                                _ => String::new(),
                            },
                            address: match rng.below(40) {
                                0 => format!("http://{id}:9"),
                                _ => format!("http://{id}:1"),
                            },
                            world_size: if rng.below(40) == 0 { 2 } else { 1 },
                            shrink_only: rng.below(30) == 0,
                            commit_failures: if rng.below(30) == 0 { 1 } else { 0 },
                            ..member(&id)
                        };
                        e.join(m, now).unwrap();
                        e.poll(now)
                    }
                    6 => {
                        e.heartbeat(&id, now).unwrap();
                        None
                    }
                    7 | 8 => {
                        now += Duration::from_millis(rng.below(700));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                assert_eq!(q.revision, history.len() as u64 + 1, "seed {seed}");
                let stable = e.stable_since();
                // Every holder: nothing, or any earlier quorum.
                // The service's choice: steps only, else a delta against the previous
                // quorum when only that holder is not covered, else the full form.
                let previous = history.last().filter(|_| stable == q.revision);
                for known in std::iter::once(None).chain(history.iter().map(Some)) {
                    let (kid, krev) = known.map_or((0, 0), |k| (k.quorum_id, k.revision));
                    let reply = if compact::compact_applies(&q, stable, kid, krev) {
                        compact_used += 1;
                        compact::compact_form(&q)
                    } else if let Some(prev) =
                        previous.filter(|p| compact::delta_applies(p, kid, krev))
                    {
                        delta_used += 1;
                        compact::delta_form(prev, &q)
                    } else {
                        q.clone()
                    };
                    let rebuilt = compact::expand(known, reply)
                        .unwrap_or_else(|err| panic!("seed {seed}: {err}"));
                    assert_eq!(rebuilt, q, "seed {seed}: known revision {krev}");
                }
                history.push(q);
            }
        }
        eprintln!("compact form used {compact_used} times, delta {delta_used} times");
        assert!(delta_used > 100, "delta form exercised {delta_used} times");
        assert!(
            compact_used > 100,
            "compact form exercised {compact_used} times"
        );
    }
}
