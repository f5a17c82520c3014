//! Python wrappers for the lighthouse: server, client, quorum types and the daemon entry point.
//!
//! Thin conversions only: arguments are checked and owned, the GIL is released while the Rust
//! core runs, results are turned back into Python objects. `QuorumMember.data` is a dict in
//! Python and a JSON string on the wire.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pyo3::exceptions::{PySystemExit, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::{block_on, check_duration};
use crate::lighthouse::{self as core, daemon, LighthouseConfig};
use crate::proto;

fn dict_to_json(py: Python<'_>, data: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    match data {
        None => Ok(String::new()),
        Some(d) if d.is_none() => Ok(String::new()),
        Some(d) => {
            if !d.is_instance_of::<PyDict>() {
                return Err(PyValueError::new_err("data must be a dict"));
            }
            py.import("json")?.call_method1("dumps", (d,))?.extract()
        }
    }
}

fn json_to_dict(py: Python<'_>, data: &str) -> PyResult<Py<PyAny>> {
    if data.is_empty() {
        return Ok(PyDict::new(py).into_any().unbind());
    }
    Ok(py.import("json")?.call_method1("loads", (data,))?.unbind())
}

/// One replica group as presented to the lighthouse.
///
/// Args:
///     replica_id: unique id of this incarnation of the replica group (not empty).
///     address: manager server address of the group (`http://host:port`).
///     store_address: rendezvous store address of the group (`host:port`).
///     step: committed steps of the group (not negative).
///     world_size: ranks in the group (at least 1).
///     shrink_only: ask that the next quorum keep only members of the previous one.
///     commit_failures: consecutive failed commits the group saw (a non-zero value forces
///         a new quorum id).
///     data: user metadata (a JSON-serialisable dict) carried along unchanged.
#[pyclass(module = "torchft._torchft", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumMember {
    /// Unique id of this incarnation of the replica group.
    #[pyo3(get)]
    pub replica_id: String,
    /// Manager server address of the group.
    #[pyo3(get)]
    pub address: String,
    /// Rendezvous store address of the group.
    #[pyo3(get)]
    pub store_address: String,
    /// Committed steps of the group.
    #[pyo3(get)]
    pub step: i64,
    /// Ranks in the group.
    #[pyo3(get)]
    pub world_size: u64,
    /// Whether the group asked to keep only previous members.
    #[pyo3(get)]
    pub shrink_only: bool,
    /// Consecutive failed commits the group saw.
    #[pyo3(get)]
    pub commit_failures: i64,
    data_json: String,
}

impl From<proto::QuorumMember> for QuorumMember {
    fn from(m: proto::QuorumMember) -> Self {
        Self {
            replica_id: m.replica_id,
            address: m.address,
            store_address: m.store_address,
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            commit_failures: m.commit_failures,
            data_json: m.data,
        }
    }
}

#[pymethods]
impl QuorumMember {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (replica_id, address = String::new(), store_address = String::new(),
        step = 0, world_size = 1, shrink_only = false, commit_failures = 0, data = None))]
    fn new(
        py: Python<'_>,
        replica_id: String,
        address: String,
        store_address: String,
        step: i64,
        world_size: u64,
        shrink_only: bool,
        commit_failures: i64,
        data: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(Self {
            replica_id,
            address,
            store_address,
            step,
            world_size,
            shrink_only,
            commit_failures,
            data_json: dict_to_json(py, data.as_ref())?,
        })
    }

    /// User metadata carried along unchanged (a dict; `{}` when none was given).
    #[getter]
    fn data(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        json_to_dict(py, &self.data_json)
    }

    fn __repr__(&self) -> String {
        format!(
            "QuorumMember(replica_id={:?}, address={:?}, store_address={:?}, step={}, \
             world_size={}, shrink_only={}, commit_failures={}, data={})",
            self.replica_id,
            self.address,
            self.store_address,
            self.step,
            self.world_size,
            if self.shrink_only { "True" } else { "False" },
            self.commit_failures,
            if self.data_json.is_empty() {
                "{}"
            } else {
                &self.data_json
            }
        )
    }
}

/// The set of replica groups taking part in a step.
///
/// Args:
///     quorum_id: strictly increasing id; unchanged while membership is.
///     participants: the members (`QuorumMember`), sorted by replica_id.
///     created: when the quorum was issued (a datetime; default now).
#[pyclass(module = "torchft._torchft", frozen)]
#[derive(Debug, Clone)]
pub struct Quorum {
    /// Strictly increasing id; unchanged while membership is.
    #[pyo3(get)]
    pub quorum_id: i64,
    members: Vec<QuorumMember>,
    created: SystemTime,
}

impl From<proto::Quorum> for Quorum {
    fn from(q: proto::Quorum) -> Self {
        let created = q
            .created
            .and_then(|t| {
                let secs = u64::try_from(t.seconds).ok()?;
                let nanos = u32::try_from(t.nanos).ok()?;
                UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
            })
            .unwrap_or(UNIX_EPOCH);
        Self {
            quorum_id: q.quorum_id,
            members: q.participants.into_iter().map(QuorumMember::from).collect(),
            created,
        }
    }
}

#[pymethods]
impl Quorum {
    #[new]
    #[pyo3(signature = (quorum_id, participants, created = None))]
    fn new(quorum_id: i64, participants: Vec<QuorumMember>, created: Option<SystemTime>) -> Self {
        Self {
            quorum_id,
            members: participants,
            created: created.unwrap_or_else(SystemTime::now),
        }
    }

    /// Members sorted by replica_id.
    #[getter]
    fn participants<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.members.iter().cloned())
    }

    /// When the lighthouse issued this quorum (timezone-aware UTC datetime).
    #[getter]
    fn created(&self) -> SystemTime {
        self.created
    }

    fn __repr__(&self) -> String {
        let members: Vec<String> = self.members.iter().map(QuorumMember::__repr__).collect();
        let created = self
            .created
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        format!(
            "Quorum(quorum_id={}, participants=[{}], created={created:.6})",
            self.quorum_id,
            members.join(", ")
        )
    }
}

/// A non-negative integer argument (`None`: not given).
fn non_negative(name: &str, value: Option<i64>) -> PyResult<Option<u64>> {
    value
        .map(|v| {
            u64::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("{name} must not be negative, got {v}")))
        })
        .transpose()
}

/// A lighthouse running inside this process (tests, single-machine jobs, Ray Train).
///
/// Serves gRPC and HTTP (dashboard, metrics) on one port from the shared runtime; the
/// constructor returns once it is listening.
///
/// Args:
///     bind: address to listen on, e.g. `"[::]:0"` (port 0 picks a free port; see
///         `address()`).
///     min_replicas: replica groups a quorum needs at least (>= 1).
///     join_timeout_ms: how long a round waits for healthy stragglers after the first
///         joiner (default 60000; 0 answers as soon as the rules allow).
///     quorum_tick_ms: how often pending rounds are re-evaluated (default 100; > 0).
///     heartbeat_timeout_ms: silence after which a replica group counts as lost
///         (default 5000; > 0).
///     progress_wait_ms: how long a round behind a group that may still come back waits
///         for it (default 60000; 0: never).
///     state_file: keep the lighthouse's durable state (last quorum, best committed step
///         and its holders) in this file, so a restarted lighthouse continues from it
///         (default none).
///     event_log: append the event log as JSON lines to this file (default none).
///     allow_kill: serve `POST /replicas/{id}/kill` (default off).
///     straggler_skew_pct: a group is a straggler when its busy time is this many percent
///         above the median...
///     straggler_min_ms: ...and at least this many milliseconds above it.
///     token_file: file holding the shared secret every RPC and state-changing HTTP route
///         must carry (default: env TORCHFT_TOKEN_FILE, else TORCHFT_TOKEN; none: open).
///     tls_cert: serve TLS with this PEM certificate chain.
///     tls_key: PEM private key of `tls_cert`.
///     tls_ca: PEM CA bundle to verify manager servers with when dialing them.
///     tls_client_ca: require client certificates signed by this PEM CA bundle (mutual TLS).
///     private_status: require the token on the read-only pages too.
///     max_request_bytes: largest request message or HTTP body accepted (>= 4096).
///     room_expiry_ms: a job's room (not the default room) closes after this long idle
///         (default 3600000; > 0). See docs/rooms.md.
///     max_rooms: most rooms open at once besides the default room (default 1024; >= 1).
///     room_min_replicas: per-job `min_replicas` (`{"job": n}`); other rooms use
///         `min_replicas`.
///     room_token_dir: a directory of per-job tokens (a file named after each job holds
///         its token); a job's token acts on its own room only (needs `token_file`).
///
/// Raises:
///     ValueError: an argument is out of range.
///     RuntimeError: the address cannot be bound.
#[pyclass(module = "torchft._torchft", frozen)]
pub struct LighthouseServer {
    inner: core::LighthouseServer,
}

#[pymethods]
impl LighthouseServer {
    #[new]
    #[pyo3(signature = (bind, min_replicas, join_timeout_ms = None, quorum_tick_ms = None,
        heartbeat_timeout_ms = None, *, progress_wait_ms = None, state_file = None,
        event_log = None, allow_kill = false, straggler_skew_pct = None, straggler_min_ms = None, token_file = None,
        tls_cert = None, tls_key = None, tls_ca = None, tls_client_ca = None,
        private_status = false, max_request_bytes = None, room_expiry_ms = None, max_rooms = None,
        room_min_replicas = None, room_token_dir = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bind: String,
        min_replicas: i64,
        join_timeout_ms: Option<i64>,
        quorum_tick_ms: Option<i64>,
        heartbeat_timeout_ms: Option<i64>,
        progress_wait_ms: Option<i64>,
        state_file: Option<PathBuf>,
        event_log: Option<std::path::PathBuf>,
        allow_kill: bool,
        straggler_skew_pct: Option<f64>,
        straggler_min_ms: Option<i64>,
        token_file: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
        tls_client_ca: Option<PathBuf>,
        private_status: bool,
        max_request_bytes: Option<usize>,
        room_expiry_ms: Option<i64>,
        max_rooms: Option<usize>,
        room_min_replicas: Option<std::collections::BTreeMap<String, i64>>,
        room_token_dir: Option<PathBuf>,
    ) -> PyResult<Self> {
        let min_replicas = u64::try_from(min_replicas).map_err(|_| {
            PyValueError::new_err(format!(
                "min_replicas must be at least 1, got {min_replicas}"
            ))
        })?;
        let mut config = LighthouseConfig::new(bind, min_replicas);
        for (name, value, setting) in [
            (
                "join_timeout_ms",
                join_timeout_ms,
                &mut config.join_timeout_ms,
            ),
            ("quorum_tick_ms", quorum_tick_ms, &mut config.quorum_tick_ms),
            (
                "heartbeat_timeout_ms",
                heartbeat_timeout_ms,
                &mut config.heartbeat_timeout_ms,
            ),
            (
                "progress_wait_ms",
                progress_wait_ms,
                &mut config.progress_wait_ms,
            ),
            (
                "straggler_min_ms",
                straggler_min_ms,
                &mut config.straggler_min_ms,
            ),
        ] {
            if let Some(ms) = non_negative(name, value)? {
                *setting = ms;
            }
        }
        config.state_file = state_file;
        config.event_log = event_log;
        config.allow_kill = allow_kill;
        if let Some(pct) = straggler_skew_pct {
            config.straggler_skew_pct = pct;
        }
        config.token_file = token_file;
        config.tls_cert = tls_cert;
        config.tls_key = tls_key;
        config.tls_ca = tls_ca;
        config.tls_client_ca = tls_client_ca;
        config.private_status = private_status;
        if let Some(bytes) = max_request_bytes {
            config.max_request_bytes = bytes;
        }
        if let Some(ms) = non_negative("room_expiry_ms", room_expiry_ms)? {
            config.room_expiry_ms = ms;
        }
        if let Some(n) = max_rooms {
            config.max_rooms = n;
        }
        for (job, n) in room_min_replicas.unwrap_or_default() {
            let n = u64::try_from(n).map_err(|_| {
                PyValueError::new_err(format!(
                    "min_replicas of room {job:?} must be at least 1, got {n}"
                ))
            })?;
            config.room_min_replicas.push((job, n));
        }
        config.room_token_dir = room_token_dir;
        let access = config.access()?;
        let inner = block_on(py, config.bind(access))?;
        Ok(Self { inner })
    }

    /// `http://host:port` clients should dial (`https://` when it serves TLS).
    fn address(&self) -> String {
        self.inner.address()
    }

    /// Stops serving; pending quorum requests fail with an error.
    fn shutdown(&self, py: Python<'_>) {
        block_on(py, self.inner.shutdown());
    }

    fn __repr__(&self) -> String {
        format!("LighthouseServer(address={:?})", self.inner.address())
    }
}

/// A client of a lighthouse (manager servers use the Rust one; this is for tools and tests).
///
/// Args:
///     addr: the lighthouse address (`http://host:port`).
///     connect_timeout: how long to keep retrying the connection (a `timedelta`).
///     job: the job (room) every request names (default: the default room).
///
/// Raises:
///     TimeoutError: no connection within `connect_timeout`.
///     ValueError: `job` is not a valid job name.
#[pyclass(module = "torchft._torchft", frozen)]
pub struct LighthouseClient {
    inner: core::LighthouseClient,
    addr: String,
}

#[pymethods]
impl LighthouseClient {
    #[new]
    #[pyo3(signature = (addr, connect_timeout, job = String::new()))]
    fn new(py: Python<'_>, addr: String, connect_timeout: Duration, job: String) -> PyResult<Self> {
        let connect_timeout = check_duration("connect_timeout", connect_timeout)?;
        crate::ids::validate_job(&job)?;
        let inner = block_on(py, core::LighthouseClient::connect(&addr, connect_timeout))?
            .with_job(&job)?;
        Ok(Self { inner, addr })
    }

    /// Joins the current round and waits until this replica is in an issued quorum.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (replica_id, timeout, address = None, store_address = None, step = None,
        world_size = None, shrink_only = None, data = None))]
    fn quorum(
        &self,
        py: Python<'_>,
        replica_id: String,
        timeout: Duration,
        address: Option<String>,
        store_address: Option<String>,
        step: Option<i64>,
        world_size: Option<i64>,
        shrink_only: Option<bool>,
        data: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Quorum> {
        let timeout = check_duration("timeout", timeout)?;
        let world_size = world_size.unwrap_or(1);
        if world_size < 1 {
            return Err(PyValueError::new_err(format!(
                "world_size must be at least 1, got {world_size}"
            )));
        }
        let member = proto::QuorumMember {
            replica_id,
            address: address.unwrap_or_default(),
            store_address: store_address.unwrap_or_default(),
            step: step.unwrap_or(0),
            world_size: world_size.unsigned_abs(),
            shrink_only: shrink_only.unwrap_or(false),
            commit_failures: 0,
            data: dict_to_json(py, data.as_ref())?,
        };
        let client = self.inner.clone();
        let q = block_on(py, async move { client.quorum(member, timeout).await })?;
        Ok(Quorum::from(q))
    }

    /// Tells the lighthouse this replica is alive and, if given, its committed step.
    #[pyo3(signature = (replica_id, timeout = Duration::from_secs(5), step = None))]
    fn heartbeat(
        &self,
        py: Python<'_>,
        replica_id: String,
        timeout: Duration,
        step: Option<i64>,
    ) -> PyResult<()> {
        let timeout = check_duration("timeout", timeout)?;
        if let Some(s) = step.filter(|s| *s < 0) {
            return Err(PyValueError::new_err(format!(
                "step must not be negative, got {s}"
            )));
        }
        let client = self.inner.clone();
        block_on(py, async move {
            client
                .heartbeat_lease(&replica_id, step, None, timeout)
                .await
                .map_err(crate::error::Error::from)
        })?;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("LighthouseClient(addr={:?})", self.addr)
    }
}

/// Entry point of the `torchft_lighthouse` console script: parses `sys.argv` with the same
/// flags as the binary and serves until SIGTERM/SIGINT.
#[pyfunction]
fn lighthouse_main(py: Python<'_>) -> PyResult<()> {
    use clap::Parser;
    let argv: Vec<String> = py.import("sys")?.getattr("argv")?.extract()?;
    let args = match daemon::Args::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return Err(PySystemExit::new_err(e.exit_code()));
        }
    };
    let res = py.detach(|| daemon::run(args));
    // SIGINT also reached Python's own handler; the daemon already handled it.
    let _ = py.check_signals();
    match res {
        Ok(()) => Ok(()),
        Err(e) => {
            eprintln!("torchft_lighthouse: {e}");
            Err(PySystemExit::new_err(1))
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<QuorumMember>()?;
    m.add_class::<Quorum>()?;
    m.add_class::<LighthouseServer>()?;
    m.add_class::<LighthouseClient>()?;
    m.add_function(wrap_pyfunction!(lighthouse_main, m)?)?;
    Ok(())
}
