//! Manager servers running in this process, reached without the network.
//!
//! Group rank 0 hosts its group's manager server and is also one of its clients: every step
//! it asks that server for the quorum (and, in groups of several ranks, casts its vote
//! there), and its telemetry reports go there in batches. Over gRPC that is a loopback round
//! trip per call (HTTP/2 framing, protobuf both ways, a socket hop and the wake-ups of both
//! sides) in the middle of the step. A server registers here under the address it
//! advertises; a [`super::ManagerClient`] dialled to that address calls the server's handlers
//! directly instead, with the same request (its deadline included), the same handler code
//! and the same errors.
//!
//! What the network path checks before a handler runs is checked here too: a client whose
//! token the server would refuse goes over the network (and is refused there), and a request
//! over the server's size limit is refused with the limit named. A server leaves the registry
//! when it starts shutting down, so later calls take the network path and fail as they did.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use prost::Message;

use crate::proto::manager_service_server::ManagerService;
use crate::security::Token;

/// A registered server: its handlers, the token it requires and its request size limit.
#[derive(Clone)]
pub struct InProcess {
    service: Arc<dyn ManagerService>,
    token: Option<Token>,
    max_request_bytes: usize,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcess")
            .field("max_request_bytes", &self.max_request_bytes)
            .finish_non_exhaustive()
    }
}

impl InProcess {
    /// The server's handlers.
    pub fn service(&self) -> &Arc<dyn ManagerService> {
        &self.service
    }

    /// `None` if a request of this encoded size may go in; else the refusal the server's
    /// own size limit would give.
    pub fn refuse_size(&self, req: &impl Message) -> Option<tonic::Status> {
        let len = req.encoded_len();
        (len > self.max_request_bytes).then(|| {
            tonic::Status::out_of_range(format!(
                "request of {len} bytes is larger than the manager server's limit of {} bytes",
                self.max_request_bytes
            ))
        })
    }
}

static SERVERS: LazyLock<Mutex<HashMap<String, InProcess>>> = LazyLock::new(Default::default);

fn servers() -> std::sync::MutexGuard<'static, HashMap<String, InProcess>> {
    SERVERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers the server advertised as `address` (replacing an earlier one there).
pub fn register(
    address: &str,
    service: Arc<dyn ManagerService>,
    token: Option<Token>,
    max_request_bytes: usize,
) {
    servers().insert(
        address.to_string(),
        InProcess {
            service,
            token,
            max_request_bytes,
        },
    );
}

/// Removes the server advertised as `address`; idempotent.
pub fn unregister(address: &str) {
    servers().remove(address);
}

/// The server at `address` in this process, if there is one and it accepts `token` (what
/// the client sends; a server without a token accepts any).
pub fn find(address: &str, token: Option<&Token>) -> Option<InProcess> {
    let found = servers().get(address)?.clone();
    let accepted = match (&found.token, token) {
        (None, _) => true,
        (Some(required), Some(sent)) => required.matches(sent.expose().as_bytes()),
        (Some(_), None) => false,
    };
    accepted.then_some(found)
}
