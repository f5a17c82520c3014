//! The telemetry schema shared by the lighthouse and the manager servers: the limits and
//! validation of a rank's report, the replica-group name of an incarnation id, and the kinds
//! of events the lighthouse publishes (`/events`, the event log; see docs/telemetry.md).
//!
//! A manager server validates its ranks' reports before forwarding them, the lighthouse
//! validates what it receives; both take the rules from here, so neither depends on the other.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::proto::telemetry_report::Phase;
use crate::proto::{TelemetryBatch, TelemetryReport};

/// Reports accepted in one batch at most.
pub const MAX_BATCH: usize = 4096;
/// Longest replica id (an incarnation id may be twice as long).
pub const MAX_ID_BYTES: usize = 256;
/// Longest host name.
pub const MAX_HOSTNAME_BYTES: usize = 256;
/// Longest heal address (`host:port`, an IPv6 host in brackets).
pub const MAX_ADDR_BYTES: usize = MAX_HOSTNAME_BYTES + 16;
/// Longest error text.
pub const MAX_ERROR_BYTES: usize = 16 * 1024;
/// Longest snapshot path (a directory name; Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest duration a report may carry (seconds).
pub const MAX_SECONDS: f64 = 1e7;

/// What an event says happened. The wire name ([`EventKind::as_str`]) is what `/events` and
/// the event log carry in `kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// The lighthouse started (`min_replicas`, `pid`).
    LighthouseStarted,
    /// A quorum with another member set was issued (`quorum_id`, `previous_quorum_id`,
    /// `participants`).
    QuorumChanged,
    /// A replica group incarnation was first seen (`replica_id`, `incarnation`, `hostname`).
    ReplicaJoined,
    /// A replica group changed state (`replica_id`, `from`, `to`, `step`, `reason`).
    StateChanged,
    /// A replica group died or went silent (`replica_id`, `incarnation`, `reason`).
    ReplicaLost,
    /// A replica group healed from a peer (`replica_id`, `step`, `heal_s`, `heal_bytes`,
    /// `source`, `gbps`).
    ReplicaHealed,
    /// A replica group's step did not commit (`replica_id`, `step`, `error`).
    CommitFailed,
    /// A replica group became a straggler, or its named cause changed (`replica_id`,
    /// `skew_pct`, `busy_s`, `median_busy_s`, `cause`, `previous_cause`, `evidence`: its
    /// step phases against the job's median).
    StragglerFlagged,
    /// A replica group stopped being a straggler (same fields).
    StragglerCleared,
    /// A replica group's training failed (`replica_id`, `error`).
    ReplicaFailed,
    /// A replica group finished training (`replica_id`, `step`).
    ReplicaFinished,
    /// The dashboard's kill action was used (`replica_id`, `incarnation`).
    KillRequested,
    /// A quorum continued from an older step than the best committed one known
    /// (`quorum_id`, `from_step`, `to_step`, `resumes_from`, `steps_lost`, `alive_holders`,
    /// `unavoidable`, `snapshot_step`).
    ProgressRegressed,
    /// A replica group's training loop stopped reaching its manager while its process lives
    /// and a round waits on it: the others go on without it (`replica_id`, `idle_s`,
    /// `hang_timeout_s`, `rule`).
    ReplicaHung,
    /// A hung replica group's training loop came back (`replica_id`, `hung_s`).
    ReplicaResumed,
    /// Runtime state parity found a group's committed state different from the others' at
    /// the same step (`replica_id`, `step`, `action`: `heal` from the agreeing majority or
    /// `stop` when no majority agrees, `majority`, `compared`, `ranks`).
    ReplicaDiverged,
    /// A lasting straggler was dropped from the quorum for a while
    /// (`--straggler_drop_after_ms`): `replica_id`, `incarnation`, `reason`, `for_s`.
    StragglerDropped,
    /// A durable snapshot of a committed step completed (`replica_id`, `incarnation`, `step`,
    /// `path`, `bytes`, `stage_s`, `write_s`, `quorum_id`, `unix_s`, `latest`: whether it is
    /// now the latest complete snapshot the lighthouse knows).
    SnapshotComplete,
    /// A durable snapshot attempt failed (`replica_id`, `step`, `error`, `path`).
    SnapshotFailed,
    /// The job's goodput accounts, every few seconds while it trains and once more
    /// (`final`: true) when every group finished (`window_start_unix_s`, `step`, the job's
    /// accounts and `ratio`, and per group in `groups`; see docs/telemetry.md).
    Goodput,
}

impl EventKind {
    /// Every kind, in documentation order.
    pub const ALL: [EventKind; 20] = [
        EventKind::LighthouseStarted,
        EventKind::QuorumChanged,
        EventKind::ReplicaJoined,
        EventKind::StateChanged,
        EventKind::ReplicaLost,
        EventKind::ReplicaHealed,
        EventKind::CommitFailed,
        EventKind::StragglerFlagged,
        EventKind::StragglerCleared,
        EventKind::ReplicaFailed,
        EventKind::ReplicaFinished,
        EventKind::KillRequested,
        EventKind::ProgressRegressed,
        EventKind::ReplicaHung,
        EventKind::ReplicaResumed,
        EventKind::ReplicaDiverged,
        EventKind::StragglerDropped,
        EventKind::SnapshotComplete,
        EventKind::SnapshotFailed,
        EventKind::Goodput,
    ];

    /// The name events carry in `kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::LighthouseStarted => "lighthouse_started",
            EventKind::QuorumChanged => "quorum_changed",
            EventKind::ReplicaJoined => "replica_joined",
            EventKind::StateChanged => "state_changed",
            EventKind::ReplicaLost => "replica_lost",
            EventKind::ReplicaHealed => "replica_healed",
            EventKind::CommitFailed => "commit_failed",
            EventKind::StragglerFlagged => "straggler_flagged",
            EventKind::StragglerCleared => "straggler_cleared",
            EventKind::ReplicaFailed => "replica_failed",
            EventKind::ReplicaFinished => "replica_finished",
            EventKind::KillRequested => "kill_requested",
            EventKind::ProgressRegressed => "progress_regressed",
            EventKind::ReplicaHung => "replica_hung",
            EventKind::ReplicaResumed => "replica_resumed",
            EventKind::ReplicaDiverged => "replica_diverged",
            EventKind::StragglerDropped => "straggler_dropped",
            EventKind::SnapshotComplete => "snapshot_complete",
            EventKind::SnapshotFailed => "snapshot_failed",
            EventKind::Goodput => "goodput",
        }
    }

    /// Whether events of this kind concern one replica group and name it in `replica_id`.
    pub fn names_a_replica(self) -> bool {
        !matches!(
            self,
            EventKind::LighthouseStarted
                | EventKind::QuorumChanged
                | EventKind::ProgressRegressed
                | EventKind::Goodput
        )
    }

    /// The kind with wire name `name`.
    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for EventKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl From<EventKind> for Value {
    fn from(k: EventKind) -> Value {
        Value::String(k.as_str().to_string())
    }
}

/// Checks one report; nothing is applied if any report of a batch is refused.
pub fn validate_report(r: &TelemetryReport) -> Result<()> {
    let bad = |what: String| Err(Error::InvalidArgument(format!("telemetry report: {what}")));
    if r.replica_id.trim().is_empty() {
        return bad("replica_id must not be empty".into());
    }
    if r.replica_id.len() > MAX_ID_BYTES || r.incarnation.len() > 2 * MAX_ID_BYTES {
        return bad(format!(
            "replica_id/incarnation longer than {MAX_ID_BYTES}/{} bytes",
            2 * MAX_ID_BYTES
        ));
    }
    if !r.incarnation.is_empty() && base_id(&r.incarnation) != r.replica_id {
        return bad(format!(
            "incarnation {:?} does not belong to replica_id {:?}",
            r.incarnation, r.replica_id
        ));
    }
    if r.heal_source.len() > MAX_ID_BYTES {
        return bad(format!("heal_source longer than {MAX_ID_BYTES} bytes"));
    }
    if r.heal_addr.len() > MAX_ADDR_BYTES {
        return bad(format!("heal_addr longer than {MAX_ADDR_BYTES} bytes"));
    }
    if r.hostname.len() > MAX_HOSTNAME_BYTES {
        return bad(format!("hostname longer than {MAX_HOSTNAME_BYTES} bytes"));
    }
    if r.error.len() > MAX_ERROR_BYTES {
        return bad(format!("error longer than {MAX_ERROR_BYTES} bytes"));
    }
    if r.snapshot_path.len() > MAX_PATH_BYTES {
        return bad(format!("snapshot_path longer than {MAX_PATH_BYTES} bytes"));
    }
    if r.group_world_size < 1 || r.group_world_size > 1 << 20 {
        return bad(format!(
            "group_world_size must be in 1..=1048576, got {}",
            r.group_world_size
        ));
    }
    if r.group_rank < 0 || r.group_rank >= r.group_world_size {
        return bad(format!(
            "group_rank must be in [0, {}), got {}",
            r.group_world_size, r.group_rank
        ));
    }
    if r.rank < -1 {
        return bad(format!("rank must be -1 (unknown) or more, got {}", r.rank));
    }
    if r.step < 0 || r.participants < 0 {
        return bad("step and participants must not be negative".into());
    }
    if Phase::try_from(r.phase).is_err() {
        return bad(format!("unknown phase {}", r.phase));
    }
    for (name, v) in [
        ("step_s", r.step_s),
        ("quorum_wait_s", r.quorum_wait_s),
        ("collective_s", r.collective_s),
        ("should_commit_s", r.should_commit_s),
        ("busy_s", r.busy_s),
        ("heal_s", r.heal_s),
        ("snapshot_stage_s", r.snapshot_stage_s),
        ("snapshot_write_s", r.snapshot_write_s),
        ("input_s", r.input_s),
        ("forward_s", r.forward_s),
        ("backward_s", r.backward_s),
        ("optimizer_s", r.optimizer_s),
        ("cpu_s", r.cpu_s),
    ] {
        if !v.is_finite() || !(0.0..=MAX_SECONDS).contains(&v) {
            return bad(format!(
                "{name} must be a finite number of seconds >= 0, got {v}"
            ));
        }
    }
    if !r.host_load.is_finite() || !(0.0..=1e6).contains(&r.host_load) {
        return bad(format!(
            "host_load must be a finite load average per CPU >= 0, got {}",
            r.host_load
        ));
    }
    if !r.unix_s.is_finite() || r.unix_s < 0.0 {
        return bad(format!("unix_s must be finite and >= 0, got {}", r.unix_s));
    }
    for (name, v) in [
        ("net_rx_bytes_per_s", r.net_rx_bytes_per_s),
        ("net_tx_bytes_per_s", r.net_tx_bytes_per_s),
    ] {
        if !v.is_finite() || !(0.0..=1e13).contains(&v) {
            return bad(format!(
                "{name} must be a finite number of bytes per second >= 0, got {v}"
            ));
        }
    }
    if !r.host_steal.is_finite() || !(0.0..=1.0).contains(&r.host_steal) {
        return bad(format!(
            "host_steal must be a share of CPU time in [0, 1], got {}",
            r.host_steal
        ));
    }
    if r.host_mem_available_bytes > r.host_mem_total_bytes {
        return bad(format!(
            "host_mem_available_bytes ({}) exceeds host_mem_total_bytes ({})",
            r.host_mem_available_bytes, r.host_mem_total_bytes
        ));
    }
    if !r.gpu_util_pct.is_finite() || !(0.0..=100.0).contains(&r.gpu_util_pct) {
        return bad(format!(
            "gpu_util_pct must be a percentage in [0, 100], got {}",
            r.gpu_util_pct
        ));
    }
    if r.gpu_mem_used_bytes > r.gpu_mem_total_bytes {
        return bad(format!(
            "gpu_mem_used_bytes ({}) exceeds gpu_mem_total_bytes ({})",
            r.gpu_mem_used_bytes, r.gpu_mem_total_bytes
        ));
    }
    if !r.gpu && (r.gpu_util_pct != 0.0 || r.gpu_mem_used_bytes != 0 || r.gpu_mem_total_bytes != 0)
    {
        return bad("gpu metrics without gpu = true".to_string());
    }
    Ok(())
}

/// Checks a batch (size and every report).
pub fn validate_batch(b: &TelemetryBatch) -> Result<()> {
    if b.reports.len() > MAX_BATCH {
        return Err(Error::InvalidArgument(format!(
            "telemetry batch of {} reports (at most {MAX_BATCH})",
            b.reports.len()
        )));
    }
    b.reports.iter().try_for_each(validate_report)
}

/// The replica group name of a lighthouse id: `name:uuid` → `name`; other ids are their own
/// name.
pub fn base_id(incarnation: &str) -> &str {
    match incarnation.rsplit_once(':') {
        Some((base, suffix)) if !base.is_empty() && is_uuid(suffix) => base,
        _ => incarnation,
    }
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const U1: &str = "11111111-1111-4111-8111-111111111111";

    fn inc(name: &str, u: &str) -> String {
        format!("{name}:{u}")
    }

    fn report(inc: &str) -> TelemetryReport {
        TelemetryReport {
            replica_id: base_id(inc).to_string(),
            incarnation: inc.to_string(),
            group_rank: 0,
            group_world_size: 1,
            hostname: "h".into(),
            step_s: 0.11,
            busy_s: 0.1,
            unix_s: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn event_kinds_round_trip_and_are_unique() {
        let names: std::collections::HashSet<&str> =
            EventKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), EventKind::ALL.len());
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.as_str()), Some(k));
            assert_eq!(Value::from(k), Value::String(k.to_string()));
        }
        assert_eq!(EventKind::parse("feed_lagged"), None);
        assert!(EventKind::CommitFailed.names_a_replica());
        assert!(!EventKind::QuorumChanged.names_a_replica());
    }

    #[test]
    fn base_id_strips_only_a_uuid_suffix() {
        assert_eq!(base_id(&inc("train_0", U1)), "train_0");
        assert_eq!(base_id(&inc("a:b", U1)), "a:b");
        assert_eq!(base_id("host:1234"), "host:1234");
        assert_eq!(base_id(U1), U1);
        assert_eq!(base_id(&format!(":{U1}")), format!(":{U1}"));
    }

    #[test]
    fn bad_reports_are_refused() {
        let good = report(&inc("a", U1));
        assert!(validate_report(&good).is_ok());
        let snapshot = TelemetryReport {
            phase: Phase::Snapshot as i32,
            snapshot_path: "p".repeat(MAX_PATH_BYTES),
            snapshot_stage_s: 0.25,
            snapshot_write_s: 12.0,
            snapshot_bytes: u64::MAX,
            ..good.clone()
        };
        assert!(
            validate_report(&snapshot).is_ok(),
            "a snapshot at the limits"
        );
        let system = TelemetryReport {
            host_mem_total_bytes: 64 << 30,
            host_mem_available_bytes: 8 << 30,
            net_rx_bytes_per_s: 1.25e9,
            net_tx_bytes_per_s: 0.0,
            host_steal: 0.25,
            gpu: true,
            gpu_util_pct: 100.0,
            gpu_mem_used_bytes: 70 << 30,
            gpu_mem_total_bytes: 80 << 30,
            ..good.clone()
        };
        assert!(validate_report(&system).is_ok(), "system metrics in range");
        type Breaker = Box<dyn Fn(&mut TelemetryReport)>;
        let cases: Vec<Breaker> = vec![
            Box::new(|r| r.replica_id.clear()),
            Box::new(|r| r.replica_id = "x".repeat(300)),
            Box::new(|r| r.incarnation = inc("other", U1)),
            Box::new(|r| r.group_world_size = 0),
            Box::new(|r| r.group_rank = 1),
            Box::new(|r| r.step = -1),
            Box::new(|r| r.busy_s = f64::NAN),
            Box::new(|r| r.step_s = -1.0),
            Box::new(|r| r.heal_s = f64::INFINITY),
            Box::new(|r| r.phase = 99),
            Box::new(|r| r.error = "e".repeat(MAX_ERROR_BYTES + 1)),
            Box::new(|r| r.heal_addr = "a".repeat(MAX_ADDR_BYTES + 1)),
            Box::new(|r| r.snapshot_path = "p".repeat(MAX_PATH_BYTES + 1)),
            Box::new(|r| r.snapshot_stage_s = -0.5),
            Box::new(|r| r.snapshot_write_s = f64::NAN),
            Box::new(|r| r.snapshot_write_s = f64::INFINITY),
            Box::new(|r| r.input_s = -0.1),
            Box::new(|r| r.backward_s = f64::NAN),
            Box::new(|r| r.cpu_s = f64::INFINITY),
            Box::new(|r| r.host_load = -1.0),
            Box::new(|r| r.host_load = f64::NAN),
            Box::new(|r| r.net_rx_bytes_per_s = -1.0),
            Box::new(|r| r.net_tx_bytes_per_s = f64::INFINITY),
            Box::new(|r| r.host_steal = 1.5),
            Box::new(|r| r.host_mem_available_bytes = 2),
            Box::new(|r| {
                r.gpu = true;
                r.gpu_util_pct = 101.0;
            }),
            Box::new(|r| {
                r.gpu = true;
                r.gpu_mem_used_bytes = 2;
                r.gpu_mem_total_bytes = 1;
            }),
            Box::new(|r| r.gpu_util_pct = 50.0),
        ];
        for (i, break_it) in cases.iter().enumerate() {
            let mut r = good.clone();
            break_it(&mut r);
            assert!(validate_report(&r).is_err(), "case {i} accepted");
        }
        let batch = TelemetryBatch {
            reports: vec![good; MAX_BATCH + 1],
            dropped: 0,
            ..Default::default()
        };
        assert!(validate_batch(&batch).is_err());
    }
}
