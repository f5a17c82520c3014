//! Python wrappers for the lighthouse server and client.
use pyo3::prelude::*;
pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
