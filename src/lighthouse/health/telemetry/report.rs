//! The job's verdicts over time: the goodput accounts and their events, the history a late
//! dashboard draws from, and the end-of-run report (`summary.json`, `summary.html`).

use std::time::Instant;

use serde_json::{json, Map, Value};

use super::group::Lifecycle;
use super::history::Point;
use super::{round3, round6, Event, Figures, Telemetry, FINAL_GROUPS, PERIODIC_GROUPS, TIMELINE};
use crate::telemetry::{base_id, EventKind};

/// Event kinds the end-of-run report's timeline shows.
const TIMELINE_KINDS: [EventKind; 12] = [
    EventKind::StateChanged,
    EventKind::QuorumChanged,
    EventKind::ProgressRegressed,
    EventKind::ReplicaLost,
    EventKind::ReplicaFailed,
    EventKind::ReplicaHung,
    EventKind::ReplicaDiverged,
    EventKind::StragglerFlagged,
    EventKind::StragglerDropped,
    EventKind::SnapshotComplete,
    EventKind::SnapshotFailed,
    EventKind::LighthouseStarted,
];

/// The end-of-run report's template (shared with `python -m torchft.eventlog --html`).
const SUMMARY_TEMPLATE: &str = include_str!("../../../../python/torchft/summary.html");
/// Where the template takes the report's JSON.
const PLACEHOLDER: &str = "__TORCHFT_SUMMARY_JSON__";

/// A timeline entry's short text (the same rule as `torchft.eventlog`).
pub fn timeline_detail(kind: &str, f: &Map<String, Value>) -> String {
    let s = |k: &str| match f.get(k) {
        Some(Value::String(v)) => v.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    match kind {
        "state_changed" => {
            let reason = s("reason");
            if reason.is_empty() {
                format!("{} -> {}", s("from"), s("to"))
            } else {
                format!("{} -> {}: {reason}", s("from"), s("to"))
            }
        }
        "quorum_changed" => {
            let n = f
                .get("participants")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            format!("quorum {}: {n} participants", s("quorum_id"))
        }
        "progress_regressed" => {
            let (to, from_snapshot) = (s("to_step"), s("resumes_from"));
            let resumed = if from_snapshot.is_empty() || from_snapshot == to {
                String::new()
            } else {
                format!(", resuming from the snapshot of step {from_snapshot}")
            };
            format!(
                "step {} -> {to}{resumed} ({} steps lost)",
                s("from_step"),
                s("steps_lost")
            )
        }
        "snapshot_complete" | "snapshot_failed" => {
            let error = s("error");
            if error.is_empty() {
                format!("step {}", s("step"))
            } else {
                format!("step {}: {error}", s("step"))
            }
        }
        "straggler_flagged" => s("cause"),
        "replica_diverged" => format!("step {}: {}", s("step"), s("action")),
        _ => {
            for k in ["reason", "error", "rule"] {
                let v = s(k);
                if !v.is_empty() {
                    return v;
                }
            }
            String::new()
        }
    }
}

/// Cuts `text` to at most `limit` characters.
fn short(text: String, limit: usize) -> String {
    if text.chars().count() <= limit {
        text
    } else {
        text.chars().take(limit).collect()
    }
}

/// The report's JSON inside the template's `<script type="application/json">`: every
/// character that could end the element or confuse a parser is escaped.
pub fn render_html(summary: &Value) -> String {
    let mut data = String::new();
    for c in summary.to_string().chars() {
        match c {
            '<' => data.push_str("\\u003c"),
            '>' => data.push_str("\\u003e"),
            '&' => data.push_str("\\u0026"),
            '\u{2028}' => data.push_str("\\u2028"),
            '\u{2029}' => data.push_str("\\u2029"),
            c => data.push(c),
        }
    }
    SUMMARY_TEMPLATE.replacen(PLACEHOLDER, &data, 1)
}

impl Telemetry {
    /// An accepted write-ahead commit of `step` by the incarnation (a lighthouse id), with
    /// group rank 0's quorum wait in the step when the announcement said.
    pub fn on_commit(&mut self, incarnation: &str, step: i64, wait: Option<f64>, now: Instant) {
        let unix = self.unix(now);
        let name = match self.current(incarnation) {
            Some(name) => name,
            None => match self.group_for(incarnation, now) {
                Some(name) => name,
                None => return,
            },
        };
        self.goodput.on_commit(&name, incarnation, step, unix, wait);
    }

    /// Groups known.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Changes of the goodput accounts so far (the state file is rewritten on a change).
    pub fn goodput_revision(&self) -> u64 {
        self.goodput.revision()
    }

    /// What the state file keeps of the goodput accounts, encoded (only the groups changed
    /// since the previous call are encoded again).
    pub fn encode_goodput(&mut self) -> serde_json::Result<super::EncodedGoodput> {
        self.goodput.encode_saved()
    }

    /// Continues the goodput accounts a state file kept; returns the groups whose entry was
    /// damaged (dropped).
    pub fn restore_goodput(&mut self, saved: super::SavedGoodput) -> Vec<String> {
        self.goodput.restore(saved)
    }

    /// The job's goodput figures now (None before its first committed step).
    pub fn goodput(&self, now: Instant) -> Option<Figures> {
        self.goodput.job_figures(self.unix(now))
    }

    /// One group's goodput figures now.
    pub fn group_goodput(&self, name: &str, now: Instant) -> Option<Figures> {
        self.goodput.group_figures(name, self.unix(now))
    }

    /// The window's start (unix seconds).
    pub fn goodput_start(&self) -> Option<f64> {
        self.goodput.start()
    }

    /// The server-side history (`/history`) and its interval now (seconds).
    pub fn history(&self) -> (&[Point], f64) {
        (self.history.points(), self.history.every().as_secs_f64())
    }

    fn best_step(&self) -> Option<i64> {
        self.groups.values().map(|g| g.step).max()
    }

    /// Whether every known group finished cleanly (the job ended).
    pub fn job_finished(&self) -> bool {
        !self.groups.is_empty()
            && self
                .groups
                .values()
                .all(|g| g.lifecycle == Lifecycle::Finished)
    }

    fn point(&self, now: Instant) -> Point {
        let unix = self.unix(now);
        let job = self.goodput.job_figures(unix);
        Point {
            t: round3(unix),
            step: self.best_step(),
            members: self.quorum_members.len(),
            ratio: job.as_ref().and_then(Figures::ratio),
            steps_committed: job.as_ref().map_or(0, |j| j.accounts.steps_committed),
            productive_s: job.as_ref().map(|j| round3(j.accounts.productive_s)),
            wall_s: job.as_ref().map(|j| round3(j.wall_s)),
        }
    }

    /// The periodic work: a history point every interval, a `goodput` event every
    /// [`super::GOODPUT_EVERY`] while the job trains and a final one when it ends. Returns
    /// true when the job just ended (the end-of-run report is due).
    pub(super) fn goodput_tick(&mut self, now: Instant) -> bool {
        let finished = self.goodput.start().is_some() && self.job_finished();
        let ending = finished && !self.final_emitted;
        // The history ends with the job's final state, not up to an interval before it.
        if (self.history.due(now) || ending) && !self.groups.is_empty() {
            let p = self.point(now);
            self.history.push(now, p);
        }
        if self.goodput.start().is_none() {
            return false;
        }
        if finished {
            if self.final_emitted {
                return false;
            }
            self.final_emitted = true;
            self.emit_goodput(now, true);
            self.ended_at = Some(now);
            return true;
        }
        self.final_emitted = false;
        if self.goodput_due.is_none_or(|d| now >= d) {
            self.goodput_due = now.checked_add(super::GOODPUT_EVERY);
            self.emit_goodput(now, false);
        }
        false
    }

    /// Whether the job ended since the last call (once per end).
    pub fn take_ended(&mut self) -> bool {
        self.ended_at.take().is_some()
    }

    fn groups_json(&self, now: Instant, limit: usize) -> (Vec<Value>, usize) {
        let unix = self.unix(now);
        let mut names: Vec<&String> = self.groups.keys().collect();
        names.sort();
        if names.len() > limit {
            return (Vec::new(), names.len());
        }
        let out = names
            .into_iter()
            .filter_map(|name| {
                let g = &self.groups[name];
                let f = self.goodput.group_figures(name, unix)?;
                let mut m = f.to_json();
                m.insert("replica_id".into(), json!(name));
                m.insert("state".into(), json!(g.state.as_str()));
                m.insert("step".into(), json!(g.step));
                let r = round6;
                if let Some(p) = self.goodput.phases(name) {
                    m.insert(
                        "phases".into(),
                        json!({"input_s": r(p.input_s), "forward_s": r(p.forward_s),
                               "backward_s": r(p.backward_s), "optimizer_s": r(p.optimizer_s),
                               "collective_s": r(p.collective_s),
                               "quorum_wait_s": r(p.quorum_wait_s),
                               "should_commit_s": r(p.should_commit_s)}),
                    );
                }
                Some(Value::Object(m))
            })
            .collect();
        (out, 0)
    }

    /// The job's goodput as JSON fields (`window_start_unix_s`, `step`, the accounts,
    /// `ratio`), None before its first committed step.
    pub fn goodput_json(&self, now: Instant) -> Option<Map<String, Value>> {
        let job = self.goodput(now)?;
        let mut m = job.to_json();
        m.insert(
            "window_start_unix_s".into(),
            json!(self.goodput.start().map(round3)),
        );
        m.insert("step".into(), json!(self.best_step()));
        Some(m)
    }

    fn emit_goodput(&mut self, now: Instant, last: bool) {
        let Some(mut m) = self.goodput_json(now) else {
            return;
        };
        let limit = if last { FINAL_GROUPS } else { PERIODIC_GROUPS };
        let (groups, omitted) = self.groups_json(now, limit);
        m.insert("final".into(), json!(last));
        m.insert("groups".into(), json!(groups));
        m.insert("groups_omitted".into(), json!(omitted));
        let p = self.point(now);
        self.series.push(now, p);
        self.emit(now, EventKind::Goodput, Value::Object(m));
    }

    /// Keeps the events the end-of-run report's timeline shows.
    pub(super) fn note_timeline(&mut self, e: &Event) {
        if !TIMELINE_KINDS.contains(&e.kind) {
            return;
        }
        let kind = e.kind.as_str();
        let replica = e
            .fields
            .get("replica_id")
            .and_then(Value::as_str)
            .map(|r| base_id(r).to_string());
        let state = (e.kind == EventKind::StateChanged)
            .then(|| e.fields.get("to").cloned())
            .flatten();
        self.timeline.push_back(json!({
            "t": round3(e.ts),
            "kind": kind,
            "replica_id": replica,
            "state": state,
            "detail": short(timeline_detail(kind, &e.fields), 200),
        }));
        while self.timeline.len() > TIMELINE {
            self.timeline.pop_front();
            self.timeline_dropped += 1;
        }
    }

    /// The end-of-run report (the schema `python -m torchft.eventlog --html` writes too).
    pub fn summary(&self, now: Instant) -> Value {
        let unix = self.unix(now);
        let (groups, omitted) = self.groups_json(now, FINAL_GROUPS);
        let mut prev: Option<&Point> = None;
        let series: Vec<Value> = self
            .series
            .points()
            .iter()
            .map(|p| {
                let rate = prev.and_then(|q| {
                    let dt = p.t - q.t;
                    match (p.step, q.step) {
                        (Some(a), Some(b)) if dt > 0.0 => Some((a - b) as f64 / dt),
                        _ => None,
                    }
                });
                prev = Some(p);
                json!({"t": p.t, "step": p.step, "ratio": p.ratio, "steps_per_s": rate,
                       "productive_s": p.productive_s, "wall_s": p.wall_s})
            })
            .collect();
        json!({
            "schema": 1,
            "source": "lighthouse",
            "job": "",
            "generated_unix_s": round3(unix),
            "started_unix_s": round3(self.epoch.1),
            "ended_unix_s": round3(unix),
            "finished": self.job_finished(),
            "goodput": self.goodput_json(now),
            "groups": groups,
            "groups_omitted": omitted,
            "series": series,
            "timeline": self.timeline.iter().cloned().collect::<Vec<_>>(),
            "timeline_dropped": self.timeline_dropped,
        })
    }
}
