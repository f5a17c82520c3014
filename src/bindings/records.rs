//! Typed records for the manager client's calls (`TelemetryReport`, `QuorumRequest`) and its
//! quorum answer (`QuorumResult`): each field is declared once, here, with its default; the
//! client methods take the record, or its fields as keywords (built through the same
//! constructor).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::proto::telemetry_report::Phase;
use crate::proto::{ManagerQuorumRequest, ManagerQuorumResponse, TelemetryReport};

/// Telemetry phases by their Python name.
const PHASES: [(&str, Phase); 6] = [
    ("step", Phase::Step),
    ("heal_started", Phase::HealStarted),
    ("finished", Phase::Finished),
    ("failed", Phase::Failed),
    ("snapshot", Phase::Snapshot),
    ("snapshot_failed", Phase::SnapshotFailed),
];

fn parse_phase(phase: &str) -> PyResult<Phase> {
    match PHASES.iter().find(|(name, _)| *name == phase) {
        Some((_, p)) => Ok(*p),
        None => Err(PyValueError::new_err(format!(
            "phase must be one of step, heal_started, finished, failed, snapshot, \
             snapshot_failed; got {phase:?}"
        ))),
    }
}

/// Declares a frozen record class wrapping a wire message: its keyword constructor lists
/// every field once (the required ones first, then those with a default), and a field named
/// `phase` stands for the message's phase enum by name.
macro_rules! record {
    (
        $(#[$doc:meta])*
        $name:ident($py_name:literal) wraps $msg:ident {
            required { $($req:ident: $rty:ty),* $(,)? }
            optional { $($opt:ident: $oty:ty = $default:expr),* $(,)? }
            $(with { $($extra:ident: $ety:ty = $edefault:expr => $conv:expr),* $(,)? })?
        }
    ) => {
        $(#[$doc])*
        #[pyclass(module = "torchft._torchft", name = $py_name, frozen)]
        pub struct $name {
            msg: $msg,
        }

        #[pymethods]
        impl $name {
            #[new]
            #[pyo3(signature = (
                *,
                $($req,)*
                $($opt = $default,)*
                $($($extra = $edefault,)*)?
            ))]
            #[allow(clippy::too_many_arguments)]
            fn new(
                $($req: $rty,)*
                $($opt: $oty,)*
                $($($extra: $ety,)*)?
            ) -> PyResult<Self> {
                Ok(Self {
                    msg: $msg {
                        $($req,)*
                        $($opt,)*
                        $($($extra: $conv,)*)?
                    },
                })
            }
        }

        impl $name {
            /// The record's wire message.
            pub(crate) fn message(&self) -> $msg {
                self.msg.clone()
            }

            /// The record given as such (`record`), or built from `fields` given as keywords
            /// through the same constructor; not both.
            pub(crate) fn from_call(
                py: Python<'_>,
                record: Option<PyRef<'_, Self>>,
                fields: Option<&Bound<'_, PyDict>>,
            ) -> PyResult<$msg> {
                let fields = fields.filter(|f| !f.is_empty());
                match (record, fields) {
                    (Some(r), None) => Ok(r.message()),
                    (Some(_), Some(_)) => Err(PyTypeError::new_err(concat!(
                        "pass a ", $py_name, " or its fields as keywords, not both"
                    ))),
                    (None, fields) => {
                        let built = py.get_type::<Self>().call((), fields)?;
                        Ok(built.extract::<PyRef<'_, Self>>()?.message())
                    }
                }
            }
        }
    };
}

record! {
    /// One telemetry report of a rank: identity, step, timings, commit result, errors.
    ///
    /// `phase` is one of step, heal_started, finished, failed, snapshot (a durable snapshot
    /// of committed step `step` completed: `snapshot_path`, `snapshot_stage_s`,
    /// `snapshot_write_s` and the group's `snapshot_bytes`; sent once per snapshot, by the
    /// rank that wrote its manifest) and snapshot_failed (`error` says why); neither snapshot
    /// phase is a step.
    ///
    /// Raises ValueError for an unknown phase; the client's `report` checks the rest.
    PyTelemetryReport("TelemetryReport") wraps TelemetryReport {
        required {
            replica_id: String,
            group_rank: i64,
            group_world_size: i64,
            step: i64,
        }
        optional {
            incarnation: String = String::new(),
            rank: i64 = -1,
            hostname: String = String::new(),
            pid: u32 = 0,
            quorum_id: i64 = 0,
            participants: i64 = 0,
            committed: bool = false,
            healed: bool = false,
            step_s: f64 = 0.0,
            quorum_wait_s: f64 = 0.0,
            collective_s: f64 = 0.0,
            should_commit_s: f64 = 0.0,
            busy_s: f64 = 0.0,
            heal_s: f64 = 0.0,
            heal_bytes: u64 = 0,
            heal_source: String = String::new(),
            heal_addr: String = String::new(),
            error: String = String::new(),
            unix_s: f64 = 0.0,
            snapshot_path: String = String::new(),
            snapshot_stage_s: f64 = 0.0,
            snapshot_write_s: f64 = 0.0,
            snapshot_bytes: u64 = 0,
            input_s: f64 = 0.0,
            forward_s: f64 = 0.0,
            backward_s: f64 = 0.0,
            optimizer_s: f64 = 0.0,
            cpu_s: f64 = 0.0,
            rss_bytes: u64 = 0,
            host_load: f64 = 0.0,
            host_mem_total_bytes: u64 = 0,
            host_mem_available_bytes: u64 = 0,
            net_rx_bytes_per_s: f64 = 0.0,
            net_tx_bytes_per_s: f64 = 0.0,
            host_steal: f64 = 0.0,
            gpu: bool = false,
            gpu_util_pct: f64 = 0.0,
            gpu_mem_used_bytes: u64 = 0,
            gpu_mem_total_bytes: u64 = 0,
        }
        with {
            phase: &str = "step" => parse_phase(phase)? as i32,
        }
    }
}

record! {
    /// One rank's request for its part of the next quorum.
    ///
    /// Args:
    ///     group_rank: this rank in its replica group.
    ///     step: the group's committed step.
    ///     checkpoint_metadata: how other groups fetch this rank's live state.
    ///     shrink_only: restrict the quorum to the previous members.
    ///     commit_failures: consecutive failed commits of this group.
    ///     init_sync: heal every member but one at step 0.
    PyQuorumRequest("QuorumRequest") wraps ManagerQuorumRequest {
        required {
            group_rank: i64,
            step: i64,
            checkpoint_metadata: String,
            shrink_only: bool,
        }
        optional {
            commit_failures: i64 = 0,
            init_sync: bool = true,
        }
    }
}

/// How a field of a mutable record is shown in its Python `repr`.
trait PyRepr {
    fn py_repr(&self) -> String;
}

impl PyRepr for i64 {
    fn py_repr(&self) -> String {
        self.to_string()
    }
}

impl PyRepr for bool {
    fn py_repr(&self) -> String {
        if *self { "True" } else { "False" }.to_string()
    }
}

impl PyRepr for String {
    fn py_repr(&self) -> String {
        format!("{self:?}")
    }
}

impl PyRepr for Option<i64> {
    fn py_repr(&self) -> String {
        self.map_or_else(|| "None".to_string(), |x| x.to_string())
    }
}

impl<T: std::fmt::Debug> PyRepr for Vec<T> {
    fn py_repr(&self) -> String {
        format!("{self:?}")
    }
}

/// Declares a mutable record class filled from a wire message: every field is readable and
/// writable, and its constructor takes each field (positionally or by keyword) with a
/// default, so code built on top can fabricate one in its tests.
macro_rules! answer_record {
    (
        $(#[$doc:meta])*
        $name:ident($py_name:literal) from $msg:ident {
            $($field:ident: $ty:ty = $default:expr),* $(,)?
        }
    ) => {
        $(#[$doc])*
        #[pyclass(module = "torchft._torchft", name = $py_name, get_all, set_all)]
        pub struct $name {
            $($field: $ty,)*
        }

        impl From<$msg> for $name {
            fn from(m: $msg) -> Self {
                Self { $($field: m.$field,)* }
            }
        }

        #[pymethods]
        impl $name {
            /// Builds one by hand (the server builds the real ones).
            #[new]
            #[pyo3(signature = ($($field = $default,)*))]
            #[allow(clippy::too_many_arguments)]
            fn new($($field: $ty,)*) -> Self {
                Self { $($field,)* }
            }

            fn __repr__(&self) -> String {
                let fields = [$(format!("{}={}", stringify!($field), self.$field.py_repr()),)*];
                format!("{}({})", $py_name, fields.join(", "))
            }
        }
    };
}

answer_record! {
    /// One rank's answer to a quorum request: its role in the step.
    ///
    /// Constructible with keyword arguments (all default to empty/zero/None, except
    /// `replica_world_size` to 1) and mutable, so tests of code built on top can fabricate
    /// answers.
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
    ///     replica_ids: replica ids of the quorum, in replica-rank order; from the
    ///         lighthouse's sparse answer only this group, its heal sources and its stores
    ///         are named, the other entries are empty strings.
    QuorumResult("QuorumResult") from ManagerQuorumResponse {
        quorum_id: i64 = 0,
        replica_rank: i64 = 0,
        replica_world_size: i64 = 1,
        recover_src_manager_address: String = String::new(),
        recover_src_replica_rank: Option<i64> = None,
        recover_dst_replica_ranks: Vec<i64> = Vec::new(),
        store_address: String = String::new(),
        max_step: i64 = 0,
        max_replica_rank: Option<i64> = None,
        max_world_size: i64 = 0,
        heal: bool = false,
        commit_failures: i64 = 0,
        replica_ids: Vec<String> = Vec::new(),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<QuorumResult>()?;
    m.add_class::<PyTelemetryReport>()?;
    m.add_class::<PyQuorumRequest>()?;
    Ok(())
}
