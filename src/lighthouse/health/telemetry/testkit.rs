//! Helpers of the health model's tests: incarnations, reports, a small job.

use std::time::{Duration, Instant};

use super::*;
use crate::proto::telemetry_report::Phase;
use crate::proto::TelemetryReport;
use crate::telemetry::{base_id, EventKind};

pub(super) const U1: &str = "11111111-1111-4111-8111-111111111111";
pub(super) const U2: &str = "22222222-2222-4222-8222-222222222222";

pub(super) fn inc(name: &str, u: &str) -> String {
    format!("{name}:{u}")
}

pub(super) fn report(inc: &str, step: i64, busy: f64) -> TelemetryReport {
    TelemetryReport {
        replica_id: base_id(inc).to_string(),
        incarnation: inc.to_string(),
        group_rank: 0,
        group_world_size: 1,
        rank: 0,
        hostname: "h".into(),
        pid: 7,
        step,
        quorum_id: 1,
        participants: 3,
        committed: true,
        step_s: busy + 0.01,
        busy_s: busy,
        quorum_wait_s: 0.01,
        unix_s: next_unix(),
        ..Default::default()
    }
}

/// A new, later report time for each report (the lighthouse ignores a step report not newer
/// than its rank's last one: a resent batch).
fn next_unix() -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    1.0 + N.fetch_add(1, Ordering::Relaxed) as f64 * 1e-3
}

pub(super) struct Job {
    pub(super) t: Telemetry,
    pub(super) now: Instant,
    pub(super) ids: Vec<String>,
}

impl Job {
    /// `n` groups in one quorum, each with one committed step.
    pub(super) fn new(n: usize) -> Self {
        let now = Instant::now();
        let mut t = Telemetry::new(TelemetryOptions::default(), now, 1000.0);
        let ids: Vec<String> = (0..n).map(|i| inc(&format!("g{i}"), U1)).collect();
        let addresses: Vec<String> = ids.iter().map(|id| format!("http://{id}")).collect();
        let members = ids
            .iter()
            .zip(&addresses)
            .map(|(id, a)| (id.as_str(), 0, a.as_str()));
        t.on_quorum(5, 1, members, now);
        let mut j = Self { t, now, ids };
        j.step_all(&[0.1; 16][..n]);
        j
    }

    pub(super) fn ages(&self) -> Vec<(String, Duration)> {
        self.ids
            .iter()
            .map(|id| (id.clone(), Duration::from_millis(50)))
            .collect()
    }

    pub(super) fn step_all(&mut self, busy: &[f64]) {
        self.step_with(busy, |_, _| {});
    }

    /// Like `step_all`, with `shape(group index, report)` filling in each report's phases.
    pub(super) fn step_with(&mut self, busy: &[f64], shape: impl Fn(usize, &mut TelemetryReport)) {
        self.now += Duration::from_millis(200);
        for (i, (id, b)) in self.ids.clone().iter().zip(busy).enumerate() {
            let step = self.t.groups[base_id(id)].step;
            let mut r = report(id, step, *b);
            shape(i, &mut r);
            self.t.on_report(&r, self.now);
        }
        let ages = self.ages();
        self.t.evaluate(self.now, &ages);
    }

    pub(super) fn state(&self, name: &str) -> GroupState {
        self.t.groups[name].state
    }

    pub(super) fn kinds(&mut self) -> Vec<(EventKind, String)> {
        self.t
            .take_events()
            .into_iter()
            .map(|e| {
                let id = e.fields.get("replica_id").and_then(|v| v.as_str());
                (e.kind, id.unwrap_or("").to_string())
            })
            .collect()
    }
}

pub(super) fn snapshot(inc: &str, step: i64) -> TelemetryReport {
    TelemetryReport {
        phase: Phase::Snapshot as i32,
        committed: false,
        step_s: 0.0,
        busy_s: 0.0,
        quorum_wait_s: 0.0,
        snapshot_path: format!("/ckpt/step_{step}"),
        snapshot_stage_s: 0.25,
        snapshot_write_s: 3.5,
        snapshot_bytes: 1 << 30,
        unix_s: 1000.0 + step as f64,
        ..report(inc, step, 0.0)
    }
}
