//! Replica group health derived from the ranks' telemetry reports and the lighthouse's own
//! observations (quorums, sessions, heartbeat ages).
//!
//! Pure: every call takes `now`; wall-clock timestamps of events are derived from the
//! instant the state was created. Bounded: a window of recent samples per group, a capped
//! number of groups (the oldest inactive ones are forgotten first), a ring of recent events.
//! The service drains [`Telemetry::take_events`] after each call and publishes them.
//!
//! Its pieces: `group` one group's samples and lifecycle; `records` what the status
//! pages and `/metrics` show; `snapshots` the latest durable snapshot; `stragglers`
//! the straggler verdicts. This module holds the model itself and the events it emits.

use std::collections::VecDeque;

use crate::ids::{IdMap, IdSet};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::proto::telemetry_report::Phase;
use crate::proto::TelemetryReport;
use crate::telemetry::{base_id, EventKind};

mod goodput;
mod group;
mod history;
mod records;
mod report;
mod snapshots;
mod stragglers;

pub use goodput::{EncodedGoodput, Figures, SavedGoodput};
pub use history::Point;
pub use records::{GlobalCounters, GroupState, HealRecord, ReplicaStatus, SnapshotStatus, Timings};
pub use report::{render_html, timeline_detail};
pub use snapshots::SnapshotRecord;

use group::{median, Counters, Group, Lifecycle, RankInfo, Sample};
use records::{round3, round6};

/// Default straggler threshold: percent above the median busy time.
pub const DEFAULT_STRAGGLER_SKEW_PCT: u64 = 50;
/// Default straggler threshold: milliseconds above the median busy time.
pub const DEFAULT_STRAGGLER_MIN_MS: u64 = 50;
/// Samples per group the timings and the straggler verdict are taken over.
pub const WINDOW: usize = 8;
/// Events kept for `/status` and for SSE clients that reconnect.
pub const RECENT_EVENTS: usize = 100;
/// Replica groups remembered at most.
pub const MAX_GROUPS: usize = 20_000;
/// Previous incarnations remembered per group (their late reports are ignored).
const RETIRED: usize = 8;
/// Points kept for the step rate.
const RATE_POINTS: usize = 16;
/// Samples needed before a group takes part in the straggler verdict.
const MIN_SAMPLES: usize = 3;
/// How often a `goodput` event is emitted while the job trains.
pub const GOODPUT_EVERY: Duration = Duration::from_secs(5);
/// How often the history (`/history`) takes a point, before it is compacted.
pub const HISTORY_EVERY: Duration = Duration::from_secs(1);
/// Groups listed in a periodic `goodput` event at most (the final one lists up to
/// [`FINAL_GROUPS`]).
const PERIODIC_GROUPS: usize = 64;
/// Groups listed in the final `goodput` event and the end-of-run report at most.
pub const FINAL_GROUPS: usize = 1000;
/// Entries of the end-of-run report's timeline kept (the latest).
pub const TIMELINE: usize = 5000;

/// Tunables of the derivation.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryOptions {
    /// A group whose heartbeats are older than this is lost.
    pub heartbeat_timeout: Duration,
    /// Busy time this many percent above the median flags a straggler.
    pub straggler_skew_pct: f64,
    /// ... and at least this much above it (absolute).
    pub straggler_min: Duration,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        Self {
            heartbeat_timeout: Duration::from_secs(5),
            straggler_skew_pct: DEFAULT_STRAGGLER_SKEW_PCT as f64,
            straggler_min: Duration::from_millis(DEFAULT_STRAGGLER_MIN_MS),
        }
    }
}

/// One event (a state change, a quorum change, a heal, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Increasing number, from 1.
    pub seq: u64,
    /// Unix time in seconds.
    pub ts: f64,
    /// What happened (see docs/telemetry.md).
    pub kind: EventKind,
    /// The kind's fields.
    pub fields: Map<String, Value>,
}

impl Event {
    /// The event as one flat JSON object (`seq`, `ts`, `kind`, then the fields).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("seq".into(), json!(self.seq));
        m.insert("ts".into(), json!((self.ts * 1e6).round() / 1e6));
        m.insert("kind".into(), self.kind.into());
        for (k, v) in &self.fields {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }
}

/// The derived health of every replica group.
#[derive(Debug)]
pub struct Telemetry {
    opts: TelemetryOptions,
    /// Creation instant and the unix time it corresponds to (event timestamps).
    epoch: (Instant, f64),
    groups: IdMap<Group>,
    /// Lighthouse id → replica group name, for current and retired incarnations.
    by_incarnation: IdMap<String>,
    quorum_id: Option<i64>,
    /// The revision of the last quorum told (0: none yet).
    quorum_revision: u64,
    quorum_members: IdSet,
    next_seq: u64,
    pending: Vec<Event>,
    recent: VecDeque<Event>,
    counters: GlobalCounters,
    /// The latest complete durable snapshot (None before the first one).
    snapshot: Option<SnapshotRecord>,
    /// Changes whenever `snapshot` does (the state file is rewritten then).
    snapshot_revision: u64,
    /// The goodput accounts.
    goodput: goodput::Goodput,
    /// When the next periodic `goodput` event is due.
    goodput_due: Option<Instant>,
    /// Whether the final `goodput` event of the job was emitted (every group finished).
    final_emitted: bool,
    /// The job's step, members and goodput every second (compacted: the whole run).
    history: history::History,
    /// The samples of the `goodput` events (the end-of-run report's series).
    series: history::History,
    /// Failures and recoveries, for the end-of-run report.
    timeline: VecDeque<Value>,
    timeline_dropped: u64,
    /// When the job ended, until the end-of-run report is written.
    ended_at: Option<Instant>,
}

impl Telemetry {
    /// Empty state; `now` corresponds to unix time `unix_now` (seconds).
    pub fn new(opts: TelemetryOptions, now: Instant, unix_now: f64) -> Self {
        Self {
            opts,
            epoch: (now, unix_now),
            groups: IdMap::default(),
            by_incarnation: IdMap::default(),
            quorum_id: None,
            quorum_revision: 0,
            quorum_members: IdSet::default(),
            next_seq: 1,
            pending: Vec::new(),
            recent: VecDeque::new(),
            counters: GlobalCounters::default(),
            snapshot: None,
            snapshot_revision: 0,
            goodput: goodput::Goodput::default(),
            goodput_due: None,
            final_emitted: false,
            history: history::History::new(HISTORY_EVERY),
            series: history::History::new(GOODPUT_EVERY),
            timeline: VecDeque::new(),
            timeline_dropped: 0,
            ended_at: None,
        }
    }

    /// The options in use.
    pub fn options(&self) -> &TelemetryOptions {
        &self.opts
    }

    fn unix(&self, now: Instant) -> f64 {
        let (t0, u0) = self.epoch;
        if now >= t0 {
            u0 + (now - t0).as_secs_f64()
        } else {
            u0 - (t0 - now).as_secs_f64()
        }
    }

    /// Records an event (published by the caller via [`Telemetry::take_events`]).
    pub fn emit(&mut self, now: Instant, kind: EventKind, fields: Value) {
        let fields = match fields {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        let event = Event {
            seq: self.next_seq,
            ts: self.unix(now),
            kind,
            fields,
        };
        self.next_seq += 1;
        self.counters.events += 1;
        self.note_timeline(&event);
        self.recent.push_back(event.clone());
        while self.recent.len() > RECENT_EVENTS {
            self.recent.pop_front();
        }
        self.pending.push(event);
    }

    /// Events emitted since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.pending)
    }

    /// The last [`RECENT_EVENTS`] events, oldest first.
    pub fn recent_events(&self) -> impl Iterator<Item = &Event> {
        self.recent.iter()
    }

    /// Job-wide counters.
    pub fn counters(&self) -> &GlobalCounters {
        &self.counters
    }

    /// A quorum continued from an older step than the best known: counted, and announced as
    /// a `progress_regressed` event.
    ///
    /// The job resumes from the latest complete durable snapshot when the quorum is behind
    /// it, else from the quorum's step; `steps_lost` counts from there (none when the
    /// snapshot is past `from_step`). Groups restore the newest snapshot newer than every
    /// member's step at the first answer of a new quorum (a regression always is one): a
    /// fresh member (a process holding its start-up state, as after a total loss) any newer
    /// one, a group that has trained one at least two steps ahead (the step that loads it
    /// does not commit, so one step ahead would gain nothing). The others heal from them.
    pub fn on_progress_regressed(&mut self, r: &super::Regression, now: Instant) {
        self.counters.progress_regressions += 1;
        let snapshot_step = self.snapshot.as_ref().map(|s| s.step);
        let ahead = if r.fresh { 1 } else { 2 };
        let resumes_from = snapshot_step
            .filter(|s| *s >= r.to_step + ahead)
            .unwrap_or(r.to_step);
        self.emit(
            now,
            EventKind::ProgressRegressed,
            json!({
                "quorum_id": r.quorum_id,
                "from_step": r.from_step,
                "to_step": r.to_step,
                "resumes_from": resumes_from,
                "steps_lost": (r.from_step - resumes_from).max(0),
                "alive_holders": r.alive_holders,
                "unavoidable": r.alive_holders.is_empty(),
                // Whether the regression landed on the latest durable snapshot (or how far
                // from it), for the post-mortem.
                "snapshot_step": snapshot_step,
            }),
        );
    }

    /// Counts a refused write-ahead commit.
    pub fn commit_refused(&mut self) {
        self.counters.commits_refused += 1;
    }

    /// Counts a refused batch of `n` reports.
    pub fn rejected(&mut self, n: u64) {
        self.counters.reports_rejected += n;
    }

    /// The group an incarnation belongs to, creating it or switching the group to this
    /// incarnation. None for a retired incarnation (an old process's late words).
    fn group_for(&mut self, incarnation: &str, now: Instant) -> Option<String> {
        if let Some(name) = self.by_incarnation.get(incarnation) {
            let g = self.groups.get(name)?;
            return (g.incarnation == incarnation).then(|| name.clone());
        }
        let name = base_id(incarnation).to_string();
        if let Some(g) = self.groups.get_mut(&name) {
            // A new start of a known group.
            let old = std::mem::replace(&mut g.incarnation, incarnation.to_string());
            g.retired.push_back(old);
            while g.retired.len() > RETIRED {
                if let Some(gone) = g.retired.pop_front() {
                    self.by_incarnation.remove(&gone);
                }
            }
            g.counters.incarnations += 1;
            g.ranks.clear();
            g.samples.clear();
            g.rate.clear();
            g.healing = false;
            g.committed = false;
            g.lifecycle = Lifecycle::Running;
            g.session_closed = false;
            g.hb_at = None;
            g.in_quorum = self.quorum_members.contains(incarnation);
            g.straggler = false;
            g.skew_pct = 0.0;
            g.last_error = None;
            g.last_commit = None;
            g.last_seen = now;
        } else {
            self.make_room();
            let unix = self.unix(now);
            self.goodput.seen(&name, unix);
            let mut g = Group::new(incarnation, now);
            g.in_quorum = self.quorum_members.contains(incarnation);
            self.groups.insert(name.clone(), g);
        }
        self.by_incarnation
            .insert(incarnation.to_string(), name.clone());
        self.emit(
            now,
            EventKind::ReplicaJoined,
            json!({"replica_id": name, "incarnation": incarnation, "hostname": ""}),
        );
        self.refresh(&name, now);
        Some(name)
    }

    /// Forgets the least recently seen inactive groups while over [`MAX_GROUPS`].
    fn make_room(&mut self) {
        while self.groups.len() >= MAX_GROUPS {
            let victim = self
                .groups
                .iter()
                .min_by_key(|(_, g)| {
                    let active = matches!(
                        g.state,
                        GroupState::Healthy | GroupState::Straggler | GroupState::Healing
                    );
                    (active, g.last_seen)
                })
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { return };
            self.goodput.forget(&victim);
            if let Some(g) = self.groups.remove(&victim) {
                self.by_incarnation.remove(&g.incarnation);
                for r in g.retired {
                    self.by_incarnation.remove(&r);
                }
            }
        }
    }

    /// A quorum member: creates or switches its group; `address` is its manager server (for
    /// the kill action), `step` its step. Refreshes the group's state.
    fn note_member(&mut self, incarnation: &str, address: &str, step: i64, now: Instant) {
        // The usual case, a member already known under this incarnation, updates the group
        // in place: this runs for every member of every quorum, 10,000 at a time.
        let timeout = self.opts.heartbeat_timeout;
        if let Some(name) = self.by_incarnation.get(incarnation) {
            let Some(g) = self.groups.get_mut(name) else {
                return;
            };
            if g.incarnation != incarnation {
                return; // a retired incarnation
            }
            g.seen_in_quorum(address, step, now);
            if g.derive(now, timeout).0 != g.state {
                let name = name.clone();
                self.refresh(&name, now);
            }
            return;
        }
        let Some(name) = self.group_for(incarnation, now) else {
            return;
        };
        if let Some(g) = self.groups.get_mut(&name) {
            g.seen_in_quorum(address, step, now);
        }
        self.refresh(&name, now);
    }

    /// Refreshes every group whose derived state changed (see [`Self::refresh`]), cloning
    /// only their names.
    fn refresh_all(&mut self, now: Instant) {
        let timeout = self.opts.heartbeat_timeout;
        let changed: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| g.derive(now, timeout).0 != g.state)
            .map(|(name, _)| name.clone())
            .collect();
        for name in changed {
            self.refresh(&name, now);
        }
    }

    /// The group's session opened (`open`) or ended.
    pub fn on_session(&mut self, incarnation: &str, open: bool, now: Instant) {
        if open {
            let Some(name) = self.group_for(incarnation, now) else {
                return;
            };
            if let Some(g) = self.groups.get_mut(&name) {
                g.session_closed = false;
                g.last_seen = now;
            }
            self.refresh(&name, now);
        } else if let Some(name) = self.current(incarnation) {
            if let Some(g) = self.groups.get_mut(&name) {
                g.session_closed = true;
                if g.lifecycle != Lifecycle::Finished {
                    self.goodput.ended(&name, incarnation);
                }
            }
            self.refresh(&name, now);
        }
    }

    /// The name of the group whose current incarnation this is.
    fn current(&self, incarnation: &str) -> Option<String> {
        let name = self.by_incarnation.get(incarnation)?;
        let g = self.groups.get(name)?;
        (g.incarnation == incarnation).then(|| name.clone())
    }

    /// A quorum was issued; `members` are `(lighthouse id, step, manager address)`. Called
    /// for every quorum issued (each steps-only round too): O(members), and O(groups) only
    /// when the quorum id changed (membership may have).
    ///
    /// `revision` is the quorum's (see `Quorum.revision`): a quorum no newer than the last one
    /// told is ignored, so the lighthouse may tell it from several tasks without a lock
    /// ordering them.
    pub fn on_quorum<'a, I>(&mut self, quorum_id: i64, revision: u64, members: I, now: Instant)
    where
        I: IntoIterator<Item = (&'a str, i64, &'a str)>,
        I::IntoIter: Clone,
    {
        if revision <= self.quorum_revision {
            return;
        }
        self.quorum_revision = revision;
        let members = members.into_iter();
        // A quorum id names one member set (the lighthouse keeps an id only while the
        // members stay the same).
        let changed = self.quorum_id != Some(quorum_id);
        if changed {
            self.quorum_members = members.clone().map(|(id, _, _)| id.to_string()).collect();
            let previous = self.quorum_id;
            self.quorum_id = Some(quorum_id);
            self.counters.quorum_changes += 1;
            let mut names: Vec<&str> = members.clone().map(|(id, _, _)| base_id(id)).collect();
            names.sort_unstable();
            self.emit(
                now,
                EventKind::QuorumChanged,
                json!({"quorum_id": quorum_id, "previous_quorum_id": previous,
                       "participants": names}),
            );
            for g in self.groups.values_mut() {
                g.in_quorum = self.quorum_members.contains(&g.incarnation);
            }
        }
        for (id, step, address) in members {
            self.note_member(id, address, step, now);
        }
        if changed {
            // Groups that left the quorum.
            self.refresh_all(now);
        }
    }

    /// Applies one validated report (see [`crate::telemetry::validate_report`]).
    pub fn on_report(&mut self, r: &TelemetryReport, now: Instant) {
        self.counters.reports += 1;
        let incarnation = if r.incarnation.is_empty() {
            match self.groups.get(&r.replica_id) {
                Some(g) => g.incarnation.clone(),
                None => r.replica_id.clone(),
            }
        } else {
            r.incarnation.clone()
        };
        let phase = Phase::try_from(r.phase).unwrap_or(Phase::Step);
        let name = self.group_for(&incarnation, now);
        let seen = name
            .as_ref()
            .and_then(|n| self.groups.get(n))
            .and_then(|g| g.ranks.get(&r.group_rank))
            .is_some_and(|k| phase == Phase::Step && r.unix_s > 0.0 && r.unix_s <= k.last_unix);
        if seen {
            // A report seen already: its batch was sent again (the first answer was lost).
            self.counters.reports_repeated += 1;
            return;
        }
        self.on_snapshot(r, phase, now);
        let Some(name) = name else {
            return;
        };
        let mut events: Vec<(EventKind, Value)> = Vec::new();
        let unix = self.unix(now);
        let Some(g) = self.groups.get_mut(&name) else {
            return;
        };
        let last_unix = g.ranks.get(&r.group_rank).map_or(0.0, |k| k.last_unix);
        g.counters.reports += 1;
        g.last_seen = now;
        g.last_report = Some(now);
        if !r.hostname.is_empty() && (g.hostname.is_empty() || r.group_rank == 0) {
            g.hostname = r.hostname.clone();
        }
        g.world_size = r.group_world_size;
        g.ranks.insert(
            r.group_rank,
            RankInfo {
                pid: r.pid,
                last_report: now,
                last_unix: if phase == Phase::Step {
                    r.unix_s.max(last_unix)
                } else {
                    last_unix
                },
            },
        );
        let lead = r.group_rank == 0;
        match phase {
            // Counted and announced above; the group was heard from, nothing more.
            Phase::Snapshot | Phase::SnapshotFailed => {}
            Phase::HealStarted => g.healing = true,
            Phase::Finished => {
                if lead {
                    let at = if r.unix_s > 0.0 { r.unix_s } else { unix };
                    self.goodput.finished(&name, at);
                }
                if g.lifecycle == Lifecycle::Running {
                    g.lifecycle = Lifecycle::Finished;
                    events.push((
                        EventKind::ReplicaFinished,
                        json!({"replica_id": name, "step": g.step}),
                    ));
                }
            }
            Phase::Failed => {
                if !matches!(g.lifecycle, Lifecycle::Failed(_)) {
                    let error = if r.error.is_empty() {
                        "failed".to_string()
                    } else {
                        r.error.clone()
                    };
                    g.last_error = Some(error.clone());
                    g.lifecycle = Lifecycle::Failed(error.clone());
                    events.push((
                        EventKind::ReplicaFailed,
                        json!({"replica_id": name, "error": error}),
                    ));
                }
            }
            Phase::Step => {
                if lead {
                    self.goodput.on_step(&name, r, unix);
                }
                g.counters.heal_bytes = g.counters.heal_bytes.saturating_add(r.heal_bytes);
                if r.healed {
                    g.last_heal_s = r.heal_s;
                    if lead {
                        g.counters.heals += 1;
                        let heal = HealRecord::from_report(r);
                        events.push((
                            EventKind::ReplicaHealed,
                            json!({"replica_id": name, "step": r.step, "heal_s": r.heal_s,
                                   "heal_bytes": r.heal_bytes, "source": heal.source,
                                   "addr": heal.addr, "gbps": heal.gbps}),
                        ));
                        g.last_heal = Some(heal);
                    }
                }
                g.participants = r.participants;
                if !r.error.is_empty() {
                    g.last_error = Some(r.error.clone());
                }
                if lead {
                    g.last_commit = Some(r.committed);
                }
                if r.committed {
                    g.committed = true;
                    g.healing = false;
                    let step = r.step + 1;
                    if step > g.step || lead {
                        g.step = step.max(g.step);
                    }
                    if lead {
                        g.counters.steps_committed += 1;
                        g.rate.push_back((now, step));
                        while g.rate.len() > RATE_POINTS {
                            g.rate.pop_front();
                        }
                    }
                    // Only committed steps describe the group's pace (a failed step is cut
                    // short by an abort or a timeout).
                    if !r.healed {
                        g.samples.push_back(Sample {
                            step_s: r.step_s,
                            busy_s: r.busy_s,
                            quorum_wait_s: r.quorum_wait_s,
                            collective_s: r.collective_s,
                            should_commit_s: r.should_commit_s,
                            input_s: r.input_s,
                            forward_s: r.forward_s,
                            backward_s: r.backward_s,
                            optimizer_s: r.optimizer_s,
                            cpu_s: r.cpu_s,
                            rss_bytes: r.rss_bytes,
                            host_load: r.host_load,
                            host_steal: r.host_steal,
                            host_mem_total: r.host_mem_total_bytes,
                            host_mem_available: r.host_mem_available_bytes,
                            net_rx: r.net_rx_bytes_per_s,
                            net_tx: r.net_tx_bytes_per_s,
                            gpu: r.gpu.then_some((
                                r.gpu_util_pct,
                                r.gpu_mem_used_bytes,
                                r.gpu_mem_total_bytes,
                            )),
                        });
                        while g.samples.len() > WINDOW {
                            g.samples.pop_front();
                        }
                    }
                } else if lead {
                    g.counters.commit_failures += 1;
                    let error = (!r.error.is_empty()).then(|| r.error.clone());
                    events.push((
                        EventKind::CommitFailed,
                        json!({"replica_id": name, "step": r.step, "error": error}),
                    ));
                }
            }
        }
        for (kind, fields) in events {
            self.emit(now, kind, fields);
        }
        self.refresh(&name, now);
    }

    /// Adds the drop count a batch carried to the group(s) it came from.
    pub fn on_dropped(&mut self, replica_id: &str, dropped: u64) {
        if let Some(g) = self.groups.get_mut(replica_id) {
            g.counters.reports_dropped += dropped;
        }
    }

    /// Periodic re-evaluation: heartbeat ages (`(lighthouse id, age)` of every known id) and
    /// the straggler verdicts.
    pub fn evaluate(&mut self, now: Instant, ages: &[(String, Duration)]) {
        let timeout = self.opts.heartbeat_timeout;
        let mut fresh: Vec<&str> = Vec::new();
        for (id, age) in ages {
            match self.by_incarnation.get(id.as_str()) {
                Some(name) => {
                    if let Some(g) = self.groups.get_mut(name) {
                        if g.incarnation == *id {
                            let at = now.checked_sub(*age).unwrap_or(now);
                            g.hb_at = Some(at);
                            g.last_seen = g.last_seen.max(at);
                        }
                    }
                }
                None if *age <= timeout => fresh.push(id),
                None => {}
            }
        }
        for id in fresh {
            // A group heard of only through heartbeats so far (or a restart of one).
            self.group_for(id, now);
        }
        self.judge_stragglers(now);
        self.refresh_all(now);
        self.goodput_tick(now);
    }

    /// Re-derives one group's state and emits the transition (and a loss) if it changed.
    fn refresh(&mut self, name: &str, now: Instant) {
        let timeout = self.opts.heartbeat_timeout;
        let Some(g) = self.groups.get_mut(name) else {
            return;
        };
        let (state, reason) = g.derive(now, timeout);
        if state == g.state {
            return;
        }
        let from = g.state;
        g.state = state;
        g.state_since = now;
        let step = g.step;
        let incarnation = g.incarnation.clone();
        if state == GroupState::Lost {
            g.counters.lost += 1;
        }
        self.emit(
            now,
            EventKind::StateChanged,
            json!({"replica_id": name, "from": from.as_str(), "to": state.as_str(),
                   "step": step, "reason": reason}),
        );
        if state == GroupState::Lost {
            self.emit(
                now,
                EventKind::ReplicaLost,
                json!({"replica_id": name, "incarnation": incarnation, "reason": reason}),
            );
        }
    }

    /// Whether this incarnation of a group reported a clean shutdown (`finished`), so its
    /// departure is expected rather than a fault.
    pub fn finished(&self, incarnation: &str) -> bool {
        self.groups
            .get(crate::telemetry::base_id(incarnation))
            .is_some_and(|g| g.incarnation == incarnation && g.lifecycle == Lifecycle::Finished)
    }

    /// The manager address of a group's current incarnation (for the kill action).
    pub fn manager_address(&self, replica_id: &str) -> Option<(String, String)> {
        let g = self.groups.get(replica_id)?;
        (!g.address.is_empty()).then(|| (g.incarnation.clone(), g.address.clone()))
    }

    /// Every group's status, sorted by replica id.
    pub fn replicas(&self, now: Instant) -> Vec<ReplicaStatus> {
        let unix = self.unix(now);
        let mut out: Vec<ReplicaStatus> =
            self.groups
                .iter()
                .map(|(name, g)| {
                    let figures = self.goodput.group_figures(name, unix);
                    ReplicaStatus {
                        replica_id: name.clone(),
                        incarnation: g.incarnation.clone(),
                        state: g.state,
                        state_since_s: now.saturating_duration_since(g.state_since).as_secs_f64(),
                        step: g.step,
                        hostname: g.hostname.clone(),
                        pids: g.ranks.values().map(|r| r.pid).collect(),
                        ranks_reporting: g.ranks.len(),
                        world_size: g.world_size,
                        last_heartbeat_age_s: g
                            .hb_at
                            .map(|t| now.saturating_duration_since(t).as_secs_f64()),
                        last_report_age_s: g
                            .ranks
                            .values()
                            .map(|r| r.last_report)
                            .max()
                            .or(g.last_report)
                            .map(|t| now.saturating_duration_since(t).as_secs_f64()),
                        in_quorum: g.in_quorum,
                        participants: g.participants,
                        last_commit: g.last_commit,
                        last_error: g.last_error.clone(),
                        straggler: g.straggler,
                        straggler_cause: g.straggler_cause,
                        skew_pct: round3(g.skew_pct),
                        steps_per_s: g.steps_per_s(),
                        timings: Timings {
                            step_s: g.timing(|s| s.step_s),
                            busy_s: g.timing(|s| s.busy_s),
                            quorum_wait_s: g.timing(|s| s.quorum_wait_s),
                            collective_s: g.timing(|s| s.collective_s),
                            should_commit_s: g.timing(|s| s.should_commit_s),
                            heal_s: (g.counters.heals > 0).then_some(g.last_heal_s),
                            input_s: g.timing(|s| s.input_s),
                            forward_s: g.timing(|s| s.forward_s),
                            backward_s: g.timing(|s| s.backward_s),
                            optimizer_s: g.timing(|s| s.optimizer_s),
                            cpu_s: g.timing(|s| s.cpu_s),
                            rss_bytes: g.samples.back().map(|s| s.rss_bytes),
                            host_load: g.timing(|s| s.host_load),
                            host_steal: g.timing(|s| s.host_steal),
                            host_mem_total_bytes: g
                                .samples
                                .back()
                                .map(|s| s.host_mem_total)
                                .filter(|b| *b > 0),
                            host_mem_available_bytes: g
                                .samples
                                .back()
                                .filter(|s| s.host_mem_total > 0)
                                .map(|s| s.host_mem_available),
                            net_rx_bytes_per_s: g.timing(|s| s.net_rx),
                            net_tx_bytes_per_s: g.timing(|s| s.net_tx),
                            gpu_util_pct: g.samples.back().and_then(|s| s.gpu).map(|_| {
                                median(g.samples.iter().filter_map(|s| s.gpu.map(|x| x.0)))
                            }),
                            gpu_mem_used_bytes: g.samples.back().and_then(|s| s.gpu).map(|x| x.1),
                            gpu_mem_total_bytes: g.samples.back().and_then(|s| s.gpu).map(|x| x.2),
                        },
                        counters: g.counters.clone(),
                        last_heal: g.last_heal.clone(),
                        goodput: figures.as_ref().map(Figures::to_json),
                        goodput_ratio: figures.as_ref().and_then(Figures::ratio),
                    }
                })
                .collect();
        out.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        out
    }
}

#[cfg(test)]
mod testkit;

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;

    #[test]
    fn joining_then_healthy_after_a_commit_in_the_quorum() {
        let now = Instant::now();
        let mut t = Telemetry::new(TelemetryOptions::default(), now, 0.0);
        let a = inc("a", U1);
        t.on_session(&a, true, now);
        assert_eq!(t.groups["a"].state, GroupState::Joining);
        t.on_quorum(1, 1, [(a.as_str(), 0, "http://a")], now);
        assert_eq!(t.groups["a"].state, GroupState::Joining, "no commit yet");
        t.on_report(&report(&a, 0, 0.1), now);
        assert_eq!(t.groups["a"].state, GroupState::Healthy);
        assert_eq!(t.groups["a"].step, 1);
        let kinds: Vec<&str> = t.take_events().iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["replica_joined", "quorum_changed", "state_changed"],
            "joined, quorum, joining -> healthy"
        );
    }

    #[test]
    fn a_quorum_told_late_does_not_undo_a_newer_one() {
        // The lighthouse tells telemetry of a quorum from its tick and from the round that
        // issued it, without a lock ordering the two: an older one arriving second is ignored.
        let mut j = Job::new(2);
        j.kinds();
        let members: Vec<(&str, i64, &str)> = j.ids.iter().map(|id| (id.as_str(), 3, "")).collect();
        j.t.on_quorum(9, 4, members.clone(), j.now);
        assert_eq!(j.t.quorum_id, Some(9));
        j.t.on_quorum(5, 3, members.clone(), j.now);
        assert_eq!(j.t.quorum_id, Some(9), "the older quorum came back");
        j.t.on_quorum(9, 4, members, j.now);
        let kinds: Vec<EventKind> = j.kinds().into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            kinds,
            [EventKind::QuorumChanged],
            "one change, to the newer quorum"
        );
        assert_eq!(
            j.t.counters.quorum_changes, 2,
            "the job's first quorum and this one"
        );
    }

    #[test]
    fn kill_restart_heal_walks_the_states() {
        let mut j = Job::new(2);
        j.kinds();
        let old = j.ids[1].clone();
        // SIGKILL: the session ends.
        j.now += Duration::from_millis(10);
        j.t.on_session(&old, false, j.now);
        assert_eq!(j.state("g1"), GroupState::Lost);
        assert_eq!(j.t.groups["g1"].counters.lost, 1);
        // The restarted process: a new incarnation.
        let new = inc("g1", U2);
        j.now += Duration::from_millis(10);
        j.t.on_session(&new, true, j.now);
        assert_eq!(j.state("g1"), GroupState::Joining);
        assert_eq!(j.t.groups["g1"].counters.incarnations, 2);
        // Late words of the dead incarnation are ignored.
        j.t.on_report(&report(&old, 1, 0.1), j.now);
        assert_eq!(j.state("g1"), GroupState::Joining);
        let mut r = report(&new, 0, 0.0);
        r.phase = Phase::HealStarted as i32;
        j.t.on_report(&r, j.now);
        assert_eq!(j.state("g1"), GroupState::Healing);
        j.ids[1] = new.clone();
        let members = j.ids.iter().map(|id| (id.as_str(), 1, ""));
        j.t.on_quorum(6, 2, members, j.now);
        let mut r = report(&new, 1, 0.1);
        r.healed = true;
        r.heal_s = 0.5;
        r.heal_bytes = 1000;
        r.heal_source = "g0".into();
        r.heal_addr = "192.0.2.2:41000".into();
        j.t.on_report(&r, j.now);
        assert_eq!(j.state("g1"), GroupState::Healthy);
        assert_eq!(j.t.groups["g1"].counters.heals, 1);
        assert_eq!(j.t.groups["g1"].counters.heal_bytes, 1000);
        let status = j.t.replicas(j.now);
        let g1 = status.iter().find(|s| s.replica_id == "g1").unwrap();
        assert_eq!(
            g1.last_heal,
            Some(HealRecord {
                source: "g0".into(),
                addr: "192.0.2.2:41000".into(),
                step: 1,
                seconds: 0.5,
                bytes: 1000,
                gbps: Some(0.000002),
            })
        );
        let events = j.t.take_events();
        let healed = events
            .iter()
            .find(|e| e.kind == EventKind::ReplicaHealed)
            .unwrap();
        assert_eq!(healed.fields["source"], "g0");
        assert_eq!(healed.fields["addr"], "192.0.2.2:41000");
        assert_eq!(healed.fields["heal_bytes"], 1000);
        let transitions: Vec<(String, String)> = events
            .into_iter()
            .filter(|e| e.kind == EventKind::StateChanged)
            .map(|e| {
                (
                    e.fields["from"].as_str().unwrap().to_string(),
                    e.fields["to"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want = [
            ("healthy", "lost"),
            ("lost", "joining"),
            ("joining", "healing"),
            ("healing", "healthy"),
        ];
        assert_eq!(
            transitions,
            want.map(|(a, b)| (a.to_string(), b.to_string()))
        );
    }

    #[test]
    fn heartbeat_timeout_is_lost_and_resuming_recovers() {
        let mut j = Job::new(2);
        let id = j.ids[0].clone();
        j.now += Duration::from_secs(6);
        j.t.evaluate(
            j.now,
            &[
                (id.clone(), Duration::from_secs(6)),
                (j.ids[1].clone(), Duration::ZERO),
            ],
        );
        assert_eq!(j.state("g0"), GroupState::Lost);
        // Its heartbeat record may be gone from the engine: the age keeps growing anyway.
        j.now += Duration::from_secs(2);
        j.t.evaluate(j.now, &[(j.ids[1].clone(), Duration::ZERO)]);
        let age = j.t.replicas(j.now)[0].last_heartbeat_age_s.unwrap();
        assert!((age - 8.0).abs() < 1e-6, "{age}");
        j.t.evaluate(
            j.now,
            &[(id, Duration::ZERO), (j.ids[1].clone(), Duration::ZERO)],
        );
        assert_eq!(j.state("g0"), GroupState::Healthy);
    }

    #[test]
    fn finished_and_failed_are_final_for_the_incarnation() {
        let mut j = Job::new(2);
        let mut r = report(&j.ids[0], 2, 0.0);
        r.phase = Phase::Finished as i32;
        j.t.on_report(&r, j.now);
        j.t.on_session(&j.ids[0].clone(), false, j.now);
        assert_eq!(j.state("g0"), GroupState::Finished);
        // Its departure is expected; the other group's (not finished) is not, nor is an
        // older incarnation of the finished one.
        assert!(j.t.finished(&j.ids[0]));
        assert!(!j.t.finished(&j.ids[1]));
        assert!(!j.t.finished(&inc("g0", U2)));
        let mut r = report(&j.ids[1], 2, 0.0);
        r.phase = Phase::Failed as i32;
        r.error = "boom".into();
        j.t.on_report(&r, j.now);
        assert_eq!(j.state("g1"), GroupState::Failed);
        assert_eq!(j.t.groups["g1"].last_error.as_deref(), Some("boom"));
    }

    #[test]
    fn the_history_ends_with_the_jobs_final_state() {
        let mut j = Job::new(1);
        j.t.evaluate(j.now, &j.ages());
        assert_eq!(j.t.history().0.len(), 1);
        // The last steps and the finish come well within the interval of the next point.
        for step in 1..4 {
            j.t.on_report(&report(&j.ids[0], step, 0.1), j.now);
        }
        let mut r = report(&j.ids[0], 4, 0.0);
        r.phase = Phase::Finished as i32;
        j.t.on_report(&r, j.now);
        let end = j.now + Duration::from_millis(100);
        j.t.evaluate(end, &j.ages());
        assert!(j.t.job_finished());
        let (points, _) = j.t.history();
        assert_eq!(points.len(), 2, "{points:?}");
        assert_eq!(points[1].step, Some(j.t.groups["g0"].step), "{points:?}");
        assert!(points[0].step < points[1].step, "{points:?}");
        // Once only.
        j.t.evaluate(end + Duration::from_millis(100), &j.ages());
        assert_eq!(j.t.history().0.len(), 2);
    }

    #[test]
    fn a_step_report_received_again_is_ignored() {
        let mut j = Job::new(2);
        let before = j.t.groups["g0"].counters.steps_committed;
        let r = report(&j.ids[0], 5, 0.1);
        j.t.on_report(&r, j.now);
        // Its batch was sent again after the answer was lost.
        j.t.on_report(&r, j.now);
        assert_eq!(j.t.groups["g0"].counters.steps_committed, before + 1);
        assert_eq!(j.t.counters().reports_repeated, 1);
        let later = report(&j.ids[0], 6, 0.1);
        j.t.on_report(&later, j.now);
        assert_eq!(j.t.groups["g0"].counters.steps_committed, before + 2);
    }

    #[test]
    fn commit_failures_count_and_emit() {
        let mut j = Job::new(2);
        j.kinds();
        let mut r = report(&j.ids[0], 1, 0.1);
        r.committed = false;
        r.error = "peer lost".into();
        j.t.on_report(&r, j.now);
        assert_eq!(j.t.groups["g0"].counters.commit_failures, 1);
        assert_eq!(j.kinds(), [(EventKind::CommitFailed, "g0".to_string())]);
    }

    #[test]
    fn groups_are_bounded() {
        let now = Instant::now();
        let mut t = Telemetry::new(TelemetryOptions::default(), now, 0.0);
        for i in 0..MAX_GROUPS + 10 {
            t.on_session(
                &format!("g{i}"),
                true,
                now + Duration::from_micros(i as u64),
            );
        }
        assert_eq!(t.groups.len(), MAX_GROUPS);
        assert!(t.by_incarnation.len() <= MAX_GROUPS);
        assert!(!t.groups.contains_key("g0"), "the oldest is forgotten");
        assert!(t.recent_events().count() <= RECENT_EVENTS);
    }

    #[test]
    fn event_json_is_flat_with_seq_ts_kind() {
        let now = Instant::now();
        let mut t = Telemetry::new(TelemetryOptions::default(), now, 100.0);
        t.emit(
            now + Duration::from_millis(1500),
            EventKind::KillRequested,
            json!({"replica_id": "a"}),
        );
        let e = t.take_events().remove(0).to_json();
        assert_eq!(e["seq"], 1);
        assert_eq!(e["kind"], "kill_requested");
        assert_eq!(e["replica_id"], "a");
        assert!((e["ts"].as_f64().unwrap() - 101.5).abs() < 1e-6);
    }
}
