//! The write-ahead commit's own connection for a hosting rank that votes alone.
//!
//! A single-rank group's training thread asks [`super::ManagerServer::may_commit_blocking`]
//! once per step and waits for the lighthouse's answer. Over the server's shared connection
//! that round trip takes two hand-offs between threads: the request wakes a runtime thread
//! to write it, and the answer, read by that thread, wakes the training thread again. On a
//! machine whose cores the job keeps busy, each wake-up waits for a core. Here the
//! connection lives on a runtime without worker threads: the waiting thread drives it
//! itself (writes the request, reads the answer), so nothing else has to be scheduled (a
//! lighthouse named by host name is resolved on a blocking thread when it is dialled).
//!
//! Between two waits nothing drives the connection, so it cannot answer the lighthouse, nor
//! notice by itself that the lighthouse is gone. The server therefore closes it (drops its
//! runtime, which closes the socket) when it may be in the way or dead:
//! - when the open lighthouse session on the shared connection ends, or a new one fails to
//!   open: a lighthouse stopping ends its sessions first, and the group closes this
//!   connection a round trip later, so the lighthouse's graceful stop does not wait out its
//!   grace for the answer to its last ping; a connection the shared link's keep-alive finds
//!   dead ends the session too;
//! - when an announcement gets no answer on it within
//!   [`OWN_LINK_TRY`](super::OWN_LINK_TRY): the announcement is sent again on the shared
//!   connection;
//! - once the lighthouse turns out to take no announcements (an upstream one);
//! - for good at the server's shutdown.
//!
//! After any of these but the last, the next announcement dials anew.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::runtime::{Builder, Runtime};
use tonic::transport::Endpoint;

use crate::client::LighthouseClient;
use crate::error::{Error, Result};
use crate::manager::ManagerOptions;
use crate::security::Token;

/// The connection, opened on first use (multi-rank groups never use it).
pub(super) struct OwnLink {
    endpoint: Endpoint,
    token: Option<Token>,
    job: String,
    open: Mutex<Option<Arc<Link>>>,
    /// Set at the server's shutdown: no connection is opened any more.
    shut: AtomicBool,
}

/// One connection and the runtime it lives on.
struct Link {
    /// Always `Some` until dropped (taken to shut it down without blocking).
    rt: Option<Runtime>,
    lighthouse: LighthouseClient,
}

impl std::fmt::Debug for OwnLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        f.debug_struct("OwnLink").field("open", &open).finish()
    }
}

impl OwnLink {
    /// The lighthouse at `endpoint` (without keep-alive: between two waits nothing would
    /// answer a ping; see the module's documentation for what replaces it), with the token
    /// and job of `opts`; not dialled yet.
    pub(super) fn new(endpoint: Endpoint, opts: &ManagerOptions) -> Self {
        Self {
            endpoint,
            token: opts.security.token.clone(),
            job: opts.job.clone(),
            open: Mutex::new(None),
            shut: AtomicBool::new(false),
        }
    }

    /// Runs `call` with the link's client to completion on this thread, which drives the
    /// connection meanwhile (dialled first if it is not open).
    ///
    /// # Errors
    /// `InvalidArgument` when called from inside a tokio runtime (whose threads must not
    /// block); `Unavailable` when the link's runtime cannot start; `Shutdown` after
    /// [`OwnLink::close_for_good`].
    pub(super) fn run<F, Fut>(&self, call: F) -> Result<Fut::Output>
    where
        F: FnOnce(LighthouseClient) -> Fut,
        Fut: Future,
    {
        outside_runtime()?;
        let link = self.link()?;
        match &link.rt {
            Some(rt) => Ok(rt.block_on(call(link.lighthouse.clone()))),
            None => Err(Error::Shutdown),
        }
    }

    /// Closes the connection, if open: its runtime and tasks are dropped, which closes the
    /// socket (at once, or when a call running on it returns). The next call dials anew.
    pub(super) fn close(&self) {
        let link = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(link);
    }

    /// Closes the connection and opens none any more (the server's shutdown): later calls
    /// fail with `Shutdown`.
    pub(super) fn close_for_good(&self) {
        self.shut.store(true, Ordering::SeqCst);
        self.close();
    }

    /// Whether a connection is open (for tests).
    pub(super) fn is_open(&self) -> bool {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn link(&self) -> Result<Arc<Link>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if self.shut.load(Ordering::SeqCst) {
            return Err(Error::Shutdown);
        }
        if let Some(link) = &*open {
            return Ok(link.clone());
        }
        let rt = Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Unavailable(format!("cannot start the commit runtime: {e}")))?;
        let lighthouse = {
            // The lazy channel starts its worker on the runtime entered here.
            let _entered = rt.enter();
            LighthouseClient::from_channel(self.endpoint.connect_lazy(), self.token.as_ref())
                .with_job(&self.job)?
        };
        let link = Arc::new(Link {
            rt: Some(rt),
            lighthouse,
        });
        *open = Some(link.clone());
        Ok(link)
    }
}

/// `InvalidArgument` on a thread inside a tokio runtime, whose threads must not block.
pub(super) fn outside_runtime() -> Result<()> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InvalidArgument(
            "may_commit_blocking waits on the calling thread: call it from outside any tokio \
             runtime (inside one, await may_commit)"
                .into(),
        ));
    }
    Ok(())
}

impl Drop for Link {
    fn drop(&mut self) {
        // The last owner may be a task of the shared runtime, where blocking is not allowed.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
