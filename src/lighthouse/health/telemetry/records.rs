//! The records the health model shows on the status pages and in `/metrics`: each group's
//! status and timings, job-wide counters, heal and snapshot records as shown.

use serde::Serialize;

use super::{Counters, SnapshotRecord};
use crate::proto::TelemetryReport;

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
    pub(super) fn from_report(r: &TelemetryReport) -> Self {
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
    /// Why it is a straggler: input-bound, compute-bound, communication-bound,
    /// host-contended, memory-growing or unattributed (docs/telemetry.md); None otherwise.
    pub straggler_cause: Option<&'static str>,
    pub skew_pct: f64,
    pub steps_per_s: Option<f64>,
    pub timings: Timings,
    pub counters: Counters,
    /// The group's last heal: source, bytes, seconds and GB/s.
    pub last_heal: Option<HealRecord>,
    /// The group's goodput accounts (see docs/telemetry.md), null before the job's first
    /// committed step.
    pub goodput: Option<serde_json::Map<String, serde_json::Value>>,
    /// Its goodput ratio (productive / wall time).
    pub goodput_ratio: Option<f64>,
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
    /// The busy time's phases (see `TelemetryReport`): input, forward, backward, optimizer.
    pub input_s: Option<f64>,
    pub forward_s: Option<f64>,
    pub backward_s: Option<f64>,
    pub optimizer_s: Option<f64>,
    /// CPU seconds per step of the reporting processes.
    pub cpu_s: Option<f64>,
    /// Resident memory of the last report's process (bytes).
    pub rss_bytes: Option<u64>,
    /// The host's 1-minute load average per CPU.
    pub host_load: Option<f64>,
    /// The share of the host's CPU time stolen by the hypervisor.
    pub host_steal: Option<f64>,
    /// The host's memory, total and available, at the last report (bytes; null where not
    /// reported).
    pub host_mem_total_bytes: Option<u64>,
    pub host_mem_available_bytes: Option<u64>,
    /// The host's network throughput, other than loopback (bytes per second).
    pub net_rx_bytes_per_s: Option<f64>,
    pub net_tx_bytes_per_s: Option<f64>,
    /// The rank's GPU through NVML (null without one): median utilisation percent, and
    /// memory used and total at the last report.
    pub gpu_util_pct: Option<f64>,
    pub gpu_mem_used_bytes: Option<u64>,
    pub gpu_mem_total_bytes: Option<u64>,
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
    /// Reports received again (a batch resent after its answer was lost), ignored.
    pub reports_repeated: u64,
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

pub(super) fn round3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

pub(super) fn round6(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}
