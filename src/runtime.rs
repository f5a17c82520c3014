//! The one process-wide tokio runtime used by every server and client in this process.
//!
//! Python objects and the daemon share it: one runtime per object would multiply threads and
//! make shutdown order fragile.

use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// Returns the process-wide runtime, creating it on first use.
///
/// Worker threads are named `torchft-rt` so they are easy to spot in stack dumps. The thread
/// count follows `TORCHFT_RUNTIME_THREADS` when set (default: 2, enough for control traffic).
pub fn get() -> &'static Runtime {
    RUNTIME.get_or_init(|| {
        let threads = std::env::var("TORCHFT_RUNTIME_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(2);
        // Building a runtime only fails when the OS refuses threads; nothing can run then.
        #[allow(clippy::expect_used)]
        Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("torchft-rt")
            .enable_all()
            .build()
            .expect("failed to start the torchft tokio runtime")
    })
}
