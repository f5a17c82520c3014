//! Write-ahead commits and what the lighthouse keeps across its own restarts.
//!
//! A group announces a commit before applying it; the engine refuses one under a quorum it
//! has replaced or from a member declared lost. [`Durable`] is what the state file keeps, and
//! [`QuorumEngine::restored`] continues from it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{EarlierLife, HeartbeatRecord, QuorumEngine};
use crate::error::{ensure, Result};
use crate::lighthouse::LighthouseOptions;

/// The lighthouse's answer to a write-ahead commit announcement (see
/// [`QuorumEngine::commit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitVerdict {
    /// The step is recorded as committed by the replica: it may apply it.
    Accepted,
    /// The replica must not commit the step (the reason says why); it rejoins and heals.
    Refused(String),
}

/// What a lighthouse keeps across its own restarts (see [`QuorumEngine::durable`]): enough
/// to refuse a commit under a quorum it had replaced, and to wait for the holders of the
/// best step it knew.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Durable {
    /// Id of the last issued quorum (None before the first).
    pub quorum_id: Option<i64>,
    /// Its members (sorted).
    pub members: Vec<String>,
    /// The best committed step known (None before any report).
    pub best_step: Option<i64>,
    /// Replicas known to hold `best_step` that may still come back (sorted).
    pub holders: Vec<String>,
    /// The other replicas known with a committed step below `best_step` that may still come
    /// back and were not given up on, with that step (best first, at most
    /// [`MAX_DURABLE_OTHERS`]): when every holder of the best step is gone, a restarted
    /// lighthouse still waits for the best of these (absent in older state files).
    #[serde(default)]
    pub others: Vec<(String, i64)>,
    /// How long each replica of `holders` and `others` had been silent while a lighthouse
    /// ran, in milliseconds: this life's silence plus what earlier lives saw, the time no
    /// lighthouse was up not counted (absent in older state files). A restarted lighthouse
    /// waits for a remembered replica only for what is left of `progress_wait`: a lighthouse
    /// restarted more often than that still gives up on a dead holder, and one down for long
    /// still waits for a holder stopped meanwhile. The file is rewritten at least every
    /// second while the lighthouse runs, so a life's silence is saved within about that.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub silent_ms: BTreeMap<String, u64>,
}

/// Most replicas below the best step a state file remembers.
pub const MAX_DURABLE_OTHERS: usize = 64;

impl QuorumEngine {
    /// A fresh engine started at `now` that continues a previous life of the lighthouse,
    /// whose [`QuorumEngine::durable`] state was `durable`: a commit under a quorum other
    /// than its last one is refused, and the holders of its best step are waited for (for
    /// what the silence the earlier lives saw left of `progress_wait`, from `now`) like
    /// silent replicas that may come back.
    pub fn restored(
        opts: LighthouseOptions,
        initial_quorum_id: i64,
        now: Instant,
        durable: Durable,
    ) -> Self {
        let mut e = Self::new(opts, initial_quorum_id, now);
        if durable.quorum_id.is_some() || durable.best_step.is_some() {
            e.earlier_life = Some(EarlierLife::StateFile {
                quorum_id: durable.quorum_id,
                best_step: durable.best_step,
            });
        }
        if let Some(id) = durable.quorum_id {
            e.restored_quorum = Some((id, durable.members.into_iter().collect()));
            // Ids stay strictly increasing even if the clock went back.
            e.next_id = e.next_id.max(id.saturating_add(1));
        }
        if let Some(step) = durable.best_step.filter(|s| *s >= 0) {
            e.high_water = Some(step);
            let wait = e.opts.progress_wait;
            let remembered = durable.holders.into_iter().map(|id| (id, step)).chain(
                durable
                    .others
                    .into_iter()
                    .filter(|(_, s)| *s >= 0 && *s < step),
            );
            let mut silent = durable.silent_ms;
            for (id, held) in remembered {
                if e.heartbeats.contains_key(&id) {
                    continue;
                }
                let silent_before =
                    Duration::from_millis(silent.remove(&id).unwrap_or(0)).min(wait);
                // Far in the future rather than no wait at all, should it overflow.
                let until = now
                    .checked_add(wait - silent_before)
                    .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
                e.restored_by_group
                    .entry(crate::telemetry::base_id(&id).to_string())
                    .or_default()
                    .push(id.clone());
                e.heartbeats.insert(
                    id,
                    HeartbeatRecord {
                        step: Some(held),
                        restored_until: Some(until),
                        heard: false,
                        silent_before,
                        ..HeartbeatRecord::new(now)
                    },
                );
            }
        }
        e
    }

    /// The replicas remembered from an earlier life, not heard in this one, that may still
    /// come back, with how long each is still waited for (O(known replicas)).
    pub fn remembered_wait(&self, now: Instant) -> Vec<(String, Duration)> {
        let mut left: Vec<(String, Duration)> = self
            .heartbeats
            .iter()
            .filter(|(_, rec)| !rec.heard)
            .filter_map(|(id, rec)| {
                let until = rec.restored_until.filter(|until| now < *until)?;
                Some((id.clone(), until - now))
            })
            .collect();
        left.sort();
        left
    }

    /// How long `id` has been silent at `now` while a lighthouse ran: since it was last
    /// heard in this life or, if not heard in it, what earlier lives saw plus this life.
    fn silent_for(&self, id: &str, now: Instant) -> Option<Duration> {
        let rec = self.heartbeats.get(id)?;
        Some(if rec.heard {
            now.saturating_duration_since(rec.last_seen)
        } else {
            rec.silent_before + now.saturating_duration_since(self.started)
        })
    }

    /// The state to keep across a restart of the lighthouse, as of `now` (O(known
    /// replicas)).
    pub fn durable(&self, now: Instant) -> Durable {
        let (quorum_id, mut members) = match (&self.previous, &self.restored_quorum) {
            (Some(q), _) => (
                Some(q.quorum_id),
                self.previous_ids.iter().cloned().collect(),
            ),
            (None, Some((id, members))) => (Some(*id), members.iter().cloned().collect()),
            (None, None) => (None, Vec::new()),
        };
        members.sort();
        let mut holders: Vec<String> = match self.high_water {
            Some(hw) => self
                .heartbeats
                .iter()
                .filter(|(_, rec)| rec.step == Some(hw))
                .map(|(id, _)| id.clone())
                .collect(),
            None => Vec::new(),
        };
        holders.sort();
        let mut others: Vec<(String, i64)> = self
            .heartbeats
            .iter()
            .filter_map(|(id, rec)| {
                let step = rec.step?;
                let below = self.high_water.is_some_and(|hw| step < hw);
                let given_up = self.waived.get(id).is_some_and(|w| step <= *w);
                (below && !given_up).then(|| (id.clone(), step))
            })
            .collect();
        others.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        others.truncate(MAX_DURABLE_OTHERS);
        let silent_ms = holders
            .iter()
            .chain(others.iter().map(|(id, _)| id))
            .filter_map(|id| {
                let silent = self.silent_for(id, now)?;
                Some((
                    id.clone(),
                    u64::try_from(silent.as_millis()).unwrap_or(u64::MAX),
                ))
            })
            .collect();
        Durable {
            quorum_id,
            members,
            best_step: self.high_water,
            holders,
            others,
            silent_ms,
        }
    }

    /// Changes whenever [`QuorumEngine::durable`] may have changed (a cheap check before
    /// saving it).
    pub fn durable_revision(&self) -> u64 {
        self.durable_revision
    }

    /// A write-ahead commit: `replica_id`, a member of quorum `quorum_id`, is about to commit
    /// `step` (its committed step count after the commit).
    ///
    /// Refused when that quorum is no longer current for the replica: the lighthouse has
    /// issued a newer quorum (the others went on without it), or declared the replica lost
    /// in it (the others abandoned the step). Two groups then never commit the same step
    /// with different states. Accepted otherwise, and the step is recorded as the replica's
    /// committed step at once, so a round behind it waits for the replica (the
    /// no-regression rule) even if it stops before it heartbeats again. A lighthouse that
    /// has issued no quorum and remembers none accepts (it cannot know better).
    pub fn commit(
        &mut self,
        replica_id: &str,
        quorum_id: i64,
        step: i64,
        now: Instant,
    ) -> Result<CommitVerdict> {
        Self::check_id(replica_id)?;
        ensure!(
            step >= 0,
            "step must not be negative (replica {replica_id:?} sent {step})"
        );
        let current = match (&self.previous, &self.restored_quorum) {
            (Some(q), _) => Some((
                q.quorum_id,
                self.previous_ids.contains(replica_id),
                self.lost_reported.contains(replica_id),
            )),
            (None, Some((id, members))) => Some((*id, members.contains(replica_id), false)),
            (None, None) => None,
        };
        if let Some(why) = self.parity.stopped(replica_id) {
            return Ok(CommitVerdict::Refused(why.to_string()));
        }
        if let Some((current_id, member, lost)) = current {
            if current_id != quorum_id || !member {
                return Ok(CommitVerdict::Refused(format!(
                    "quorum {quorum_id} was replaced by quorum {current_id}{}",
                    if member { "" } else { " without this replica" }
                )));
            }
            if lost {
                return Ok(CommitVerdict::Refused(format!(
                    "this replica was declared lost in quorum {quorum_id}; its other members \
                     abandoned the step"
                )));
            }
        }
        self.note_step(replica_id, Some(step), now);
        Ok(CommitVerdict::Accepted)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::testkit::*;
    use super::super::*;
    use super::*;

    #[test]
    fn a_commit_under_the_current_quorum_is_accepted_and_waited_for_while_silent() {
        let (mut e, mut t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        for id in ["a", "b", "c"] {
            e.session_opened(id, t).unwrap();
        }
        // a announces step 101 and stops (SIGSTOP) before it heartbeats again: alive but
        // silent, its session open. b and c abandoned the step and ask at 100.
        assert_eq!(e.commit("a", qid, 101, t).unwrap(), CommitVerdict::Accepted);
        assert_eq!(e.best_known_step(), Some(101));
        t += Duration::from_secs(1);
        join_at(&mut e, &["b", "c"], 100, t);
        // Past the heartbeat timeout (a is declared lost for its quorum, but its session is
        // open) the round still waits for a, up to progress_wait.
        let t = waits(&mut e, t, 80, &["b", "c"]);
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { ref holder, step: 101, candidates_step: 100, .. }
                if holder == "a"
        ));
        // a resumes and asks at 101: one quorum, nobody regressed.
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a quorum once the holder asks");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(e.take_regressions().is_empty());
    }

    #[test]
    fn a_commit_under_a_replaced_quorum_is_refused() {
        let (mut e, mut t) = running(100);
        let old = e.previous().unwrap().quorum_id;
        e.session_opened("a", t).unwrap();
        // a stops mid-step; its heartbeats expire, b and c go on without it at 100 ...
        t += Duration::from_secs(6);
        e.heartbeat("b", t).unwrap();
        e.heartbeat("c", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost().len(), 1);
        join_at(&mut e, &["b", "c"], 100, t);
        let q = e.poll(t).expect("b and c go on: a holds nothing newer");
        assert_eq!(ids(&q), ["b", "c"]);
        assert_eq!(
            e.commit("b", q.quorum_id, 101, t).unwrap(),
            CommitVerdict::Accepted
        );
        // ... so when a resumes and finishes the step of the old quorum, it may not commit.
        let why = refused(e.commit("a", old, 101, t).unwrap());
        assert!(
            why.contains("replaced") && why.contains("without this replica"),
            "{why}"
        );
        // A member of the current quorum announcing under an old id is refused too.
        assert!(matches!(
            e.commit("c", old, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.best_known_step(), Some(101));
    }

    #[test]
    fn a_member_declared_lost_may_not_commit_in_that_quorum() {
        let (mut e, mut t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        t += Duration::from_secs(6);
        e.heartbeat("b", t).unwrap();
        e.heartbeat("c", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost()[0].replica_id, "a");
        // No newer quorum yet: the others were told a is lost and abandon the step.
        let why = refused(e.commit("a", qid, 101, t).unwrap());
        assert!(why.contains("declared lost"), "{why}");
        assert_eq!(e.best_known_step(), Some(100));
        // The members still alive may.
        assert_eq!(e.commit("b", qid, 101, t).unwrap(), CommitVerdict::Accepted);
    }

    #[test]
    fn bad_commit_announcements_are_refused_and_change_nothing() {
        let (mut e, t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        let rev = e.durable_revision();
        assert!(matches!(
            e.commit("", qid, 101, t),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            e.commit("a", qid, -1, t),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(e.durable_revision(), rev);
        assert_eq!(e.best_known_step(), Some(100));
    }

    #[test]
    fn a_fresh_lighthouse_without_memory_accepts_commits() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t);
        assert_eq!(e.commit("a", 7, 12, t).unwrap(), CommitVerdict::Accepted);
        assert_eq!(e.best_known_step(), Some(12));
    }

    #[test]
    fn a_restarted_lighthouse_waits_for_the_holder_of_the_best_step_it_remembers() {
        let (d, _, t0) = before_restart();
        // Restarted while a is stopped: b and c ask at 100; a is silent and has no session.
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        assert_eq!(e.best_known_step(), Some(101));
        join_at(&mut e, &["b", "c"], 100, t);
        // The restored holder is not counted healthy (b and c are a majority) but is waited
        // for, past the startup hold, up to progress_wait after the restart.
        let t = waits(&mut e, t, 95, &["b", "c"]);
        waiting_for(&e, t, 101);
        // a resumes: its heartbeat (and then its request) end the wait without regression.
        e.heartbeat_with_step("a", Some(101), t).unwrap();
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a quorum");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(q.quorum_id > 50);
        assert!(e.take_regressions().is_empty());
    }

    #[test]
    fn a_restarted_lighthouse_waits_for_the_best_holder_left_when_the_best_step_holders_died() {
        // a held 101 and died; b (100) is stopped; c died too. The previous life waited for b.
        let (mut e, t0) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        e.commit("a", qid, 101, t0).unwrap();
        e.lost("a", t0);
        e.lost("c", t0);
        let d = e.durable(t0);
        assert_eq!((d.best_step, d.holders.clone()), (Some(101), vec![]));
        assert_eq!(d.others, vec![("b".to_string(), 100)]);
        // Older state files have no `others`: they still load.
        let old: Durable =
            serde_json::from_str(r#"{"quorum_id":5,"members":["a"],"best_step":3,"holders":[]}"#)
                .unwrap();
        assert!(old.others.is_empty());
        // Restarted while b is stopped, a fresh c asks at step 0: the job waits for b, not
        // regresses to 0, and b's return ends the wait.
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        e.join(at("c", 0), t).unwrap();
        // Past the startup hold (5 s) and up to progress_wait (10 s) after the restart.
        let t = waits(&mut e, t, 90, &["c"]);
        waiting_for(&e, t, 100);
        e.heartbeat_with_step("b", Some(100), t).unwrap();
        e.join(at("b", 100), t).unwrap();
        let q = e.poll(t).expect("a quorum");
        assert_eq!(ids(&q), ["b", "c"]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1, "101 is lost with its holder, 100 is not");
        assert_eq!((r[0].from_step, r[0].to_step), (101, 100));
    }

    #[test]
    fn only_replicas_heard_since_a_restart_have_heartbeat_ages() {
        // A state file that remembers two incarnations of g2 (the live one holds the best
        // step, an old one a step below it). Telemetry learns of groups from the ages: were
        // both there at once, it could take the old one as g2's and drop what the live one
        // sends (its steps would be missing from the goodput).
        const LIVE: &str = "g2:22222222-2222-2222-2222-222222222222";
        const OLD: &str = "g2:11111111-1111-1111-1111-111111111111";
        let d = Durable {
            quorum_id: Some(40),
            members: vec![LIVE.into()],
            best_step: Some(3530),
            holders: vec![LIVE.into()],
            others: vec![(OLD.into(), 2900)],
            ..Durable::default()
        };
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 50, t0, d);
        assert!(
            e.heartbeat_ages(t0).is_empty(),
            "{:?}",
            e.heartbeat_ages(t0)
        );
        let t1 = t0 + Duration::from_millis(100);
        e.heartbeat(LIVE, t1).unwrap();
        let ages = e.heartbeat_ages(t1);
        assert_eq!(ages, vec![(LIVE.to_string(), Duration::ZERO)]);
        // Left out of the ages is not forgotten: the live one is still a remembered holder.
        assert!(e.durable(t1).holders.contains(&LIVE.to_string()));
    }

    /// g1's old incarnation, remembered as the holder of step 1411 of quorum 40; its new one
    /// and g0's.
    const OLD: &str = "g1:11111111-1111-1111-1111-111111111111";
    const NEW: &str = "g1:22222222-2222-2222-2222-222222222222";
    const G0: &str = "g0:33333333-3333-3333-3333-333333333333";

    /// A state file whose best step, 1411, only [`OLD`] held, and that remembers `others`.
    fn g1_replaced(others: Vec<(String, i64)>) -> Durable {
        Durable {
            quorum_id: Some(40),
            members: vec![OLD.into()],
            best_step: Some(1411),
            holders: vec![OLD.into()],
            others,
            ..Durable::default()
        }
    }

    #[test]
    fn a_restarted_lighthouse_does_not_wait_for_an_incarnation_its_group_replaced() {
        // g1's old incarnation held 1411 (remembered by the state file); its group now runs
        // a new incarnation at step 0. Waiting for the old one (progress_wait after every
        // restart of the lighthouse) would stall the job for as long as the lighthouse keeps
        // being restarted: the regression is decided at once, as every holder is gone.
        let d = g1_replaced(vec![]);
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 50, t0, d);
        // A plain id shares no group with it: still remembered.
        e.heartbeat("g1", t0).unwrap();
        assert!(e.durable(t0).holders.contains(&OLD.to_string()));
        let mut t = t0 + Duration::from_secs(6); // past the startup hold
        e.join(at(NEW, 0), t).unwrap();
        e.join(at(G0, 0), t).unwrap();
        assert!(!e.durable(t).holders.contains(&OLD.to_string()));
        let q = loop {
            if let Some(q) = e.tick(t) {
                break q;
            }
            t += Duration::from_millis(100);
            assert!(
                t < t0 + progress_opts().progress_wait,
                "waited for the replaced one"
            );
            e.heartbeat(NEW, t).unwrap();
            e.heartbeat(G0, t).unwrap();
        };
        assert_eq!(ids(&q), [G0, NEW]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].from_step, r[0].to_step), (1411, 0));
        assert!(
            r[0].alive_holders.is_empty(),
            "the replaced incarnation is not alive"
        );
    }

    #[test]
    fn a_restarted_lighthouse_gives_up_on_a_remembered_holder_after_progress_wait() {
        let (d, _, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        join_at(&mut e, &["b", "c"], 100, t);
        let later = t + progress_opts().progress_wait;
        e.heartbeat("b", later).unwrap();
        e.heartbeat("c", later).unwrap();
        let q = e.tick(later).expect("issued once the holder is waited out");
        assert_eq!(ids(&q), ["b", "c"]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].from_step, r[0].to_step), (101, 100));
        assert_eq!(r[0].alive_holders, ["a"]);
    }

    #[test]
    fn a_replacing_incarnation_remembered_too_ends_the_wait_for_the_one_it_replaced() {
        // The previous life heard g1's new incarnation at step 0 after the old one (holder of
        // 1411) died, and saved both. Once the new one is heard again, the old one is gone
        // for good, as when the new one is heard for the first time.
        let d = g1_replaced(vec![(NEW.into(), 0)]);
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 50, t0, d);
        e.heartbeat(NEW, t0).unwrap();
        assert!(!e.durable(t0).holders.contains(&OLD.to_string()));
        let t = t0 + Duration::from_secs(6); // past the startup hold
        e.heartbeat(NEW, t).unwrap();
        e.join(at(NEW, 0), t).unwrap();
        let q = e.tick(t).expect("nobody left to wait for");
        assert_eq!(ids(&q), [NEW]);
        let r = e.take_regressions();
        assert_eq!((r[0].from_step, r[0].to_step), (1411, 0));
        assert!(r[0].alive_holders.is_empty());
    }

    #[test]
    fn a_remembered_holder_heard_then_replaced_by_its_group_is_not_waited_for() {
        // g1's incarnation that holds 1411 is heard once by the restarted lighthouse, then
        // stopped before it reopens its session (so it may still come back), then killed and
        // replaced: its group's new incarnation ends the wait for it.
        let d = g1_replaced(vec![]);
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 50, t0, d);
        e.heartbeat(OLD, t0).unwrap();
        let t = t0 + Duration::from_secs(6); // past the startup hold and OLD's heartbeats
        join_at(&mut e, &[G0], 0, t);
        assert!(e.tick(t).is_none());
        assert_eq!(
            waiting_for(&e, t, 1411),
            OLD,
            "stopped, it may still come back"
        );
        e.heartbeat(NEW, t).unwrap();
        e.join(at(NEW, 0), t).unwrap();
        let q = e.tick(t).expect("replaced, it will not");
        assert_eq!(ids(&q), [G0, NEW]);
        assert_eq!(e.take_regressions()[0].from_step, 1411);
    }

    #[test]
    fn lighthouse_lives_shorter_than_the_progress_wait_give_up_on_a_dead_holder_in_time() {
        // a announces 101 and dies at once. The lighthouse is then restarted every 7.5 s
        // (down 0.5 s, up 7 s: past its startup hold of 5 s, but within the progress wait of
        // 10 s of its start). b and c ask at 100 throughout. Waiting the progress wait from
        // each life's start, no life would ever issue; counting the silence each life saw,
        // the job waits for a as one long life would (but for the time no lighthouse ran),
        // then regresses once.
        let (mut e, t0) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        e.commit("a", qid, 101, t0).unwrap();
        let mut d = e.durable(t0);
        assert_eq!(d.silent_ms.get("a"), Some(&0));
        let mut issued = None;
        for life in 0..4u32 {
            let start = t0 + Duration::from_millis(7_500) * life + Duration::from_millis(500);
            let mut e = QuorumEngine::restored(progress_opts(), 50, start, d);
            join_at(&mut e, &["b", "c"], 100, start);
            let mut t = start;
            while t < start + Duration::from_secs(7) && issued.is_none() {
                t += Duration::from_millis(100);
                e.heartbeat("b", t).unwrap();
                e.heartbeat("c", t).unwrap();
                if let Some(q) = e.tick(t) {
                    issued = Some((q, life, t - start, e.take_regressions()));
                }
            }
            d = e.durable(t);
            if issued.is_none() {
                // The silence each life saw adds up; the time between lives does not.
                let seen = u64::from(life + 1) * 7_000;
                assert_eq!(d.silent_ms.get("a"), Some(&seen), "life {life}");
            }
        }
        let (q, life, into_life, regressions) =
            issued.expect("a chain of short lives stalled the job");
        assert_eq!(ids(&q), ["b", "c"]);
        // Life 1 has 3 s of the wait left, within its startup hold: it issues at the hold's end.
        assert_eq!((life, into_life), (1, Duration::from_secs(5)));
        assert_eq!(regressions.len(), 1);
        assert_eq!(
            (regressions[0].from_step, regressions[0].to_step),
            (101, 100)
        );
    }

    #[test]
    fn a_remembered_holder_is_waited_for_what_its_silence_left_of_the_progress_wait() {
        let (d, _, t0) = before_restart();
        // However long the lighthouse was down: only the silence a lighthouse saw counts.
        let t = t0 + Duration::from_secs(90);
        let wait = progress_opts().progress_wait;
        let restart = |silent_ms: Option<u64>| {
            let mut d = d.clone();
            d.silent_ms = silent_ms
                .map(|ms| ("a".to_string(), ms))
                .into_iter()
                .collect();
            QuorumEngine::restored(progress_opts(), 50, t, d)
        };
        let a_left = |e: &QuorumEngine| {
            let left = e.remembered_wait(t);
            left.into_iter()
                .find(|(id, _)| id == "a")
                .map(|(_, left)| left)
        };
        // Silent for 3 s while a lighthouse ran: 7 s left, and the verdict says so.
        let mut e = restart(Some(3_000));
        assert_eq!(a_left(&e), Some(Duration::from_secs(7)));
        join_at(&mut e, &["b", "c"], 100, t);
        let later = waits(&mut e, t, 55, &["b", "c"]);
        match e.verdict(later) {
            Verdict::WaitingForProgress { remaining, .. } => {
                assert_eq!(remaining, Duration::from_millis(1_500))
            }
            v => panic!("unexpected verdict {v}"),
        }
        // This life's silence adds to the earlier lives'.
        assert_eq!(e.durable(later).silent_ms.get("a"), Some(&8_500));
        // Silent for the whole progress wait already: not waited for (the startup hold
        // still hears every replica that lives).
        assert_eq!(a_left(&restart(Some(10_000))), None);
        // An older state file says nothing: the whole wait, and this life's silence counts.
        let e = restart(None);
        assert_eq!(a_left(&e), Some(wait));
        let at = t + Duration::from_secs(4);
        assert_eq!(e.durable(at).silent_ms.get("a"), Some(&4_000));
        // Heard again in this life: silent only since its last heartbeat.
        let mut e = restart(Some(3_000));
        e.heartbeat("a", t + Duration::from_secs(2)).unwrap();
        assert_eq!(e.durable(at).silent_ms.get("a"), Some(&2_000));
    }

    #[test]
    fn a_restarted_lighthouse_ends_its_startup_hold_once_the_remembered_quorum_asks() {
        let (d, _, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        // Every member of the remembered quorum asks, one at the remembered best step: the
        // first quorum is issued at once, not at the end of the startup hold.
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        join_at(&mut e, &["b", "c"], 100, t);
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("issued without the hold");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(e.take_regressions().is_empty());

        // A member missing, or every member behind the remembered best step: the hold stays.
        let hold = progress_opts().heartbeat_timeout;
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        e.join(at("a", 101), t).unwrap();
        e.join(at("b", 100), t).unwrap();
        e.join(at("z", 0), t).unwrap();
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        for id in ["a", "b", "c"] {
            e.join(at(id, 100), t).unwrap();
        }
        assert!(e.tick(t + hold - Duration::from_millis(1)).is_none());
        assert!(e.tick(t + hold).is_some());

        // A lighthouse that remembers no quorum but was told of one by a manager: the hold
        // runs to its end (no remembered quorum can end it early).
        let mut e = QuorumEngine::new(progress_opts(), 50, t);
        e.join(at("a", 0), t).unwrap();
        e.holds_quorum("a", 7);
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        assert!(e.tick(t + hold - Duration::from_millis(1)).is_none());
        assert!(e.tick(t + hold).is_some());
    }

    #[test]
    fn a_restarted_lighthouse_refuses_commits_under_quorums_it_had_replaced() {
        let (d, qid, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        // Ids stay above the remembered one even with an initial id below it.
        assert!(matches!(
            e.commit("b", qid - 1, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert!(matches!(
            e.commit("z", qid, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.commit("b", qid, 101, t).unwrap(), CommitVerdict::Accepted);
        // Once this life issues a quorum without c, c's commit under the old one is refused.
        let mut t = t + Duration::from_secs(6);
        e.heartbeat_with_step("a", Some(101), t).unwrap();
        join_at(&mut e, &["a", "b"], 101, t);
        t += progress_opts().join_timeout;
        let q = e.tick(t).expect("a and b");
        assert!(q.quorum_id > qid);
        assert!(matches!(
            e.commit("c", qid, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        let d2 = e.durable(t);
        assert_eq!(
            (d2.quorum_id, d2.members),
            (Some(q.quorum_id), vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn durable_state_changes_with_progress_and_membership_only() {
        let (mut e, t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        let r0 = e.durable_revision();
        e.heartbeat_with_step("a", Some(100), t).unwrap();
        assert_eq!(e.durable_revision(), r0, "nothing new");
        e.commit("a", qid, 101, t).unwrap();
        let r1 = e.durable_revision();
        assert!(r1 > r0);
        e.lost("a", t);
        assert!(e.durable_revision() > r1);
        assert_eq!(e.durable(t).holders, Vec::<String>::new());
    }

    #[test]
    fn a_remembered_holder_heard_once_then_silent_without_a_session_is_still_waited_for() {
        let (d, _, t0) = before_restart();
        let mut t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        // a asks once right after the restart, then stops before its manager reopens its
        // session; its request is answered by a quorum with a fresh b.
        e.join(at("a", 101), t).unwrap();
        e.join(at("b2", 0), t).unwrap();
        t += Duration::from_secs(6);
        let q = e.tick(t).expect("a and b2 past the startup hold");
        assert_eq!(ids(&q), ["a", "b2"]);
        // a is declared lost (silent past the heartbeat timeout) and b2 asks alone at 0: it
        // waits for a, which may still come back, until progress_wait after the restart.
        t += Duration::from_secs(3);
        e.heartbeat("b2", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost().len(), 1);
        e.join(at("b2", 0), t).unwrap();
        assert!(e.tick(t).is_none(), "issued behind the remembered holder");
        waiting_for(&e, t, 101);
        // Once a's session opens, its liveness is the session's.
        e.session_opened("a", t).unwrap();
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a is back");
        assert_eq!(ids(&q), ["a", "b2"]);
        assert!(e.take_regressions().is_empty());
    }
}
