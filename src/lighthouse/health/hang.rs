//! Hung replica groups: a group whose training loop has stopped reaching its manager while
//! its process (and so its heartbeats) lives on.
//!
//! Heartbeats come from the manager server's own thread, so they prove that the process
//! lives, not that it trains. Managers that know say in each heartbeat how long ago their
//! training loop last reached them (a quorum request or a commit vote of the whole group);
//! a quorum request is such a visit too. A group counted as healthy and not asking, whose
//! loop has been away longer than the hang timeout while a round is open (the job waits on
//! it) or after a quorum without it was issued (the job went on without it; their rounds may
//! then complete as they ask, never seen open), is *hung*: the quorum rules
//! stop counting it as healthy (majority and join wait), so the others go on without it. It
//! is no longer hung as soon as its loop comes back (it asks, or its manager reports a
//! fresh visit); it then rejoins and heals like any late group, and the write-ahead commit
//! refuses the step it was in (its quorum was replaced).
//!
//! The hang timeout adapts to the job: [`HANG_MULTIPLE`] times the median interval between
//! recent quorum rounds (a step, or a sync of LocalSGD/DiLoCo), at least [`HANG_FLOOR`] and
//! at most [`HANG_CEILING`]; a fixed timeout replaces it when configured. Pure: the caller
//! supplies `now`.

use std::collections::{BTreeMap, VecDeque};

use crate::ids::IdMap;
use std::time::{Duration, Instant};

/// The adaptive hang timeout is this many times the job's recent round interval ...
pub const HANG_MULTIPLE: u32 = 10;
/// ... and never shorter than this (a job stepping in milliseconds resumes within it) ...
pub const HANG_FLOOR: Duration = Duration::from_secs(10);
/// ... nor longer than this (a job with ten-minute steps is never cut for a normal step).
pub const HANG_CEILING: Duration = Duration::from_secs(3600);
/// Round intervals kept for the median.
const SAMPLES: usize = 32;
/// Fewer round intervals than this (a fresh or restarted lighthouse) say nothing of the
/// job's pace: the adaptive timeout is then the ceiling, so a job with long steps is not cut
/// before its pace is known.
const MIN_SAMPLES: usize = 3;

/// A group found hung.
#[derive(Debug, Clone, PartialEq)]
pub struct Hung {
    /// The replica group.
    pub replica_id: String,
    /// How long its training loop had been away when it was found hung.
    pub idle: Duration,
    /// The hang timeout it passed.
    pub timeout: Duration,
    /// When it was found hung.
    pub since: Instant,
}

/// Tracks the training loops' visits, the job's pace and the groups found hung.
#[derive(Debug, Default)]
pub struct HangWatch {
    /// A configured hang timeout (None: adaptive).
    fixed: Option<Duration>,
    /// Recent intervals between issued rounds, oldest first.
    intervals: VecDeque<Duration>,
    last_round: Option<Instant>,
    /// When each group's training loop last reached its manager, as last reported.
    visited: IdMap<Instant>,
    /// Groups hung now, by id.
    hung: BTreeMap<String, Hung>,
    /// Groups found hung since the last [`HangWatch::take_newly_hung`].
    newly_hung: Vec<Hung>,
    /// Groups whose loop came back since the last [`HangWatch::take_resumed`].
    resumed: Vec<String>,
}

impl HangWatch {
    /// A watch with a fixed hang timeout, or the adaptive one (`None`).
    pub fn new(fixed: Option<Duration>) -> Self {
        Self {
            fixed,
            ..Self::default()
        }
    }

    /// A round was issued at `now`: its interval since the last one samples the job's pace.
    pub fn round_issued(&mut self, now: Instant) {
        if let Some(last) = self.last_round {
            if self.intervals.len() == SAMPLES {
                self.intervals.pop_front();
            }
            self.intervals
                .push_back(now.saturating_duration_since(last));
        }
        self.last_round = Some(now);
    }

    /// The median of the recent round intervals (None before `MIN_SAMPLES` of them).
    pub fn pace(&self) -> Option<Duration> {
        if self.intervals.len() < MIN_SAMPLES {
            return None;
        }
        let mut sorted: Vec<Duration> = self.intervals.iter().copied().collect();
        sorted.sort_unstable();
        Some(sorted[sorted.len() / 2])
    }

    /// The hang timeout now: the configured one, else [`HANG_MULTIPLE`] × the pace within
    /// [`HANG_FLOOR`] and [`HANG_CEILING`] (the ceiling before the pace is known).
    pub fn timeout(&self) -> Duration {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        self.pace()
            .map_or(HANG_CEILING, |p| p.saturating_mul(HANG_MULTIPLE))
            .clamp(HANG_FLOOR, HANG_CEILING)
    }

    /// How the timeout was chosen, for logs and status pages.
    pub fn timeout_rule(&self) -> String {
        match (self.fixed, self.pace()) {
            (Some(_), _) => "configured".to_string(),
            (None, Some(p)) => format!(
                "{HANG_MULTIPLE} x the recent round interval {:.3}s, within {}s..{}s",
                p.as_secs_f64(),
                HANG_FLOOR.as_secs(),
                HANG_CEILING.as_secs()
            ),
            (None, None) => format!(
                "the ceiling {}s until {MIN_SAMPLES} round intervals show the job's pace",
                HANG_CEILING.as_secs()
            ),
        }
    }

    /// `replica_id`'s manager reports (at `now`) that its training loop last reached it
    /// `idle` ago. A visit newer than the hang ends it.
    pub fn visited(&mut self, replica_id: &str, idle: Duration, now: Instant) {
        let at = now.checked_sub(idle).unwrap_or(now);
        self.mark_visit(replica_id, at);
        if self.hung.get(replica_id).is_some_and(|h| at > h.since) {
            self.resume(replica_id);
        }
    }

    /// `replica_id` asked for a quorum at `now`: its loop is back.
    pub fn asked(&mut self, replica_id: &str, now: Instant) {
        self.mark_visit(replica_id, now);
        if self.hung.contains_key(replica_id) {
            self.resume(replica_id);
        }
    }

    /// Moves `replica_id`'s last visit forward to `at`. Looked up before inserting: no
    /// allocation for a group already known (this runs on every request and heartbeat).
    fn mark_visit(&mut self, replica_id: &str, at: Instant) {
        match self.visited.get_mut(replica_id) {
            Some(slot) => {
                if at > *slot {
                    *slot = at;
                }
            }
            None => {
                self.visited.insert(replica_id.to_string(), at);
            }
        }
    }

    fn resume(&mut self, replica_id: &str) {
        // Checked first: the lighthouse's tick calls this for every healthy group, and
        // removing from a map hashes the id even when the map is empty.
        if !self.hung.is_empty() && self.hung.remove(replica_id).is_some() {
            self.resumed.push(replica_id.to_string());
        }
    }

    /// Forgets a group the engine no longer keeps a record of.
    pub fn forget(&mut self, replica_id: &str) {
        self.visited.remove(replica_id);
        self.hung.remove(replica_id);
    }

    /// Whether `replica_id` is hung as of `now`, judged for a group that is counted as
    /// healthy and not asking: away longer than the timeout, and either hung already or the
    /// job waits on it or went on without it: a round is open (someone waits on it), or a
    /// quorum it is not a member of (`left_out`) was issued after its loop's last visit.
    /// Updates the hung set; call for every such group once per check (see
    /// [`HangWatch::clear`] for the others).
    pub fn judge(
        &mut self,
        replica_id: &str,
        round_open: bool,
        left_out: bool,
        now: Instant,
    ) -> bool {
        let Some(at) = self.visited.get(replica_id).copied() else {
            return false; // its loop never reached the manager yet: joining, not hung
        };
        let idle = now.saturating_duration_since(at);
        let timeout = self.timeout();
        if idle <= timeout {
            self.resume(replica_id);
            return false;
        }
        if self.hung.contains_key(replica_id) {
            return true;
        }
        // Rounds of the others that complete at once are rarely seen open by a periodic
        // check; a quorum issued without it since its last visit says the same.
        let went_on_without = left_out && self.last_round.is_some_and(|r| r > at);
        if !round_open && !went_on_without {
            return false;
        }
        let h = Hung {
            replica_id: replica_id.to_string(),
            idle,
            timeout,
            since: now,
        };
        self.hung.insert(replica_id.to_string(), h.clone());
        self.newly_hung.push(h);
        true
    }

    /// `replica_id` is asking or no longer counted as healthy: not hung (a lost group is
    /// handled by the death rules).
    pub fn clear(&mut self, replica_id: &str) {
        if !self.hung.is_empty() {
            self.hung.remove(replica_id);
        }
    }

    /// Number of groups hung now.
    pub fn count(&self) -> usize {
        self.hung.len()
    }

    /// Whether `replica_id` is hung now.
    pub fn is_hung(&self, replica_id: &str) -> bool {
        self.hung.contains_key(replica_id)
    }

    /// `replica_id`'s hang, if it is hung now.
    pub fn get(&self, replica_id: &str) -> Option<&Hung> {
        self.hung.get(replica_id)
    }

    /// The groups hung now, by id.
    pub fn hung(&self) -> impl Iterator<Item = &Hung> {
        self.hung.values()
    }

    /// The groups found hung since the last call.
    pub fn take_newly_hung(&mut self) -> Vec<Hung> {
        std::mem::take(&mut self.newly_hung)
    }

    /// The groups whose loop came back since the last call.
    pub fn take_resumed(&mut self) -> Vec<String> {
        std::mem::take(&mut self.resumed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn timeout_follows_the_pace_within_floor_and_ceiling() {
        let t0 = Instant::now();
        let mut w = HangWatch::new(None);
        // Pace unknown (a fresh or restarted lighthouse): nobody is cut before it is known.
        assert_eq!(w.timeout(), HANG_CEILING);
        w.round_issued(t0);
        w.round_issued(t0 + 50 * MS);
        w.round_issued(t0 + 100 * MS);
        assert_eq!(w.pace(), None);
        assert_eq!(w.timeout(), HANG_CEILING);
        // Fast steps: the floor.
        for i in 3..10 {
            w.round_issued(t0 + 50 * MS * i);
        }
        assert_eq!(w.pace(), Some(50 * MS));
        assert_eq!(w.timeout(), HANG_FLOOR);
        // Ten-minute steps: ten times that is above the ceiling, so the ceiling, and a
        // normal step (600 s) stays far below it.
        let mut slow = HangWatch::new(None);
        for i in 0..5 {
            slow.round_issued(t0 + Duration::from_secs(600) * i);
        }
        assert_eq!(slow.timeout(), HANG_CEILING);
        // Two-second steps: ten times the median; one long outlier (a hang itself) does not
        // move the median.
        let mut mid = HangWatch::new(None);
        let mut t = t0;
        for _ in 0..9 {
            mid.round_issued(t);
            t += Duration::from_secs(2);
        }
        t += Duration::from_secs(60);
        mid.round_issued(t);
        assert_eq!(mid.timeout(), Duration::from_secs(20));
        // A configured timeout wins.
        let fixed = HangWatch::new(Some(Duration::from_secs(3)));
        assert_eq!(fixed.timeout(), Duration::from_secs(3));
        assert_eq!(fixed.timeout_rule(), "configured");
    }

    #[test]
    fn a_group_is_hung_only_past_the_timeout_while_a_round_waits_and_resumes_on_a_visit() {
        let t0 = Instant::now();
        let mut w = HangWatch::new(Some(Duration::from_secs(5)));
        // Never visited: joining, never hung.
        assert!(!w.judge("new", true, false, t0 + Duration::from_secs(100)));
        w.visited("g", Duration::ZERO, t0);
        assert!(!w.judge("g", true, false, t0 + Duration::from_secs(4)));
        // Away past the timeout, but nobody waits: not hung.
        assert!(!w.judge("g", false, false, t0 + Duration::from_secs(6)));
        // A round is open: hung, reported once.
        assert!(w.judge("g", true, false, t0 + Duration::from_secs(7)));
        assert!(w.judge("g", false, false, t0 + Duration::from_secs(8)));
        let newly = w.take_newly_hung();
        assert_eq!(newly.len(), 1);
        assert_eq!(newly[0].replica_id, "g");
        assert!(newly[0].idle > Duration::from_secs(5));
        assert!(w.take_newly_hung().is_empty());
        assert_eq!(w.count(), 1);
        // A heartbeat reporting the same old visit does not end it ...
        w.visited("g", Duration::from_secs(9), t0 + Duration::from_secs(9));
        assert!(w.is_hung("g"));
        // ... a fresh one does.
        w.visited("g", Duration::from_millis(10), t0 + Duration::from_secs(10));
        assert!(!w.is_hung("g"));
        assert_eq!(w.take_resumed(), vec!["g".to_string()]);
        // Hung again later, then it asks: resumed at once.
        assert!(w.judge("g", true, false, t0 + Duration::from_secs(20)));
        w.asked("g", t0 + Duration::from_secs(21));
        assert!(!w.is_hung("g"));
        assert!(!w.judge("g", true, false, t0 + Duration::from_secs(22)));
        // Forgotten groups leave nothing behind.
        w.forget("g");
        assert!(!w.judge("g", true, false, t0 + Duration::from_secs(100)));
    }

    #[test]
    fn a_group_left_out_of_a_quorum_issued_after_its_last_visit_is_hung_with_no_round_open() {
        let t0 = Instant::now();
        let mut w = HangWatch::new(Some(Duration::from_secs(5)));
        w.visited("g", Duration::ZERO, t0);
        // A quorum issued before its last visit (the one it was in) says nothing.
        w.round_issued(t0 - Duration::from_millis(1));
        assert!(!w.judge("g", false, true, t0 + Duration::from_secs(6)));
        // The others went on without it (a quorum issued later, which it is not in), and
        // their rounds complete at once: no round is seen open, yet it is hung.
        w.round_issued(t0 + Duration::from_secs(1));
        assert!(!w.judge("g", false, true, t0 + Duration::from_secs(4)));
        assert!(
            !w.judge("g", false, false, t0 + Duration::from_secs(7)),
            "still a member"
        );
        assert!(w.judge("g", false, true, t0 + Duration::from_secs(7)));
        assert_eq!(w.take_newly_hung().len(), 1);
    }
}
