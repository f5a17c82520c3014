//! Straggler verdicts: a group whose step time stays well above the median over a window
//! is flagged (and cleared when it catches up), named with its cause; a lasting one is
//! handed to the quorum rules to drop.
//!
//! The cause comes from where the group's busy time goes against the job's median group
//! (window medians of the phases its ranks report):
//!
//! - `memory-growing`: the group's resident memory grew by at least a tenth (and
//!   [`MEMORY_GROWTH_MIN`]) from the first half of the window to the second;
//! - otherwise the phase with the largest excess over the job's median: `input-bound` (before
//!   the first forward: data loading, user code), `compute-bound` (forward, backward,
//!   optimizer), `communication-bound` (a collective in flight);
//! - `host-contended` instead of input- or compute-bound when the group's hosts are
//!   overloaded (load per CPU above 1, and [`HOST_LOAD_FACTOR`] times the job's median);
//! - `unattributed` when no phase exceeds the job's (or the group reports no phases: a
//!   script without torchft's DDP and optimizer wrappers).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::group::{Group, Sample};
use super::{median, round3, round6, GroupState, Telemetry};
use crate::telemetry::EventKind;

/// Least resident-memory growth over a window that names a straggler memory-growing.
pub const MEMORY_GROWTH_MIN: u64 = 64 << 20;
/// A group's host load per CPU must be this many times the job's median (and above 1) to
/// name it host-contended.
pub const HOST_LOAD_FACTOR: f64 = 1.5;
/// A group's hosts must lose at least this share of their CPU time to the hypervisor (and
/// twice the job's median) to name it host-contended.
pub const HOST_STEAL_MIN: f64 = 0.1;

/// Window medians of one group's phases (seconds per step) and host load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Profile {
    pub(super) input: f64,
    pub(super) compute: f64,
    pub(super) communication: f64,
    pub(super) host_load: f64,
    pub(super) steal: f64,
    /// Whether its ranks report phases at all.
    pub(super) measured: bool,
}

impl Profile {
    pub(super) fn of(g: &Group) -> Self {
        let m = |f: fn(&Sample) -> f64| g.timing(f).unwrap_or(0.0);
        Self {
            input: m(|s| s.input_s),
            compute: m(|s| s.forward_s + s.backward_s + s.optimizer_s),
            communication: m(|s| s.collective_s),
            host_load: m(|s| s.host_load),
            steal: m(|s| s.host_steal),
            measured: g.samples.iter().any(|s| s.forward_s > 0.0),
        }
    }

    /// The job's median group: each field the median over `profiles`.
    fn median_of(profiles: &[Profile]) -> Self {
        let m = |f: fn(&Profile) -> f64| median(profiles.iter().map(f));
        Self {
            input: m(|p| p.input),
            compute: m(|p| p.compute),
            communication: m(|p| p.communication),
            host_load: m(|p| p.host_load),
            steal: m(|p| p.steal),
            measured: profiles.iter().any(|p| p.measured),
        }
    }
}

/// How much the group's resident memory grew over its window (the largest of the second
/// half against the largest of the first), in bytes; 0 when it did not or is not reported.
pub(super) fn memory_growth(g: &Group) -> u64 {
    let n = g.samples.len();
    if n < 4 {
        return 0;
    }
    let half = |it: &mut dyn Iterator<Item = &Sample>| it.map(|s| s.rss_bytes).max().unwrap_or(0);
    let first = half(&mut g.samples.iter().take(n / 2));
    let second = half(&mut g.samples.iter().skip(n / 2));
    if first == 0 {
        return 0;
    }
    second.saturating_sub(first)
}

/// Names a straggler's cause (see the module docs) from its profile, the job's median
/// profile and its memory growth.
pub(super) fn cause(g: &Profile, job: &Profile, growth: u64, rss: u64) -> &'static str {
    if growth >= MEMORY_GROWTH_MIN && growth.saturating_mul(10) >= rss.saturating_sub(growth) {
        return "memory-growing";
    }
    let contended = (g.host_load > 1.0 && g.host_load > HOST_LOAD_FACTOR * job.host_load)
        || (g.steal >= HOST_STEAL_MIN && g.steal > 2.0 * job.steal);
    if !g.measured {
        return if contended {
            "host-contended"
        } else {
            "unattributed"
        };
    }
    let excess = [
        (g.input - job.input, "input-bound"),
        (g.compute - job.compute, "compute-bound"),
        (g.communication - job.communication, "communication-bound"),
    ];
    let (gap, name) =
        excess.into_iter().fold(
            (0.0, "unattributed"),
            |best, e| if e.0 > best.0 { e } else { best },
        );
    if gap <= 0.0 {
        return if contended {
            "host-contended"
        } else {
            "unattributed"
        };
    }
    if contended && name != "communication-bound" {
        return "host-contended";
    }
    name
}

/// The evidence of a cause: the group's phases against the job's median (seconds per step).
fn evidence(g: &Profile, job: &Profile, growth: u64) -> Value {
    json!({
        "input_s": round6(g.input), "job_input_s": round6(job.input),
        "compute_s": round6(g.compute), "job_compute_s": round6(job.compute),
        "communication_s": round6(g.communication),
        "job_communication_s": round6(job.communication),
        "host_load": round3(g.host_load), "job_host_load": round3(job.host_load),
        "host_steal": round3(g.steal), "job_host_steal": round3(job.steal),
        "memory_growth_bytes": growth,
    })
}

impl Telemetry {
    pub(super) fn judge_stragglers(&mut self, now: Instant) {
        let timeout = self.opts.heartbeat_timeout;
        let busy: Vec<(String, f64)> = self
            .groups
            .iter()
            .filter(|(_, g)| {
                matches!(
                    g.derive(now, timeout).0,
                    GroupState::Healthy | GroupState::Straggler
                )
            })
            .filter_map(|(k, g)| g.busy_median().map(|b| (k.clone(), b)))
            .collect();
        let reference = median(busy.iter().map(|(_, b)| *b));
        let profiles: Vec<Profile> = busy
            .iter()
            .filter_map(|(k, _)| self.groups.get(k).map(Profile::of))
            .collect();
        let job = Profile::median_of(&profiles);
        let enough = busy.len() >= 2;
        let skew_limit = self.opts.straggler_skew_pct;
        let min_gap = self.opts.straggler_min.as_secs_f64();
        let mut events = Vec::new();
        for (name, b) in &busy {
            let Some(g) = self.groups.get_mut(name) else {
                continue;
            };
            let gap = b - reference;
            let skew = if reference > 0.0 {
                100.0 * gap / reference
            } else if gap > 0.0 {
                f64::INFINITY
            } else {
                0.0
            };
            g.skew_pct = if skew.is_finite() { skew } else { 1e6 };
            let flag = enough && skew > skew_limit && gap > min_gap;
            let clear = !enough || skew < skew_limit / 2.0 || gap < min_gap / 2.0;
            let mut fields = json!({"replica_id": name, "skew_pct": round3(g.skew_pct),
                                "busy_s": round6(*b), "median_busy_s": round6(reference)});
            if !g.straggler && flag {
                g.straggler = true;
                g.straggler_since = Some(now);
            } else if g.straggler && clear {
                g.straggler = false;
                g.straggler_since = None;
                g.straggler_cause = None;
                events.push((EventKind::StragglerCleared, fields));
                continue;
            }
            if !g.straggler {
                continue;
            }
            // Named at the flag, and again whenever the evidence names another cause.
            let profile = Profile::of(g);
            let growth = memory_growth(g);
            let rss = g.samples.back().map_or(0, |s| s.rss_bytes);
            let named = cause(&profile, &job, growth, rss);
            if g.straggler_cause != Some(named) {
                fields["cause"] = json!(named);
                fields["previous_cause"] = json!(g.straggler_cause);
                fields["evidence"] = evidence(&profile, &job, growth);
                g.straggler_cause = Some(named);
                events.push((EventKind::StragglerFlagged, fields));
            }
        }
        // Groups that left the comparison are no longer stragglers.
        let judged: HashSet<&String> = busy.iter().map(|(k, _)| k).collect();
        for (name, g) in &mut self.groups {
            if g.straggler && !judged.contains(name) {
                g.straggler = false;
                g.straggler_since = None;
                g.straggler_cause = None;
                events.push((
                    EventKind::StragglerCleared,
                    json!({"replica_id": name, "skew_pct": null, "busy_s": null,
                           "median_busy_s": round6(reference)}),
                ));
            }
        }
        for (kind, fields) in events {
            self.emit(now, kind, fields);
        }
    }

    /// Groups flagged stragglers for at least `window` without a break: `(incarnation, why)`
    /// for each. Each is taken to be dropped for `window`: its next window counts from the
    /// end of that drop (it must stay a straggler a whole window after it rejoins to be
    /// dropped again).
    pub fn take_long_stragglers(
        &mut self,
        now: Instant,
        window: Duration,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (name, g) in &mut self.groups {
            let Some(since) = g.straggler_since else {
                continue;
            };
            let flagged_for = now.saturating_duration_since(since);
            if !g.straggler || flagged_for < window {
                continue;
            }
            g.straggler_since = Some(now.checked_add(window).unwrap_or(now));
            let busy = g.busy_median().unwrap_or(0.0);
            out.push((
                g.incarnation.clone(),
                format!(
                    "replica group {name} has been a straggler for {:.1}s ({}; median busy \
                     time {:.1} ms, {:+.0}% against the job's median)",
                    flagged_for.as_secs_f64(),
                    g.straggler_cause.unwrap_or("unattributed"),
                    busy * 1e3,
                    g.skew_pct
                ),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;

    #[test]
    fn a_steady_slow_group_is_flagged_and_cleared_but_one_slow_step_is_not() {
        let mut j = Job::new(3);
        j.kinds();
        for _ in 0..10 {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        // One slow step: the window median does not move.
        j.step_all(&[0.1, 0.1, 0.5]);
        j.step_all(&[0.1, 0.1, 0.1]);
        assert_eq!(j.state("g2"), GroupState::Healthy);
        assert!(j.kinds().is_empty());
        // Steadily slow: flagged once the median moves (within WINDOW / 2 + 1 steps).
        let mut flagged_after = None;
        for i in 0..WINDOW {
            j.step_all(&[0.1, 0.11, 0.35]);
            if j.state("g2") == GroupState::Straggler {
                flagged_after = Some(i + 1);
                break;
            }
        }
        assert!(flagged_after.is_some_and(|n| n <= WINDOW / 2 + 1));
        assert_eq!(j.state("g0"), GroupState::Healthy);
        assert_eq!(j.state("g1"), GroupState::Healthy);
        let kinds = j.kinds();
        assert!(kinds.contains(&(EventKind::StragglerFlagged, "g2".into())));
        assert!(kinds.contains(&(EventKind::StateChanged, "g2".into())));
        assert!(j.t.groups["g2"].skew_pct > 50.0);
        // Fast again: cleared.
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        assert_eq!(j.state("g2"), GroupState::Healthy);
        assert!(j
            .kinds()
            .contains(&(EventKind::StragglerCleared, "g2".into())));
    }

    #[test]
    fn a_straggler_is_taken_once_per_window_and_its_next_window_starts_after_the_drop() {
        let mut j = Job::new(3);
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        let window = Duration::from_secs(2);
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.4]);
        }
        assert_eq!(j.state("g2"), GroupState::Straggler);
        // Flagged for less than the window so far (each step is 200 ms).
        let flagged = j.t.groups["g2"].straggler_since.unwrap();
        assert!(j
            .t
            .take_long_stragglers(flagged + window / 2, window)
            .is_empty());
        let at = flagged + window;
        let long = j.t.take_long_stragglers(at, window);
        assert_eq!(long.len(), 1);
        assert!(long[0].0.starts_with("g2"), "{long:?}");
        assert!(long[0].1.contains("straggler for 2.0s"), "{long:?}");
        // Dropped for the window: not taken again before a whole window after it rejoins.
        assert!(j.t.take_long_stragglers(at + window, window).is_empty());
        assert_eq!(j.t.take_long_stragglers(at + window * 2, window).len(), 1);
        // A cleared straggler is never taken.
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        assert!(j
            .t
            .take_long_stragglers(at + window * 10, window)
            .is_empty());
    }

    #[test]
    fn small_absolute_gaps_are_not_stragglers() {
        let mut j = Job::new(3);
        for _ in 0..WINDOW {
            // 3x slower, but only 20 ms: below straggler_min.
            j.step_all(&[0.01, 0.01, 0.03]);
        }
        assert_eq!(j.state("g2"), GroupState::Healthy);
    }

    /// Three groups of which g2 is slow in `slow`'s way; returns g2's named cause and the
    /// flag event's evidence.
    fn named(slow: impl Fn(&mut crate::proto::TelemetryReport)) -> (Option<&'static str>, Value) {
        let mut j = Job::new(3);
        let normal = |r: &mut crate::proto::TelemetryReport| {
            r.input_s = 0.02;
            r.forward_s = 0.03;
            r.backward_s = 0.04;
            r.optimizer_s = 0.01;
            r.collective_s = 0.02;
            r.host_load = 0.5;
            r.rss_bytes = 500 << 20;
        };
        for _ in 0..WINDOW {
            j.step_with(&[0.1, 0.1, 0.1], |_, r| normal(r));
        }
        j.kinds();
        for _ in 0..WINDOW {
            j.step_with(&[0.1, 0.1, 0.3], |i, r| {
                normal(r);
                if i == 2 {
                    slow(r);
                }
            });
        }
        assert_eq!(j.state("g2"), GroupState::Straggler);
        let flagged =
            j.t.recent_events()
                .filter(|e| e.kind == EventKind::StragglerFlagged)
                .last()
                .map(|e| e.to_json())
                .expect("a straggler_flagged event");
        (j.t.groups["g2"].straggler_cause, flagged)
    }

    #[test]
    fn a_straggler_is_named_by_the_phase_that_grew() {
        let (c, ev) = named(|r| r.input_s = 0.22);
        assert_eq!(c, Some("input-bound"));
        assert_eq!(ev["cause"], "input-bound", "{ev}");
        assert!(ev["evidence"]["input_s"].as_f64().unwrap() > 0.1, "{ev}");
        assert!((ev["evidence"]["job_input_s"].as_f64().unwrap() - 0.02).abs() < 1e-9);
        assert_eq!(named(|r| r.backward_s = 0.24).0, Some("compute-bound"));
        assert_eq!(
            named(|r| r.collective_s = 0.3).0,
            Some("communication-bound")
        );
        // Slower compute on an overloaded host: the host is named.
        let contended = named(|r| {
            r.forward_s = 0.2;
            r.host_load = 2.5;
        });
        assert_eq!(contended.0, Some("host-contended"));
        // ... or on a host whose CPU time the hypervisor steals.
        let stolen = named(|r| {
            r.forward_s = 0.2;
            r.host_steal = 0.3;
        });
        assert_eq!(stolen.0, Some("host-contended"));
        let steal = stolen.1["evidence"]["host_steal"].as_f64().unwrap_or(0.0);
        assert!((super::HOST_STEAL_MIN..=0.3).contains(&steal), "{steal}");
        assert_eq!(stolen.1["evidence"]["job_host_steal"], 0.0);
        // Memory growing through the window (40 MiB a step).
        let grows = |r: &mut crate::proto::TelemetryReport| {
            let step = r.step.max(0) as u64;
            r.rss_bytes = (500 << 20) + step * (40 << 20);
            r.input_s = 0.2;
        };
        assert_eq!(named(grows).0, Some("memory-growing"));
        // No phases reported (no torchft wrappers): flagged, cause unattributed.
        let bare = named(|r| {
            r.input_s = 0.0;
            r.forward_s = 0.0;
            r.backward_s = 0.0;
            r.optimizer_s = 0.0;
        });
        assert_eq!(
            bare.0,
            Some("unattributed"),
            "its busy time has no phases to name"
        );
        let mut j = Job::new(3);
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.35]);
        }
        assert_eq!(j.state("g2"), GroupState::Straggler);
        assert_eq!(j.t.groups["g2"].straggler_cause, Some("unattributed"));
        // Cleared: the cause goes with the flag.
        for _ in 0..WINDOW {
            j.step_all(&[0.1, 0.1, 0.1]);
        }
        assert_eq!(j.t.groups["g2"].straggler_cause, None);
    }
}
