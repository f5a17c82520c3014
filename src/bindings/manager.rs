//! Python wrappers for the manager server and client (`ManagerServer`, `ManagerClient`,
//! `QuorumResult`).
//!
//! Thin: convert arguments, release the GIL, run the core on the process-wide runtime, convert
//! the result. Deadline expiry raises `TimeoutError`, bad arguments `ValueError`.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::records::{PyQuorumRequest, PyTelemetryReport, QuorumResult};
use super::{block_on, check_duration, TorchFTError};
use crate::manager::reports::ReportQueue;
use crate::manager::topology::{Placement, Topology};
use crate::manager::{
    ManagerClient as CoreClient, ManagerOptions, ManagerServer as CoreServer,
    DEFAULT_MAX_REQUEST_BYTES,
};
use crate::proto::{ManagerQuorumRequest, ManagerQuorumResponse};
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
///     job: the job (room) this group belongs to on a lighthouse serving many jobs
///         (`TORCHFT_JOB`; empty: the default room).
///     sparse_quorum: without a topology file, ask the lighthouse for this group's own
///         quorum answer and the few members it names (`TORCHFT_SPARSE_QUORUM`); False: the
///         whole member list, so `QuorumResult.replica_ids` names every member.
///
/// Raises:
///     ValueError: an argument is out of range, the job name is invalid, or the topology
///         file is unreadable or malformed (the message names the field) or lacks this
///         group's ranks.
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
        job = String::new(),
        sparse_quorum = true,
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
        job: String,
        sparse_quorum: bool,
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
            job,
            sparse_quorum,
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
    /// to `timeout` while the lighthouse is unreachable). Single-rank groups ask this. The
    /// calling thread (GIL released) drives the announcement's connection while it waits.
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
        // Waits on this thread, which drives the announcement's connection itself.
        Ok(py.detach(|| self.server.may_commit_blocking(step, timeout))?)
    }

    /// `ManagerClient._quorum_start` for the hosting rank of a group of one rank: the
    /// request goes on a connection to the lighthouse that the calling thread drives (GIL
    /// released) until the request is written and again in `PendingQuorum.wait`, so no
    /// other thread is woken in a short step. Same arguments, answers and errors; raises
    /// ValueError in a group of several ranks (their ranks use the client's).
    #[pyo3(signature = (*args, **fields))]
    fn _quorum_start(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        fields: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PendingQuorum> {
        let (req, timeout) = quorum_call(py, args, fields)?;
        let own = py.detach(|| self.server.quorum_start_blocking(req, timeout))?;
        Ok(PendingQuorum {
            pending: Mutex::new(Some(Pending::Own(own))),
        })
    }

    /// Takes this (hosting) rank's digest of its committed state after `step` (runtime
    /// state parity). Raises ValueError for a step below 1, a rank outside the group, or a
    /// digest that is empty or longer than 64 bytes.
    fn _offer_digest(&self, group_rank: i64, step: i64, digest: Vec<u8>) -> PyResult<()> {
        Ok(self.server.offer_digest(group_rank, step, digest)?)
    }

    /// Notes this (hosting) rank's quorum wait in `step` (its committed step count before the
    /// step), in seconds, before it votes: the step's commit announcement carries it to the
    /// lighthouse. Raises ValueError for a negative step or a wait that is negative or not
    /// finite.
    fn _note_quorum_wait(&self, step: i64, seconds: f64) -> PyResult<()> {
        Ok(self.server.note_step_wait(step, seconds)?)
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

    /// What the lighthouse's parity checks said of this group's committed states, as
    /// ``(checked, ok_step, diverged_step)``: whether the lighthouse says at all (upstream
    /// lighthouses do not), the newest step decided with this group's digest and no
    /// disagreement, and the newest step at which it differed (0 = none of either).
    fn parity_verdicts(&self) -> (bool, i64, i64) {
        let v = self.server.parity_verdicts();
        (v.checked, v.ok_step, v.diverged_step)
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
    /// Takes a `TelemetryReport`, or its fields as keywords (see `TelemetryReport`).
    ///
    /// Returns False if the queue was full (the report is dropped and counted). Raises
    /// ValueError on a malformed report (an unknown phase, negative or non-finite seconds, a
    /// field over its length limit, ...).
    #[pyo3(signature = (report = None, /, **fields))]
    fn report(
        &self,
        py: Python<'_>,
        report: Option<PyRef<'_, PyTelemetryReport>>,
        fields: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<bool> {
        let report = PyTelemetryReport::from_call(py, report, fields)?;
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

    /// Asks for this rank's part of the next quorum (waits for the whole group, at most
    /// `timeout`). Takes a `QuorumRequest` and `timeout`, the request's fields as keywords,
    /// or upstream's positional form `(group_rank, step, checkpoint_metadata, shrink_only,
    /// timeout, commit_failures, init_sync)`.
    #[pyo3(signature = (*args, **fields))]
    fn _quorum(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        fields: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<QuorumResult> {
        let (req, timeout) = quorum_call(py, args, fields)?;
        let resp = block_on(py, self.client.quorum(req, timeout))?;
        Ok(QuorumResult::from(resp))
    }

    /// Sends the same request as `_quorum` without waiting for the answer.
    ///
    /// The request runs on the shared runtime, so the training thread can overlap it with the
    /// forward pass without a Python helper thread (which would contend for the GIL); the
    /// answer is collected with `PendingQuorum.wait`.
    #[pyo3(signature = (*args, **fields))]
    fn _quorum_start(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        fields: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PendingQuorum> {
        let (req, timeout) = quorum_call(py, args, fields)?;
        let client = self.client.clone();
        let handle = crate::runtime::get().spawn(async move { client.quorum(req, timeout).await });
        Ok(PendingQuorum {
            pending: Mutex::new(Some(Pending::Spawned(handle))),
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

/// A quorum request started by `ManagerClient._quorum_start` (or a single-rank group's
/// `ManagerServer._quorum_start`), answered once.
#[pyclass(module = "torchft._torchft", frozen)]
pub struct PendingQuorum {
    pending: Mutex<Option<Pending>>,
}

/// Where a started quorum request runs.
enum Pending {
    /// A task of the process's runtime.
    Spawned(JoinHandle<crate::error::Result<ManagerQuorumResponse>>),
    /// On the hosting rank's own connection, driven by the thread that waits.
    Own(crate::manager::OwnQuorum),
}

#[pymethods]
impl PendingQuorum {
    /// Whether the answer (or error) has arrived, so `wait` would not block.
    fn done(&self, py: Python<'_>) -> bool {
        // Without the GIL throughout: reading an answer drives the connection, and the lock
        // is never waited for while holding the GIL another caller may need.
        py.detach(|| {
            let Ok(guard) = self.pending.lock() else {
                return true;
            };
            match guard.as_ref() {
                None => true,
                Some(Pending::Spawned(h)) => h.is_finished(),
                // Reads an answer that already came (only its callers drive the connection).
                Some(Pending::Own(own)) => own.is_done(),
            }
        })
    }

    /// Waits for the answer with the GIL released; same errors as `_quorum`.
    ///
    /// The request carries its own deadline, so this never blocks past it. May be called
    /// only once.
    fn wait(&self, py: Python<'_>) -> PyResult<QuorumResult> {
        let pending = self
            .pending
            .lock()
            .map_err(|_| PyRuntimeError::new_err("pending quorum lock poisoned"))?
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("pending quorum was already waited for"))?;
        match pending {
            Pending::Spawned(handle) => match block_on(py, handle) {
                Ok(resp) => Ok(QuorumResult::from(resp?)),
                Err(e) => Err(TorchFTError::new_err(format!(
                    "quorum request task failed: {e}"
                ))),
            },
            Pending::Own(own) => Ok(QuorumResult::from(py.detach(|| own.wait())?)),
        }
    }
}

/// Continues a state digest (runtime state parity) over the `length` bytes at `address`:
/// returns `(crc, adler)` as `zlib.crc32` and `zlib.adler32` would, computed without the GIL.
/// The caller keeps the memory alive and unchanged for the call (a tensor it holds, between
/// a step's start and its commit vote). Raises ValueError for a null address with bytes to
/// read, or a range past the end of memory.
#[pyfunction]
fn _digest_update(
    py: Python<'_>,
    crc: u32,
    adler: u32,
    address: usize,
    length: usize,
) -> PyResult<(u32, u32)> {
    // SAFETY: the Python caller's contract (above): the memory is alive and unchanged.
    unsafe {
        super::sum_memory(py, "digest", address, length, |bytes| {
            crate::manager::parity::digest_update(crc, adler, bytes)
        })
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyManagerServer>()?;
    m.add_class::<PyManagerClient>()?;
    m.add_class::<PendingQuorum>()?;
    m.add_function(wrap_pyfunction!(_digest_update, m)?)?;
    super::records::register(m)
}

/// The request and timeout of a `_quorum` or `_quorum_start` call.
/// The positional parameters of upstream's `_quorum` / `_quorum_start`, in order.
const QUORUM_POSITIONAL: [&str; 7] = [
    "group_rank",
    "step",
    "checkpoint_metadata",
    "shrink_only",
    "timeout",
    "commit_failures",
    "init_sync",
];

/// Parses the three call forms of `_quorum`: `(QuorumRequest, timeout)`, keywords, or
/// upstream's positional arguments (see [`QUORUM_POSITIONAL`]); `timeout` may be a keyword
/// in every form.
fn quorum_call(
    py: Python<'_>,
    args: &Bound<'_, PyTuple>,
    fields: Option<&Bound<'_, PyDict>>,
) -> PyResult<(ManagerQuorumRequest, Duration)> {
    let all = PyDict::new(py);
    if let Some(f) = fields {
        all.update(f.as_mapping())?;
    }
    let mut request: Option<PyRef<'_, PyQuorumRequest>> = None;
    let first_is_record = args.len() > 0 && args.get_item(0)?.is_instance_of::<PyQuorumRequest>();
    let names: &[&str] = if first_is_record {
        request = Some(args.get_item(0)?.extract()?);
        &["request", "timeout"]
    } else {
        &QUORUM_POSITIONAL
    };
    if args.len() > names.len() {
        return Err(PyTypeError::new_err(format!(
            "_quorum takes at most {} positional arguments ({} given)",
            names.len(),
            args.len()
        )));
    }
    for (i, name) in names.iter().enumerate().take(args.len()) {
        if *name == "request" {
            continue;
        }
        if all.contains(*name)? {
            return Err(PyTypeError::new_err(format!(
                "_quorum got multiple values for argument {name:?}"
            )));
        }
        all.set_item(*name, args.get_item(i)?)?;
    }
    if request.is_none() {
        if let Some(r) = all.get_item("request")? {
            all.del_item("request")?;
            if !r.is_none() {
                request = Some(r.extract()?);
            }
        }
    }
    let timeout = match all.get_item("timeout")? {
        Some(t) => {
            all.del_item("timeout")?;
            t.extract::<Duration>()?
        }
        None => return Err(PyTypeError::new_err("missing argument: timeout")),
    };
    let timeout = check_duration("timeout", timeout)?;
    Ok((
        PyQuorumRequest::from_call(py, request, Some(&all))?,
        timeout,
    ))
}
