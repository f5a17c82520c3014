//! The Python module `torchft._torchft`: thin pyo3 wrappers over the Rust core.
//!
//! Every blocking method owns its inputs, releases the GIL, runs on the process-wide runtime
//! and converts the result. Deadline expiry raises the built-in `TimeoutError`, bad arguments
//! `ValueError`, everything else `torchft._torchft.TorchFTError` (a `RuntimeError`).

use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;

mod checkpoint;
mod lighthouse;
mod manager;
mod records;

pyo3::create_exception!(
    _torchft,
    TorchFTError,
    PyRuntimeError,
    "A torchft operation failed (not a timeout, not a bad argument)."
);

pyo3::create_exception!(
    _torchft,
    StateDivergedError,
    TorchFTError,
    "This replica group's committed state differs from the others' with no majority to say \
     which is right (runtime state parity): training must stop."
);

/// Ends the message of every `TimeoutError` raised from the native side: upstream torchft's
/// deadline errors read like this (its scripts and tests match on "status: Cancelled" and
/// "Timeout expired"), so they keep matching ours.
const UPSTREAM_TIMEOUT_SUFFIX: &str = "(status: Cancelled, message: \"Timeout expired\")";

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::Timeout(_) => {
                PyTimeoutError::new_err(format!("{msg} {UPSTREAM_TIMEOUT_SUFFIX}"))
            }
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Diverged(_) => StateDivergedError::new_err(msg),
            _ => TorchFTError::new_err(msg),
        }
    }
}

/// Runs `fut` on the process-wide runtime with the GIL released.
pub(crate) fn block_on<F, T>(py: Python<'_>, fut: F) -> T
where
    F: std::future::Future<Output = T> + Send,
    T: Send,
{
    py.detach(|| crate::runtime::get().block_on(fut))
}

/// Runs `sum` over the `length` bytes at `address` (memory Python holds: a tensor's) without
/// the GIL, and returns what it gives (over no bytes when `length` is 0). ValueError (naming
/// `what` the sum does) for a null address with bytes to read, or a range past the end of
/// memory.
///
/// # Safety
/// The caller (Python, by the function's documented contract) keeps `length` readable bytes
/// at `address` alive and unchanged for the call.
pub(crate) unsafe fn sum_memory<T: Send>(
    py: Python<'_>,
    what: &str,
    address: usize,
    length: usize,
    sum: impl FnOnce(&[u8]) -> T + Send,
) -> PyResult<T> {
    if length == 0 {
        return Ok(sum(&[]));
    }
    if address == 0 {
        return Err(PyValueError::new_err(format!(
            "cannot {what} {length} bytes at a null address"
        )));
    }
    if length > isize::MAX as usize || address.checked_add(length).is_none() {
        return Err(PyValueError::new_err(format!(
            "cannot {what} {length} bytes at {address:#x}: past the end of memory"
        )));
    }
    Ok(py.detach(move || {
        // SAFETY: this function's contract; the range was checked to be addressable.
        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, length) };
        sum(bytes)
    }))
}

/// Rejects negative or non-finite durations coming from Python (`timedelta`).
pub(crate) fn check_duration(name: &str, d: Duration) -> PyResult<Duration> {
    if d.is_zero() {
        return Err(PyValueError::new_err(format!("{name} must be positive")));
    }
    Ok(d)
}

/// Names this process on every native log line from now on: `[replica_id/group_rank]`.
///
/// The Manager calls it once it knows its replica group's id; one process hosts one rank.
#[pyfunction]
fn set_log_context(replica_id: &str, group_rank: i64) {
    crate::logging::set_context(replica_id, group_rank);
}

/// Importing the module installs the native log subscriber (stderr, level from `TORCHFT_LOG`,
/// else `RUST_LOG`, else warn), so the core's warnings reach the training process's stderr.
/// A bad `TORCHFT_LOG` or `TORCHFT_RUNTIME_THREADS` fails the import, naming the variable.
#[pymodule]
fn _torchft(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::logging::init("warn")?;
    crate::runtime::threads_from_env()?;
    m.add("TorchFTError", m.py().get_type::<TorchFTError>())?;
    m.add(
        "StateDivergedError",
        m.py().get_type::<StateDivergedError>(),
    )?;
    m.add_function(wrap_pyfunction!(set_log_context, m)?)?;
    // The lighthouse's event kinds and whether each names a replica group (for tools that
    // read the event log, e.g. `python -m torchft.eventlog`, and their tests).
    let kinds: Vec<(&str, bool)> = crate::telemetry::EventKind::ALL
        .iter()
        .map(|k| (k.as_str(), k.names_a_replica()))
        .collect();
    m.add("EVENT_KINDS", kinds)?;
    lighthouse::register(m)?;
    manager::register(m)?;
    checkpoint::register(m)?;
    m.add_function(wrap_pyfunction!(security_settings, m)?)?;
    Ok(())
}

/// The token and TLS files of this process, from `TORCHFT_TOKEN_FILE` / `TORCHFT_TOKEN` /
/// `TORCHFT_TLS_*` (the one parser of those variables, shared with the Rust servers), as a
/// dict with keys `token`, `tls_cert`, `tls_key`, `tls_ca`, `tls_client_ca` (each a str or
/// None). Raises ValueError on an unreadable token file or an incomplete TLS combination.
#[pyfunction]
fn security_settings(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let s = crate::security::Security::from_env()?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("token", s.token.as_ref().map(|t| t.expose().to_string()))?;
    let path =
        |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.to_string_lossy().into_owned());
    d.set_item("tls_cert", path(&s.tls.cert))?;
    d.set_item("tls_key", path(&s.tls.key))?;
    d.set_item("tls_ca", path(&s.tls.ca))?;
    d.set_item("tls_client_ca", path(&s.tls.client_ca))?;
    Ok(d)
}
