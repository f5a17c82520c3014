//! No progress regression: each replica's committed step, the holders of the best one, the
//! startup hold of a restarted lighthouse, and the regressions that could not be avoided.
//!
//! A round whose candidates are all behind a replica that may still come back waits for it
//! until `progress_wait` after the round began; a holder given up on at a step is not waited
//! for again at that step; a quorum issued behind the best known step is reported once
//! through [`QuorumEngine::take_regressions`].

use std::fmt;
use std::time::{Duration, Instant};

use super::{QuorumEngine, Regression, Verdict};

/// How an engine knows that the job ran before this life of the lighthouse began (so a
/// replica still heartbeating may hold progress it has not heard of yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EarlierLife {
    /// The state file held the state of a previous life.
    StateFile {
        /// The last quorum it remembers, if any.
        quorum_id: Option<i64>,
        /// The best committed step it remembers, if any.
        best_step: Option<i64>,
    },
    /// A replica reported holding a quorum this life did not issue.
    Reported {
        /// The replica that reported it.
        replica_id: String,
        /// The quorum id it holds.
        quorum_id: i64,
    },
}

impl fmt::Display for EarlierLife {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EarlierLife::StateFile {
                quorum_id,
                best_step,
            } => {
                write!(f, "its state file remembers")?;
                match quorum_id {
                    Some(id) => write!(f, " quorum {id}")?,
                    None => write!(f, " no quorum")?,
                }
                match best_step {
                    Some(step) => write!(f, " and step {step}"),
                    None => Ok(()),
                }
            }
            EarlierLife::Reported {
                replica_id,
                quorum_id,
            } => write!(
                f,
                "{replica_id} holds quorum {quorum_id} from an earlier life"
            ),
        }
    }
}

impl QuorumEngine {
    /// Takes the regressions announced since the previous call.
    pub fn take_regressions(&mut self) -> Vec<Regression> {
        std::mem::take(&mut self.pending_regressions)
    }

    /// The best committed step the engine knows of (None before any report).
    pub fn best_known_step(&self) -> Option<i64> {
        self.high_water
    }

    /// How long a restarted engine holds its first quorum: every replica still heartbeating
    /// is heard within a heartbeat timeout; no hold when progress is not waited for at all.
    pub(super) fn startup_hold(&self) -> Duration {
        self.opts.heartbeat_timeout.min(self.opts.progress_wait)
    }

    /// Notes that `replica_id` holds quorum `quorum_id` (from a request's known quorum or a
    /// heartbeat). Before this life issued its first quorum, any quorum a replica holds is
    /// from an earlier life: the lighthouse restarted, and its first quorum is held like a
    /// restored one's. Ids this life gives out stay above every id a replica reports (a
    /// clock that went back must not reuse one). Returns true when this turned the hold on.
    pub fn holds_quorum(&mut self, replica_id: &str, quorum_id: i64) -> bool {
        if quorum_id <= 0 {
            return false;
        }
        if quorum_id >= self.next_id {
            self.next_id = quorum_id.saturating_add(1);
        }
        if self.previous.is_some() || self.earlier_life.is_some() {
            return false;
        }
        self.earlier_life = Some(EarlierLife::Reported {
            replica_id: replica_id.to_string(),
            quorum_id,
        });
        true
    }

    /// How this engine knows the job ran before it started (None: a fresh job).
    pub fn earlier_life(&self) -> Option<&EarlierLife> {
        self.earlier_life.as_ref()
    }

    /// When the startup hold ends, while it may still delay this life's first quorum (a
    /// restarted engine before its first quorum and before the hold ran out).
    pub fn startup_hold_until(&self, now: Instant) -> Option<Instant> {
        if self.previous.is_some() || self.earlier_life.is_none() {
            return None;
        }
        let hold = self.startup_hold();
        let end = self.started.checked_add(hold)?;
        (!hold.is_zero() && now < end).then_some(end)
    }

    /// The no-regression rules for a round that is otherwise ready: the startup hold of a
    /// restarted engine, then the wait for a live replica ahead of every candidate. None:
    /// issue now.
    pub(super) fn hold_for_progress(&self, now: Instant) -> Option<Verdict> {
        if let (Some(end), Some(why)) = (self.startup_hold_until(now), &self.earlier_life) {
            if !self.remembered_quorum_asks() {
                return Some(Verdict::StartupHold {
                    remaining: end - now,
                    why: why.clone(),
                });
            }
        }
        if self.opts.progress_wait.is_zero() {
            return None;
        }
        let candidates_step = self.candidates_step();
        let (holder, step) = self
            .holders_ahead(candidates_step, now)
            .max_by_key(|(_, s)| *s)?;
        let round_ends = self
            .round_started
            .unwrap_or(now)
            .checked_add(self.opts.progress_wait)?;
        // A holder only remembered from an earlier life is waited for until its own end.
        let deadline = self
            .heartbeats
            .get(holder)
            .and_then(|rec| rec.waited_for_until(now, self.opts.heartbeat_timeout))
            .map_or(round_ends, |until| until.min(round_ends));
        (now < deadline).then(|| Verdict::WaitingForProgress {
            holder: holder.to_string(),
            step,
            candidates_step,
            remaining: deadline - now,
        })
    }

    /// A restored engine's startup hold can end early: every member of the quorum it
    /// remembers asks, at or above the best step it remembers. Only a member of the last
    /// quorum can have committed since it was issued, and a commit acknowledged under the
    /// write-ahead rule raised the remembered best step first, so no replica that is not
    /// heard yet holds more than the round's candidates. (O(members of that quorum), only
    /// while no quorum was issued in this life.)
    pub(super) fn remembered_quorum_asks(&self) -> bool {
        let Some((_, members)) = &self.restored_quorum else {
            return false;
        };
        !members.is_empty()
            && members.iter().all(|id| self.participants.contains_key(id))
            && self
                .high_water
                .is_none_or(|best| self.candidates_step() >= best)
    }

    pub(super) fn is_candidate(&self, replica_id: &str) -> bool {
        if self.shrinking() {
            self.participants.contains_key(replica_id) && self.previous_ids.contains(replica_id)
        } else {
            self.participants.contains_key(replica_id)
        }
    }

    /// The best step among the round's candidates (O(participants)).
    pub(super) fn candidates_step(&self) -> i64 {
        self.participants
            .iter()
            .filter(|(id, _)| self.is_candidate(id))
            .map(|(_, p)| p.member.step)
            .max()
            .unwrap_or(0)
    }

    /// Replicas that are not asking, may still come back, and hold a step above `step` they
    /// were not given up on at (O(records); O(1) when every known replica is asking).
    pub(super) fn holders_ahead(
        &self,
        step: i64,
        now: Instant,
    ) -> impl Iterator<Item = (&str, i64)> + '_ {
        let everyone_asks = self.heartbeats.len() <= self.participants.len();
        let timeout = self.opts.heartbeat_timeout;
        self.heartbeats
            .iter()
            .filter(move |_| !everyone_asks)
            .filter(move |(id, rec)| {
                rec.may_come_back(now, timeout) && !self.participants.contains_key(*id)
            })
            .filter_map(move |(id, rec)| {
                let held = rec.step.filter(|s| *s > step)?;
                let waived = self.waived.get(id).is_some_and(|w| held <= *w);
                (!waived).then_some((id.as_str(), held))
            })
    }

    /// Records the progress of a quorum issued at `to_step`: holders still `ahead` of it are
    /// given up on at their step, and a quorum behind the best step known is reported once
    /// (`fresh`: a member asked at step 0, see [`Regression::fresh`]).
    pub(super) fn account_progress(
        &mut self,
        quorum_id: i64,
        to_step: i64,
        ahead: Vec<(String, i64)>,
        fresh: bool,
    ) {
        let alive_holders: Vec<String> = ahead.iter().map(|(id, _)| id.clone()).collect();
        for (id, step) in ahead {
            self.waived.insert(id, step);
        }
        match self.high_water {
            Some(from_step) if from_step > to_step => {
                self.pending_regressions.push(Regression {
                    from_step,
                    to_step,
                    quorum_id,
                    alive_holders,
                    fresh,
                });
                self.high_water = Some(to_step);
                self.durable_revision += 1;
            }
            Some(hw) if hw >= to_step => {}
            _ => {
                self.high_water = Some(to_step);
                self.durable_revision += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::time::{Duration, Instant};

    use super::super::testkit::*;
    use super::super::*;

    #[test]
    fn round_behind_a_heartbeating_holder_waits_for_it_to_join() {
        let (mut e, mut t) = running(100);
        // a and b die and come back fresh (new incarnations at step 0); c, at step 101, is
        // busy in a blocking call but heartbeats its step.
        e.lost("a", t);
        e.lost("b", t);
        e.heartbeat_with_step("c", Some(101), t).unwrap();
        join_at(&mut e, &["a2", "b2"], 0, t);
        assert!(e.poll(t).is_none());
        // Past the join timeout, 2 of 3 healthy would be enough: the round waits for c.
        for _ in 0..80 {
            t += Duration::from_millis(100);
            e.heartbeat_with_step("c", Some(101), t).unwrap();
            assert!(e.tick(t).is_none(), "issued behind a live holder");
        }
        match e.verdict(t) {
            Verdict::WaitingForProgress {
                holder,
                step,
                candidates_step,
                remaining,
            } => {
                assert_eq!((holder.as_str(), step, candidates_step), ("c", 101, 0));
                assert!(remaining <= Duration::from_secs(2), "{remaining:?}");
            }
            v => panic!("unexpected verdict {v}"),
        }
        assert!(e.verdict(t).to_string().contains("c (at step 101)"));
        // c asks: everyone takes part, the fresh groups will heal from it; no regression.
        e.join(at("c", 101), t).unwrap();
        let q = e.poll(t).expect("issued once the holder joins");
        assert_eq!(ids(&q), ["a2", "b2", "c"]);
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(101));
    }

    #[test]
    fn silent_holder_with_open_session_is_waited_for_until_the_bound_then_given_up() {
        let (mut e, t0) = running(50);
        e.session_opened("c", t0).unwrap();
        e.heartbeat_with_step("c", Some(51), t0).unwrap();
        // c is stopped: silent, its session still open. a and b restart fresh.
        e.lost("a", t0);
        e.lost("b", t0);
        let mut t = t0 + Duration::from_secs(6);
        e.tick(t);
        join_at(&mut e, &["a2", "b2"], 0, t);
        let round = t;
        // c is not healthy (no heartbeat for 6 s), so the round is otherwise ready at once.
        assert_eq!(waiting_for(&e, t, 51), "c");
        while t < round + Duration::from_millis(9_900) {
            t += Duration::from_millis(100);
            assert!(e.tick(t).is_none(), "gave up too early at {:?}", t - round);
        }
        t += Duration::from_millis(200);
        let q = e.tick(t).expect("the wait is bounded");
        assert_eq!(ids(&q), ["a2", "b2"]);
        assert_eq!(
            e.take_regressions(),
            vec![Regression {
                from_step: 51,
                to_step: 0,
                quorum_id: q.quorum_id,
                alive_holders: vec!["c".into()],
                fresh: true,
            }]
        );
        // Given up on at step 51: neither its heartbeats nor the next rounds wait for it again.
        e.heartbeat_with_step("c", Some(51), t).unwrap();
        join_at(&mut e, &["a2", "b2"], 1, t);
        let q2 = e.poll(t).expect("fast path, no second wait");
        assert_eq!(q2.quorum_id, q.quorum_id);
        assert!(e.take_regressions().is_empty(), "reported once");
        // If it reports newer progress it is waited for again.
        e.heartbeat_with_step("c", Some(52), t).unwrap();
        join_at(&mut e, &["a2", "b2"], 2, t);
        assert!(e.poll(t).is_none());
        waiting_for(&e, t, 52);
    }

    #[test]
    fn regression_when_every_holder_is_dead_is_issued_at_once_and_reported_once() {
        let (mut e, t) = running(200);
        for id in ["a", "b", "c"] {
            e.lost(id, t);
        }
        e.join(at("a2", 0), t).unwrap();
        let q = e.poll(t).expect("no live holder: nothing to wait for");
        assert_eq!(ids(&q), ["a2"]);
        let r = e.take_regressions();
        assert_eq!(
            r,
            vec![Regression {
                from_step: 200,
                to_step: 0,
                quorum_id: q.quorum_id,
                alive_holders: vec![],
                fresh: true,
            }]
        );
        e.join(at("a2", 1), t).unwrap();
        assert!(e.poll(t).is_some());
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(1));
    }

    #[test]
    fn fresh_job_gets_its_first_quorum_at_once() {
        // Nothing says the job ran before: the join rules alone decide (a lone replica at
        // any step, with min_replicas 1, is answered at once).
        let t0 = Instant::now();
        for step in [0, 1, 900] {
            let mut e = QuorumEngine::new(progress_opts(), 100, t0);
            e.join(at("only", step), t0).unwrap();
            assert_eq!(e.verdict(t0), Verdict::AllHealthyJoined);
            assert_eq!(ids(&e.poll(t0).unwrap()), ["only"]);
            assert!(e.earlier_life().is_none());
        }
        // A heartbeat without a quorum id is no evidence either.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.heartbeat_with_step("b", Some(3), t0).unwrap();
        assert!(!e.holds_quorum("b", 0));
        e.join(at("a", 3), t0).unwrap();
        e.join(at("b", 3), t0).unwrap();
        assert_eq!(ids(&e.poll(t0).unwrap()), ["a", "b"]);
        // Once this life issued a quorum, a quorum id reported is one of its own.
        assert!(!e.holds_quorum("a", 100));
        assert!(e.startup_hold_until(t0).is_none());
    }

    #[test]
    fn restarted_lighthouse_holds_the_first_quorum_until_heartbeats_are_heard() {
        // The lighthouse restarts at t0 without a state file. A surviving group's manager
        // heartbeats first, saying it holds quorum 42 (from the earlier life): that turns
        // the hold on. A fresh group asks; the group holding step 900 is heard again 2 s
        // later.
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.heartbeat_with_step("old", Some(900), t0).unwrap();
        assert!(e.holds_quorum("old", 42));
        assert!(!e.holds_quorum("old", 42), "turned on once");
        let mut t = t0 + Duration::from_millis(100);
        join_at(&mut e, &["fresh", "fresh2"], 0, t);
        assert!(e.poll(t).is_none());
        // Past the join timeout the round would be ready but for the hold.
        t = t0 + Duration::from_millis(1_200);
        assert!(e.tick(t).is_none());
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        let why = e.verdict(t).to_string();
        assert!(
            why.contains("restarted (old holds quorum 42 from an earlier life)"),
            "{why}"
        );
        assert_eq!(e.startup_hold_until(t), Some(t0 + Duration::from_secs(5)));
        t = t0 + Duration::from_secs(2);
        e.heartbeat_with_step("old", Some(900), t).unwrap();
        assert!(e.tick(t).is_none());
        // After the hold the round waits for the holder, which then joins.
        t = t0 + Duration::from_millis(5_100);
        e.heartbeat_with_step("old", Some(900), t).unwrap();
        assert!(e.tick(t).is_none());
        waiting_for(&e, t, 900);
        e.join(at("old", 900), t).unwrap();
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["fresh", "fresh2", "old"]);
        assert!(e.take_regressions().is_empty());

        // A request holding a quorum of an earlier life turns the hold on as well; nobody
        // else alive: the first quorum comes right at the end of the hold.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.join(at("only", 7), t0).unwrap();
        assert!(e.holds_quorum("only", 9));
        assert!(e.tick(t0 + Duration::from_millis(4_900)).is_none());
        assert_eq!(ids(&e.tick(t0 + Duration::from_secs(5)).unwrap()), ["only"]);
        // The hold is min(heartbeat timeout, progress wait); no wait at all disables it.
        for (wait, ready_at) in [(Duration::from_secs(2), 2_000), (Duration::ZERO, 0)] {
            let o = LighthouseOptions {
                progress_wait: wait,
                ..progress_opts()
            };
            let mut e = QuorumEngine::new(o, 100, t0);
            e.join(at("only", 7), t0).unwrap();
            e.holds_quorum("only", 9);
            if ready_at > 0 {
                assert!(e.tick(t0 + Duration::from_millis(ready_at - 1)).is_none());
            }
            assert!(e.tick(t0 + Duration::from_millis(ready_at)).is_some());
        }
        // Evidence heard after the hold would have ended changes nothing.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        let late = t0 + Duration::from_secs(6);
        e.join(at("only", 7), late).unwrap();
        assert!(e.holds_quorum("only", 9));
        assert!(e.poll(late).is_some());
    }

    #[test]
    fn ids_stay_above_every_quorum_id_a_replica_reports() {
        // The earlier life's clock was ahead: its ids are above this life's start id.
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        assert!(e.holds_quorum("a", 5_000));
        assert!(!e.holds_quorum("b", 7_000), "the hold is already on");
        e.join(at("a", 1), t0).unwrap();
        e.join(at("b", 1), t0).unwrap();
        let q = e
            .tick(t0 + Duration::from_secs(5))
            .expect("issued after the hold");
        assert_eq!(q.quorum_id, 7_001);
        // Reports of this life's own ids (or older ones) change nothing.
        assert!(!e.holds_quorum("a", 7_001));
        assert!(!e.holds_quorum("a", 3));
        e.join(at("a", 2), t0 + Duration::from_secs(5)).unwrap();
        let q2 = e
            .tick(t0 + Duration::from_secs(7))
            .expect("a alone, after the join timeout");
        assert_eq!(q2.quorum_id, 7_002);
    }

    #[test]
    fn a_state_file_that_remembers_nothing_is_a_fresh_job() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 100, t0, Durable::default());
        assert!(e.earlier_life().is_none());
        e.join(at("only", 0), t0).unwrap();
        assert!(e.poll(t0).is_some());
        // One that remembers a step holds, and says what it remembers.
        let durable = Durable {
            best_step: Some(12),
            ..Durable::default()
        };
        let mut e = QuorumEngine::restored(progress_opts(), 100, t0, durable);
        e.join(at("only", 0), t0).unwrap();
        assert!(e.poll(t0).is_none());
        let why = e.verdict(t0).to_string();
        assert!(
            why.contains("its state file remembers no quorum and step 12"),
            "{why}"
        );
    }

    #[test]
    fn holders_not_ahead_and_asking_replicas_never_delay_a_round() {
        let (mut e, t) = running(10);
        // A heartbeating group at the same step, and one behind: no wait.
        e.heartbeat_with_step("d", Some(10), t).unwrap();
        e.heartbeat_with_step("e", Some(3), t).unwrap();
        for id in ["a", "b", "c"] {
            e.join(at(id, 11), t).unwrap();
        }
        assert!(e.poll(t).is_some(), "fast path");
        // A holder ahead that is itself asking is a candidate, not a reason to wait.
        for (id, step) in [("a", 12), ("b", 12), ("c", 12), ("d", 40)] {
            e.join(at(id, step), t).unwrap();
        }
        let q = e.tick(t + Duration::from_secs(1)).unwrap();
        assert_eq!(ids(&q), ["a", "b", "c", "d"]);
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(40));
    }

    #[test]
    fn shrink_only_round_waits_for_a_live_holder_outside_it() {
        let (mut e, t) = running(5);
        // c went ahead alone?! It cannot, but its heartbeat may say more than a and b know
        // (a commit the others missed). A shrink-only round of a and b waits for it too.
        e.heartbeat_with_step("c", Some(6), t).unwrap();
        e.join(
            QuorumMember {
                shrink_only: true,
                ..at("a", 5)
            },
            t,
        )
        .unwrap();
        e.join(at("b", 5), t).unwrap();
        let later = t + Duration::from_secs(2);
        e.heartbeat_with_step("c", Some(6), later).unwrap();
        assert!(e.tick(later).is_none());
        waiting_for(&e, later, 6);
    }

    #[test]
    fn randomized_no_quorum_behind_a_live_unwaived_holder_before_the_bound() {
        for seed in 1..=150u64 {
            let mut rng = XorShift(seed.wrapping_mul(0xA24B_AED4_963E_E407) | 1);
            let o = LighthouseOptions {
                min_replicas: 1,
                join_timeout: Duration::from_millis(200 + rng.below(800)),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000 + rng.below(2000)),
                progress_wait: Duration::from_millis(500 + rng.below(4000)),
                state_file: None,
                hang_timeout: None,
            };
            let t0 = Instant::now();
            let mut e = QuorumEngine::new(o.clone(), 1, t0);
            // A restarted lighthouse: a manager says it holds a quorum of the earlier life.
            assert!(e.holds_quorum("r0", 1));
            let mut now = t0;
            // The model: each replica's step, last heartbeat, open session, waiver.
            let mut step: HashMap<String, i64> = HashMap::new();
            let mut seen: HashMap<String, Instant> = HashMap::new();
            let mut session: HashSet<String> = HashSet::new();
            let mut asking: HashMap<String, (i64, Instant)> = HashMap::new();
            let mut round_start: Option<Instant> = None;
            let mut waived: HashMap<String, i64> = HashMap::new();
            // Replicas whose session ended and when: their heartbeats are ignored for a
            // heartbeat timeout, until they ask or open a session.
            let mut ended: HashMap<String, Instant> = HashMap::new();
            let mut first = true;
            for _ in 0..500 {
                let id = format!("r{}", rng.below(5));
                let issued = match rng.below(10) {
                    0..=2 => {
                        let s = *step.entry(id.clone()).or_insert(0);
                        ended.remove(&id);
                        e.join(at(&id, s), now).unwrap();
                        seen.insert(id.clone(), now);
                        asking.insert(id.clone(), (s, now));
                        round_start.get_or_insert(now);
                        e.poll(now)
                    }
                    3 => {
                        let ignored = ended.get(&id).is_some_and(|t| {
                            now.saturating_duration_since(*t) <= o.heartbeat_timeout
                        });
                        if ignored {
                            // Sent before its session ended: the engine must not count it.
                            e.heartbeat_with_step(&id, Some(1 + rng.below(3) as i64), now)
                                .unwrap();
                        } else {
                            let s = step.entry(id.clone()).or_insert(0);
                            *s += rng.below(3) as i64;
                            e.heartbeat_with_step(&id, Some(*s), now).unwrap();
                            seen.insert(id.clone(), now);
                        }
                        None
                    }
                    4 => {
                        ended.remove(&id);
                        e.session_opened(&id, now).unwrap();
                        seen.insert(id.clone(), now);
                        session.insert(id.clone());
                        None
                    }
                    5 => {
                        // Dies: a new incarnation will use another id.
                        e.lost(&id, now);
                        ended.insert(id.clone(), now);
                        seen.remove(&id);
                        session.remove(&id);
                        asking.remove(&id);
                        waived.remove(&id);
                        step.remove(&id);
                        if asking.is_empty() {
                            round_start = None;
                        }
                        e.poll(now)
                    }
                    6 | 7 => {
                        now += Duration::from_millis(rng.below(1200));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                let members: HashSet<String> = ids(&q).into_iter().collect();
                let to = q.participants.iter().map(|m| m.step).max().unwrap();
                let started = round_start.unwrap_or(now);
                if first {
                    let hold = o.heartbeat_timeout.min(o.progress_wait);
                    assert!(
                        now >= t0 + hold,
                        "seed {seed}: first quorum inside the hold"
                    );
                    first = false;
                }
                for (h, s) in &step {
                    let alive = session.contains(h)
                        || seen.get(h).is_some_and(|t| {
                            now.saturating_duration_since(*t) <= o.heartbeat_timeout
                        });
                    let behind = *s > to && !members.contains(h) && !asking.contains_key(h);
                    let given_up = waived.get(h).is_some_and(|w| *s <= *w);
                    if alive && behind && !given_up {
                        assert!(
                            now >= started + o.progress_wait,
                            "seed {seed}: issued at step {to} behind live {h} at {s} \
                             after {:?}",
                            now - started
                        );
                        waived.insert(h.clone(), *s);
                    }
                }
                for m in &q.participants {
                    asking.remove(&m.replica_id);
                }
                round_start = if asking.is_empty() { None } else { Some(now) };
            }
            let _ = e.take_regressions();
        }
    }
}
