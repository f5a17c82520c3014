//! The write-ahead commit's own connection for a hosting rank that votes alone.
//!
//! A single-rank group's training thread asks [`super::ManagerServer::may_commit_blocking`]
//! once per step and waits for the lighthouse's answer. Over the server's shared connection
//! that round trip takes two hand-offs between threads: the request wakes a runtime thread
//! to write it, and the answer, read by that thread, wakes the training thread again. On a
//! machine whose cores the job keeps busy, each wake-up waits for a core. Here the
//! connection lives on a runtime of its own with no threads: the waiting thread drives it
//! itself (writes the request, reads the answer), so nothing else has to be scheduled.

use std::future::Future;

use tokio::runtime::{Builder, Runtime};

use crate::client::LighthouseClient;
use crate::error::{Error, Result};
use crate::manager::ManagerOptions;

/// A lighthouse client on a runtime that only the thread waiting on it drives.
pub(super) struct OwnLink {
    /// Always `Some` until dropped (taken to shut it down without blocking).
    rt: Option<Runtime>,
    /// Commits only: its connection is idle, and undriven, between two waits.
    pub(super) lighthouse: LighthouseClient,
}

impl std::fmt::Debug for OwnLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnLink").finish_non_exhaustive()
    }
}

impl OwnLink {
    /// A lazy connection to the lighthouse of `opts` (dialled by the first call). No HTTP/2
    /// keep-alive: between two waits nothing answers a ping; each call's deadline bounds it.
    pub(super) fn new(opts: &ManagerOptions) -> Result<Self> {
        let rt = Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Unavailable(format!("cannot start the commit runtime: {e}")))?;
        let endpoint = crate::security::client::quiet_endpoint(
            &opts.lighthouse_addr,
            opts.connect_timeout,
            &opts.security,
        )
        .map_err(|e| Error::InvalidArgument(format!("lighthouse address: {}", e.message())))?;
        let lighthouse = {
            // The lazy channel starts its worker on the runtime entered here.
            let _entered = rt.enter();
            LighthouseClient::from_channel(endpoint.connect_lazy(), opts.security.token.as_ref())
                .with_job(&opts.job)?
        };
        Ok(Self {
            rt: Some(rt),
            lighthouse,
        })
    }

    /// Runs `fut` to completion on this thread, driving the link's connection meanwhile.
    ///
    /// # Errors
    /// `InvalidArgument` when called from inside a tokio runtime (which cannot block).
    pub(super) fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::InvalidArgument(
                "may_commit_blocking waits on the calling thread: call it from outside any \
                 tokio runtime (inside one, await may_commit)"
                    .into(),
            ));
        }
        match &self.rt {
            Some(rt) => Ok(rt.block_on(fut)),
            None => Err(Error::Shutdown),
        }
    }
}

impl Drop for OwnLink {
    fn drop(&mut self) {
        // The last owner may be a task of the shared runtime, where blocking is not allowed.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
