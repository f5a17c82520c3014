//! `GET /metrics`: the lighthouse's state in the Prometheus text exposition format (0.0.4).
//!
//! Names carry the `torchft_` prefix and base units (seconds, bytes); counters end in
//! `_total`; the only per-replica label is `replica_id` (bounded by the number of groups),
//! plus `state` on the one-hot state gauge. Never a step or a quorum id as a label.

use std::fmt::Write as _;

use super::telemetry::{Figures, GlobalCounters, GroupState, ReplicaStatus, SnapshotStatus};

/// Escapes a label value (backslash, double quote, newline).
fn label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Formats a sample value (Prometheus accepts Go float syntax; NaN/Inf spelled out).
fn value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

/// One metric family: its `# HELP`/`# TYPE` lines and its samples (of every room).
struct Family {
    name: String,
    header: String,
    samples: String,
}

/// Collects families in the order they are first written; the samples of every room go
/// under their family's one header.
#[derive(Default)]
struct Writer {
    families: Vec<Family>,
    index: std::collections::HashMap<String, usize>,
    current: usize,
    /// The room being written (empty: the default room, whose samples carry no `job`).
    job: String,
}

impl Writer {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        if let Some(&i) = self.index.get(name) {
            self.current = i;
            return;
        }
        let mut header = String::new();
        let _ = writeln!(header, "# HELP {name} {help}");
        let _ = writeln!(header, "# TYPE {name} {kind}");
        self.families.push(Family {
            name: name.to_string(),
            header,
            samples: String::new(),
        });
        self.current = self.families.len() - 1;
        self.index.insert(name.to_string(), self.current);
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let family = &mut self.families[self.current];
        debug_assert_eq!(family.name, name);
        let out = &mut family.samples;
        out.push_str(name);
        let job = (!self.job.is_empty()).then_some(("job", self.job.as_str()));
        let all: Vec<&(&str, &str)> = job.iter().chain(labels.iter()).collect();
        if !all.is_empty() {
            out.push('{');
            for (i, (k, val)) in all.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{k}=\"{}\"", label(val));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {}", value(v));
    }

    fn finish(self) -> String {
        let mut out = String::new();
        for f in self.families {
            out.push_str(&f.header);
            out.push_str(&f.samples);
        }
        out
    }

    /// One family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, v: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], v);
    }

    /// One family with one sample per replica (skipping replicas without a value).
    fn per_replica(
        &mut self,
        replicas: &[ReplicaStatus],
        name: &str,
        kind: &str,
        help: &str,
        f: impl Fn(&ReplicaStatus) -> Option<f64>,
    ) {
        self.family(name, kind, help);
        for r in replicas {
            if let Some(v) = f(r) {
                self.sample(name, &[("replica_id", &r.replica_id)], v);
            }
        }
    }
}

/// What `/metrics` shows besides the replicas.
pub struct JobMetrics {
    /// Id of the last issued quorum.
    pub quorum_id: Option<i64>,
    /// Members of the last issued quorum.
    pub quorum_participants: usize,
    /// Configured minimum number of replica groups.
    pub min_replicas: u64,
    /// Telemetry counters.
    pub counters: GlobalCounters,
    /// Event log lines dropped.
    pub event_log_dropped: u64,
    /// Replica groups held hung now (alive, training loop away past the hang timeout).
    pub replicas_hung: usize,
    /// The hang timeout now, in seconds.
    pub hang_timeout_s: f64,
    /// Steps whose state digests were compared across groups.
    pub parity_checks: u64,
    /// Groups found diverged by the parity check.
    pub replicas_diverged: u64,
    /// Groups stopped now by the parity check (no majority).
    pub replicas_stopped: usize,
    /// Groups dropped from the quorum now as lasting stragglers.
    pub replicas_dropped: usize,
    /// The latest complete durable snapshot, with its age (None before the first).
    pub snapshot: Option<SnapshotStatus>,
    /// The job's goodput figures (None before its first committed step).
    pub goodput: Option<Figures>,
}

/// Renders the exposition text of a lighthouse with one room.
pub fn render(job: &JobMetrics, replicas: &[ReplicaStatus]) -> String {
    render_rooms(&[("", job, replicas)])
}

/// Renders the exposition text of every room `(job, metrics, replicas)`: each family once,
/// with the samples of every room; a named room's samples carry its `job` label (the
/// default room's none, as a single-job lighthouse's).
pub fn render_rooms(rooms: &[(&str, &JobMetrics, &[ReplicaStatus])]) -> String {
    let mut w = Writer::default();
    w.family(
        "torchft_rooms",
        "gauge",
        "Rooms (jobs) open, the default room included.",
    );
    w.sample("torchft_rooms", &[], rooms.len() as f64);
    for (name, job, replicas) in rooms {
        w.job = name.to_string();
        render_room(&mut w, job, replicas);
    }
    w.finish()
}

fn render_room(w: &mut Writer, job: &JobMetrics, replicas: &[ReplicaStatus]) {
    if let Some(q) = job.quorum_id {
        let help = "Id of the last issued quorum.";
        w.single("torchft_quorum_id", "gauge", help, q as f64);
    }
    let c = &job.counters;
    let job_families: [(&str, &str, &str, f64); 18] = [
        (
            "torchft_quorum_participants",
            "gauge",
            "Replica groups in the last issued quorum.",
            job.quorum_participants as f64,
        ),
        (
            "torchft_min_replicas",
            "gauge",
            "Fewest replica groups a quorum may have.",
            job.min_replicas as f64,
        ),
        (
            "torchft_quorum_changes_total",
            "counter",
            "Quorums issued with a new quorum_id.",
            c.quorum_changes as f64,
        ),
        (
            "torchft_telemetry_reports_total",
            "counter",
            "Telemetry reports accepted.",
            c.reports as f64,
        ),
        (
            "torchft_telemetry_rejected_total",
            "counter",
            "Telemetry reports refused as malformed.",
            c.reports_rejected as f64,
        ),
        (
            "torchft_events_total",
            "counter",
            "Replica health events emitted.",
            c.events as f64,
        ),
        (
            "torchft_progress_regressions_total",
            "counter",
            "Quorums that continued from an older committed step than the best known \
             (progress_regressed events).",
            c.progress_regressions as f64,
        ),
        (
            "torchft_commits_refused_total",
            "counter",
            "Commits refused because the group's quorum was replaced or the group was \
             declared lost in it (the group heals instead of forking the job's state).",
            c.commits_refused as f64,
        ),
        (
            "torchft_event_log_dropped_total",
            "counter",
            "Event log lines dropped because the writer fell behind.",
            job.event_log_dropped as f64,
        ),
        (
            "torchft_snapshots_total",
            "counter",
            "Durable snapshots reported complete (snapshot_complete events), newer or not.",
            c.snapshots as f64,
        ),
        (
            "torchft_snapshot_failures_total",
            "counter",
            "Durable snapshot attempts reported failed (snapshot_failed events).",
            c.snapshot_failures as f64,
        ),
        (
            "torchft_replicas",
            "gauge",
            "Replica groups known.",
            replicas.len() as f64,
        ),
        (
            "torchft_replicas_hung",
            "gauge",
            "Replica groups held hung: alive, but their training loop has not reached their \
             manager for longer than the hang timeout while a round waited (replica_hung events).",
            job.replicas_hung as f64,
        ),
        (
            "torchft_hang_timeout_seconds",
            "gauge",
            "The hang timeout now (configured, or adaptive from the job's round interval).",
            job.hang_timeout_s,
        ),
        (
            "torchft_parity_checks_total",
            "counter",
            "Steps whose committed-state digests were compared across replica groups.",
            job.parity_checks as f64,
        ),
        (
            "torchft_replicas_diverged_total",
            "counter",
            "Replica groups whose committed state differed from the others' at the same step \
             (replica_diverged events).",
            job.replicas_diverged as f64,
        ),
        (
            "torchft_replicas_stopped",
            "gauge",
            "Replica groups stopped because their states differ with no majority to say which is \
             right.",
            job.replicas_stopped as f64,
        ),
        (
            "torchft_replicas_dropped",
            "gauge",
            "Replica groups dropped from the quorum now as lasting stragglers \
             (straggler_dropped events).",
            job.replicas_dropped as f64,
        ),
    ];
    for (name, kind, help, v) in job_families {
        w.single(name, kind, help, v);
    }
    // The latest snapshot's gauges are absent until one completed (like torchft_quorum_id
    // before the first quorum): a made-up value would read as a real step or age.
    if let Some(s) = &job.snapshot {
        for (name, help, v) in [
            (
                "torchft_snapshot_latest_step",
                "Committed step of the latest complete durable snapshot.",
                s.record.step as f64,
            ),
            (
                "torchft_snapshot_age_seconds",
                "Seconds since the latest complete durable snapshot completed.",
                s.age_s,
            ),
            (
                "torchft_snapshot_bytes",
                "Bytes of tensor data the latest complete durable snapshot holds.",
                s.record.bytes as f64,
            ),
            (
                "torchft_snapshot_write_seconds",
                "Seconds the latest complete durable snapshot took to write (in the \
                 background).",
                s.record.write_s,
            ),
            (
                "torchft_snapshot_stage_seconds",
                "Seconds the training thread was blocked staging the latest complete durable \
                 snapshot.",
                s.record.stage_s,
            ),
        ] {
            w.single(name, "gauge", help, v);
        }
    }

    if let Some(g) = &job.goodput {
        if let Some(ratio) = g.ratio() {
            w.single(
                "torchft_goodput_ratio",
                "gauge",
                "Productive time over wall time of the job's replica groups since its first \
                 committed step (docs/telemetry.md, Goodput).",
                ratio,
            );
        }
        w.family(
            "torchft_goodput_seconds_total",
            "counter",
            "The job's replica-group seconds since its first committed step, by account: \
             productive, quorum, discarded, heal, recovery, regressed (they sum to wall).",
        );
        let a = &g.accounts;
        for (account, v) in [
            ("wall", g.wall_s),
            ("productive", a.productive_s),
            ("quorum", a.quorum_s),
            ("discarded", a.discarded_s),
            ("heal", a.heal_s),
            ("recovery", g.recovery_s),
            ("regressed", a.regressed_s),
        ] {
            w.sample("torchft_goodput_seconds_total", &[("account", account)], v);
        }
        w.single(
            "torchft_goodput_regressed_steps_total",
            "counter",
            "Committed steps the job's progress later lost (progress_regressed), per group.",
            a.regressed_steps as f64,
        );
    }
    w.family(
        "torchft_replica_state",
        "gauge",
        "1 for the replica group's current state, 0 for the others.",
    );
    for r in replicas {
        for s in GroupState::ALL {
            let v = if r.state == s { 1.0 } else { 0.0 };
            w.sample(
                "torchft_replica_state",
                &[("replica_id", &r.replica_id), ("state", s.as_str())],
                v,
            );
        }
    }
    w.family(
        "torchft_straggler",
        "gauge",
        "1 for each replica group flagged a straggler, labelled with the cause named from its \
         step phases (input-bound, compute-bound, communication-bound, host-contended, \
         memory-growing, unattributed).",
    );
    for r in replicas {
        if let Some(cause) = r.straggler_cause {
            w.sample(
                "torchft_straggler",
                &[("replica_id", &r.replica_id), ("cause", cause)],
                1.0,
            );
        }
    }
    type Get = fn(&ReplicaStatus) -> Option<f64>;
    let per_replica: [(&str, &str, &str, Get); 29] = [
        (
            "torchft_replica_step",
            "gauge",
            "Last committed step.",
            |r| Some(r.step as f64),
        ),
        (
            "torchft_replica_goodput_ratio",
            "gauge",
            "The replica group's productive time over its wall time since the job's first \
             committed step.",
            |r| r.goodput_ratio,
        ),
        (
            "torchft_replica_heartbeat_age_seconds",
            "gauge",
            "Seconds since the replica group's last heartbeat.",
            |r| r.last_heartbeat_age_s,
        ),
        (
            "torchft_replica_busy_seconds",
            "gauge",
            "Median busy time per step (step time minus waits).",
            |r| r.timings.busy_s,
        ),
        (
            "torchft_replica_step_seconds",
            "gauge",
            "Median wall time per step.",
            |r| r.timings.step_s,
        ),
        (
            "torchft_replica_quorum_wait_seconds",
            "gauge",
            "Median time per step blocked on the quorum (healing included).",
            |r| r.timings.quorum_wait_s,
        ),
        (
            "torchft_replica_collective_seconds",
            "gauge",
            "Median time per step with a collective in flight.",
            |r| r.timings.collective_s,
        ),
        (
            "torchft_replica_should_commit_seconds",
            "gauge",
            "Median time per step in the commit vote.",
            |r| r.timings.should_commit_s,
        ),
        (
            "torchft_replica_input_seconds",
            "gauge",
            "Median time per step before the first forward (input and user code).",
            |r| r.timings.input_s,
        ),
        (
            "torchft_replica_forward_seconds",
            "gauge",
            "Median time per step in forward passes.",
            |r| r.timings.forward_s,
        ),
        (
            "torchft_replica_backward_seconds",
            "gauge",
            "Median time per step from the last forward to the optimizer step.",
            |r| r.timings.backward_s,
        ),
        (
            "torchft_replica_optimizer_seconds",
            "gauge",
            "Median time per step in the wrapped optimizer's own step.",
            |r| r.timings.optimizer_s,
        ),
        (
            "torchft_replica_cpu_seconds",
            "gauge",
            "Median CPU seconds per step of the group's reporting processes.",
            |r| r.timings.cpu_s,
        ),
        (
            "torchft_replica_resident_memory_bytes",
            "gauge",
            "Resident memory of the group's last reporting process.",
            |r| r.timings.rss_bytes.map(|b| b as f64),
        ),
        (
            "torchft_replica_host_load_ratio",
            "gauge",
            "Median 1-minute load average per CPU of the group's hosts.",
            |r| r.timings.host_load,
        ),
        (
            "torchft_replica_host_steal_ratio",
            "gauge",
            "Median share of the group's hosts' CPU time stolen by the hypervisor.",
            |r| r.timings.host_steal,
        ),
        (
            "torchft_replica_host_memory_available_bytes",
            "gauge",
            "Available memory of the host of the group's last reporting process.",
            |r| r.timings.host_mem_available_bytes.map(|b| b as f64),
        ),
        (
            "torchft_replica_host_memory_total_bytes",
            "gauge",
            "Total memory of the host of the group's last reporting process.",
            |r| r.timings.host_mem_total_bytes.map(|b| b as f64),
        ),
        (
            "torchft_replica_network_receive_bytes_per_second",
            "gauge",
            "Median network bytes per second received by the group's hosts (not loopback).",
            |r| r.timings.net_rx_bytes_per_s,
        ),
        (
            "torchft_replica_network_transmit_bytes_per_second",
            "gauge",
            "Median network bytes per second sent by the group's hosts (not loopback).",
            |r| r.timings.net_tx_bytes_per_s,
        ),
        (
            "torchft_replica_gpu_utilization_ratio",
            "gauge",
            "Median GPU utilisation of the group's reporting rank (NVML; absent without a GPU).",
            |r| r.timings.gpu_util_pct.map(|p| p / 100.0),
        ),
        (
            "torchft_replica_gpu_memory_used_bytes",
            "gauge",
            "GPU memory used on the device of the group's reporting rank (NVML).",
            |r| r.timings.gpu_mem_used_bytes.map(|b| b as f64),
        ),
        (
            "torchft_replica_skew_ratio",
            "gauge",
            "Busy time relative to the median of the healthy groups, minus 1.",
            |r| Some(r.skew_pct / 100.0),
        ),
        (
            "torchft_replica_steps_committed_total",
            "counter",
            "Steps the replica group committed.",
            |r| Some(r.counters.steps_committed as f64),
        ),
        (
            "torchft_replica_commit_failures_total",
            "counter",
            "Steps the replica group did not commit.",
            |r| Some(r.counters.commit_failures as f64),
        ),
        (
            "torchft_replica_heals_total",
            "counter",
            "Heals from a live peer.",
            |r| Some(r.counters.heals as f64),
        ),
        (
            "torchft_replica_heal_bytes_total",
            "counter",
            "Bytes fetched by heals.",
            |r| Some(r.counters.heal_bytes as f64),
        ),
        (
            "torchft_replica_lost_total",
            "counter",
            "Times the replica group was declared lost.",
            |r| Some(r.counters.lost as f64),
        ),
        (
            "torchft_replica_reports_dropped_total",
            "counter",
            "Telemetry reports its ranks and manager server dropped.",
            |r| Some(r.counters.reports_dropped as f64),
        ),
    ];
    for (name, kind, help, f) in per_replica {
        w.per_replica(replicas, name, kind, help, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(value(f64::NAN), "NaN");
        assert_eq!(value(1.5), "1.5");
        assert_eq!(value(3.0), "3");
    }

    #[test]
    fn every_family_has_help_and_type_and_counters_end_in_total() {
        let job = JobMetrics {
            quorum_id: Some(9),
            quorum_participants: 2,
            min_replicas: 2,
            counters: GlobalCounters::default(),
            event_log_dropped: 0,
            replicas_hung: 1,
            hang_timeout_s: 10.0,
            parity_checks: 3,
            replicas_diverged: 1,
            replicas_stopped: 0,
            replicas_dropped: 0,
            snapshot: None,
            goodput: None,
        };
        let text = render(&job, &[]);
        let mut families = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                families += 1;
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(name.starts_with("torchft_"), "{name}");
                assert_eq!(kind == "counter", name.ends_with("_total"), "{name}");
            }
        }
        assert!(families > 10);
        assert!(text.contains("torchft_quorum_id 9\n"));
        assert!(text.contains("torchft_snapshots_total 0\n"));
        assert!(text.contains("torchft_snapshot_failures_total 0\n"));
    }

    #[test]
    fn the_latest_snapshot_gauges_are_absent_until_one_completed() {
        let mut job = JobMetrics {
            quorum_id: None,
            quorum_participants: 0,
            min_replicas: 1,
            counters: GlobalCounters::default(),
            event_log_dropped: 0,
            replicas_hung: 0,
            hang_timeout_s: 10.0,
            parity_checks: 0,
            replicas_diverged: 0,
            replicas_stopped: 0,
            replicas_dropped: 0,
            snapshot: None,
            goodput: None,
        };
        let text = render(&job, &[]);
        assert!(!text.contains("torchft_snapshot_latest_step"), "{text}");
        assert!(!text.contains("torchft_snapshot_age_seconds"), "{text}");
        job.counters.snapshots = 3;
        job.counters.snapshot_failures = 1;
        job.snapshot = Some(SnapshotStatus {
            record: crate::lighthouse::health::telemetry::SnapshotRecord {
                step: 120,
                replica_id: "a".into(),
                incarnation: String::new(),
                path: "/ckpt".into(),
                bytes: 2048,
                stage_s: 0.25,
                write_s: 4.5,
                quorum_id: 1,
                unix_s: 1.0,
            },
            age_s: 30.5,
        });
        let text = render(&job, &[]);
        for line in [
            "torchft_snapshot_latest_step 120",
            "torchft_snapshot_age_seconds 30.5",
            "torchft_snapshot_bytes 2048",
            "torchft_snapshot_write_seconds 4.5",
            "torchft_snapshot_stage_seconds 0.25",
            "torchft_snapshots_total 3",
            "torchft_snapshot_failures_total 1",
            "# TYPE torchft_snapshot_latest_step gauge",
            "# TYPE torchft_snapshots_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing: {text}");
        }
    }
}
