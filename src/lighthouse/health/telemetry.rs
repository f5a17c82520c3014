//! Replica group health derived from the ranks' telemetry reports and the lighthouse's own
//! observations (quorums, sessions, heartbeat ages).
//!
//! Pure: every call takes `now`; wall-clock timestamps of events are derived from the
//! instant the state was created. Bounded: a window of recent samples per group, a capped
//! number of groups (the oldest inactive ones are forgotten first), a ring of recent events.
//! The service drains [`Telemetry::take_events`] after each call and publishes them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::proto::telemetry_report::Phase;
use crate::proto::TelemetryReport;
use crate::telemetry::{base_id, EventKind, MAX_ID_BYTES, MAX_PATH_BYTES};

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

/// Lifecycle state of a replica group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupState {
    /// Seen, but not yet in a quorum or without a committed step in this incarnation.
    Joining,
    /// Fetching live state from a peer.
    Healing,
    /// In the quorum and committing.
    Healthy,
    /// Healthy, but much slower than the median group.
    Straggler,
    /// The lighthouse stopped hearing from it.
    Lost,
    /// A rank reported a fatal error, or the group was killed.
    Failed,
    /// Shut down cleanly.
    Finished,
}

impl GroupState {
    /// Every state, in display order.
    pub const ALL: [GroupState; 7] = [
        GroupState::Joining,
        GroupState::Healing,
        GroupState::Healthy,
        GroupState::Straggler,
        GroupState::Lost,
        GroupState::Failed,
        GroupState::Finished,
    ];

    /// The state's name as shown on /status, /metrics and in events.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupState::Joining => "joining",
            GroupState::Healing => "healing",
            GroupState::Healthy => "healthy",
            GroupState::Straggler => "straggler",
            GroupState::Lost => "lost",
            GroupState::Failed => "failed",
            GroupState::Finished => "finished",
        }
    }
}

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
            straggler_skew_pct: 50.0,
            straggler_min: Duration::from_millis(50),
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

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    step_s: f64,
    busy_s: f64,
    quorum_wait_s: f64,
    collective_s: f64,
    should_commit_s: f64,
}

#[derive(Debug, Clone)]
struct RankInfo {
    pid: u32,
    last_report: Instant,
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
enum Lifecycle {
    Running,
    Finished,
    Failed(String),
}

#[derive(Debug)]
struct Group {
    incarnation: String,
    retired: VecDeque<String>,
    hostname: String,
    address: String,
    world_size: i64,
    ranks: BTreeMap<i64, RankInfo>,
    step: i64,
    participants: i64,
    last_commit: Option<bool>,
    last_error: Option<String>,
    samples: VecDeque<Sample>,
    last_heal_s: f64,
    last_heal: Option<HealRecord>,
    healing: bool,
    committed: bool,
    lifecycle: Lifecycle,
    session_closed: bool,
    /// When the current incarnation last heartbeated, as of the last evaluation.
    hb_at: Option<Instant>,
    in_quorum: bool,
    straggler: bool,
    /// When it was last flagged a straggler (or rejoined after being dropped as one): the
    /// drop window counts from here.
    straggler_since: Option<Instant>,
    skew_pct: f64,
    state: GroupState,
    state_since: Instant,
    last_seen: Instant,
    last_report: Option<Instant>,
    rate: VecDeque<(Instant, i64)>,
    counters: Counters,
}

impl Group {
    fn new(incarnation: &str, now: Instant) -> Self {
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
    fn busy_median(&self) -> Option<f64> {
        (self.samples.len() >= MIN_SAMPLES).then(|| median(self.samples.iter().map(|s| s.busy_s)))
    }

    fn timing(&self, f: impl Fn(&Sample) -> f64) -> Option<f64> {
        (!self.samples.is_empty()).then(|| median(self.samples.iter().map(f)))
    }

    fn steps_per_s(&self) -> Option<f64> {
        let (t0, s0) = self.rate.front()?;
        let (t1, s1) = self.rate.back()?;
        let dt = t1.saturating_duration_since(*t0).as_secs_f64();
        (dt > 0.0).then(|| (s1 - s0) as f64 / dt)
    }

    fn is_lost(&self, now: Instant, timeout: Duration) -> bool {
        if self.session_closed {
            return true;
        }
        let age = now.saturating_duration_since(self.hb_at.unwrap_or(self.last_seen));
        age > timeout
    }

    /// The state the observations imply (straggler included), and why.
    fn derive(&self, now: Instant, timeout: Duration) -> (GroupState, &'static str) {
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

fn median(values: impl Iterator<Item = f64>) -> f64 {
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

/// The last heal of a replica group, as its group rank 0 measured it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HealRecord {
    /// The replica group it healed from (empty if the reporter did not say).
    pub source: String,
    /// The address (`host:port`) its state was fetched from: the network the heal used
    /// (empty if the reporter did not say).
    pub addr: String,
    /// The step it healed to.
    pub step: i64,
    /// Seconds from asking the source to holding its state.
    pub seconds: f64,
    /// Bytes of state received.
    pub bytes: u64,
    /// `bytes / seconds` in GB/s (None when either is zero).
    pub gbps: Option<f64>,
}

impl HealRecord {
    fn from_report(r: &TelemetryReport) -> Self {
        Self {
            source: r.heal_source.clone(),
            addr: r.heal_addr.clone(),
            step: r.step,
            seconds: round6(r.heal_s),
            bytes: r.heal_bytes,
            gbps: (r.heal_s > 0.0 && r.heal_bytes > 0)
                .then(|| round6(r.heal_bytes as f64 / r.heal_s / 1e9)),
        }
    }
}

/// Per-replica view for `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaStatus {
    pub replica_id: String,
    pub incarnation: String,
    pub state: GroupState,
    pub state_since_s: f64,
    pub step: i64,
    pub hostname: String,
    pub pids: Vec<u32>,
    pub ranks_reporting: usize,
    pub world_size: i64,
    pub last_heartbeat_age_s: Option<f64>,
    pub last_report_age_s: Option<f64>,
    pub in_quorum: bool,
    pub participants: i64,
    pub last_commit: Option<bool>,
    pub last_error: Option<String>,
    pub straggler: bool,
    pub skew_pct: f64,
    pub steps_per_s: Option<f64>,
    pub timings: Timings,
    pub counters: Counters,
    /// The group's last heal: source, bytes, seconds and GB/s.
    pub last_heal: Option<HealRecord>,
}

/// Median timings over the window (seconds); `heal_s` is the last heal.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    pub step_s: Option<f64>,
    pub busy_s: Option<f64>,
    pub quorum_wait_s: Option<f64>,
    pub collective_s: Option<f64>,
    pub should_commit_s: Option<f64>,
    pub heal_s: Option<f64>,
}

/// Job-wide counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GlobalCounters {
    /// Quorums issued with a new quorum_id.
    pub quorum_changes: u64,
    /// Reports accepted.
    pub reports: u64,
    /// Reports refused as malformed.
    pub reports_rejected: u64,
    /// Events emitted.
    pub events: u64,
    /// Quorums issued behind the best committed step known (`progress_regressed`).
    pub progress_regressions: u64,
    /// Write-ahead commits refused (the group's quorum was replaced or it was declared lost).
    pub commits_refused: u64,
    /// Durable snapshots reported complete (`snapshot_complete`), newer or not.
    pub snapshots: u64,
    /// Durable snapshot attempts reported failed (`snapshot_failed`).
    pub snapshot_failures: u64,
}

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
    fn from_report(r: &TelemetryReport, unix_now: f64) -> Self {
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

/// The latest complete snapshot as `/status` shows it: the record and its age.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotStatus {
    /// The record, its fields inline.
    #[serde(flatten)]
    pub record: SnapshotRecord,
    /// Seconds since it completed (0 if its time is ahead of the lighthouse's clock).
    pub age_s: f64,
}

/// The derived health of every replica group.
#[derive(Debug)]
pub struct Telemetry {
    opts: TelemetryOptions,
    /// Creation instant and the unix time it corresponds to (event timestamps).
    epoch: (Instant, f64),
    groups: HashMap<String, Group>,
    /// Lighthouse id → replica group name, for current and retired incarnations.
    by_incarnation: HashMap<String, String>,
    quorum_id: Option<i64>,
    quorum_members: HashSet<String>,
    next_seq: u64,
    pending: Vec<Event>,
    recent: VecDeque<Event>,
    counters: GlobalCounters,
    /// The latest complete durable snapshot (None before the first one).
    snapshot: Option<SnapshotRecord>,
    /// Changes whenever `snapshot` does (the state file is rewritten then).
    snapshot_revision: u64,
}

impl Telemetry {
    /// Empty state; `now` corresponds to unix time `unix_now` (seconds).
    pub fn new(opts: TelemetryOptions, now: Instant, unix_now: f64) -> Self {
        Self {
            opts,
            epoch: (now, unix_now),
            groups: HashMap::new(),
            by_incarnation: HashMap::new(),
            quorum_id: None,
            quorum_members: HashSet::new(),
            next_seq: 1,
            pending: Vec::new(),
            recent: VecDeque::new(),
            counters: GlobalCounters::default(),
            snapshot: None,
            snapshot_revision: 0,
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
    pub fn on_progress_regressed(&mut self, r: &super::Regression, now: Instant) {
        self.counters.progress_regressions += 1;
        self.emit(
            now,
            EventKind::ProgressRegressed,
            json!({
                "quorum_id": r.quorum_id,
                "from_step": r.from_step,
                "to_step": r.to_step,
                "steps_lost": r.from_step - r.to_step,
                "alive_holders": r.alive_holders,
                "unavoidable": r.alive_holders.is_empty(),
                // Whether the regression landed on the latest durable snapshot (or how far
                // from it), for the post-mortem.
                "snapshot_step": self.snapshot.as_ref().map(|s| s.step),
            }),
        );
    }

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
    fn on_snapshot(&mut self, r: &TelemetryReport, phase: Phase, now: Instant) {
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
            if let Some(g) = self.groups.remove(&victim) {
                self.by_incarnation.remove(&g.incarnation);
                for r in g.retired {
                    self.by_incarnation.remove(&r);
                }
            }
        }
    }

    /// A quorum member: creates or switches its group; `address` is its manager server (for
    /// the kill action), `step` its step. The caller refreshes the group's state.
    fn note_member(&mut self, incarnation: &str, address: &str, step: i64, now: Instant) {
        let Some(name) = self.group_for(incarnation, now) else {
            return;
        };
        if let Some(g) = self.groups.get_mut(&name) {
            g.last_seen = now;
            if !address.is_empty() {
                g.address = address.to_string();
            }
            if step > g.step && !g.committed {
                g.step = step;
            }
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

    /// A quorum was issued; `members` are `(lighthouse id, step, manager address)`.
    pub fn on_quorum(&mut self, quorum_id: i64, members: &[(String, i64, String)], now: Instant) {
        self.quorum_members = members.iter().map(|(id, _, _)| id.clone()).collect();
        if self.quorum_id != Some(quorum_id) {
            let previous = self.quorum_id;
            self.quorum_id = Some(quorum_id);
            self.counters.quorum_changes += 1;
            let mut names: Vec<&str> = members.iter().map(|(id, _, _)| base_id(id)).collect();
            names.sort_unstable();
            self.emit(
                now,
                EventKind::QuorumChanged,
                json!({"quorum_id": quorum_id, "previous_quorum_id": previous,
                       "participants": names}),
            );
        }
        for (id, step, address) in members {
            self.note_member(id, address, *step, now);
        }
        let names: Vec<String> = self.groups.keys().cloned().collect();
        for name in names {
            if let Some(g) = self.groups.get_mut(&name) {
                g.in_quorum = self.quorum_members.contains(&g.incarnation);
            }
            self.refresh(&name, now);
        }
    }

    /// Applies one validated report (see [`validate_report`]).
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
        self.on_snapshot(r, phase, now);
        let Some(name) = name else {
            return;
        };
        let mut events: Vec<(EventKind, Value)> = Vec::new();
        let Some(g) = self.groups.get_mut(&name) else {
            return;
        };
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
            },
        );
        let lead = r.group_rank == 0;
        match phase {
            // Counted and announced above; the group was heard from, nothing more.
            Phase::Snapshot | Phase::SnapshotFailed => {}
            Phase::HealStarted => g.healing = true,
            Phase::Finished => {
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
        let mut fresh: Vec<String> = Vec::new();
        for (id, age) in ages {
            if let Some(name) = self.current(id) {
                if let Some(g) = self.groups.get_mut(&name) {
                    let at = now.checked_sub(*age).unwrap_or(now);
                    g.hb_at = Some(at);
                    g.last_seen = g.last_seen.max(at);
                }
            } else if *age <= timeout && !self.by_incarnation.contains_key(id) {
                fresh.push(id.clone());
            }
        }
        for id in fresh {
            // A group heard of only through heartbeats so far (or a restart of one).
            self.group_for(&id, now);
        }
        self.judge_stragglers(now);
        let names: Vec<String> = self.groups.keys().cloned().collect();
        for name in names {
            self.refresh(&name, now);
        }
    }

    fn judge_stragglers(&mut self, now: Instant) {
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
        let mut out: Vec<ReplicaStatus> = self
            .groups
            .iter()
            .map(|(name, g)| ReplicaStatus {
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
                skew_pct: round3(g.skew_pct),
                steps_per_s: g.steps_per_s(),
                timings: Timings {
                    step_s: g.timing(|s| s.step_s),
                    busy_s: g.timing(|s| s.busy_s),
                    quorum_wait_s: g.timing(|s| s.quorum_wait_s),
                    collective_s: g.timing(|s| s.collective_s),
                    should_commit_s: g.timing(|s| s.should_commit_s),
                    heal_s: (g.counters.heals > 0).then_some(g.last_heal_s),
                },
                counters: g.counters.clone(),
                last_heal: g.last_heal.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        out
    }
}

fn round3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

fn round6(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    const U1: &str = "11111111-1111-4111-8111-111111111111";
    const U2: &str = "22222222-2222-4222-8222-222222222222";

    fn inc(name: &str, u: &str) -> String {
        format!("{name}:{u}")
    }

    fn report(inc: &str, step: i64, busy: f64) -> TelemetryReport {
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
            unix_s: 1.0,
            ..Default::default()
        }
    }

    struct Job {
        t: Telemetry,
        now: Instant,
        ids: Vec<String>,
    }

    impl Job {
        /// `n` groups in one quorum, each with one committed step.
        fn new(n: usize) -> Self {
            let now = Instant::now();
            let mut t = Telemetry::new(TelemetryOptions::default(), now, 1000.0);
            let ids: Vec<String> = (0..n).map(|i| inc(&format!("g{i}"), U1)).collect();
            let members: Vec<(String, i64, String)> = ids
                .iter()
                .map(|id| (id.clone(), 0, format!("http://{id}")))
                .collect();
            t.on_quorum(5, &members, now);
            let mut j = Self { t, now, ids };
            j.step_all(&[0.1; 16][..n]);
            j
        }

        fn ages(&self) -> Vec<(String, Duration)> {
            self.ids
                .iter()
                .map(|id| (id.clone(), Duration::from_millis(50)))
                .collect()
        }

        fn step_all(&mut self, busy: &[f64]) {
            self.now += Duration::from_millis(200);
            for (id, b) in self.ids.clone().iter().zip(busy) {
                let step = self.t.groups[base_id(id)].step;
                self.t.on_report(&report(id, step, *b), self.now);
            }
            let ages = self.ages();
            self.t.evaluate(self.now, &ages);
        }

        fn state(&self, name: &str) -> GroupState {
            self.t.groups[name].state
        }

        fn kinds(&mut self) -> Vec<(EventKind, String)> {
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

    #[test]
    fn joining_then_healthy_after_a_commit_in_the_quorum() {
        let now = Instant::now();
        let mut t = Telemetry::new(TelemetryOptions::default(), now, 0.0);
        let a = inc("a", U1);
        t.on_session(&a, true, now);
        assert_eq!(t.groups["a"].state, GroupState::Joining);
        t.on_quorum(1, &[(a.clone(), 0, "http://a".into())], now);
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
        let members: Vec<(String, i64, String)> = j
            .ids
            .iter()
            .map(|id| (id.clone(), 1, String::new()))
            .collect();
        j.t.on_quorum(6, &members, j.now);
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

    fn snapshot(inc: &str, step: i64) -> TelemetryReport {
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
        let r = super::super::Regression {
            from_step: 40,
            to_step: 30,
            quorum_id: 9,
            alive_holders: Vec::new(),
        };
        j.t.on_progress_regressed(&r, j.now);
        let e = j.t.take_events().remove(0);
        assert_eq!(e.kind, EventKind::ProgressRegressed);
        assert_eq!(e.fields["snapshot_step"], 30);
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
