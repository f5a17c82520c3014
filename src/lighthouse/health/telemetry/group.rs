//! One replica group as the health model keeps it: its recent samples, ranks, counters
//! and lifecycle, and the state derived from them.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::{GroupState, HealRecord, MIN_SAMPLES};
use serde::Serialize;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sample {
    pub(super) step_s: f64,
    pub(super) busy_s: f64,
    pub(super) quorum_wait_s: f64,
    pub(super) collective_s: f64,
    pub(super) should_commit_s: f64,
    pub(super) input_s: f64,
    pub(super) forward_s: f64,
    pub(super) backward_s: f64,
    pub(super) optimizer_s: f64,
    pub(super) cpu_s: f64,
    pub(super) rss_bytes: u64,
    pub(super) host_load: f64,
    pub(super) host_steal: f64,
    pub(super) host_mem_total: u64,
    pub(super) host_mem_available: u64,
    pub(super) net_rx: f64,
    pub(super) net_tx: f64,
    /// (utilisation percent, memory used, memory total) when the rank has a GPU.
    pub(super) gpu: Option<(f64, u64, u64)>,
}

#[derive(Debug, Clone)]
pub(super) struct RankInfo {
    pub(super) pid: u32,
    pub(super) last_report: Instant,
    /// The newest report's own time (a batch sent again after a lost answer repeats older
    /// ones, which are ignored).
    pub(super) last_unix: f64,
}

/// Counters of one replica group (over all its incarnations).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Steps reported committed (by group rank 0).
    pub steps_committed: u64,
    /// Steps reported not committed (by group rank 0).
    pub commit_failures: u64,
    /// Heals completed (by group rank 0).
    pub heals: u64,
    /// Bytes fetched by heals (all ranks).
    pub heal_bytes: u64,
    /// Starts seen.
    pub incarnations: u64,
    /// Times declared lost.
    pub lost: u64,
    /// Reports received.
    pub reports: u64,
    /// Reports its ranks and manager server dropped.
    pub reports_dropped: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Lifecycle {
    Running,
    Finished,
    Failed(String),
}

#[derive(Debug)]
pub(super) struct Group {
    pub(super) incarnation: String,
    pub(super) retired: VecDeque<String>,
    pub(super) hostname: String,
    pub(super) address: String,
    pub(super) world_size: i64,
    pub(super) ranks: BTreeMap<i64, RankInfo>,
    pub(super) step: i64,
    pub(super) participants: i64,
    pub(super) last_commit: Option<bool>,
    pub(super) last_error: Option<String>,
    pub(super) samples: VecDeque<Sample>,
    pub(super) last_heal_s: f64,
    pub(super) last_heal: Option<HealRecord>,
    pub(super) healing: bool,
    pub(super) committed: bool,
    pub(super) lifecycle: Lifecycle,
    pub(super) session_closed: bool,
    /// When the current incarnation last heartbeated, as of the last evaluation.
    pub(super) hb_at: Option<Instant>,
    pub(super) in_quorum: bool,
    pub(super) straggler: bool,
    /// When it was last flagged a straggler (or rejoined after being dropped as one): the
    /// drop window counts from here.
    pub(super) straggler_since: Option<Instant>,
    pub(super) skew_pct: f64,
    /// Why it is a straggler (see `stragglers::cause`), while it is one.
    pub(super) straggler_cause: Option<&'static str>,
    pub(super) state: GroupState,
    pub(super) state_since: Instant,
    pub(super) last_seen: Instant,
    pub(super) last_report: Option<Instant>,
    pub(super) rate: VecDeque<(Instant, i64)>,
    pub(super) counters: Counters,
}

impl Group {
    pub(super) fn new(incarnation: &str, now: Instant) -> Self {
        Self {
            incarnation: incarnation.to_string(),
            retired: VecDeque::new(),
            hostname: String::new(),
            address: String::new(),
            world_size: 0,
            ranks: BTreeMap::new(),
            step: 0,
            participants: 0,
            last_commit: None,
            last_error: None,
            samples: VecDeque::new(),
            last_heal_s: 0.0,
            last_heal: None,
            healing: false,
            committed: false,
            lifecycle: Lifecycle::Running,
            session_closed: false,
            hb_at: None,
            in_quorum: false,
            straggler: false,
            straggler_since: None,
            skew_pct: 0.0,
            straggler_cause: None,
            state: GroupState::Joining,
            state_since: now,
            last_seen: now,
            last_report: None,
            rate: VecDeque::new(),
            counters: Counters {
                incarnations: 1,
                ..Default::default()
            },
        }
    }

    /// The median busy time of the window, if there are enough samples.
    pub(super) fn busy_median(&self) -> Option<f64> {
        (self.samples.len() >= MIN_SAMPLES).then(|| median(self.samples.iter().map(|s| s.busy_s)))
    }

    pub(super) fn timing(&self, f: impl Fn(&Sample) -> f64) -> Option<f64> {
        (!self.samples.is_empty()).then(|| median(self.samples.iter().map(f)))
    }

    pub(super) fn steps_per_s(&self) -> Option<f64> {
        let (t0, s0) = self.rate.front()?;
        let (t1, s1) = self.rate.back()?;
        let dt = t1.saturating_duration_since(*t0).as_secs_f64();
        (dt > 0.0).then(|| (s1 - s0) as f64 / dt)
    }

    pub(super) fn is_lost(&self, now: Instant, timeout: Duration) -> bool {
        if self.session_closed {
            return true;
        }
        let age = now.saturating_duration_since(self.hb_at.unwrap_or(self.last_seen));
        age > timeout
    }

    /// Seen as a quorum member now, with its manager server's address (for the kill action;
    /// empty: unknown) and its step.
    pub(super) fn seen_in_quorum(&mut self, address: &str, step: i64, now: Instant) {
        self.last_seen = now;
        if !address.is_empty() && self.address != address {
            self.address = address.to_string();
        }
        if step > self.step && !self.committed {
            self.step = step;
        }
    }

    /// The state the observations imply (straggler included), and why.
    pub(super) fn derive(&self, now: Instant, timeout: Duration) -> (GroupState, &'static str) {
        match &self.lifecycle {
            Lifecycle::Failed(_) => return (GroupState::Failed, "a rank reported a fatal error"),
            Lifecycle::Finished => return (GroupState::Finished, "shut down cleanly"),
            Lifecycle::Running => {}
        }
        if self.session_closed {
            return (GroupState::Lost, "session ended");
        }
        if self.is_lost(now, timeout) {
            return (GroupState::Lost, "heartbeat timeout");
        }
        if self.healing {
            return (GroupState::Healing, "fetching live state from a peer");
        }
        if !self.committed {
            return (GroupState::Joining, "no committed step yet");
        }
        if !self.in_quorum {
            return (GroupState::Joining, "not in the current quorum");
        }
        if self.straggler {
            return (GroupState::Straggler, "busy time well above the median");
        }
        (GroupState::Healthy, "in the quorum and committing")
    }
}

pub(super) fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
