//! The latest complete durable snapshot the lighthouse heard of: recorded from the ranks'
//! reports, announced, kept in the state file and restored from it.

use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use super::{round3, round6, SnapshotStatus, Telemetry};
use crate::proto::telemetry_report::Phase;
use crate::proto::TelemetryReport;
use crate::telemetry::{base_id, EventKind, MAX_ID_BYTES, MAX_PATH_BYTES};

/// The latest complete durable snapshot the lighthouse heard of: what a restore after the
/// loss of every replica group would start from. Kept in the state file (`--state_file`), so
/// a restarted lighthouse still knows it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct SnapshotRecord {
    /// The committed step the snapshot holds.
    pub step: i64,
    /// The replica group (its stable name) that wrote it.
    pub replica_id: String,
    /// The writer's lighthouse id (`name:uuid`) when it reported.
    #[serde(default)]
    pub incarnation: String,
    /// The snapshot's directory.
    #[serde(default)]
    pub path: String,
    /// Bytes of tensor data the whole group wrote.
    #[serde(default)]
    pub bytes: u64,
    /// Seconds the training thread was blocked staging the copy.
    #[serde(default)]
    pub stage_s: f64,
    /// Seconds the background write took.
    #[serde(default)]
    pub write_s: f64,
    /// The quorum the writer was in.
    #[serde(default)]
    pub quorum_id: i64,
    /// Unix time (seconds) it completed, as the writer's report says (the lighthouse's
    /// receipt time when the report carried none).
    #[serde(default)]
    pub unix_s: f64,
}

impl SnapshotRecord {
    pub(super) fn from_report(r: &TelemetryReport, unix_now: f64) -> Self {
        Self {
            step: r.step,
            replica_id: base_id(&r.replica_id).to_string(),
            incarnation: r.incarnation.clone(),
            path: r.snapshot_path.clone(),
            bytes: r.snapshot_bytes,
            stage_s: round6(r.snapshot_stage_s),
            write_s: round6(r.snapshot_write_s),
            quorum_id: r.quorum_id,
            unix_s: if r.unix_s > 0.0 { r.unix_s } else { unix_now },
        }
    }

    /// Why a record read back from a state file is unusable (None when it is fine): the
    /// bounds a report must meet, so a damaged file cannot show what no report could.
    pub fn problem(&self) -> Option<String> {
        let seconds_ok = |v: f64| v.is_finite() && v >= 0.0;
        if self.step < 0 {
            return Some(format!("negative step {}", self.step));
        }
        if self.replica_id.trim().is_empty() || self.replica_id.len() > MAX_ID_BYTES {
            return Some("replica_id empty or too long".into());
        }
        if self.incarnation.len() > 2 * MAX_ID_BYTES || self.path.len() > MAX_PATH_BYTES {
            return Some("incarnation or path too long".into());
        }
        if !(seconds_ok(self.stage_s) && seconds_ok(self.write_s) && seconds_ok(self.unix_s)) {
            return Some("negative or non-finite seconds".into());
        }
        None
    }
}

impl Telemetry {
    /// The latest complete durable snapshot, if any.
    pub fn snapshot(&self) -> Option<&SnapshotRecord> {
        self.snapshot.as_ref()
    }

    /// The latest snapshot with its age at `now`, as `/status` shows it.
    pub fn snapshot_status(&self, now: Instant) -> Option<SnapshotStatus> {
        let unix_now = self.unix(now);
        self.snapshot.as_ref().map(|s| SnapshotStatus {
            record: s.clone(),
            age_s: round3((unix_now - s.unix_s).max(0.0)),
        })
    }

    /// Changes whenever [`Telemetry::snapshot`] does (a cheap check before saving it).
    pub fn snapshot_revision(&self) -> u64 {
        self.snapshot_revision
    }

    /// Takes the latest snapshot a previous life of the lighthouse recorded (from the state
    /// file): shown as it was, without an event or a count, and not a change to save.
    pub fn restore_snapshot(&mut self, record: SnapshotRecord) {
        self.snapshot = Some(record);
    }

    /// A snapshot report (`SNAPSHOT` or `SNAPSHOT_FAILED`): counted and announced; a
    /// complete one newer than the recorded one becomes the latest. Not a step: nothing of
    /// the group's timings, commits or state is touched. Taken even from an incarnation
    /// that has since been replaced, since the snapshot on disk outlives its writer.
    pub(super) fn on_snapshot(&mut self, r: &TelemetryReport, phase: Phase, now: Instant) {
        match phase {
            Phase::Snapshot => {
                self.counters.snapshots += 1;
                let record = SnapshotRecord::from_report(r, self.unix(now));
                let latest = self.snapshot.as_ref().is_none_or(|s| record.step > s.step);
                self.emit(
                    now,
                    EventKind::SnapshotComplete,
                    json!({"replica_id": record.replica_id, "incarnation": record.incarnation,
                           "step": record.step, "path": record.path, "bytes": record.bytes,
                           "stage_s": record.stage_s, "write_s": record.write_s,
                           "quorum_id": record.quorum_id, "unix_s": record.unix_s,
                           "latest": latest}),
                );
                if latest {
                    self.snapshot = Some(record);
                    self.snapshot_revision += 1;
                }
            }
            Phase::SnapshotFailed => {
                self.counters.snapshot_failures += 1;
                let error = if r.error.is_empty() {
                    "snapshot failed".to_string()
                } else {
                    r.error.clone()
                };
                self.emit(
                    now,
                    EventKind::SnapshotFailed,
                    json!({"replica_id": base_id(&r.replica_id), "step": r.step,
                           "error": error, "path": r.snapshot_path}),
                );
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_newer_snapshot_is_recorded_an_older_one_only_announced() {
        let mut j = Job::new(2);
        j.kinds();
        assert!(j.t.snapshot().is_none());
        j.t.on_report(&snapshot(&j.ids[0], 10), j.now);
        let rec = j.t.snapshot().cloned().expect("recorded");
        assert_eq!(
            rec,
            SnapshotRecord {
                step: 10,
                replica_id: "g0".into(),
                incarnation: j.ids[0].clone(),
                path: "/ckpt/step_10".into(),
                bytes: 1 << 30,
                stage_s: 0.25,
                write_s: 3.5,
                quorum_id: 1,
                unix_s: 1010.0,
            }
        );
        let rev = j.t.snapshot_revision();
        // An older one (g1 was slower to write) and one of the same step: announced and
        // counted, not recorded.
        j.t.on_report(&snapshot(&j.ids[1], 5), j.now);
        j.t.on_report(&snapshot(&j.ids[1], 10), j.now);
        assert_eq!(j.t.snapshot(), Some(&rec));
        assert_eq!(j.t.snapshot_revision(), rev, "nothing new to save");
        // A newer one from the other group replaces it.
        j.t.on_report(&snapshot(&j.ids[1], 20), j.now);
        assert_eq!(
            j.t.snapshot().map(|s| (s.step, s.replica_id.as_str())),
            Some((20, "g1"))
        );
        assert!(j.t.snapshot_revision() > rev);
        assert_eq!(j.t.counters().snapshots, 4);
        let events: Vec<(EventKind, i64, bool)> =
            j.t.take_events()
                .into_iter()
                .map(|e| {
                    (
                        e.kind,
                        e.fields["step"].as_i64().unwrap(),
                        e.fields["latest"] == true,
                    )
                })
                .collect();
        let k = EventKind::SnapshotComplete;
        assert_eq!(
            events,
            [(k, 10, true), (k, 5, false), (k, 10, false), (k, 20, true)]
        );
        // /status shows it with its age (the lighthouse's clock started at unix 1000).
        let status = j.t.snapshot_status(j.now).unwrap();
        assert_eq!(status.record.step, 20);
        let age = j.now.duration_since(j.t.epoch.0).as_secs_f64() + 1000.0 - 1020.0;
        assert!(
            (status.age_s - age.max(0.0)).abs() < 1e-3,
            "{}",
            status.age_s
        );
    }

    #[test]
    fn a_failed_snapshot_is_counted_and_announced_not_recorded() {
        let mut j = Job::new(1);
        j.kinds();
        let mut r = snapshot(&j.ids[0], 7);
        r.phase = Phase::SnapshotFailed as i32;
        r.error = "disk full".into();
        j.t.on_report(&r, j.now);
        assert!(j.t.snapshot().is_none());
        assert_eq!(j.t.counters().snapshot_failures, 1);
        assert_eq!(j.t.counters().snapshots, 0);
        let events = j.t.take_events();
        assert_eq!(events.len(), 1, "{events:?}");
        let e = &events[0];
        assert_eq!(e.kind, EventKind::SnapshotFailed);
        assert_eq!(e.fields["replica_id"], "g0");
        assert_eq!(e.fields["step"], 7);
        assert_eq!(e.fields["error"], "disk full");
        assert_eq!(e.fields["path"], "/ckpt/step_7");
    }

    #[test]
    fn a_snapshot_report_is_not_a_step() {
        let mut j = Job::new(3);
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        j.kinds();
        let before = j.t.replicas(j.now);
        let g0 = &j.t.groups["g0"];
        let samples = g0.samples.len();
        let rate = g0.rate.len();
        let step = g0.step;
        // Reports of every kind of snapshot, by two ranks, with slow "timings" a step report
        // would take as a straggler's, and committed=false that a step would count a failure.
        for phase in [Phase::Snapshot, Phase::SnapshotFailed] {
            for _ in 0..WINDOW {
                let mut r = snapshot(&j.ids[0], step - 1);
                r.phase = phase as i32;
                r.busy_s = 5.0;
                r.step_s = 5.0;
                j.t.on_report(&r, j.now);
            }
        }
        j.step_all(&[0.1, 0.1, 0.1]);
        let g0 = &j.t.groups["g0"];
        assert_eq!(g0.step, step + 1, "only the step report moved the step");
        assert_eq!(g0.samples.len(), samples.min(WINDOW));
        assert!(
            g0.samples.iter().all(|s| s.busy_s < 1.0),
            "no snapshot sample"
        );
        assert_eq!(g0.rate.len(), (rate + 1).min(RATE_POINTS));
        let after = j.t.replicas(j.now);
        for (b, a) in before.iter().zip(&after) {
            assert_eq!(a.state, GroupState::Healthy, "{}", a.replica_id);
            assert!(!a.straggler);
            assert_eq!(a.counters.steps_committed, b.counters.steps_committed + 1);
            assert_eq!(a.counters.commit_failures, b.counters.commit_failures);
            assert_eq!(a.last_commit, Some(true));
        }
        let kinds: HashSet<EventKind> = j.kinds().into_iter().map(|(k, _)| k).collect();
        let want: HashSet<EventKind> = [EventKind::SnapshotComplete, EventKind::SnapshotFailed]
            .into_iter()
            .collect();
        assert_eq!(
            kinds, want,
            "no state change, commit failure or straggler verdict"
        );
    }

    #[test]
    fn a_replaced_incarnations_snapshot_still_counts_and_regressions_name_it() {
        let mut j = Job::new(2);
        let old = j.ids[1].clone();
        j.t.on_session(&inc("g1", U2), true, j.now);
        // The old process's report arrives after its restart: the snapshot is on disk.
        j.t.on_report(&snapshot(&old, 30), j.now);
        assert_eq!(j.t.snapshot().map(|s| s.step), Some(30));
        j.kinds();
        let r = crate::lighthouse::health::Regression {
            from_step: 40,
            to_step: 30,
            quorum_id: 9,
            alive_holders: Vec::new(),
            fresh: false,
        };
        j.t.on_progress_regressed(&r, j.now);
        let e = j.t.take_events().remove(0);
        assert_eq!(e.kind, EventKind::ProgressRegressed);
        assert_eq!(e.fields["snapshot_step"], 30);
        // (from_step, to_step, a member asked at step 0) -> (resumes_from, steps_lost). Fresh
        // processes (after a total loss) ask at step 0 and restore the snapshot first: the
        // job goes on from step 30, not 0. Live groups behind the snapshot restore it too
        // when it is at least two steps ahead of them (one step ahead gains nothing: the
        // step that loads it does not commit), while a fresh member takes it one step ahead.
        // A quorum past the snapshot goes on from its own step. A snapshot past the best step
        // known (lowered by an earlier regression) loses nothing.
        let cases = [
            ((40, 30, false), (30, 10)),
            ((40, 0, true), (30, 10)),
            ((40, 20, false), (30, 10)),
            ((40, 28, false), (30, 10)),
            ((40, 29, false), (29, 11)),
            ((40, 29, true), (30, 10)),
            ((40, 35, true), (35, 5)),
            ((25, 0, true), (30, 0)),
        ];
        for ((from_step, to_step, fresh), (resumes_from, lost)) in cases {
            let r = crate::lighthouse::health::Regression {
                from_step,
                to_step,
                fresh,
                ..r.clone()
            };
            j.t.on_progress_regressed(&r, j.now);
            let e = j.t.take_events().remove(0);
            let case = format!("from {from_step} to {to_step}, fresh {fresh}");
            assert_eq!(e.fields["resumes_from"], resumes_from, "{case}");
            assert_eq!(e.fields["steps_lost"], lost, "{case}");
            let detail = super::super::report::timeline_detail("progress_regressed", &e.fields);
            let said = format!("resuming from the snapshot of step {resumes_from}");
            assert_eq!(detail.contains(&said), resumes_from != to_step, "{detail}");
        }
        // A restored record (from the state file) is shown, not announced or re-saved.
        let mut fresh = Telemetry::new(TelemetryOptions::default(), j.now, 0.0);
        fresh.on_progress_regressed(&r, j.now);
        assert!(fresh.take_events()[0].fields["snapshot_step"].is_null());
        fresh.restore_snapshot(j.t.snapshot().cloned().unwrap());
        assert_eq!(fresh.snapshot_revision(), 0);
        assert!(fresh.take_events().is_empty());
        assert_eq!(
            fresh.snapshot_status(j.now).unwrap().age_s,
            0.0,
            "clock behind"
        );
    }

    #[test]
    fn damaged_snapshot_records_are_found() {
        let good = SnapshotRecord::from_report(&snapshot("a", 3), 0.0);
        assert_eq!(good.problem(), None);
        type Breaker = fn(&mut SnapshotRecord);
        let cases: [Breaker; 6] = [
            |s| s.step = -1,
            |s| s.replica_id.clear(),
            |s| s.path = "p".repeat(MAX_PATH_BYTES + 1),
            |s| s.write_s = -1.0,
            |s| s.stage_s = f64::NAN,
            |s| s.unix_s = f64::INFINITY,
        ];
        for (i, break_it) in cases.iter().enumerate() {
            let mut s = good.clone();
            break_it(&mut s);
            assert!(s.problem().is_some(), "case {i} accepted");
        }
    }
}
