//! Goodput: how much of the job's wall time trained the model, and where the rest went.
//!
//! Accounted per replica group (its stable name, across incarnations) from the steps its
//! group rank 0 reports, in unix seconds:
//!
//! - the window opens at the job's first committed step (the first accepted write-ahead
//!   commit, or the first committed report for managers that announce none); a group's wall
//!   time runs from the window's start to its clean finish (or now): a group that starts
//!   late counts the time before it as recovery (the job's capacity was not training);
//! - a committed step is `productive` (its time less its quorum wait, which is `quorum`), or
//!   `heal` when the group healed in it (all of it); a step that did not commit is
//!   `discarded` (its quorum wait is `quorum`);
//! - only the part of a step inside the window counts (its quorum wait is its first part; a
//!   step that ended before the window opened, reported late, is not accounted);
//! - the first step of each incarnation is start-up (its time counts before the step was
//!   known to be one), so it falls in `recovery`, with everything the group's steps do not
//!   cover: restarts, joining, time lost or hung;
//! - a committed step the group commits again later was lost (the job's progress went
//!   back, e.g. to a durable snapshot after every group died): its productive time moves to
//!   `regressed`;
//! - reports lost with a process that was killed are made up from the group's write-ahead
//!   commit announcements: the time since the previous one (or since the end of a later
//!   reported step that did not commit), less the step's quorum wait (quorum: the one the
//!   announcement carried, else the median of the incarnation's last reported steps), is
//!   productive; a step that is not the one after the last step accounted (the group healed
//!   in between) is `heal`.
//!
//! `wall = productive + quorum + discarded + heal + recovery + regressed`; the goodput
//! ratio is `productive / wall`. Bounded: a group keeps its last [`RECENT`] committed steps
//! (for regressions) and [`ANNOUNCED`] unreported commit announcements.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::ids::IdMap;
use crate::proto::TelemetryReport;

/// Committed steps a group remembers, for the time a regression takes back.
pub const RECENT: usize = 1024;
/// Unreported commit announcements kept per incarnation.
pub const ANNOUNCED: usize = 256;
/// Reported quorum waits a group keeps for the estimate of made-up steps.
const WAITS: usize = 8;
/// Committed steps a state file keeps per group.
const RECENT_SAVED: usize = 64;

/// A group's time accounts (seconds, cumulative over the window).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Accounts {
    /// Committed steps, less their quorum wait.
    pub productive_s: f64,
    /// Waiting for the quorum in steps that did not heal.
    pub quorum_s: f64,
    /// Steps that did not commit, less their quorum wait.
    pub discarded_s: f64,
    /// Committed steps in which the group healed.
    pub heal_s: f64,
    /// Productive time of committed steps the job's progress later lost.
    pub regressed_s: f64,
    /// How many such steps.
    pub regressed_steps: u64,
    /// Committed steps accounted (healing ones included).
    pub steps_committed: u64,
}

impl Accounts {
    fn explained(&self) -> f64 {
        self.productive_s + self.quorum_s + self.discarded_s + self.heal_s + self.regressed_s
    }

    fn add(&mut self, o: &Accounts) {
        self.productive_s += o.productive_s;
        self.quorum_s += o.quorum_s;
        self.discarded_s += o.discarded_s;
        self.heal_s += o.heal_s;
        self.regressed_s += o.regressed_s;
        self.regressed_steps += o.regressed_steps;
        self.steps_committed += o.steps_committed;
    }

    fn valid(&self) -> bool {
        [
            self.productive_s,
            self.quorum_s,
            self.discarded_s,
            self.heal_s,
            self.regressed_s,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// Where a group's step time went, summed over its reported steps (seconds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseSums {
    pub input_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub optimizer_s: f64,
    pub collective_s: f64,
    pub quorum_wait_s: f64,
    pub should_commit_s: f64,
}

impl PhaseSums {
    fn add(&mut self, r: &TelemetryReport) {
        self.input_s += r.input_s;
        self.forward_s += r.forward_s;
        self.backward_s += r.backward_s;
        self.optimizer_s += r.optimizer_s;
        self.collective_s += r.collective_s;
        self.quorum_wait_s += r.quorum_wait_s;
        self.should_commit_s += r.should_commit_s;
    }
}

/// An accepted commit announcement not yet matched by a report: the step, when (unix
/// seconds), and group rank 0's quorum wait in it when the announcement said (kept in the
/// state file as `[step, at]` or `[step, at, wait]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(from = "MarkRepr", into = "MarkRepr")]
struct Mark {
    step: i64,
    at: f64,
    wait: Option<f64>,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum MarkRepr {
    Timed(i64, f64),
    Waited(i64, f64, f64),
}

impl From<MarkRepr> for Mark {
    fn from(r: MarkRepr) -> Self {
        match r {
            MarkRepr::Timed(step, at) => Mark {
                step,
                at,
                wait: None,
            },
            MarkRepr::Waited(step, at, wait) => Mark {
                step,
                at,
                wait: Some(wait),
            },
        }
    }
}

impl From<Mark> for MarkRepr {
    fn from(m: Mark) -> Self {
        match m.wait {
            None => MarkRepr::Timed(m.step, m.at),
            Some(w) => MarkRepr::Waited(m.step, m.at, w),
        }
    }
}

/// The current incarnation's marks (kept in the state file with the accounts: the commits
/// a process announced before it and the lighthouse were killed together are still made
/// up after the restart).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
struct Life {
    incarnation: String,
    /// Step reports of group rank 0 seen.
    steps: u64,
    /// Accepted commit announcements not yet matched by a report: (step, unix time).
    announced: VecDeque<Mark>,
    /// When the last accounted commit was announced.
    last_at: Option<f64>,
    /// The step of that commit (None: not known, e.g. from an older state file).
    last_step: Option<i64>,
    /// Steps up to this one were made up from announcements (their late reports are
    /// ignored).
    filled_upto: i64,
    /// The quorum waits of its last reported committed steps (the estimate for the steps
    /// made up from announcements).
    waits: VecDeque<f64>,
    /// The send time (the rank's unix seconds) of the last step report counted: a report
    /// sent again (its acknowledgement was lost) is not counted twice.
    reported_unix: f64,
}

/// One group's goodput.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GroupGoodput {
    /// When the group was first seen (unix seconds).
    pub first_seen: f64,
    /// When it finished cleanly (None while it runs).
    pub finished_at: Option<f64>,
    pub accounts: Accounts,
    pub phases: PhaseSums,
    /// Its last committed steps and their productive time.
    #[serde(default)]
    recent: VecDeque<(i64, f64)>,
    /// The highest step in `recent` (None: not known yet, e.g. after a restore).
    #[serde(skip)]
    high: Option<i64>,
    #[serde(default)]
    life: Life,
}

impl GroupGoodput {
    fn life(&mut self, incarnation: &str) -> &mut Life {
        if self.life.incarnation != incarnation {
            self.fill_in();
            self.life = Life {
                incarnation: incarnation.to_string(),
                filled_upto: -1,
                ..Life::default()
            };
        }
        &mut self.life
    }

    fn committed(&mut self, step: i64, productive: f64) {
        let recent = &self.recent;
        let high = *self
            .high
            .get_or_insert_with(|| recent.iter().map(|e| e.0).max().unwrap_or(-1));
        self.high = Some(high.max(step));
        if step <= high {
            // The group commits a step again: its earlier commits of it were lost (the job's
            // progress went back, e.g. to a durable snapshot after a total loss).
            let (mut lost, mut n) = (0.0, 0);
            self.recent.retain(|(s, p)| {
                let again = *s == step;
                if again {
                    lost += p;
                    n += 1;
                }
                !again
            });
            self.accounts.productive_s = (self.accounts.productive_s - lost).max(0.0);
            self.accounts.regressed_s += lost;
            self.accounts.regressed_steps += n;
        }
        self.accounts.productive_s += productive;
        self.accounts.steps_committed += 1;
        self.recent.push_back((step, productive));
        while self.recent.len() > RECENT {
            self.recent.pop_front();
        }
    }

    /// Accounts the announced commits no report will come for (their process is gone): the
    /// time between two announcements, its quorum wait estimated by the median of the
    /// incarnation's last reported steps.
    fn fill_in(&mut self) {
        let announced = std::mem::take(&mut self.life.announced);
        let wait = if self.life.waits.is_empty() {
            0.0
        } else {
            let mut w: Vec<f64> = self.life.waits.iter().copied().collect();
            w.sort_by(f64::total_cmp);
            w[w.len() / 2]
        };
        for Mark {
            step,
            at,
            wait: told,
        } in announced
        {
            if let Some(prev) = self.life.last_at {
                let span = (at - prev).max(0.0);
                if self.life.last_step.is_some_and(|last| step != last + 1) {
                    // Not the step after the last one accounted: the group healed in
                    // between (it jumped), and the span may hold steps that did not commit
                    // and time it was stopped: none of it is known to be productive.
                    self.accounts.heal_s += span;
                    self.accounts.steps_committed += 1;
                } else {
                    let w = told.unwrap_or(wait).min(span);
                    self.accounts.quorum_s += w;
                    self.committed(step, span - w);
                }
            }
            self.life.last_at = Some(at);
            self.life.last_step = Some(step);
            self.life.filled_upto = self.life.filled_upto.max(step);
        }
    }

    /// A copy as the state file keeps it: only the last [`RECENT_SAVED`] committed steps.
    fn for_saving(&self) -> GroupGoodput {
        let mut g = self.clone();
        let skip = g.recent.len().saturating_sub(RECENT_SAVED);
        g.recent.drain(..skip);
        g
    }

    fn wall(&self, start: f64, now: f64) -> f64 {
        (self.finished_at.unwrap_or(now) - start).max(0.0)
    }
}

/// The parts of a step of `step_s` seconds that ended at `end` (unix seconds) which fall
/// at or after the window's `start`: its quorum wait (the step's first `wait` seconds) and
/// the rest.
fn in_window(step_s: f64, wait: f64, end: f64, start: f64) -> (f64, f64) {
    let inside = (end - start).clamp(0.0, step_s);
    let work = (step_s - wait).min(inside);
    (inside - work, work)
}

/// The job's goodput accounts.
#[derive(Debug, Default)]
pub struct Goodput {
    /// The job's first committed step (unix seconds): the window's start.
    start: Option<f64>,
    groups: IdMap<GroupGoodput>,
    /// Bumped on every change (the state file is rewritten then).
    revision: u64,
    /// Groups changed since their last encoding for the state file.
    dirty: HashSet<String>,
    /// Each group's last encoding for the state file (`[name, accounts]`), by name: a write
    /// re-encodes only the groups that changed since the previous one.
    encoded: BTreeMap<String, Arc<RawValue>>,
}

/// The goodput accounts as a state file keeps them, already encoded (the shape of
/// [`SavedGoodput`]).
#[derive(Debug, Default)]
pub struct EncodedGoodput {
    start: Option<f64>,
    groups: Vec<Arc<RawValue>>,
}

impl Serialize for EncodedGoodput {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let groups: Vec<&RawValue> = self.groups.iter().map(|g| &**g).collect();
        let mut out = s.serialize_struct("SavedGoodput", 2)?;
        out.serialize_field("start", &self.start)?;
        out.serialize_field("groups", &groups)?;
        out.end()
    }
}

/// What a state file keeps of the goodput accounts.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SavedGoodput {
    pub start: Option<f64>,
    pub groups: Vec<(String, GroupGoodput)>,
}

/// The figures of one group or of the job.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    pub wall_s: f64,
    pub recovery_s: f64,
    pub accounts: Accounts,
}

impl Figures {
    /// `productive / wall`, None while the wall time is 0.
    pub fn ratio(&self) -> Option<f64> {
        (self.wall_s > 0.0).then(|| (self.accounts.productive_s / self.wall_s).clamp(0.0, 1.0))
    }

    /// The figures as JSON fields (seconds rounded to the millisecond).
    pub fn to_json(&self) -> serde_json::Map<String, Value> {
        let a = &self.accounts;
        let r = super::round3;
        let v = json!({
            "wall_s": r(self.wall_s), "productive_s": r(a.productive_s),
            "quorum_s": r(a.quorum_s), "discarded_s": r(a.discarded_s), "heal_s": r(a.heal_s),
            "recovery_s": r(self.recovery_s), "regressed_s": r(a.regressed_s),
            "regressed_steps": a.regressed_steps, "steps_committed": a.steps_committed,
            "ratio": self.ratio().map(super::round6),
        });
        match v {
            Value::Object(m) => m,
            _ => unreachable!("a JSON object"),
        }
    }
}

impl Goodput {
    /// Changes so far (for the state file).
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The window's start (unix seconds), None before the job's first committed step.
    pub fn start(&self) -> Option<f64> {
        self.start
    }

    /// A group was seen for the first time (or again).
    pub fn seen(&mut self, name: &str, unix: f64) {
        if !self.groups.contains_key(name) {
            self.groups.insert(
                name.to_string(),
                GroupGoodput {
                    first_seen: unix,
                    ..GroupGoodput::default()
                },
            );
            self.revision += 1;
            self.dirty.insert(name.to_string());
        }
    }

    /// Forgets a group (the telemetry forgot it).
    pub fn forget(&mut self, name: &str) {
        if self.groups.remove(name).is_some() {
            self.revision += 1;
            self.dirty.remove(name);
            self.encoded.remove(name);
        }
    }

    /// The group `name` (created if new), marked changed.
    fn group(&mut self, name: &str, unix: f64) -> &mut GroupGoodput {
        self.seen(name, unix);
        if !self.dirty.contains(name) {
            self.dirty.insert(name.to_string());
        }
        self.groups.get_mut(name).expect("inserted above")
    }

    /// An accepted write-ahead commit of `step` by `incarnation` of group `name`, with group
    /// rank 0's quorum wait in the step when the announcement said.
    pub fn on_commit(
        &mut self,
        name: &str,
        incarnation: &str,
        step: i64,
        unix: f64,
        wait: Option<f64>,
    ) {
        self.start.get_or_insert(unix);
        // Saved with the commit itself: an announcement must survive a lighthouse killed
        // together with the group that made it.
        self.revision += 1;
        let g = self.group(name, unix);
        g.finished_at = None;
        let life = g.life(incarnation);
        if step <= life.filled_upto || life.announced.back().is_some_and(|m| m.step >= step) {
            // Made up already, or announced again (a group repeats an announcement it got
            // no answer to): one step, one mark.
            return;
        }
        life.announced.push_back(Mark {
            step,
            at: unix,
            wait,
        });
        while life.announced.len() > ANNOUNCED {
            // Reports stopped coming for this long: the oldest is only a mark now.
            if let Some(Mark { step, at, .. }) = life.announced.pop_front() {
                life.last_at = Some(at);
                life.last_step = Some(step);
            }
        }
    }

    /// A step report of group rank 0 (`unix`: when the lighthouse got it).
    pub fn on_step(&mut self, name: &str, r: &TelemetryReport, unix: f64) {
        if r.committed {
            let at = if r.unix_s > 0.0 { r.unix_s } else { unix };
            self.start.get_or_insert(at);
        }
        let incarnation = if r.incarnation.is_empty() {
            name
        } else {
            &r.incarnation
        };
        self.revision += 1;
        let window = self.start;
        let g = self.group(name, unix);
        let life = g.life(incarnation);
        if r.unix_s > 0.0 {
            // A rank stamps its reports in order: one no newer than the last counted is a
            // copy (a batch sent again after its acknowledgement was lost).
            if r.unix_s <= life.reported_unix {
                return;
            }
            life.reported_unix = r.unix_s;
        }
        g.finished_at = None;
        let done = r.step + 1;
        let life = &mut g.life;
        if r.committed && done <= life.filled_upto {
            return;
        }
        life.steps += 1;
        let first = life.steps == 1;
        while let Some(&Mark { step, at, .. }) = life.announced.front() {
            if step > done {
                break;
            }
            life.announced.pop_front();
            if step == done {
                life.last_at = Some(at);
                life.last_step = Some(step);
            }
        }
        if !r.committed {
            // A step made up later from an announcement spans from the end of this one, not
            // from the commit before it: the time between is this step's, accounted here.
            let end = if r.unix_s > 0.0 { r.unix_s } else { unix };
            life.last_at = Some(life.last_at.map_or(end, |at| at.max(end)));
        }
        if first {
            // Start-up: recovery.
            return;
        }
        let step_s = r.step_s.max(0.0);
        let wait = r.quorum_wait_s.clamp(0.0, step_s);
        // Only the part of the step inside the window counts (a step that began before the
        // window opened, e.g. one that waited out a lighthouse restart, is no wall time; one
        // that ended before it, reported late, is not accounted at all).
        let (wait_in, work_in) = match window {
            Some(start) if r.unix_s > 0.0 => {
                if r.unix_s < start {
                    return;
                }
                in_window(step_s, wait, r.unix_s, start)
            }
            _ => (wait, step_s - wait),
        };
        g.phases.add(r);
        if r.healed {
            g.accounts.heal_s += wait_in + work_in;
            if r.committed {
                g.accounts.steps_committed += 1;
            }
        } else if r.committed {
            g.accounts.quorum_s += wait_in;
            g.committed(done, work_in);
            g.life.waits.push_back(wait);
            while g.life.waits.len() > WAITS {
                g.life.waits.pop_front();
            }
        } else {
            g.accounts.quorum_s += wait_in;
            g.accounts.discarded_s += work_in;
        }
    }

    /// The group finished cleanly.
    pub fn finished(&mut self, name: &str, unix: f64) {
        let g = self.group(name, unix);
        g.finished_at = Some(unix);
        self.revision += 1;
    }

    /// The incarnation's process is gone (its session ended without a clean finish): the
    /// commits it announced but never reported are accounted now.
    pub fn ended(&mut self, name: &str, incarnation: &str) {
        if let Some(g) = self.groups.get_mut(name) {
            if g.life.incarnation == incarnation && !g.life.announced.is_empty() {
                g.fill_in();
                self.revision += 1;
                self.dirty.insert(name.to_string());
            }
        }
    }

    /// One group's figures at `now` (None before the window opened or for an unknown
    /// group).
    pub fn group_figures(&self, name: &str, now: f64) -> Option<Figures> {
        let start = self.start?;
        let g = self.groups.get(name)?;
        let wall = g.wall(start, now);
        Some(Figures {
            wall_s: wall,
            recovery_s: (wall - g.accounts.explained()).max(0.0),
            accounts: g.accounts.clone(),
        })
    }

    /// The phase sums of a group.
    pub fn phases(&self, name: &str) -> Option<&PhaseSums> {
        self.groups.get(name).map(|g| &g.phases)
    }

    /// The job's figures (sums over its groups) at `now`.
    pub fn job_figures(&self, now: f64) -> Option<Figures> {
        self.start?;
        let mut job = Figures::default();
        for name in self.groups.keys() {
            if let Some(f) = self.group_figures(name, now) {
                job.wall_s += f.wall_s;
                job.recovery_s += f.recovery_s;
                job.accounts.add(&f.accounts);
            }
        }
        Some(job)
    }

    /// What the state file keeps (each group's last [`RECENT_SAVED`] committed steps).
    #[cfg(test)]
    pub fn saved(&self) -> SavedGoodput {
        let mut groups: Vec<(String, GroupGoodput)> = self
            .groups
            .iter()
            .map(|(k, g)| (k.clone(), g.for_saving()))
            .collect();
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        SavedGoodput {
            start: self.start,
            groups,
        }
    }

    /// [`Goodput::saved`], encoded: only the groups changed since the previous call are
    /// encoded again (O(changed groups) encoding, O(groups) pointer copies).
    pub fn encode_saved(&mut self) -> serde_json::Result<EncodedGoodput> {
        for name in std::mem::take(&mut self.dirty) {
            let Some(g) = self.groups.get(&name) else {
                self.encoded.remove(&name);
                continue;
            };
            match serde_json::value::to_raw_value(&(&name, g.for_saving())) {
                Ok(raw) => {
                    self.encoded.insert(name, Arc::from(raw));
                }
                Err(e) => {
                    self.dirty.insert(name);
                    return Err(e);
                }
            }
        }
        Ok(EncodedGoodput {
            start: self.start,
            groups: self.encoded.values().cloned().collect(),
        })
    }

    /// Continues from what a state file kept; a damaged entry is dropped alone.
    pub fn restore(&mut self, saved: SavedGoodput) -> Vec<String> {
        let mut problems = Vec::new();
        self.start = saved.start.filter(|s| s.is_finite() && *s > 0.0);
        for (name, g) in saved.groups {
            let ok = g.accounts.valid()
                && g.first_seen.is_finite()
                && g.finished_at.is_none_or(f64::is_finite)
                && name.len() <= crate::telemetry::MAX_ID_BYTES
                && g.recent.iter().all(|(_, p)| p.is_finite() && *p >= 0.0)
                && g.life.announced.len() <= ANNOUNCED
                && g.life
                    .announced
                    .iter()
                    .all(|m| m.at.is_finite() && m.wait.is_none_or(|w| w.is_finite() && w >= 0.0))
                && g.life.last_at.is_none_or(f64::is_finite);
            if ok {
                self.dirty.insert(name.clone());
                self.groups.insert(name, g);
            } else {
                problems.push(name);
            }
        }
        self.revision += 1;
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(inc: &str, step: i64, committed: bool, step_s: f64, wait: f64) -> TelemetryReport {
        TelemetryReport {
            replica_id: "g".into(),
            incarnation: inc.into(),
            step,
            committed,
            step_s,
            quorum_wait_s: wait,
            forward_s: 0.01,
            ..TelemetryReport::default()
        }
    }

    /// `r` as sent at `unix_s` (the rank's clock: when its step ended).
    fn stamped(mut r: TelemetryReport, unix_s: f64) -> TelemetryReport {
        r.unix_s = unix_s;
        r
    }

    /// A group whose incarnation `g:1` announced and reported steps `0..n`, one a second
    /// from 10 s.
    fn reported(n: i64) -> Goodput {
        let mut g = Goodput::default();
        for s in 0..n {
            g.on_commit("g", "g:1", s + 1, 10.0 + s as f64, Some(0.0));
            g.on_step("g", &step("g:1", s, true, 1.0, 0.0), 10.0 + s as f64);
        }
        g
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn steps_are_split_into_productive_quorum_discarded_heal_and_recovery() {
        let mut g = Goodput::default();
        g.seen("g", 100.0);
        g.on_commit("g", "g:1", 1, 100.5, None);
        g.on_step("g", &step("g:1", 0, true, 5.0, 1.0), 100.5); // start-up
        g.on_step("g", &step("g:1", 1, true, 1.0, 0.25), 101.5);
        g.on_step("g", &step("g:1", 2, false, 1.0, 0.5), 102.5);
        let mut healed = step("g:1", 2, true, 2.0, 1.5);
        healed.healed = true;
        g.on_step("g", &healed, 104.5);
        let f = g.group_figures("g", 110.5).unwrap();
        assert!(close(f.wall_s, 10.0), "{f:?}");
        assert!(close(f.accounts.productive_s, 0.75));
        assert!(close(f.accounts.quorum_s, 0.75));
        assert!(close(f.accounts.discarded_s, 0.5));
        assert!(close(f.accounts.heal_s, 2.0));
        assert!(close(f.recovery_s, 10.0 - 4.0));
        assert_eq!(f.accounts.steps_committed, 2);
        assert!(close(f.ratio().unwrap(), 0.075));
        assert!(close(g.phases("g").unwrap().forward_s, 0.03));
    }

    #[test]
    fn commits_announced_by_a_killed_process_are_made_up_from_the_announcements() {
        let mut g = Goodput::default();
        g.on_commit("g", "g:1", 1, 10.0, None);
        g.on_step("g", &step("g:1", 0, true, 1.0, 0.0), 10.0);
        g.on_commit("g", "g:1", 2, 11.0, None);
        g.on_step("g", &step("g:1", 1, true, 1.0, 0.25), 11.0);
        // Two more commits whose reports died with the process.
        g.on_commit("g", "g:1", 3, 12.0, None);
        g.on_commit("g", "g:1", 4, 13.5, None);
        g.ended("g", "g:1");
        let f = g.group_figures("g", 20.0).unwrap();
        // Their quorum wait is estimated by the last reported step's (0.25 s).
        assert!(close(f.accounts.productive_s, 0.75 + 0.75 + 1.25), "{f:?}");
        assert!(close(f.accounts.quorum_s, 0.25 * 3.0), "{f:?}");
        assert_eq!(f.accounts.steps_committed, 3);
        // A late report of a made-up step is not counted twice.
        g.on_step("g", &step("g:1", 3, true, 1.5, 0.0), 20.0);
        assert!(close(
            g.group_figures("g", 20.0).unwrap().accounts.productive_s,
            2.75
        ));
    }

    #[test]
    fn an_announcement_repeated_adds_no_step() {
        let feed = |repeat: bool| {
            let mut g = Goodput::default();
            g.on_commit("g", "g:1", 1, 10.0, None);
            g.on_step("g", &step("g:1", 0, true, 1.0, 0.0), 10.0);
            g.on_commit("g", "g:1", 2, 11.0, None);
            if repeat {
                // Sent again on a new connection after a try that got no answer.
                g.on_commit("g", "g:1", 2, 21.0, None);
            }
            g.on_commit("g", "g:1", 3, 22.0, None);
            g.ended("g", "g:1");
            g.group_figures("g", 30.0).unwrap().accounts
        };
        let (once, twice) = (feed(false), feed(true));
        assert_eq!(twice.steps_committed, once.steps_committed);
        assert!(
            close(twice.productive_s, once.productive_s),
            "{twice:?} {once:?}"
        );
        assert!(close(twice.quorum_s, once.quorum_s), "{twice:?} {once:?}");
    }

    #[test]
    fn a_made_up_step_takes_the_quorum_wait_its_announcement_told() {
        let mut g = Goodput::default();
        g.on_commit("g", "g:1", 1, 10.0, Some(0.5));
        g.on_step("g", &step("g:1", 0, true, 1.0, 0.5), 10.0);
        g.on_commit("g", "g:1", 2, 11.0, Some(0.25));
        g.on_step("g", &step("g:1", 1, true, 1.0, 0.25), 11.0);
        // Lost with the process: one told its wait, one (an older manager) did not.
        g.on_commit("g", "g:1", 3, 12.0, Some(0.625));
        g.on_commit("g", "g:1", 4, 13.5, None);
        // Saved and restored on the way (the lighthouse died with the process), in the
        // state file's shape; a mark without a wait (an older file) reads back too.
        let text = serde_json::to_string(&g.encode_saved().unwrap()).unwrap();
        assert!(
            text.contains("[3,12.0,0.625]") && text.contains("[4,13.5]"),
            "{text}"
        );
        let mut h = Goodput::default();
        assert!(h.restore(serde_json::from_str(&text).unwrap()).is_empty());
        h.ended("g", "g:1");
        let f = h.group_figures("g", 20.0).unwrap();
        assert!(close(f.accounts.productive_s, 0.75 + 0.375 + 1.25), "{f:?}");
        assert!(close(f.accounts.quorum_s, 0.25 + 0.625 + 0.25), "{f:?}");
    }

    #[test]
    fn a_made_up_step_after_a_jump_is_not_productive() {
        // Reported up to step 4; then stopped for 5 s, a step that did not commit, a heal
        // to step 5 and the commit of step 6, and killed before any of it was reported.
        let mut g = reported(4);
        let before = g.group_figures("g", 30.0).unwrap().accounts;
        g.on_commit("g", "g:1", 6, 18.5, Some(0.0));
        g.on_commit("g", "g:1", 7, 19.0, Some(0.0));
        g.ended("g", "g:1");
        let f = g.group_figures("g", 30.0).unwrap();
        // Step 6's span (5.5 s) is the heal's; step 7 follows it and is productive.
        assert!(close(f.accounts.heal_s - before.heal_s, 5.5), "{f:?}");
        assert!(
            close(f.accounts.productive_s - before.productive_s, 0.5),
            "{f:?}"
        );
        assert_eq!(f.accounts.steps_committed, before.steps_committed + 2);
    }

    #[test]
    fn a_made_up_step_spans_from_the_last_reported_step_that_did_not_commit() {
        // Reported up to step 3; then stalled 9.4 s in a step that did not commit, another
        // that did not, the commit of step 4, and killed before its report was sent.
        let mut g = reported(3);
        let before = g.group_figures("g", 30.0).unwrap().accounts;
        g.on_step("g", &step("g:1", 3, false, 9.4, 0.0), 21.4);
        g.on_step("g", &stamped(step("g:1", 3, false, 0.4, 0.0), 21.8), 22.3);
        g.on_commit("g", "g:1", 4, 22.0, Some(0.0));
        g.ended("g", "g:1");
        let f = g.group_figures("g", 30.0).unwrap();
        // The discarded steps are counted once, as discarded; the made-up step is the time
        // since the last of them ended (as its rank stamped it), not since step 3's commit.
        assert!(
            close(f.accounts.discarded_s - before.discarded_s, 9.8),
            "{f:?}"
        );
        assert!(
            close(f.accounts.productive_s - before.productive_s, 0.2),
            "{f:?}"
        );
        assert_eq!(f.accounts.steps_committed, before.steps_committed + 1);
    }

    #[test]
    fn only_the_part_of_a_step_inside_the_window_counts() {
        // A lighthouse that lost its state opens the window at the first commit it sees;
        // the steps that were under way then began before it.
        let mut g = Goodput::default();
        g.on_step("g", &stamped(step("g:1", 0, false, 1.0, 0.0), 96.0), 96.0); // start-up
        g.on_commit("g", "g:1", 2, 100.0, None);
        // 98.5 to 99.5, before the window (its report came late): nothing.
        g.on_step("g", &stamped(step("g:1", 0, true, 1.0, 0.0), 99.5), 100.2);
        // 99.5 to 101, its first 1 s the quorum wait: 0.5 s of wait and 0.5 s of work count.
        g.on_step("g", &stamped(step("g:1", 1, true, 1.5, 1.0), 101.0), 101.0);
        // 101 to 102, discarded; 102 to 104, healed: inside, whole.
        g.on_step(
            "g",
            &stamped(step("g:1", 2, false, 1.0, 0.25), 102.0),
            102.0,
        );
        let mut healed = stamped(step("g:1", 2, true, 2.0, 1.0), 104.0);
        healed.healed = true;
        g.on_step("g", &healed, 104.0);
        let f = g.group_figures("g", 105.0).unwrap();
        assert!(close(f.wall_s, 5.0), "{f:?}");
        assert!(close(f.accounts.productive_s, 0.5), "{f:?}");
        assert!(close(f.accounts.quorum_s, 0.75), "{f:?}");
        assert!(close(f.accounts.discarded_s, 0.75), "{f:?}");
        assert!(close(f.accounts.heal_s, 2.0), "{f:?}");
        assert_eq!(f.accounts.steps_committed, 2);
        assert!(f.accounts.explained() <= f.wall_s);
        assert_eq!(in_window(4.0, 1.0, 110.0, 100.0), (1.0, 3.0));
        assert_eq!(in_window(4.0, 1.0, 102.0, 100.0), (0.0, 2.0));
        assert_eq!(in_window(4.0, 1.0, 103.5, 100.0), (0.5, 3.0));
    }

    #[test]
    fn a_step_committed_again_was_lost_to_a_regression() {
        let mut g = Goodput::default();
        g.on_commit("g", "g:1", 1, 1.0, None);
        for s in 0..10 {
            g.on_step("g", &step("g:1", s, true, 1.0, 0.0), 1.0 + s as f64);
        }
        // Every process died; the next one resumed from a snapshot of step 6.
        g.on_step("g", &step("g:2", 5, true, 9.0, 0.0), 20.0); // start-up: recovery
        for s in 6..12 {
            g.on_step("g", &step("g:2", s, true, 0.5, 0.0), 21.0 + s as f64);
        }
        let f = g.group_figures("g", 40.0).unwrap();
        assert_eq!(
            f.accounts.regressed_steps, 4,
            "steps 7 to 10 committed again"
        );
        assert!(close(f.accounts.regressed_s, 4.0));
        assert!(close(f.accounts.productive_s, 9.0 - 4.0 + 3.0), "{f:?}");
    }

    #[test]
    fn announcements_kept_in_the_state_file_are_made_up_after_a_restart() {
        let mut g = Goodput::default();
        g.on_commit("g", "g:1", 1, 10.0, None);
        g.on_step("g", &step("g:1", 0, true, 1.0, 0.0), 10.0);
        g.on_commit("g", "g:1", 2, 11.0, None);
        g.on_commit("g", "g:1", 3, 12.5, None);
        // The process and the lighthouse die together; the state file kept the commits.
        let text = serde_json::to_string(&g.encode_saved().unwrap()).unwrap_or_default();
        let mut h = Goodput::default();
        h.restore(serde_json::from_str(&text).unwrap_or_default());
        h.on_step("g", &step("g:2", 3, true, 5.0, 0.0), 30.0);
        let f = h.group_figures("g", 30.0).unwrap();
        assert!(close(f.accounts.productive_s, 1.0 + 1.5), "{f:?}");
        assert_eq!(f.accounts.steps_committed, 2);
    }

    #[test]
    fn a_report_sent_again_is_counted_once_even_across_a_restart() {
        let sent = |s: i64, at: f64| TelemetryReport {
            unix_s: at,
            ..step("g:1", s, true, 1.0, 0.25)
        };
        let mut g = Goodput::default();
        for s in 0..3 {
            g.on_commit("g", "g:1", s + 1, 10.0 + s as f64, None);
            g.on_step("g", &sent(s, 10.0 + s as f64), 10.0 + s as f64);
        }
        // The batch of steps 1 and 2 comes again (its acknowledgement was lost): no change,
        // and in particular no step taken for one committed again (a regression).
        let before = g.group_figures("g", 13.0).unwrap();
        g.on_step("g", &sent(1, 11.0), 13.0);
        g.on_step("g", &sent(2, 12.0), 13.0);
        assert_eq!(g.group_figures("g", 13.0).unwrap(), before);
        assert_eq!(before.accounts.steps_committed, 2);
        // The same after the lighthouse restarted from its state file.
        let text = serde_json::to_string(&g.encode_saved().unwrap()).unwrap_or_default();
        let mut h = Goodput::default();
        h.restore(serde_json::from_str(&text).unwrap_or_default());
        h.on_step("g", &sent(2, 12.0), 14.0);
        h.on_commit("g", "g:1", 4, 13.0, None);
        h.on_step("g", &sent(3, 13.0), 14.0);
        let f = h.group_figures("g", 14.0).unwrap();
        assert_eq!(
            (f.accounts.steps_committed, f.accounts.regressed_steps),
            (3, 0)
        );
        assert!(close(f.accounts.productive_s, 3.0 * 0.75), "{f:?}");
    }

    #[test]
    fn the_window_opens_at_the_first_commit_and_a_finished_group_stops_its_clock() {
        let mut g = Goodput::default();
        g.seen("a", 0.0);
        g.seen("b", 8.0);
        assert!(g.job_figures(5.0).is_none());
        g.on_commit("a", "a:1", 1, 5.0, None);
        g.finished("a", 9.0);
        let job = g.job_figures(10.0).unwrap();
        assert!(close(job.wall_s, 4.0 + 5.0), "{job:?}");
    }

    #[test]
    fn saved_accounts_survive_a_restart_and_damaged_ones_are_dropped() {
        let mut g = Goodput::default();
        g.on_commit("g", "g:1", 1, 1.0, None);
        g.on_step("g", &step("g:1", 0, true, 1.0, 0.0), 1.0);
        g.on_step("g", &step("g:1", 1, true, 1.0, 0.0), 2.0);
        let mut saved = g.saved();
        let mut bad = saved.groups[0].clone();
        bad.0 = "bad".into();
        bad.1.accounts.productive_s = f64::NAN;
        saved.groups.push(bad);
        let text = serde_json::to_string(&SavedGoodput {
            start: saved.start,
            groups: saved.groups.clone(),
        })
        .unwrap_or_default();
        let back: SavedGoodput = serde_json::from_str(&text).unwrap_or(saved);
        let mut h = Goodput::default();
        let problems = h.restore(back);
        assert_eq!(problems, ["bad"]);
        assert_eq!(h.group_figures("g", 3.0), g.group_figures("g", 3.0));
        h.on_step("g", &step("g:2", 0, true, 1.0, 0.0), 4.0);
        h.on_step("g", &step("g:2", 1, true, 1.0, 0.0), 5.0);
        assert_eq!(
            h.group_figures("g", 5.0).unwrap().accounts.regressed_steps,
            1,
            "the saved steps still tell a step committed again"
        );
    }

    #[test]
    fn the_state_file_encoding_is_incremental_and_matches_a_full_one() {
        let mut g = Goodput::default();
        g.on_commit("a", "a:1", 1, 1.0, None);
        g.on_step("a", &step("a:1", 0, true, 1.0, 0.0), 1.0);
        g.seen("b", 1.5);
        let full = |g: &Goodput| serde_json::to_string(&g.saved()).unwrap();
        let first = serde_json::to_string(&g.encode_saved().unwrap()).unwrap();
        assert_eq!(first, full(&g));
        // Every announcement changes what is saved (it must survive the lighthouse).
        let before = g.revision();
        g.on_commit("b", "b:1", 1, 2.0, None);
        assert!(g.revision() > before);
        assert_eq!(g.dirty.len(), 1);
        let second = serde_json::to_string(&g.encode_saved().unwrap()).unwrap();
        assert_eq!(second, full(&g));
        assert_ne!(second, first);
        g.forget("a");
        g.ended("b", "b:1");
        let third = serde_json::to_string(&g.encode_saved().unwrap()).unwrap();
        assert_eq!(third, full(&g));
        let back: SavedGoodput = serde_json::from_str(&third).unwrap();
        assert_eq!(back.groups.len(), 1);
        assert!(g.dirty.is_empty());
    }
}
