//! Who is alive: heartbeats, sessions, losses, hangs and drops, as the quorum rules see them.
//!
//! A replica group is healthy while it heartbeats (or asks) within `heartbeat_timeout`; a
//! group whose session ended is lost at once, and a member of the last quorum whose
//! heartbeat expired is lost at tick time (each loss reported once, see
//! [`QuorumEngine::take_lost`]). Hung groups (see [`crate::lighthouse::health::hang`]) and
//! groups dropped as lasting stragglers are not counted as healthy. Records unseen for
//! [`PRUNE_AFTER_TIMEOUTS`] timeouts are forgotten.

use std::time::{Duration, Instant};

use super::QuorumEngine;
use crate::error::{ensure, Result};
use crate::lighthouse::health::hang::Hung;

/// Heartbeat records unseen for this many heartbeat timeouts are forgotten at tick time, so
/// a long-running lighthouse does not accumulate every replica id it ever saw.
pub const PRUNE_AFTER_TIMEOUTS: u32 = 10;

/// When a replica group was last seen, whether it is counted as healthy, what it last said
/// about its progress, and whether its session is open.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeartbeatRecord {
    pub(super) last_seen: Instant,
    pub(super) counted: bool,
    /// Highest committed step the replica reported (requests, heartbeats); None if unknown.
    pub(super) step: Option<i64>,
    /// Its session with the lighthouse is open: it may still come back even while silent
    /// (e.g. stopped), so progress it holds is worth waiting for.
    pub(super) session: bool,
    /// Known from the state of a previous life of the lighthouse and without a session in
    /// this one: it may come back until then (even if heard once and silent since, e.g.
    /// stopped before its manager reopened its session).
    pub(super) restored_until: Option<Instant>,
    /// Heard from in this life of the lighthouse (false only for restored records).
    pub(super) heard: bool,
    /// For a restored record: how long earlier lives of the lighthouse saw it silent.
    pub(super) silent_before: Duration,
}

impl HeartbeatRecord {
    /// A record not counted as healthy yet (see `QuorumEngine::touch`).
    pub(super) fn new(now: Instant) -> Self {
        Self {
            last_seen: now,
            counted: false,
            step: None,
            session: false,
            restored_until: None,
            heard: true,
            silent_before: Duration::ZERO,
        }
    }

    /// Its session is open or it was heard within `timeout` of `now`.
    fn lives(&self, now: Instant, timeout: Duration) -> bool {
        self.session || (self.heard && now.saturating_duration_since(self.last_seen) <= timeout)
    }

    /// Heard from within `timeout` of `now`, silent with its session still open, or known
    /// from a previous life of the lighthouse and not yet waited out.
    pub(super) fn may_come_back(&self, now: Instant, timeout: Duration) -> bool {
        self.lives(now, timeout) || self.restored_until.is_some_and(|until| now < until)
    }

    /// Until when it may come back if nothing more is heard of it: None while it lives (see
    /// `lives`), else the end of its restored wait.
    pub(super) fn waited_for_until(&self, now: Instant, timeout: Duration) -> Option<Instant> {
        self.restored_until.filter(|_| !self.lives(now, timeout))
    }
}

/// A member of an issued quorum that was declared lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostMember {
    /// The lost replica group.
    pub replica_id: String,
    /// The quorum it was a member of (the last issued one when it was declared lost).
    pub quorum_id: i64,
}

impl QuorumEngine {
    /// Replica groups counted as healthy that are not asking in the current round, sorted,
    /// at most `limit` of them (O(records)): whom a round waiting for stragglers or for a
    /// majority waits for.
    pub fn healthy_not_asking(&self, now: Instant, limit: usize) -> Vec<String> {
        let timeout = self.opts.heartbeat_timeout;
        let mut ids: Vec<String> = self
            .heartbeats
            .iter()
            .filter(|(id, rec)| {
                rec.heard
                    && now.saturating_duration_since(rec.last_seen) <= timeout
                    && !self.participants.contains_key(*id)
                    && !self.hang.is_hung(id)
                    && !self.dropped.contains_key(*id)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids.truncate(limit);
        ids
    }

    /// Number of heartbeat records kept (healthy or not yet pruned).
    pub fn num_heartbeat_records(&self) -> usize {
        self.heartbeats.len()
    }

    /// Records that `replica_id` is alive at `now` and runs `f` on its record (created, and
    /// its group's superseded incarnations forgotten, when it is new or heard for the first
    /// time in this life). One lookup and no allocation for a replica already known: this
    /// runs on every request.
    pub(super) fn touch<R>(
        &mut self,
        replica_id: &str,
        now: Instant,
        f: impl FnOnce(&mut HeartbeatRecord) -> R,
    ) -> R {
        fn refresh(rec: &mut HeartbeatRecord, healthy: &mut usize, now: Instant) {
            if now > rec.last_seen {
                rec.last_seen = now;
            }
            rec.heard = true;
            if !rec.counted {
                rec.counted = true;
                *healthy += 1;
            }
        }
        if let Some(rec) = self.heartbeats.get_mut(replica_id) {
            let restored = !rec.heard;
            refresh(rec, &mut self.healthy, now);
            if !restored {
                return f(rec);
            }
            // Remembered from the state file too (e.g. at step 0 after a restart), and heard
            // now: its group's other remembered incarnations are gone as well.
            self.forget_superseded(replica_id);
            if let Some(rec) = self.heartbeats.get_mut(replica_id) {
                return f(rec);
            }
        }
        self.forget_superseded(replica_id);
        let rec = self
            .heartbeats
            .entry(replica_id.to_string())
            .or_insert_with(|| HeartbeatRecord::new(now));
        refresh(rec, &mut self.healthy, now);
        f(rec)
    }

    /// A replica group runs one incarnation at a time (`{name}:{uuid}`): once `replica_id`
    /// is heard (new, or remembered and heard for the first time in this life), the group's
    /// other incarnations remembered from a previous life of the lighthouse are gone for
    /// good. Nobody waits for them: one not heard in this life is forgotten, and one heard
    /// and silent since (stopped before its manager reopened its session, then replaced) is
    /// no longer waited for as a remembered one. A lighthouse restarted often would otherwise
    /// wait the whole progress wait for a dead incarnation, again and again.
    pub(super) fn forget_superseded(&mut self, replica_id: &str) {
        if self.restored_by_group.is_empty() {
            return; // nothing restored (or all of it settled): a job's first lighthouse
        }
        let base = crate::telemetry::base_id(replica_id);
        if base == replica_id {
            return; // no incarnation suffix: nothing to tell incarnations apart by
        }
        let Some(restored) = self.restored_by_group.remove(base) else {
            return;
        };
        let mut gone = Vec::new();
        let mut still = Vec::new();
        for id in restored {
            let Some(rec) = self.heartbeats.get_mut(&id) else {
                continue; // forgotten
            };
            if rec.restored_until.is_none() {
                continue; // its session says whether it lives
            }
            if id == replica_id {
                still.push(id); // the one heard now, until a later one replaces it
            } else if rec.heard {
                rec.restored_until = None; // its heartbeats alone say whether it lives
            } else {
                gone.push(id);
            }
        }
        if !still.is_empty() {
            self.restored_by_group.insert(base.to_string(), still);
        }
        for id in gone {
            if let Some(rec) = self.heartbeats.remove(&id) {
                if rec.counted {
                    self.healthy = self.healthy.saturating_sub(1);
                }
                self.hang.forget(&id);
                self.waived.remove(&id);
                self.durable_revision += 1;
            }
        }
    }

    /// Notes that `replica_id` (alive at `now`) committed `step`, raising the best step known
    /// unless the replica was given up on at that step.
    pub(super) fn note_step(&mut self, replica_id: &str, step: Option<i64>, now: Instant) {
        let Some(step) = step else {
            self.touch(replica_id, now, |_| ());
            return;
        };
        let raised = self.touch(replica_id, now, |rec| {
            let raised = rec.step.is_none_or(|s| step > s);
            if raised {
                rec.step = Some(step);
            }
            raised
        });
        if raised {
            self.durable_revision += 1;
        }
        if self.waived.get(replica_id).is_some_and(|w| step <= *w) {
            return;
        }
        if self.high_water.is_none_or(|hw| step > hw) {
            self.high_water = Some(step);
            self.durable_revision += 1;
        }
    }

    pub(super) fn check_id(replica_id: &str) -> Result<()> {
        ensure!(
            !replica_id.trim().is_empty(),
            "replica_id must not be empty"
        );
        Ok(())
    }

    /// Records that `replica_id` is alive.
    pub fn heartbeat(&mut self, replica_id: &str, now: Instant) -> Result<()> {
        self.heartbeat_with_step(replica_id, None, now)
    }

    /// Records that `replica_id` is alive and, if given, the step it has committed (heartbeats
    /// carry it, so the engine knows the progress of replicas that are not asking).
    pub fn heartbeat_with_step(
        &mut self,
        replica_id: &str,
        step: Option<i64>,
        now: Instant,
    ) -> Result<()> {
        self.heartbeat_full(replica_id, step, None, now)
    }

    /// [`QuorumEngine::heartbeat_with_step`], plus how long ago the group's training loop
    /// last reached its manager (`loop_idle`, from managers that say; see [`crate::lighthouse::health::hang`]).
    pub fn heartbeat_full(
        &mut self,
        replica_id: &str,
        step: Option<i64>,
        loop_idle: Option<Duration>,
        now: Instant,
    ) -> Result<()> {
        Self::check_id(replica_id)?;
        if let Some(step) = step {
            ensure!(
                step >= 0,
                "step must not be negative (replica {replica_id:?} sent {step})"
            );
        }
        if self.ended_recently(replica_id, now) {
            return Ok(()); // sent before its session ended: the group is dead
        }
        self.note_step(replica_id, step, now);
        if let Some(idle) = loop_idle {
            self.hang.visited(replica_id, idle, now);
        }
        Ok(())
    }

    /// Whether the session of `replica_id` ended within the last heartbeat timeout and it has
    /// neither opened a new one nor asked since (see [`QuorumEngine::lost`]).
    fn ended_recently(&self, replica_id: &str, now: Instant) -> bool {
        self.ended
            .get(replica_id)
            .is_some_and(|at| now.saturating_duration_since(*at) <= self.opts.heartbeat_timeout)
    }

    /// Whether `replica_id` is hung now (see [`crate::lighthouse::health::hang`]).
    pub fn is_hung(&self, replica_id: &str) -> Option<&Hung> {
        self.hang.get(replica_id)
    }

    /// The groups hung now, by id (at most `limit`).
    pub fn hung_ids(&self, limit: usize) -> Vec<String> {
        self.hang
            .hung()
            .take(limit)
            .map(|h| h.replica_id.clone())
            .collect()
    }

    /// The hang timeout now and how it was chosen.
    pub fn hang_timeout(&self) -> (Duration, String) {
        (self.hang.timeout(), self.hang.timeout_rule())
    }

    /// Groups found hung since the last call.
    pub fn take_newly_hung(&mut self) -> Vec<Hung> {
        self.hang.take_newly_hung()
    }

    /// Hung groups whose training loop came back since the last call.
    pub fn take_resumed(&mut self) -> Vec<String> {
        self.hang.take_resumed()
    }

    /// Records that the session of `replica_id` opened (counts as a heartbeat). Until it ends
    /// (see [`QuorumEngine::lost`]) the replica may come back even when silent.
    pub fn session_opened(&mut self, replica_id: &str, now: Instant) -> Result<()> {
        Self::check_id(replica_id)?;
        self.ended.remove(replica_id);
        self.touch(replica_id, now, |rec| {
            rec.session = true;
            // Its session now says whether it lives.
            rec.restored_until = None;
        });
        Ok(())
    }

    /// Drops `replica_id` from the quorum for `window` (a lasting straggler, see
    /// `--straggler_drop_after_ms`): it stops counting as healthy, so the others' rounds go
    /// on without it, and its requests wait until the drop ends; then it rejoins (and heals).
    /// Returns false (nothing changed) for a replica not known healthy or already dropped.
    pub fn drop_straggler(
        &mut self,
        replica_id: &str,
        window: Duration,
        why: String,
        now: Instant,
    ) -> bool {
        if self.dropped.contains_key(replica_id)
            || !self.heartbeats.get(replica_id).is_some_and(|r| r.counted)
        {
            return false;
        }
        let until = now.checked_add(window).unwrap_or(now);
        self.dropped.insert(replica_id.to_string(), (until, why));
        if let Some(p) = self.participants.get(replica_id).cloned() {
            // Its waiting request leaves the round (counters kept by `leave`) and waits.
            self.leave(replica_id, p.generation);
            self.parked.insert(replica_id.to_string(), p);
        }
        true
    }

    /// Ends the drops whose time is up: their waiting requests join the round.
    pub(super) fn end_drops(&mut self, now: Instant) {
        let over: Vec<String> = self
            .dropped
            .iter()
            .filter(|(_, (until, _))| now >= *until)
            .map(|(id, _)| id.clone())
            .collect();
        for id in over {
            self.dropped.remove(&id);
            if let Some(p) = self.parked.remove(&id) {
                self.enter_round(p, now);
            }
        }
    }

    /// Why `replica_id` is dropped from the quorum and for how much longer, if it is.
    pub fn dropped(&self, replica_id: &str, now: Instant) -> Option<(String, Duration)> {
        self.dropped
            .get(replica_id)
            .map(|(until, why)| (why.clone(), until.saturating_duration_since(now)))
    }

    /// Records that `replica_id` is gone (its process died: its session ended).
    ///
    /// It stops counting as healthy at once (its heartbeat record is dropped) and a request it
    /// still had in the round is withdrawn. If it is a member of the last quorum, the loss is
    /// queued for [`QuorumEngine::take_lost`] (once). Returns true if it was such a member.
    /// Heartbeats arriving within a heartbeat timeout are ignored: they were sent before the
    /// end (a heartbeat in flight when the process died), and counting one would hold the
    /// others' next round until it expired. A request, a new session or a heartbeat after
    /// that makes it healthy again. Call [`QuorumEngine::poll`] afterwards: the round may
    /// now be ready.
    pub fn lost(&mut self, replica_id: &str, now: Instant) -> bool {
        self.ended.insert(replica_id.to_string(), now);
        if let Some(rec) = self.heartbeats.remove(replica_id) {
            if rec.counted {
                self.healthy = self.healthy.saturating_sub(1);
            }
            self.durable_revision += 1;
        }
        self.waived.remove(replica_id);
        // A dead group is not hung: the hung count must only hold counted records.
        self.hang.forget(replica_id);
        self.parity.lost(replica_id);
        self.dropped.remove(replica_id);
        self.parked.remove(replica_id);
        if let Some(p) = self.participants.get(replica_id) {
            let generation = p.generation;
            self.leave(replica_id, generation);
        }
        if self.participants.is_empty() {
            self.round_started = None;
        } else if self.round_started.is_none() {
            self.round_started = Some(now);
        }
        self.report_lost(replica_id)
    }

    /// Queues the loss of `replica_id` if it is a member of the last quorum not yet reported.
    pub(super) fn report_lost(&mut self, replica_id: &str) -> bool {
        let Some(prev) = &self.previous else {
            return false;
        };
        if !self.previous_ids.contains(replica_id) || self.lost_reported.contains(replica_id) {
            return false;
        }
        self.lost_reported.insert(replica_id.to_string());
        self.pending_lost.push(LostMember {
            replica_id: replica_id.to_string(),
            quorum_id: prev.quorum_id,
        });
        true
    }

    /// Takes the losses of last-quorum members declared since the previous call.
    pub fn take_lost(&mut self) -> Vec<LostMember> {
        std::mem::take(&mut self.pending_lost)
    }

    /// Declares lost the members of the last quorum that are not healthy as of the last prune
    /// (O(members of the last quorum)).
    pub(super) fn expire_members(&mut self) {
        let expired: Vec<String> = self
            .previous_ids
            .iter()
            .filter(|id| !self.lost_reported.contains(*id))
            .filter(|id| !self.heartbeats.get(*id).is_some_and(|rec| rec.counted))
            .cloned()
            .collect();
        for id in expired {
            self.report_lost(&id);
        }
    }

    /// Recounts the healthy replicas and drops records older than
    /// [`PRUNE_AFTER_TIMEOUTS`] heartbeat timeouts (O(number of records)).
    pub fn prune(&mut self, now: Instant) {
        let timeout = self.opts.heartbeat_timeout;
        let forget_after = timeout.saturating_mul(PRUNE_AFTER_TIMEOUTS);
        let round_open = self.round_started.is_some();
        // A group ahead of the round's candidates holds progress they would lose: the
        // progress rule waits for it (up to progress_wait, then gives up on it), and it is not
        // held hung meanwhile (its process must not end itself with the only newer state).
        let candidates_step =
            (round_open && !self.participants.is_empty()).then(|| self.candidates_step());
        self.end_drops(now);
        self.ended
            .retain(|_, at| now.saturating_duration_since(*at) <= timeout);
        let waived = &self.waived;
        let participants = &self.participants;
        let parked = &self.parked;
        let previous = &self.previous_ids;
        let hang = &mut self.hang;
        let parity = &mut self.parity;
        let mut healthy = 0;
        self.heartbeats.retain(|id, rec| {
            let waiting = participants.contains_key(id) || parked.contains_key(id);
            let age = now.saturating_duration_since(rec.last_seen);
            rec.counted = waiting || (age <= timeout && rec.heard);
            if rec.counted {
                healthy += 1;
            }
            let ahead = match (candidates_step, rec.step) {
                (Some(c), Some(held)) => held > c && waived.get(id).is_none_or(|w| held > *w),
                _ => false,
            };
            if rec.counted && !waiting && !ahead {
                // Left out of the last quorum: the others went on without it.
                hang.judge(id, round_open, !previous.contains(id), now);
            } else {
                hang.clear(id);
            }
            // An open session keeps the record (bounded by the open connections), and so
            // does a holder restored from a previous life until it is waited out.
            let keep = waiting
                || rec.session
                || age <= forget_after
                || rec.restored_until.is_some_and(|until| now < until);
            if !keep {
                hang.forget(id);
                parity.forget(id);
            }
            keep
        });
        self.healthy = healthy;
        let known = &self.heartbeats;
        self.waived.retain(|id, _| known.contains_key(id));
        self.parity.evaluate(self.previous_ids.len(), now);
    }

    /// Every replica id heard from, with the time since it was last seen (O(n)), for the
    /// replicas' health.
    ///
    /// A replica only remembered from a state file, not heard since the restart, is left
    /// out: it is waited for (see [`QuorumEngine::restored`]), but it may be an old
    /// incarnation of a group whose live incarnation is remembered too, and telemetry takes
    /// the last incarnation it learns of as the group's own (and drops what the others
    /// send). Remembered together, at one instant, neither would be more recent than the
    /// other; heard, the live one is.
    pub fn heartbeat_ages(&self, now: Instant) -> Vec<(String, Duration)> {
        self.heartbeats
            .iter()
            .filter(|(_, rec)| rec.heard)
            .map(|(id, rec)| (id.clone(), now.saturating_duration_since(rec.last_seen)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::testkit::*;
    use super::super::*;
    use super::*;
    use Ev::*;

    /// A [`hang_engine`] whose groups a and b trained together at its start (their loops
    /// reporting fresh visits); a second later a asks for the next step. Returns it with its
    /// start.
    fn a_asks_again(hang_timeout: Duration) -> (QuorumEngine, Instant) {
        let (mut e, t0) = hang_engine(hang_timeout, None);
        quorum_of(&mut e, &["a", "b"], t0);
        e.join(member("a"), t0 + Duration::from_secs(1)).unwrap();
        (e, t0)
    }

    #[test]
    fn a_hung_group_is_not_waited_for_and_rejoins_when_its_loop_is_back() {
        let sec = Duration::from_secs(1);
        // b's process heartbeats but its loop stays away.
        let (mut e, t0) = a_asks_again(5 * sec);
        every_half_second(t0 + sec, t0 + 5 * sec, |t| {
            e.heartbeat_full("a", None, Some(Duration::ZERO), t)
                .unwrap();
            e.heartbeat_full("b", None, Some(t - t0), t).unwrap();
            assert!(e.tick(t).is_none(), "a strict majority of two needs b");
        });
        assert!(e.take_newly_hung().is_empty());
        // Past the hang timeout b is hung: a goes on alone, at once.
        let t = t0 + 5 * sec + Duration::from_millis(100);
        e.heartbeat_full("b", None, Some(t - t0), t).unwrap();
        let q2 = e.tick(t).expect("b is hung: a goes on without it");
        assert_eq!(ids(&q2), vec!["a"]);
        let hung = e.take_newly_hung();
        assert_eq!(hung.len(), 1);
        assert_eq!(hung[0].replica_id, "b");
        assert!(e.is_hung("b").is_some());
        // Whom a round would wait for: a (just answered), never the hung b.
        assert_eq!(e.healthy_not_asking(t, 8), vec!["a"]);
        let snap = e.snapshot(t);
        assert_eq!(snap.hung.len(), 1);
        assert_eq!(snap.hang_timeout.1, "configured");
        // Later rounds do not wait for it either.
        e.join(member("a"), t + sec).unwrap();
        assert!(e.tick(t + sec).is_some());
        // b's loop comes back: it asks, is no longer hung, and the next round has both.
        let back = t + 2 * sec;
        e.join(member("a"), back).unwrap();
        e.join(member("b"), back).unwrap();
        assert!(e.is_hung("b").is_none());
        assert_eq!(e.take_resumed(), vec!["b".to_string()]);
        let q3 = e.tick(back).expect("both ask");
        assert_eq!(ids(&q3), vec!["a", "b"]);
    }

    #[test]
    fn a_group_left_out_whose_loop_stays_away_is_hung_though_no_round_is_seen_open() {
        // Three groups; c's loop stops. The join timeout issues a and b without it, and from
        // then on their rounds complete as they ask (none open at a tick): c is still named
        // hung once its loop has been away past the timeout.
        let sec = Duration::from_secs(1);
        let t0 = Instant::now();
        let opts = crate::lighthouse::LighthouseOptions {
            hang_timeout: Some(5 * sec),
            join_timeout: sec,
            ..opts(1)
        };
        let mut e = QuorumEngine::new(opts, 1, t0);
        quorum_of(&mut e, &["a", "b", "c"], t0);
        e.heartbeat_full("c", None, Some(Duration::ZERO), t0)
            .unwrap();
        let mut without_c = 0;
        let t = every_half_second(t0 + sec, t0 + 7 * sec, |t| {
            e.heartbeat_full("a", None, Some(Duration::ZERO), t)
                .unwrap();
            e.heartbeat_full("b", None, Some(Duration::ZERO), t)
                .unwrap();
            e.heartbeat_full("c", None, Some(t - t0), t).unwrap();
            if without_c == 0 {
                // The first round waits for c, then the join timeout goes on without it.
                e.join(member("a"), t).unwrap();
                e.join(member("b"), t).unwrap();
                if let Some(q) = e.tick(t + Duration::from_millis(1_100)) {
                    assert_eq!(ids(&q), vec!["a", "b"]);
                    without_c += 1;
                }
                return;
            }
            e.join(member("a"), t).unwrap();
            assert!(e.poll(t).is_none(), "b has not asked yet");
            e.join(member("b"), t).unwrap();
            let q = e.poll(t).expect("both members of the last quorum ask");
            assert_eq!(ids(&q), vec!["a", "b"]);
            without_c += 1;
            assert!(e.tick(t).is_none(), "no round is open at the tick");
        });
        assert!(without_c > 3, "{without_c}");
        let hung = e.take_newly_hung();
        assert_eq!(hung.len(), 1, "{hung:?}");
        assert_eq!(hung[0].replica_id, "c");
        assert!(hung[0].idle > 5 * sec && t - t0 > hung[0].idle);
        // A member of the last quorum is not judged so: a and b never were.
        assert!(e.is_hung("a").is_none() && e.is_hung("b").is_none());
    }

    #[test]
    fn a_hung_group_that_dies_is_not_counted_hung_any_more() {
        let sec = Duration::from_secs(1);
        let (mut e, t0) = a_asks_again(2 * sec);
        let t = t0 + 3 * sec;
        e.heartbeat_full("b", None, Some(3 * sec), t).unwrap();
        assert!(e.tick(t).is_some(), "b is hung: a goes on");
        assert!(e.is_hung("b").is_some());
        // b's process dies (its session ends); its restart c and a train on: a round with
        // one of the two healthy groups asking waits (no strict majority), as before.
        e.lost("b", t);
        assert!(e.is_hung("b").is_none());
        e.heartbeat_full("c", None, Some(Duration::ZERO), t)
            .unwrap();
        e.join(member("a"), t + sec).unwrap();
        assert!(
            e.tick(t + sec).is_none(),
            "a alone of a and c is no majority"
        );
        e.join(member("c"), t + sec).unwrap();
        let q = e.tick(t + sec).expect("both ask");
        assert_eq!(ids(&q), vec!["a", "c"]);
    }

    #[test]
    fn a_hung_group_ahead_of_the_round_is_waited_for_not_held_hung() {
        let sec = Duration::from_secs(1);
        let (mut e, t0) = hang_engine(2 * sec, Some(20 * sec));
        // b holds step 9 and hangs; a restarted at step 0 asks.
        e.heartbeat_full("b", Some(9), Some(Duration::ZERO), t0)
            .unwrap();
        e.join(at("a", 0), t0).unwrap();
        let t = every_half_second(t0, t0 + 10 * sec, |t| {
            e.heartbeat_full("b", Some(9), Some(t - t0), t).unwrap();
            assert!(e.tick(t).is_none(), "a waits for b's newer state");
        });
        // Away far past the hang timeout, but never held hung: it holds the only step 9.
        assert!(e.take_newly_hung().is_empty());
        assert!(e.is_hung("b").is_none());
        // Its loop comes back: it asks, a heals from it.
        e.join(at("b", 9), t).unwrap();
        let q = e.tick(t).expect("both ask");
        assert_eq!(ids(&q), vec!["a", "b"]);
    }

    #[test]
    fn a_group_that_never_reached_its_loop_or_a_busy_one_is_never_hung() {
        let sec = Duration::from_secs(1);
        let (mut e, t0) = hang_engine(2 * sec, None);
        e.join(member("a"), t0).unwrap();
        // b heartbeats without a loop report (joining, or an upstream manager that never
        // asked), c reports its loop inside torchft (a heal in progress).
        let t = every_half_second(t0, t0 + 10 * sec, |t| {
            e.heartbeat_full("b", None, None, t).unwrap();
            e.heartbeat_full("c", None, Some(Duration::ZERO), t)
                .unwrap();
            assert!(e.tick(t).is_none());
        });
        assert!(e.take_newly_hung().is_empty());
        assert_eq!(e.healthy_not_asking(t, 8), vec!["b", "c"]);
    }

    #[test]
    fn heartbeat_expiry_drops_straggler_at_tick() {
        run(
            1,
            &[
                Heartbeat("c"),
                Join("a"),
                Join("b"),
                Nothing,
                Advance(5_001),
                Tick,
                Issued(&["a", "b"]),
            ],
        );
    }

    #[test]
    fn a_dropped_straggler_waits_out_its_drop_and_then_rejoins() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        let first = quorum_of(&mut e, &["a", "b"], t);
        let window = Duration::from_secs(10);
        assert!(e.drop_straggler("b", window, "slow".into(), t));
        assert!(!e.drop_straggler("b", window, "slow".into(), t), "once");
        assert!(!e.drop_straggler("zz", window, "unknown".into(), t));
        // b's request waits; a alone is a majority now (b is not counted as healthy).
        let jb = e.join(member("b"), t).unwrap();
        e.join(member("a"), t).unwrap();
        let q = e.poll(t).expect("a goes on without b");
        assert_eq!(ids(&q), vec!["a"]);
        assert_ne!(q.quorum_id, first.quorum_id);
        assert!(e.is_waiting("b", jb.generation));
        let (why, left) = e.dropped("b", t).unwrap();
        assert_eq!((why.as_str(), left), ("slow", window));
        assert_eq!(e.snapshot(t).dropped.len(), 1);
        // When the drop ends, b's waiting request joins the round and both go on.
        let later = t + window;
        e.heartbeat("a", later).unwrap();
        e.heartbeat("b", later).unwrap();
        e.join(member("a"), later).unwrap();
        let q = e.tick(later).expect("both again");
        assert_eq!(ids(&q), vec!["a", "b"]);
        assert!(e.dropped("b", later).is_none());
    }

    #[test]
    fn a_dropped_stragglers_request_can_be_withdrawn_and_its_death_ends_the_drop() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        quorum_of(&mut e, &["a", "b"], t);
        // Dropped while asking: the request is parked, not lost.
        let jb = e.join(member("b"), t).unwrap();
        assert!(e.drop_straggler("b", Duration::from_secs(10), "slow".into(), t));
        assert!(e.is_waiting("b", jb.generation));
        assert!(e.leave("b", jb.generation));
        assert!(!e.is_waiting("b", jb.generation));
        e.join(member("b"), t).unwrap();
        e.lost("b", t);
        assert!(e.dropped("b", t).is_none());
        assert!(e.snapshot(t).dropped.is_empty());
    }

    #[test]
    fn lost_member_is_excluded_without_waiting_for_its_heartbeat() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        let q1 = quorum_of(&mut e, &["a", "b"], t);
        assert!(e.take_lost().is_empty());
        // "a" asks again; "b" is still healthy, so the round waits for it.
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        // "b" dies: reported once, and the round is ready at once (no heartbeat timeout).
        assert!(e.lost("b", t));
        assert_eq!(
            e.take_lost(),
            vec![LostMember {
                replica_id: "b".into(),
                quorum_id: q1.quorum_id
            }]
        );
        assert!(!e.lost("b", t), "a loss is reported once");
        assert!(e.take_lost().is_empty());
        let q2 = e.poll(t).expect("ready once the lost member is gone");
        assert_eq!(ids(&q2), ["a"]);
        assert!(q2.quorum_id > q1.quorum_id);
        assert_eq!(e.num_heartbeat_records(), 1);
    }

    #[test]
    fn a_heartbeat_sent_before_the_session_ended_does_not_revive_the_group() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, t);
        let timeout = e.options().heartbeat_timeout;
        quorum_of(&mut e, &["a", "b"], t);
        e.session_opened("b", t).unwrap();
        e.join(member("a"), t).unwrap();
        assert!(e.lost("b", t));
        // b's last heartbeat was on the wire when its process died: it arrives after the end.
        let late = t + Duration::from_millis(5);
        e.heartbeat_with_step("b", Some(9), late).unwrap();
        assert_eq!(e.num_heartbeat_records(), 1, "b stays forgotten");
        assert_eq!(ids(&e.poll(late).expect("a goes on at once")), ["a"]);
        // A new session (a live manager whose connection broke reconnects) makes it count.
        e.session_opened("b", late).unwrap();
        e.join(member("a"), late).unwrap();
        assert!(e.poll(late).is_none(), "the round waits for b again");
        // So does a request, and the ignoring ends after one heartbeat timeout.
        for (id, how) in [("c", "request"), ("d", "timeout")] {
            e.heartbeat(id, late).unwrap();
            e.lost(id, late);
            e.heartbeat(id, late).unwrap();
            assert!(!e.healthy_not_asking(late, 10).contains(&id.to_string()));
            let then = match how {
                "request" => {
                    e.join(member(id), late).unwrap();
                    late
                }
                _ => late + timeout + Duration::from_millis(1),
            };
            e.heartbeat(id, then).unwrap();
            assert!(
                e.heartbeats.contains_key(id),
                "{id}: heartbeats count again after a {how}"
            );
        }
    }

    #[test]
    fn lost_withdraws_a_waiting_request_and_ignores_non_members() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        // Before any quorum nothing is reported, but the replica stops counting.
        e.heartbeat("x", t).unwrap();
        e.join(member("y"), t).unwrap();
        assert!(e.poll(t).is_none(), "waits for healthy x");
        assert!(!e.lost("x", t));
        assert!(e.take_lost().is_empty());
        assert_eq!(ids(&e.poll(t).unwrap()), ["y"]);
        // A waiting request of a lost replica leaves the round.
        e.join(member("z"), t).unwrap();
        assert_eq!(e.num_participants(), 1);
        e.lost("z", t);
        assert_eq!(e.num_participants(), 0);
        assert_eq!(e.verdict(t), Verdict::NoParticipants);
        // Unknown ids are harmless.
        assert!(!e.lost("nobody", t));
        assert!(e.take_lost().is_empty());
    }

    #[test]
    fn hung_member_is_declared_lost_at_heartbeat_expiry_only() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        let q1 = quorum_of(&mut e, &["a", "b"], t0);
        // Slow but heartbeating (every 100 ms for 20 s): never lost.
        let mut t = waits(&mut e, t0, 200, &["a", "b"]);
        assert!(e.take_lost().is_empty());
        // "b" hangs: nothing until heartbeat_timeout, then one loss of quorum q1.
        let hung_at = t;
        while t < hung_at + Duration::from_millis(4_900) {
            t += Duration::from_millis(100);
            e.heartbeat("a", t).unwrap();
            e.tick(t);
            assert!(
                e.take_lost().is_empty(),
                "declared lost too early at {:?}",
                t - hung_at
            );
        }
        t += Duration::from_millis(200);
        e.heartbeat("a", t).unwrap();
        e.tick(t);
        assert_eq!(
            e.take_lost(),
            vec![LostMember {
                replica_id: "b".into(),
                quorum_id: q1.quorum_id
            }]
        );
        t += Duration::from_millis(100);
        e.tick(t);
        assert!(e.take_lost().is_empty(), "reported once");
        // It comes back: the next quorum has it again and it can be lost again.
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        assert_eq!(ids(&e.poll(t).unwrap()), ["a", "b"]);
        assert!(e.lost("b", t));
        assert_eq!(e.take_lost().len(), 1);
    }

    #[test]
    fn heartbeat_records_pruned() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        for i in 0..50 {
            e.heartbeat(&format!("r{i}"), t).unwrap();
        }
        e.tick(t + Duration::from_secs(49));
        assert_eq!(e.num_heartbeat_records(), 50);
        e.tick(t + Duration::from_secs(51));
        assert_eq!(e.num_heartbeat_records(), 0);
    }

    #[test]
    fn waiting_participant_not_pruned() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        e.tick(t + Duration::from_secs(100));
        assert_eq!(e.num_heartbeat_records(), 1);
        assert_eq!(e.num_participants(), 1);
    }

    #[test]
    fn healthy_groups_not_asking_are_named_while_a_round_waits() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, t0);
        for id in ["c", "a", "b"] {
            e.heartbeat(id, t0).unwrap();
        }
        e.heartbeat("stale", t0 - Duration::from_secs(10)).unwrap();
        assert!(e.round_started().is_none());
        e.join(member("b"), t0).unwrap();
        assert!(e.poll(t0).is_none(), "1 of 4 healthy is no majority");
        assert_eq!(e.round_started(), Some(t0));
        assert_eq!(e.healthy_not_asking(t0, 8), ["a", "c"]);
        assert_eq!(e.healthy_not_asking(t0, 1), ["a"]);
        let s = e.snapshot(t0 + Duration::from_secs(3));
        assert_eq!(s.round_age, Some(Duration::from_secs(3)));
        assert_eq!(s.healthy_not_asking, ["a", "c"]);
    }

    #[test]
    fn heartbeat_step_and_session_inputs_are_validated() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 1, t);
        let err = e.heartbeat_with_step("a", Some(-1), t).unwrap_err();
        assert!(
            err.to_string().contains("step must not be negative"),
            "{err}"
        );
        assert!(e.heartbeat_with_step(" ", Some(1), t).is_err());
        assert!(e.session_opened("", t).is_err());
        assert_eq!(e.num_heartbeat_records(), 0);
        assert_eq!(e.best_known_step(), None);
        // A later, lower step does not lower what is known (steps only grow per incarnation).
        e.heartbeat_with_step("a", Some(9), t).unwrap();
        e.heartbeat_with_step("a", Some(4), t).unwrap();
        assert_eq!(e.best_known_step(), Some(9));
    }
}
