//! Python wrappers for the native checkpoint data path (`CheckpointDataServer`,
//! `CheckpointFetch`), used by `torchft.checkpointing.http.native`.
//!
//! Tensors cross as `(address, length)` pairs: the Python side keeps them alive and unchanged
//! for as long as the core may touch them (until `revoke` returned for an offer, until `run`
//! returned for a fetch). Everything that moves bytes runs with the GIL released.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::check_duration;
use crate::checkpoint::client::{Dest, Fetch, FetchError, FetchSpec};
use crate::checkpoint::server::{DataServer, EnterError, Offer, OfferHooks, Source};
use crate::security::Token;

/// `PyBUF_WRITE` of CPython's buffer protocol (a writable memoryview).
const PYBUF_WRITE: std::os::raw::c_int = 0x200;

/// Serves one offered state's tensor bytes to `CheckpointFetch` receivers over TCP.
///
/// Args:
///     host: IP address to listen on (`"::"` listens on every interface, IPv4 included).
///     token: the job's shared secret; requests without it are refused.
///     request_timeout: bound on reading a request from a new connection.
#[pyclass(module = "torchft._torchft", name = "CheckpointDataServer", frozen)]
pub struct PyDataServer {
    server: DataServer,
}

/// The owner's hooks of one offer: its read lock and the staging copy, both Python callables,
/// and the object that keeps the offered tensors alive.
struct PyHooks {
    enter: Option<Py<PyAny>>,
    stage: Option<Py<PyAny>>,
    _keepalive: Py<PyAny>,
}

/// A context manager entered by `PyHooks::enter`, exited when the stream ends.
struct PyGuard(Py<PyAny>);

impl Drop for PyGuard {
    fn drop(&mut self) {
        Python::attach(|py| {
            if let Err(e) = self
                .0
                .call_method1(py, "__exit__", (py.None(), py.None(), py.None()))
            {
                tracing::warn!(error = %e, "checkpoint read lock could not be released");
            }
        });
    }
}

impl OfferHooks for PyHooks {
    fn enter(&self) -> Result<Box<dyn Send>, EnterError> {
        let Some(enter) = &self.enter else {
            return Ok(Box::new(()));
        };
        Python::attach(|py| {
            let entered = || -> PyResult<(Py<PyAny>, Option<String>)> {
                let cm = enter.call0(py)?;
                let answer = cm.call_method0(py, "__enter__")?;
                Ok((cm, answer.extract::<Option<String>>(py).unwrap_or(None)))
            };
            match entered() {
                Ok((cm, None)) => Ok(Box::new(PyGuard(cm)) as Box<dyn Send>),
                // Released at once (the guard's drop exits the context manager).
                Ok((cm, Some(why))) => {
                    drop(PyGuard(cm));
                    Err(EnterError::Changed(why))
                }
                Err(e) => Err(EnterError::Failed(format!(
                    "the state could not be locked for reading: {e}"
                ))),
            }
        })
    }

    fn stage(&self, index: usize, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let Some(stage) = &self.stage else {
            return Err("no staging function for a staged tensor".into());
        };
        Python::attach(|py| -> PyResult<()> {
            // SAFETY: a writable view of `out`, valid for this call; it is released before
            // returning, so Python cannot keep using it.
            let view = unsafe {
                let ptr = pyo3::ffi::PyMemoryView_FromMemory(
                    out.as_mut_ptr().cast(),
                    out.len() as pyo3::ffi::Py_ssize_t,
                    PYBUF_WRITE,
                );
                Bound::from_owned_ptr_or_err(py, ptr)?
            };
            let r = stage.call1(py, (index, offset, &view));
            view.call_method0("release")?;
            r.map(|_| ())
        })
        .map_err(|e| e.to_string())
    }
}

impl Drop for PyDataServer {
    fn drop(&mut self) {
        // Dropped by Python with the GIL held: shutting down waits for streams, whose read
        // guards need the GIL to be released, so let go of it meanwhile.
        Python::attach(|py| py.detach(|| self.server.shutdown()));
    }
}

#[pymethods]
impl PyDataServer {
    #[new]
    #[pyo3(signature = (host, token = None, request_timeout = Duration::from_secs(60)))]
    fn new(host: &str, token: Option<&str>, request_timeout: Duration) -> PyResult<Self> {
        let request_timeout = check_duration("request_timeout", request_timeout)?;
        let token = token.map(Token::new).transpose()?;
        let server = DataServer::bind(host, token, request_timeout)?;
        Ok(PyDataServer { server })
    }

    /// The port the server listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.server.local_addr().port()
    }

    /// Serves `tensors` as the state of `step` (generation `gen`) until `revoke`.
    ///
    /// Args:
    ///     step: the step of the state.
    ///     gen: the offer's generation id (receivers name it).
    ///     tensors: per tensor `(address, length)`; address 0 means "staged": its bytes are
    ///         copied by `stage(index, offset, view)` into the stream's buffer.
    ///     timeout: bound on one stream.
    ///     keepalive: kept referenced while the offer may be read (owns the tensors).
    ///     enter: factory of a context manager held while a stream reads the state; its
    ///         `__enter__` returns None, or a message saying why the state is no longer the
    ///         one offered (the stream is then refused as "no longer served").
    ///     stage: the staging copy for staged tensors.
    ///
    /// The memory must stay valid and unchanged until `revoke` returned True.
    #[pyo3(signature = (step, gen, tensors, timeout, keepalive, enter = None, stage = None))]
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &self,
        py: Python<'_>,
        step: i64,
        gen: String,
        tensors: Vec<(usize, usize)>,
        timeout: Duration,
        keepalive: Py<PyAny>,
        enter: Option<Py<PyAny>>,
        stage: Option<Py<PyAny>>,
    ) -> PyResult<bool> {
        let timeout = check_duration("timeout", timeout)?;
        if tensors.iter().any(|&(a, _)| a == 0) && stage.is_none() {
            return Err(PyValueError::new_err(
                "staged tensors need a stage function",
            ));
        }
        let sources = tensors
            .into_iter()
            .map(|(addr, len)| match addr {
                0 => Source::Staged { len },
                addr => Source::Memory { addr, len },
            })
            .collect();
        let hooks = PyHooks {
            enter,
            stage,
            _keepalive: keepalive,
        };
        // SAFETY: the documented contract of this method (the transport keeps the tensors in
        // `keepalive`, holds its read lock per stream, and revokes before the state changes).
        let offer = unsafe { Offer::new(step, gen, sources, timeout, Box::new(hooks)) };
        Ok(py.detach(|| self.server.offer(offer)))
    }

    /// Stops serving the current offer; True once no stream reads it any more (waits a few
    /// seconds at most).
    fn revoke(&self, py: Python<'_>) -> bool {
        py.detach(|| self.server.revoke())
    }

    /// Revokes the offer, closes every connection and stops listening.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.server.shutdown());
    }
}

/// One receive of tensor bytes from a `CheckpointDataServer` (see `run`); `abort` breaks it
/// from another thread.
#[pyclass(module = "torchft._torchft", name = "CheckpointFetch", frozen)]
#[derive(Default)]
pub struct PyFetch {
    fetch: Arc<Fetch>,
}

#[pymethods]
impl PyFetch {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Breaks the fetch: `run` returns the error `("aborted", 0, ...)` promptly.
    fn abort(&self) {
        self.fetch.abort();
    }

    /// Receives tensors `ranges` (one connection each, in parallel) of the state `gen` of
    /// `step` from the server at `addr` (`host:port`) into `dests` (per tensor
    /// `(address, length)`, each valid for writes and not overlapping another, untouched by
    /// anything else until this returns).
    ///
    /// Returns:
    ///     None when every byte arrived and checked out, else `(kind, status, message)`
    ///     with kind one of "timeout", "connect", "broken", "corrupt", "refused",
    ///     "aborted" (status: the server's refusal status, else 0). On an error the
    ///     destinations hold partial data.
    #[pyo3(signature = (addr, token, step, gen, ranges, dests, timeout))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        addr: String,
        token: Option<String>,
        step: i64,
        gen: String,
        ranges: Vec<(usize, usize)>,
        dests: Vec<(usize, usize)>,
        timeout: Duration,
    ) -> PyResult<Option<(String, u32, String)>> {
        let timeout = check_duration("timeout", timeout)?;
        let dests: Vec<Dest> = dests
            .into_iter()
            .map(|(addr, len)| Dest { addr, len })
            .collect();
        if dests.iter().any(|d| d.addr == 0 && d.len > 0) {
            return Err(PyValueError::new_err("a destination has a null address"));
        }
        let spec = FetchSpec {
            addr,
            token,
            step,
            gen,
            ranges,
            deadline: Instant::now() + timeout,
        };
        let fetch = self.fetch.clone();
        // SAFETY: the documented contract of this method.
        let result = py.detach(move || unsafe { fetch.run(&spec, &dests) });
        Ok(result.err().map(|e| {
            let message = e.to_string();
            match e {
                FetchError::Timeout(_) => ("timeout".into(), 0, message),
                FetchError::Connect(_) => ("connect".into(), 0, message),
                FetchError::Broken(_) => ("broken".into(), 0, message),
                FetchError::Corrupt(_) => ("corrupt".into(), 0, message),
                FetchError::Refused { status, message } => ("refused".into(), status, message),
                FetchError::Aborted => ("aborted".into(), 0, message),
            }
        }))
    }
}

/// Continues a CRC-32 (zlib's: `zlib.crc32(bytes, crc)` gives the same value) over the
/// `length` bytes at `address`, without the GIL: the checkpoint stream's per-tensor checksum.
/// The caller keeps the memory alive and unchanged for the call. Raises ValueError for a
/// null address with bytes to read, or a range past the end of memory.
#[pyfunction]
fn _crc32_update(py: Python<'_>, crc: u32, address: usize, length: usize) -> PyResult<u32> {
    // SAFETY: the Python caller's contract (above): the memory is alive and unchanged.
    unsafe {
        super::sum_memory(py, "checksum", address, length, |bytes| {
            let mut hasher = crc32fast::Hasher::new_with_initial(crc);
            hasher.update(bytes);
            hasher.finalize()
        })
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDataServer>()?;
    m.add_class::<PyFetch>()?;
    m.add_function(wrap_pyfunction!(_crc32_update, m)?)?;
    Ok(())
}
