//! The one process-wide tokio runtime used by every server and client in this process.
//!
//! Python objects and the daemon share it: one runtime per object would multiply threads and
//! make shutdown order fragile.

use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

use crate::error::{Error, Result};

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// The variable that sets the runtime's worker thread count.
pub const ENV_THREADS: &str = "TORCHFT_RUNTIME_THREADS";
/// Worker threads when the variable is not set, at most: enough for control traffic.
pub const DEFAULT_THREADS: usize = 2;

/// Worker threads when the variable is not set: one per core this process may use beyond the
/// one its own (training) thread needs, between 1 and [`DEFAULT_THREADS`]. On one or two
/// cores a second worker cannot run beside the training thread and the first; it only adds
/// a hand-off between threads (a wake-up that waits for a core) to every message.
pub fn default_threads() -> usize {
    available_cores()
        .saturating_sub(1)
        .clamp(1, DEFAULT_THREADS)
}

/// The worker thread count from `TORCHFT_RUNTIME_THREADS` (default [`default_threads`]).
///
/// # Errors
/// `InvalidArgument` naming the variable when it is not a positive integer. Entry points
/// (the Python module, the daemon) call this first so a bad value fails loudly instead of
/// being replaced by the default.
pub fn threads_from_env() -> Result<usize> {
    parse_threads(std::env::var(ENV_THREADS).ok().as_deref())
}

fn parse_threads(raw: Option<&str>) -> Result<usize> {
    match raw.map(str::trim) {
        None | Some("") => Ok(default_threads()),
        Some(v) => v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
            Error::InvalidArgument(format!("env {ENV_THREADS}={v:?} must be an integer >= 1"))
        }),
    }
}

/// Returns the process-wide runtime, creating it on first use.
///
/// Worker threads are named `torchft-rt` so they are easy to spot in stack dumps. The thread
/// count follows `TORCHFT_RUNTIME_THREADS` (see [`threads_from_env`]).
pub fn get() -> &'static Runtime {
    RUNTIME.get_or_init(|| build(threads_from_env().unwrap_or_else(|_| default_threads())))
}

/// Returns the process-wide runtime, creating it with `threads` workers if it does not exist
/// yet (a process that serves, such as the lighthouse daemon, sizes it before first use).
/// Returns the count of the runtime it returns.
pub fn get_with(threads: usize) -> (&'static Runtime, usize) {
    let mut built = None;
    let rt = RUNTIME.get_or_init(|| {
        built = Some(threads.max(1));
        build(threads.max(1))
    });
    let count = built.unwrap_or_else(|| rt.metrics().num_workers());
    (rt, count)
}

/// One worker thread per core this process may use (its CPU affinity and cgroup quota
/// counted), at least 1.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

fn build(threads: usize) -> Runtime {
    // Building a runtime only fails when the OS refuses threads; nothing can run then.
    #[allow(clippy::expect_used)]
    Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("torchft-rt")
        .enable_all()
        .build()
        .expect("failed to start the torchft tokio runtime")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_count_is_parsed_or_refused() {
        let default = default_threads();
        assert!((1..=DEFAULT_THREADS).contains(&default));
        assert_eq!(default, available_cores().saturating_sub(1).clamp(1, 2));
        assert_eq!(parse_threads(None).unwrap(), default);
        assert_eq!(parse_threads(Some(" ")).unwrap(), default);
        assert_eq!(parse_threads(Some("4")).unwrap(), 4);
        for bad in ["0", "-1", "many"] {
            let err = parse_threads(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(ENV_THREADS), "{err}");
        }
    }
}
