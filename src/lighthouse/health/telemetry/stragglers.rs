//! Straggler verdicts: a group whose step time stays well above the median over a window
//! is flagged (and cleared when it catches up); a lasting one is handed to the quorum rules
//! to drop.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{median, round3, round6, GroupState, Telemetry};
use crate::telemetry::EventKind;

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
            let fields = json!({"replica_id": name, "skew_pct": round3(g.skew_pct),
                                "busy_s": round6(*b), "median_busy_s": round6(reference)});
            if !g.straggler && flag {
                g.straggler = true;
                g.straggler_since = Some(now);
                events.push((EventKind::StragglerFlagged, fields));
            } else if g.straggler && clear {
                g.straggler = false;
                g.straggler_since = None;
                events.push((EventKind::StragglerCleared, fields));
            }
        }
        // Groups that left the comparison are no longer stragglers.
        let judged: HashSet<&String> = busy.iter().map(|(k, _)| k).collect();
        for (name, g) in &mut self.groups {
            if g.straggler && !judged.contains(name) {
                g.straggler = false;
                g.straggler_since = None;
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
                    "replica group {name} has been a straggler for {:.1}s (median busy time \
                     {:.1} ms, {:+.0}% against the job's median)",
                    flagged_for.as_secs_f64(),
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
}
