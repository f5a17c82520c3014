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
/// The most worker threads a training process starts when the variable is not set: enough
/// for control traffic.
pub const MAX_DEFAULT_THREADS: usize = 2;

/// Worker threads when the variable is not set, for a process that may use `cores` cores:
/// one per core beyond the one its own (training) thread needs, between 1 and
/// [`MAX_DEFAULT_THREADS`]. On one or two cores a second worker cannot run beside the
/// training thread and the first; it only adds a hand-off between threads (a wake-up that
/// waits for a core) to every message.
pub fn default_threads(cores: usize) -> usize {
    cores.saturating_sub(1).clamp(1, MAX_DEFAULT_THREADS)
}

/// The worker thread count `TORCHFT_RUNTIME_THREADS` sets, None when it is unset or empty.
///
/// # Errors
/// `InvalidArgument` naming the variable when it is not a positive integer. Entry points
/// (the Python module, the daemon) call this first so a bad value fails loudly instead of
/// being replaced by the default.
pub fn threads_from_env() -> Result<Option<usize>> {
    parse_threads(std::env::var(ENV_THREADS).ok().as_deref())
}

fn parse_threads(raw: Option<&str>) -> Result<Option<usize>> {
    match raw.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .map(Some)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("env {ENV_THREADS}={v:?} must be an integer >= 1"))
            }),
    }
}

/// Returns the process-wide runtime, creating it on first use.
///
/// Worker threads are named `torchft-rt` so they are easy to spot in stack dumps. The thread
/// count follows `TORCHFT_RUNTIME_THREADS` (see [`threads_from_env`]), else
/// [`default_threads`] of this process's cores.
pub fn get() -> &'static Runtime {
    RUNTIME.get_or_init(|| {
        let set = threads_from_env().ok().flatten();
        build(set.unwrap_or_else(|| default_threads(available_cores())))
    })
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
    fn the_default_leaves_the_training_thread_a_core() {
        let by_cores: Vec<usize> = [0, 1, 2, 3, 4, 64].map(default_threads).to_vec();
        assert_eq!(by_cores, [1, 1, 1, 2, 2, 2]);
    }

    #[test]
    fn thread_count_is_parsed_or_refused() {
        assert_eq!(parse_threads(None).unwrap(), None);
        assert_eq!(parse_threads(Some(" ")).unwrap(), None);
        assert_eq!(parse_threads(Some("4")).unwrap(), Some(4));
        for bad in ["0", "-1", "many"] {
            let err = parse_threads(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(ENV_THREADS), "{err}");
        }
    }
}
