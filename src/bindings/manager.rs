//! Python wrappers for the manager server and client (`ManagerServer`, `ManagerClient`,
//! `QuorumResult`).
//!
//! Thin: convert arguments, release the GIL, run the core on the process-wide runtime, convert
//! the result. Deadline expiry raises `TimeoutError`, bad arguments `ValueError`.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{block_on, check_duration, TorchFTError};
use crate::manager::reports::ReportQueue;
use crate::manager::topology::{Placement, Topology};
use crate::manager::{
    ManagerClient as CoreClient, ManagerOptions, ManagerServer as CoreServer,
    DEFAULT_MAX_REQUEST_BYTES,
};
use crate::proto::telemetry_report::Phase;
use crate::proto::{ManagerQuorumRequest, ManagerQuorumResponse, TelemetryReport};
use crate::security::Security;
use crate::telemetry::validate_report;

/// The manager server of one replica group (hosted by group rank 0).
///
/// Gathers the group's ranks for each quorum, asks the lighthouse once, answers each rank its
/// role, and heartbeats the lighthouse on its own.
///
/// Args:
///     replica_id: id of this incarnation of the replica group.
///     lighthouse_addr: the lighthouse address (`http://host:port`).
///     hostname: host name other groups dial to reach this server.
///     bind: address to listen on, e.g. `"[::]:0"`.
///     store_addr: the group's rendezvous store (`host:port`), handed to other groups.
///     world_size: ranks in the group (>= 1); every quorum waits for all of them.
///     heartbeat_interval: how often to heartbeat the lighthouse (a `timedelta`).
///     connect_timeout: how long to keep retrying the lighthouse connection.
///     quorum_retries: extra attempts of a failed lighthouse quorum request (>= 0).
///     topology_file: the job's topology file (`WORLD_TOPOLOGY_FILE`); heal sources then
///         follow it when every group of a quorum announced the same file.
///     topology_group: this replica group's index in the job (its ranks in the file are
///         `topology_group * world_size + group_rank`); required with `topology_file`.
///
/// Raises:
///     ValueError: an argument is out of range, or the topology file is unreadable or
///         malformed (the message names the field) or lacks this group's ranks.
///     TimeoutError: the lighthouse cannot be reached within `connect_timeout`.
#[pyclass(module = "torchft._torchft", name = "ManagerServer", frozen)]
pub struct PyManagerServer {
    server: CoreServer,
}

#[pymethods]
impl PyManagerServer {
    /// Starts the server on `bind` and begins heartbeating the lighthouse.
    #[new]
    #[pyo3(signature = (
        replica_id,
        lighthouse_addr,
        hostname,
        bind,
        store_addr,
        world_size,
        heartbeat_interval = Duration::from_millis(100),
        connect_timeout = Duration::from_secs(60),
        quorum_retries = 0,
        topology_file = None,
        topology_group = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        replica_id: String,
        lighthouse_addr: String,
        hostname: String,
        bind: String,
        store_addr: String,
        world_size: i64,
        heartbeat_interval: Duration,
        connect_timeout: Duration,
        quorum_retries: i64,
        topology_file: Option<std::path::PathBuf>,
        topology_group: Option<i64>,
    ) -> PyResult<Self> {
        if world_size < 1 {
            return Err(PyValueError::new_err(format!(
                "world_size must be at least 1, got {world_size}"
            )));
        }
        if quorum_retries < 0 {
            return Err(PyValueError::new_err(format!(
                "quorum_retries must not be negative, got {quorum_retries}"
            )));
        }
        let placement =
            match (topology_file, topology_group) {
                (None, _) => None,
                (Some(_), None) => return Err(PyValueError::new_err(
                    "topology_file needs topology_group (this replica group's index in the job)",
                )),
                (Some(_), Some(g)) if g < 0 => {
                    return Err(PyValueError::new_err(format!(
                        "topology_group must not be negative, got {g}"
                    )))
                }
                (Some(path), Some(g)) => Some(Placement {
                    topology: std::sync::Arc::new(Topology::load(&path)?),
                    group: g as u64,
                }),
            };
        let opts = ManagerOptions {
            replica_id,
            lighthouse_addr,
            hostname,
            bind,
            store_addr,
            world_size: world_size as u64,
            heartbeat_interval: check_duration("heartbeat_interval", heartbeat_interval)?,
            connect_timeout: check_duration("connect_timeout", connect_timeout)?,
            quorum_retries: quorum_retries as u64,
            security: Security::from_env()?,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            placement,
        };
        let server = block_on(py, CoreServer::start(opts))?;
        Ok(Self { server })
    }

    /// The address ranks and other groups dial: `http://{hostname}:{port}`.
    fn address(&self) -> String {
        self.server.address()
    }

    /// False if this group's heartbeats lapsed during the current step (it may have been
    /// declared lost): the step must not commit.
    fn lease_held(&self) -> bool {
        self.server.lease_held()
    }

    /// Whether this group may commit `step` (its committed step count before the commit):
    /// its lease held and the lighthouse accepted the write-ahead announcement (retried up
    /// to `timeout` while the lighthouse is unreachable). Single-rank groups ask this.
    fn may_commit(
        &self,
        py: Python<'_>,
        step: i64,
        timeout: std::time::Duration,
    ) -> PyResult<bool> {
        if step < 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "step must not be negative, got {step}"
            )));
        }
        Ok(block_on(py, self.server.may_commit(step, timeout))?)
    }

    /// Takes this (hosting) rank's digest of its committed state after `step` (runtime
    /// state parity). Raises ValueError for a step below 1, a rank outside the group, or a
    /// digest that is empty or longer than 64 bytes.
    fn _offer_digest(&self, group_rank: i64, step: i64, digest: Vec<u8>) -> PyResult<()> {
        Ok(self.server.offer_digest(group_rank, step, digest)?)
    }

    /// Notes the group's committed step (after each commit): heartbeats carry it to the
    /// lighthouse, which then knows this group's progress between quorum requests.
    fn note_committed_step(&self, step: i64) -> PyResult<()> {
        if step < 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "step must not be negative, got {step}"
            )));
        }
        self.server.note_committed_step(step);
        Ok(())
    }

    /// Why the lighthouse holds this group hung (its training loop stayed away from the
    /// manager past the hang timeout while a round waited on it), or None.
    fn hung(&self) -> Option<String> {
        self.server.hung()
    }

    /// The server's view of the group now, in one line (for a hang report).
    fn describe(&self) -> String {
        self.server.describe()
    }

    /// Marks the training loop as inside torchft (`busy=True`: a heal in progress, however
    /// long) or back out of it; while busy the group is never reported away.
    fn set_loop_busy(&self, busy: bool) {
        self.server.set_loop_busy(busy);
    }

    /// Stops the server (pending calls end with an error). Safe to call twice.
    fn shutdown(&self, py: Python<'_>) {
        block_on(py, self.server.shutdown());
    }

    fn __repr__(&self) -> String {
        format!("ManagerServer(address={:?})", self.server.address())
    }
}

/// How often a rank's telemetry reports go to its manager server.
const RANK_REPORT_INTERVAL: Duration = Duration::from_millis(200);
/// Bound on one telemetry send to the manager server.
const RANK_REPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// A rank's telemetry queue and the switch that stops its forwarder.
struct Reporter {
    queue: ReportQueue,
    _stop: watch::Sender<bool>,
}

/// A client of one manager server.
///
/// Args:
///     addr: the manager server address (`http://host:port`).
///     connect_timeout: how long to keep retrying the connection (a `timedelta`,
///         default 60 s).
///
/// Raises:
///     TimeoutError: no connection within `connect_timeout`.
#[pyclass(module = "torchft._torchft", name = "ManagerClient", frozen)]
pub struct PyManagerClient {
    client: CoreClient,
    addr: String,
    /// Started by the first telemetry report.
    reporter: OnceLock<Reporter>,
}

impl PyManagerClient {
    fn reporter(&self) -> &Reporter {
        self.reporter.get_or_init(|| {
            let queue = ReportQueue::default();
            let (stop, stop_rx) = watch::channel(false);
            queue.spawn_forwarder(
                RANK_REPORT_INTERVAL,
                stop_rx,
                self.client.clone(),
                RANK_REPORT_TIMEOUT,
            );
            Reporter { queue, _stop: stop }
        })
    }
}

fn parse_phase(phase: &str) -> PyResult<Phase> {
    Ok(match phase {
        "step" => Phase::Step,
        "heal_started" => Phase::HealStarted,
        "finished" => Phase::Finished,
        "failed" => Phase::Failed,
        "snapshot" => Phase::Snapshot,
        "snapshot_failed" => Phase::SnapshotFailed,
        other => {
            return Err(PyValueError::new_err(format!(
                "phase must be one of step, heal_started, finished, failed, snapshot, \
                 snapshot_failed; got {other:?}"
            )))
        }
    })
}

#[pymethods]
impl PyManagerClient {
    /// Connects to the manager server at `addr`, retrying until `connect_timeout`.
    #[new]
    #[pyo3(signature = (addr, connect_timeout = Duration::from_secs(60)))]
    fn new(py: Python<'_>, addr: String, connect_timeout: Duration) -> PyResult<Self> {
        let connect_timeout = check_duration("connect_timeout", connect_timeout)?;
        let client = block_on(py, CoreClient::connect(&addr, connect_timeout))?;
        Ok(Self {
            client,
            addr,
            reporter: OnceLock::new(),
        })
    }

    /// Queues one telemetry report for the manager server; never waits for the network.
    ///
    /// `phase="snapshot"` says a durable snapshot of committed step `step` completed (sent
    /// once per snapshot, by the rank that wrote its manifest, with `snapshot_path`,
    /// `snapshot_stage_s`, `snapshot_write_s` and the group's `snapshot_bytes`);
    /// `phase="snapshot_failed"` that an attempt failed (`error` says why). Neither is a
    /// step.
    ///
    /// Returns False if the queue was full (the report is dropped and counted). Raises
    /// ValueError on a malformed report (an unknown phase, negative or non-finite seconds, a
    /// field over its length limit, ...).
    #[pyo3(signature = (
        *,
        replica_id,
        group_rank,
        group_world_size,
        step,
        phase = "step",
        incarnation = String::new(),
        rank = -1,
        hostname = String::new(),
        pid = 0,
        quorum_id = 0,
        participants = 0,
        committed = false,
        healed = false,
        step_s = 0.0,
        quorum_wait_s = 0.0,
        collective_s = 0.0,
        should_commit_s = 0.0,
        busy_s = 0.0,
        heal_s = 0.0,
        heal_bytes = 0,
        heal_source = String::new(),
        heal_addr = String::new(),
        error = String::new(),
        unix_s = 0.0,
        snapshot_path = String::new(),
        snapshot_stage_s = 0.0,
        snapshot_write_s = 0.0,
        snapshot_bytes = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        replica_id: String,
        group_rank: i64,
        group_world_size: i64,
        step: i64,
        phase: &str,
        incarnation: String,
        rank: i64,
        hostname: String,
        pid: u32,
        quorum_id: i64,
        participants: i64,
        committed: bool,
        healed: bool,
        step_s: f64,
        quorum_wait_s: f64,
        collective_s: f64,
        should_commit_s: f64,
        busy_s: f64,
        heal_s: f64,
        heal_bytes: u64,
        heal_source: String,
        heal_addr: String,
        error: String,
        unix_s: f64,
        snapshot_path: String,
        snapshot_stage_s: f64,
        snapshot_write_s: f64,
        snapshot_bytes: u64,
    ) -> PyResult<bool> {
        let report = TelemetryReport {
            replica_id,
            incarnation,
            group_rank,
            group_world_size,
            rank,
            hostname,
            pid,
            step,
            quorum_id,
            participants,
            committed,
            healed,
            step_s,
            quorum_wait_s,
            collective_s,
            should_commit_s,
            busy_s,
            heal_s,
            heal_bytes,
            heal_source,
            heal_addr,
            error,
            phase: parse_phase(phase)? as i32,
            unix_s,
            snapshot_path,
            snapshot_stage_s,
            snapshot_write_s,
            snapshot_bytes,
        };
        validate_report(&report)?;
        Ok(self.reporter().queue.push(report))
    }

    /// Sends the queued telemetry reports now, waiting at most `timeout`.
    #[pyo3(signature = (timeout = Duration::from_secs(1)))]
    fn _telemetry_flush(&self, py: Python<'_>, timeout: Duration) {
        let Some(reporter) = self.reporter.get() else {
            return;
        };
        block_on(py, reporter.queue.flush(&self.client, timeout));
    }

    /// Telemetry reports this client dropped so far (queue full or send failed).
    fn _telemetry_dropped(&self) -> u64 {
        self.reporter.get().map_or(0, |r| r.queue.dropped_total())
    }

    /// Asks for this rank's part of the next quorum (waits for the whole group).
    #[pyo3(signature = (
        group_rank,
        step,
        checkpoint_metadata,
        shrink_only,
        timeout,
        commit_failures = 0,
        init_sync = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn _quorum(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        checkpoint_metadata: String,
        shrink_only: bool,
        timeout: Duration,
        commit_failures: i64,
        init_sync: bool,
    ) -> PyResult<QuorumResult> {
        let timeout = check_duration("timeout", timeout)?;
        let req = quorum_request(
            group_rank,
            step,
            checkpoint_metadata,
            shrink_only,
            commit_failures,
            init_sync,
        );
        let resp = block_on(py, self.client.quorum(req, timeout))?;
        Ok(QuorumResult::from(resp))
    }

    /// Sends the same request as `_quorum` without waiting for the answer.
    ///
    /// The request runs on the shared runtime, so the training thread can overlap it with the
    /// forward pass without a Python helper thread (which would contend for the GIL); the
    /// answer is collected with `PendingQuorum.wait`.
    #[pyo3(signature = (
        group_rank,
        step,
        checkpoint_metadata,
        shrink_only,
        timeout,
        commit_failures = 0,
        init_sync = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn _quorum_start(
        &self,
        group_rank: i64,
        step: i64,
        checkpoint_metadata: String,
        shrink_only: bool,
        timeout: Duration,
        commit_failures: i64,
        init_sync: bool,
    ) -> PyResult<PendingQuorum> {
        let timeout = check_duration("timeout", timeout)?;
        let req = quorum_request(
            group_rank,
            step,
            checkpoint_metadata,
            shrink_only,
            commit_failures,
            init_sync,
        );
        let client = self.client.clone();
        let handle = crate::runtime::get().spawn(async move { client.quorum(req, timeout).await });
        Ok(PendingQuorum {
            handle: Mutex::new(Some(handle)),
        })
    }

    /// The checkpoint metadata group rank `rank` of that manager's group last reported.
    fn _checkpoint_metadata(
        &self,
        py: Python<'_>,
        rank: i64,
        timeout: Duration,
    ) -> PyResult<String> {
        let timeout = check_duration("timeout", timeout)?;
        Ok(block_on(
            py,
            self.client.checkpoint_metadata(rank, timeout),
        )?)
    }

    /// Casts this rank's vote for `step` like `should_commit`, and hands over this rank's
    /// digest of its committed state after `digest_step` (runtime state parity).
    #[allow(clippy::too_many_arguments)]
    fn _should_commit_digest(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        should_commit: bool,
        timeout: Duration,
        digest_step: i64,
        digest: Vec<u8>,
    ) -> PyResult<bool> {
        let timeout = check_duration("timeout", timeout)?;
        let max = crate::client::MAX_DIGEST_BYTES;
        if digest_step < 1 || digest.is_empty() || digest.len() > max {
            return Err(PyValueError::new_err(format!(
                "a state digest needs a positive step and 1 to {max} bytes (got step \
                 {digest_step}, {} bytes)",
                digest.len()
            )));
        }
        Ok(block_on(
            py,
            self.client.should_commit_digest(
                group_rank,
                step,
                should_commit,
                Some((digest_step, digest)),
                timeout,
            ),
        )?)
    }

    /// Casts this rank's vote for `step`; returns the group's decision (AND of all votes).
    fn should_commit(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        should_commit: bool,
        timeout: Duration,
    ) -> PyResult<bool> {
        let timeout = check_duration("timeout", timeout)?;
        Ok(block_on(
            py,
            self.client
                .should_commit(group_rank, step, should_commit, timeout),
        )?)
    }

    /// Waits up to `timeout` for lost-member events after `after_seq` (GIL released).
    ///
    /// Returns `(last_seq, [(replica_id, quorum_id), ...])`; the list is empty when nothing
    /// arrived in time, and `last_seq` is what to pass as `after_seq` next.
    fn _watch_events(
        &self,
        py: Python<'_>,
        after_seq: u64,
        timeout: Duration,
    ) -> PyResult<(u64, Vec<(String, i64)>)> {
        let timeout = check_duration("timeout", timeout)?;
        let (events, last) = block_on(py, self.client.watch_events(after_seq, timeout))?;
        Ok((
            last,
            events
                .into_iter()
                .map(|e| (e.replica_id, e.quorum_id))
                .collect(),
        ))
    }

    /// Asks the manager server to end its hosting process (logged with `msg`).
    #[pyo3(signature = (msg, timeout = Duration::from_secs(5)))]
    fn kill(&self, py: Python<'_>, msg: String, timeout: Duration) -> PyResult<()> {
        let timeout = check_duration("timeout", timeout)?;
        Ok(block_on(py, self.client.kill(&msg, timeout))?)
    }

    fn __repr__(&self) -> String {
        format!("ManagerClient(addr={:?})", self.addr)
    }
}

/// A quorum request started by `ManagerClient._quorum_start`, answered once.
#[pyclass(module = "torchft._torchft", frozen)]
pub struct PendingQuorum {
    handle: Mutex<Option<JoinHandle<crate::error::Result<ManagerQuorumResponse>>>>,
}

#[pymethods]
impl PendingQuorum {
    /// Whether the answer (or error) has arrived, so `wait` would not block.
    fn done(&self) -> bool {
        match self.handle.lock() {
            Ok(guard) => guard.as_ref().is_none_or(|h| h.is_finished()),
            Err(_) => true,
        }
    }

    /// Waits for the answer with the GIL released; same errors as `_quorum`.
    ///
    /// The request carries its own deadline, so this never blocks past it. May be called
    /// only once.
    fn wait(&self, py: Python<'_>) -> PyResult<QuorumResult> {
        let handle = self
            .handle
            .lock()
            .map_err(|_| PyRuntimeError::new_err("pending quorum lock poisoned"))?
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("pending quorum was already waited for"))?;
        match block_on(py, handle) {
            Ok(resp) => Ok(QuorumResult::from(resp?)),
            Err(e) => Err(TorchFTError::new_err(format!(
                "quorum request task failed: {e}"
            ))),
        }
    }
}

/// One rank's answer to a quorum request: its role in the step.
///
/// Constructible with keyword arguments (all default to empty/zero/None) and mutable, so tests
/// of code built on top can fabricate answers.
///
/// Args:
///     quorum_id: id of the quorum (changes when the process group must be rebuilt).
///     replica_rank: this group's rank among all members of the quorum.
///     replica_world_size: number of members of the quorum.
///     recover_src_manager_address: manager address of the group to heal from ("" if none).
///     recover_src_replica_rank: replica rank to heal from (None if not healing).
///     recover_dst_replica_ranks: replica ranks that heal from this group.
///     store_address: store to rendezvous on for the process group (`host:port`).
///     max_step: the highest committed step in the quorum.
///     max_replica_rank: this group's rank among the members at `max_step` (None if behind).
///     max_world_size: number of members at `max_step`.
///     heal: whether this rank must heal before the step.
///     commit_failures: highest count of consecutive failed commits among the members.
///     replica_ids: replica ids of the quorum, in replica-rank order.
#[pyclass(module = "torchft._torchft", get_all, set_all)]
pub struct QuorumResult {
    quorum_id: i64,
    replica_rank: i64,
    replica_world_size: i64,
    recover_src_manager_address: String,
    recover_src_replica_rank: Option<i64>,
    recover_dst_replica_ranks: Vec<i64>,
    store_address: String,
    max_step: i64,
    max_replica_rank: Option<i64>,
    max_world_size: i64,
    heal: bool,
    commit_failures: i64,
    replica_ids: Vec<String>,
}

impl From<ManagerQuorumResponse> for QuorumResult {
    fn from(r: ManagerQuorumResponse) -> Self {
        Self {
            quorum_id: r.quorum_id,
            replica_rank: r.replica_rank,
            replica_world_size: r.replica_world_size,
            recover_src_manager_address: r.recover_src_manager_address,
            recover_src_replica_rank: r.recover_src_replica_rank,
            recover_dst_replica_ranks: r.recover_dst_replica_ranks,
            store_address: r.store_address,
            max_step: r.max_step,
            max_replica_rank: r.max_replica_rank,
            max_world_size: r.max_world_size,
            heal: r.heal,
            commit_failures: r.commit_failures,
            replica_ids: r.replica_ids,
        }
    }
}

/// Python-style rendering of an optional integer.
fn py_opt(v: Option<i64>) -> String {
    v.map_or_else(|| "None".to_string(), |x| x.to_string())
}

#[pymethods]
impl QuorumResult {
    /// Builds a result by hand (the server builds the real ones).
    #[new]
    #[pyo3(signature = (
        quorum_id = 0,
        replica_rank = 0,
        replica_world_size = 1,
        recover_src_manager_address = String::new(),
        recover_src_replica_rank = None,
        recover_dst_replica_ranks = Vec::new(),
        store_address = String::new(),
        max_step = 0,
        max_replica_rank = None,
        max_world_size = 0,
        heal = false,
        commit_failures = 0,
        replica_ids = Vec::new(),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        quorum_id: i64,
        replica_rank: i64,
        replica_world_size: i64,
        recover_src_manager_address: String,
        recover_src_replica_rank: Option<i64>,
        recover_dst_replica_ranks: Vec<i64>,
        store_address: String,
        max_step: i64,
        max_replica_rank: Option<i64>,
        max_world_size: i64,
        heal: bool,
        commit_failures: i64,
        replica_ids: Vec<String>,
    ) -> Self {
        Self {
            quorum_id,
            replica_rank,
            replica_world_size,
            recover_src_manager_address,
            recover_src_replica_rank,
            recover_dst_replica_ranks,
            store_address,
            max_step,
            max_replica_rank,
            max_world_size,
            heal,
            commit_failures,
            replica_ids,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "QuorumResult(quorum_id={}, replica_rank={}, replica_world_size={}, \
             recover_src_manager_address={:?}, recover_src_replica_rank={}, \
             recover_dst_replica_ranks={:?}, store_address={:?}, max_step={}, \
             max_replica_rank={}, max_world_size={}, heal={}, commit_failures={}, \
             replica_ids={:?})",
            self.quorum_id,
            self.replica_rank,
            self.replica_world_size,
            self.recover_src_manager_address,
            py_opt(self.recover_src_replica_rank),
            self.recover_dst_replica_ranks,
            self.store_address,
            self.max_step,
            py_opt(self.max_replica_rank),
            self.max_world_size,
            if self.heal { "True" } else { "False" },
            self.commit_failures,
            self.replica_ids,
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyManagerServer>()?;
    m.add_class::<PyManagerClient>()?;
    m.add_class::<QuorumResult>()?;
    m.add_class::<PendingQuorum>()?;
    Ok(())
}

/// The request one rank sends for a quorum (shared by `_quorum` and `_quorum_start`).
fn quorum_request(
    group_rank: i64,
    step: i64,
    checkpoint_metadata: String,
    shrink_only: bool,
    commit_failures: i64,
    init_sync: bool,
) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank,
        step,
        checkpoint_metadata,
        shrink_only,
        init_sync,
        commit_failures,
    }
}
