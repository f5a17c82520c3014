//! Runtime state parity: the digests of the groups' committed states, compared step by step.
//!
//! Every `parity_every` committed steps each group rank digests its own committed state and
//! its manager server sends the group's digests (one per group rank, in rank order) with its
//! heartbeats. [`Parity`] gathers them per step and decides a step once every member of the
//! current quorum has sent it, once a later step is decided, or [`DECIDE_AFTER`] after its
//! first digest, whichever comes first:
//!
//! - all compared groups agree: one more check passed;
//! - a strict majority agrees: every other group *diverged*; it is marked to heal
//!   ([`Parity::heal_marks`]), and the quorum engine presents it one step behind the others so
//!   every manager (ours or upstream's) makes it heal from an agreeing group;
//! - no strict majority (two groups that differ, or three all different): nobody can say
//!   which state is right, so every compared group is *stopped*: its heartbeat replies say so
//!   and its manager refuses its quorums and commits until an operator restores a known good
//!   state (replica ids name one process of a group, so a new process is not stopped).
//!
//! Pure: no I/O, no clocks; the caller supplies `now`.

use std::collections::BTreeMap;

use crate::ids::IdMap;
use std::time::{Duration, Instant};

use crate::error::{ensure, Result};

/// A step whose digests have not all arrived is decided this long after its first one.
pub const DECIDE_AFTER: Duration = Duration::from_secs(30);

use crate::client::MAX_DIGEST_BYTES;
use crate::proto::StateDigest;

/// Most group ranks one group digest may have.
pub const MAX_RANKS: usize = 1 << 16;

/// Steps kept waiting for digests at once (the oldest is decided to make room).
const MAX_PENDING_STEPS: usize = 16;

/// What was done about a group whose state differed from the others'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A strict majority agreed on another state: the group heals from it.
    Heal,
    /// No strict majority: the group stops.
    Stop,
}

impl Action {
    /// The name used in events and on the status page.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Heal => "heal",
            Action::Stop => "stop",
        }
    }
}

/// One group found diverged at one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diverged {
    /// The group.
    pub replica_id: String,
    /// The committed step whose digests differed.
    pub step: i64,
    /// What happens to it.
    pub action: Action,
    /// The groups whose digests agreed with each other in the largest set (sorted); empty
    /// when no set was larger than the others.
    pub majority: Vec<String>,
    /// How many groups were compared.
    pub compared: usize,
    /// Which group ranks' digests differed from the majority's (all ranks when stopped).
    pub ranks: Vec<usize>,
}

/// What the checks so far say of one group's committed states (one incarnation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParityMark {
    /// The newest step decided with this group's digest on the winning side: it agreed with
    /// every other group compared or with a strict majority of them, or it was the only one
    /// (nothing to compare). 0: none.
    pub ok: i64,
    /// The newest step at which its digest differed from the others' (0: never).
    pub diverged: i64,
}

/// A group marked to heal: presented behind the others until it commits past the heal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealMark {
    /// The step whose digest differed.
    pub step: i64,
    /// The step it was last told to heal to (None until a quorum presented it behind).
    pub healing_to: Option<i64>,
}

#[derive(Debug)]
struct PendingStep {
    first: Instant,
    groups: BTreeMap<String, Vec<Vec<u8>>>,
}

/// Gathers and compares the groups' state digests (see the module docs).
#[derive(Debug, Default)]
pub struct Parity {
    pending: BTreeMap<i64, PendingStep>,
    /// The last step decided (digests of it and earlier steps are acknowledged and dropped).
    decided: Option<i64>,
    heal: IdMap<HealMark>,
    stopped: IdMap<String>,
    /// Per group: the newest agreeing and differing steps (see [`Parity::mark`]).
    marks: IdMap<ParityMark>,
    new_verdicts: Vec<Diverged>,
    /// Steps compared with at least two groups.
    pub checks: u64,
    /// Groups found diverged (each group at each step counts once).
    pub diverged_total: u64,
    /// The last step compared with at least two groups.
    pub last_checked: Option<i64>,
}

impl Parity {
    /// Takes group `replica_id`'s digests of its committed state after a step (as its
    /// heartbeat carries them); returns the step to acknowledge (the manager stops resending
    /// digests up to it).
    ///
    /// Errors (`InvalidArgument`, nothing recorded) on a negative step, no ranks, too many
    /// ranks, or a rank digest that is empty, too long, or of another length than the rest.
    pub fn offer(&mut self, replica_id: &str, digest: StateDigest, now: Instant) -> Result<i64> {
        let StateDigest { step, ranks } = digest;
        ensure!(
            step >= 0,
            "state digest step must not be negative (replica {replica_id:?} sent {step})"
        );
        ensure!(
            (1..=MAX_RANKS).contains(&ranks.len()),
            "a state digest needs 1 to {MAX_RANKS} rank digests (replica {replica_id:?} sent {})",
            ranks.len()
        );
        let len = ranks[0].len();
        ensure!(
            (1..=MAX_DIGEST_BYTES).contains(&len) && ranks.iter().all(|r| r.len() == len),
            "rank digests must be 1 to {MAX_DIGEST_BYTES} bytes, all of one length \
             (replica {replica_id:?})"
        );
        if self.decided.is_some_and(|d| step <= d) {
            return Ok(step);
        }
        self.pending
            .entry(step)
            .or_insert_with(|| PendingStep {
                first: now,
                groups: BTreeMap::new(),
            })
            .groups
            .insert(replica_id.to_string(), ranks);
        while self.pending.len() > MAX_PENDING_STEPS {
            let oldest = *self.pending.keys().next().expect("not empty");
            self.decide(oldest);
        }
        Ok(step)
    }

    /// Decides the steps that are ready: every one of `expected` groups (the last quorum's
    /// members; 0 before any quorum) sent its digests, a later step was decided, or
    /// [`DECIDE_AFTER`] passed since the first digest.
    pub fn evaluate(&mut self, expected: usize, now: Instant) {
        let ready: Vec<i64> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                (expected >= 1 && p.groups.len() >= expected)
                    || now.saturating_duration_since(p.first) >= DECIDE_AFTER
            })
            .map(|(s, _)| *s)
            .collect();
        // Deciding a step decides every earlier one with what it has.
        if let Some(last) = ready.last() {
            let steps: Vec<i64> = self.pending.range(..=*last).map(|(s, _)| *s).collect();
            for s in steps {
                self.decide(s);
            }
        }
    }

    fn decide(&mut self, step: i64) {
        let Some(p) = self.pending.remove(&step) else {
            return;
        };
        self.decided = Some(self.decided.map_or(step, |d| d.max(step)));
        if p.groups.len() < 2 {
            // Nothing to compare with: a lone group agrees with itself.
            self.agreed(p.groups.keys(), step);
            return;
        }
        self.checks += 1;
        self.last_checked = Some(self.last_checked.map_or(step, |l| l.max(step)));
        // Groups by digest (every rank's), largest set first, ties by the smallest id.
        let mut sets: Vec<(&Vec<Vec<u8>>, Vec<String>)> = Vec::new();
        for (id, ranks) in &p.groups {
            match sets.iter_mut().find(|(d, _)| *d == ranks) {
                Some((_, ids)) => ids.push(id.clone()),
                None => sets.push((ranks, vec![id.clone()])),
            }
        }
        if sets.len() == 1 {
            self.agreed(p.groups.keys(), step);
            return;
        }
        sets.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.1.cmp(&b.1)));
        let compared = p.groups.len();
        let (major_digest, major_ids) = (&sets[0].0, &sets[0].1);
        if major_ids.len() * 2 > compared {
            self.agreed(major_ids.iter(), step);
            for (digest, ids) in &sets[1..] {
                let ranks = differing_ranks(digest, major_digest);
                for id in ids {
                    self.mark_diverged(id, step);
                    self.heal.insert(
                        id.clone(),
                        HealMark {
                            step,
                            healing_to: None,
                        },
                    );
                    self.diverged_total += 1;
                    self.new_verdicts.push(Diverged {
                        replica_id: id.clone(),
                        step,
                        action: Action::Heal,
                        majority: major_ids.clone(),
                        compared,
                        ranks: ranks.clone(),
                    });
                }
            }
        } else {
            let largest = if sets[0].1.len() > sets[1].1.len() {
                major_ids.clone()
            } else {
                Vec::new()
            };
            let ids: Vec<&String> = p.groups.keys().collect();
            let names = ids
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            for id in ids {
                self.mark_diverged(id, step);
                self.diverged_total += 1;
                self.stopped.insert(
                    id.clone(),
                    format!(
                        "the committed states of replica groups {names} differ at step \
                         {step} and no majority agrees on one: training stops; restore a \
                         known good state (a durable checkpoint) and restart the groups"
                    ),
                );
                self.heal.remove(id);
                self.new_verdicts.push(Diverged {
                    replica_id: id.clone(),
                    step,
                    action: Action::Stop,
                    majority: largest.clone(),
                    compared,
                    ranks: (0..p.groups[id].len()).collect(),
                });
            }
        }
    }

    /// `ids` agreed with the majority (or had no one to differ from) at `step`.
    fn agreed<'a>(&mut self, ids: impl Iterator<Item = &'a String>, step: i64) {
        for id in ids {
            let mark = self.marks.entry(id.clone()).or_default();
            mark.ok = mark.ok.max(step);
        }
    }

    /// `replica_id` differed at `step`. Its earlier agreement stays as it was: a newer
    /// difference outranks it for every step up to this one.
    fn mark_diverged(&mut self, replica_id: &str, step: i64) {
        let mark = self.marks.entry(replica_id.to_string()).or_default();
        mark.diverged = mark.diverged.max(step);
    }

    /// What the checks so far say of `replica_id`'s committed states: the newest step it
    /// agreed at and the newest it differed at. A durable snapshot of a step is trusted once
    /// a check at that step or later agreed and none since the step differed.
    pub fn mark(&self, replica_id: &str) -> ParityMark {
        self.marks.get(replica_id).copied().unwrap_or_default()
    }

    /// Forgets `replica_id`'s marks (the engine no longer keeps a record of it).
    pub fn forget(&mut self, replica_id: &str) {
        self.marks.remove(replica_id);
    }

    /// The verdicts since the last call.
    pub fn take_verdicts(&mut self) -> Vec<Diverged> {
        std::mem::take(&mut self.new_verdicts)
    }

    /// The groups marked to heal.
    pub fn heal_marks(&mut self) -> &mut IdMap<HealMark> {
        &mut self.heal
    }

    /// Groups marked to heal, sorted.
    pub fn healing(&self) -> Vec<String> {
        let mut v: Vec<String> = self.heal.keys().cloned().collect();
        v.sort();
        v
    }

    /// Why `replica_id` is stopped, if it is.
    pub fn stopped(&self, replica_id: &str) -> Option<&str> {
        self.stopped.get(replica_id).map(String::as_str)
    }

    /// Groups stopped, sorted.
    pub fn stopped_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.stopped.keys().cloned().collect();
        v.sort();
        v
    }

    /// `replica_id` (one process of a group: ids name incarnations) was declared lost: its
    /// marks go (a new process heals anyway, and is not stopped), and so do the digests it
    /// sent for steps not decided yet. After every group died, the job resumes from a durable
    /// snapshot and commits those step numbers again with a new state: a dead incarnation's
    /// digest of the old state would call the new one diverged.
    pub fn lost(&mut self, replica_id: &str) {
        self.heal.remove(replica_id);
        self.stopped.remove(replica_id);
        self.marks.remove(replica_id);
        for p in self.pending.values_mut() {
            p.groups.remove(replica_id);
        }
        self.pending.retain(|_, p| !p.groups.is_empty());
    }
}

/// Rank indices where two group digests differ (all, when their rank counts differ).
fn differing_ranks(a: &[Vec<u8>], b: &[Vec<u8>]) -> Vec<usize> {
    if a.len() != b.len() {
        return (0..a.len().max(b.len())).collect();
    }
    (0..a.len()).filter(|&i| a[i] != b[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(byte: u8, ranks: usize) -> Vec<Vec<u8>> {
        vec![vec![byte; 16]; ranks]
    }

    fn digest(step: i64, ranks: Vec<Vec<u8>>) -> StateDigest {
        StateDigest { step, ranks }
    }

    /// A fresh check of a quorum of `expected` groups, evaluated once after each group sent
    /// its digest of `step`; and the time.
    fn evaluated(
        expected: usize,
        step: i64,
        digests: Vec<(&str, Vec<Vec<u8>>)>,
    ) -> (Parity, Instant) {
        let t = Instant::now();
        let mut p = Parity::default();
        for (id, ranks) in digests {
            p.offer(id, digest(step, ranks), t).unwrap();
        }
        p.evaluate(expected, t);
        (p, t)
    }

    #[test]
    fn agreeing_groups_pass_once_all_expected_have_sent() {
        let (mut p, t) = evaluated(3, 10, vec![("a", d(1, 2)), ("b", d(1, 2))]);
        assert_eq!(p.checks, 0, "c has not sent yet");
        p.offer("c", digest(10, d(1, 2)), t).unwrap();
        p.evaluate(3, t);
        assert_eq!((p.checks, p.diverged_total), (1, 0));
        assert!(p.take_verdicts().is_empty());
        // A late digest of a decided step is acknowledged and dropped.
        assert_eq!(p.offer("c", digest(10, d(9, 2)), t).unwrap(), 10);
        p.evaluate(3, t + DECIDE_AFTER);
        assert_eq!(p.checks, 1);
    }

    #[test]
    fn a_minority_group_is_marked_to_heal_with_the_rank_that_differs() {
        let mut bad = d(1, 4);
        bad[2][0] ^= 1;
        let (mut p, _) = evaluated(3, 20, vec![("a", d(1, 4)), ("b", bad), ("c", d(1, 4))]);
        let v = p.take_verdicts();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].replica_id, "b");
        assert_eq!(v[0].action, Action::Heal);
        assert_eq!(v[0].majority, vec!["a", "c"]);
        assert_eq!(v[0].ranks, vec![2]);
        assert_eq!(p.healing(), vec!["b"]);
        assert!(p.stopped("b").is_none());
    }

    #[test]
    fn two_groups_that_differ_are_both_stopped() {
        let (mut p, _) = evaluated(2, 5, vec![("a", d(1, 1)), ("b", d(2, 1))]);
        let v = p.take_verdicts();
        assert_eq!(
            v.iter().map(|x| x.action).collect::<Vec<_>>(),
            vec![Action::Stop; 2]
        );
        assert!(p.stopped("a").unwrap().contains("no majority"));
        assert_eq!(p.stopped_ids(), vec!["a", "b"]);
        assert!(p.healing().is_empty());
        p.lost("a");
        assert_eq!(p.stopped_ids(), vec!["b"]);
    }

    #[test]
    fn a_lost_incarnations_undecided_digests_are_not_compared() {
        // Every group died after "old" sent step 10; the job resumed from a snapshot and
        // the new incarnations commit step 10 again with another state.
        let t = Instant::now();
        let mut p = Parity::default();
        p.offer("old", digest(10, d(9, 1)), t).unwrap();
        p.lost("old");
        for id in ["a", "b"] {
            p.offer(id, digest(10, d(1, 1)), t).unwrap();
        }
        p.evaluate(2, t);
        assert!(p.take_verdicts().is_empty());
        assert_eq!((p.checks, p.last_checked), (1, Some(10)));
    }

    #[test]
    fn a_step_missing_a_group_is_decided_late_or_by_a_later_step() {
        let (mut p, t) = evaluated(4, 10, vec![("a", d(1, 1)), ("b", d(2, 1)), ("c", d(1, 1))]);
        assert!(p.take_verdicts().is_empty(), "d may still send step 10");
        // Step 20 complete: step 10 is decided with what it has.
        for id in ["a", "b", "c", "d"] {
            p.offer(id, digest(20, d(1, 1)), t).unwrap();
        }
        p.evaluate(4, t);
        assert_eq!(p.checks, 2);
        let v = p.take_verdicts();
        assert_eq!((v.len(), v[0].replica_id.as_str(), v[0].step), (1, "b", 10));
        // Alone, a step is never compared; it is dropped at the deadline.
        p.offer("a", digest(30, d(1, 1)), t).unwrap();
        p.evaluate(4, t + DECIDE_AFTER);
        assert_eq!(p.checks, 2);
        assert_eq!(p.last_checked, Some(20));
    }

    #[test]
    fn bad_digests_are_refused_and_change_nothing() {
        let t = Instant::now();
        let mut p = Parity::default();
        assert!(p.offer("a", digest(-1, d(1, 1)), t).is_err());
        assert!(p.offer("a", digest(1, vec![]), t).is_err());
        assert!(p.offer("a", digest(1, vec![vec![]]), t).is_err());
        assert!(p.offer("a", digest(1, vec![vec![0; 65]]), t).is_err());
        assert!(p
            .offer("a", digest(1, vec![vec![0; 16], vec![0; 8]]), t)
            .is_err());
        p.evaluate(1, t + DECIDE_AFTER);
        assert_eq!(p.checks, 0);
        assert!(p.pending.is_empty());
    }

    #[test]
    fn pending_steps_are_bounded() {
        let t = Instant::now();
        let mut p = Parity::default();
        for s in 0..100 {
            p.offer("a", digest(s, d(1, 1)), t).unwrap();
        }
        assert!(p.pending.len() <= MAX_PENDING_STEPS);
    }

    #[test]
    fn marks_say_which_steps_each_group_agreed_and_differed_at() {
        let mut bad = d(1, 2);
        bad[1][3] ^= 1;
        // Step 10: all agree. Step 20: c differs from the majority (heals).
        let (mut p, t) = evaluated(3, 10, vec![("a", d(1, 2)), ("b", d(1, 2)), ("c", d(1, 2))]);
        for id in ["a", "b", "c"] {
            assert_eq!(
                p.mark(id),
                ParityMark {
                    ok: 10,
                    diverged: 0
                },
                "{id}"
            );
        }
        for (id, ranks) in [("a", d(1, 2)), ("b", d(1, 2)), ("c", bad)] {
            p.offer(id, digest(20, ranks), t).unwrap();
        }
        p.evaluate(3, t);
        assert_eq!(
            p.mark("a"),
            ParityMark {
                ok: 20,
                diverged: 0
            }
        );
        assert_eq!(p.mark("c").diverged, 20);
        assert!(p.mark("c").ok < 20, "{:?}", p.mark("c"));
        // Healed, c agrees at 30: its snapshot of 20 stays untrusted (diverged at 20).
        for id in ["a", "b", "c"] {
            p.offer(id, digest(30, d(3, 2)), t).unwrap();
        }
        p.evaluate(3, t);
        assert_eq!(
            p.mark("c"),
            ParityMark {
                ok: 30,
                diverged: 20
            }
        );
        // A group alone in its quorum has nothing to compare against: its step is decided at
        // once, and nothing says otherwise. Before any quorum (a restarted lighthouse) the
        // others may still send theirs: undecided.
        let (mut p1, _) = evaluated(0, 40, vec![("solo", d(1, 1))]);
        assert_eq!(
            p1.mark("solo"),
            ParityMark::default(),
            "no quorum yet: undecided"
        );
        p1.evaluate(1, t);
        assert_eq!(
            p1.mark("solo"),
            ParityMark {
                ok: 40,
                diverged: 0
            }
        );
        // Two that differ are both marked; unknown, lost and forgotten groups have none.
        let (mut p2, _) = evaluated(2, 5, vec![("x", d(1, 1)), ("y", d(2, 1))]);
        assert_eq!(p2.mark("x").diverged, 5);
        assert_eq!(p2.mark("y").diverged, 5);
        assert_eq!(p2.mark("nobody"), ParityMark::default());
        p2.lost("x");
        p2.forget("y");
        assert_eq!(p2.mark("x"), ParityMark::default());
        assert_eq!(p2.mark("y"), ParityMark::default());
    }
}
