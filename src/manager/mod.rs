//! The manager server: one per replica group, hosted by group rank 0.
//!
//! It gathers the group's ranks, asks the lighthouse once per quorum round and tells each
//! rank its role for the step; it also runs the per-step commit vote.
//!
//! - [`compute`]: the pure function turning a lighthouse quorum into one rank's answer.
//! - [`round`]: a round of the group's ranks (join, replace, leave, fail), under both barriers.
//! - [`gather`]: bookkeeping of the quorum round in progress (who waits, step agreement).
//! - [`commit`]: the `should_commit` barrier (AND over the group's ranks, keyed by step).
//! - [`server`]: the server: its gRPC service, its lighthouse calls and its heartbeat loop.
//! - [`crate::client::ManagerClient`]: the client every rank uses (in the client folder).
//! - [`topology`]: the topology file and the choice of each healer's source by locality.

use std::time::Duration;

pub mod commit;
pub mod compute;
pub mod gather;
pub mod parity;
pub mod reports;
pub mod round;
pub mod server;
pub mod sparse;
pub mod topology;

pub(crate) use crate::client::rpc_error;
pub use crate::client::ManagerClient;
pub use compute::compute_quorum_results;
pub use server::{ManagerServer, OwnQuorum, ParityVerdicts, OWN_LINK_TRY};

/// Deadline applied to a request that arrives without one (a gRPC caller may omit it).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest head start the server takes on a caller's deadline.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

/// The part of a caller's `timeout` the server may spend: slightly less than the whole, so the
/// server answers DEADLINE_EXCEEDED (and removes the caller from its round) before the caller's
/// own timer fires. Otherwise a caller that already gave up could still be counted in a round
/// completed by a rank arriving in that instant, and its answer would be lost.
pub(crate) fn server_budget(timeout: Duration) -> Duration {
    timeout.saturating_sub((timeout / 20).min(DEADLINE_MARGIN))
}

/// How a manager server presents itself and reaches the lighthouse.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Unique id of this replica group incarnation (`{replica_id}:{uuid}`); must not be empty.
    pub replica_id: String,
    /// The lighthouse to ask for quorums (`host:port` or `http://host:port`).
    pub lighthouse_addr: String,
    /// Host name other groups dial to reach this server (used in [`ManagerServer::address`]).
    pub hostname: String,
    /// Where to listen, e.g. `[::]:0` (port 0 picks a free port).
    pub bind: String,
    /// This group's rendezvous store (`host:port`), handed to the lighthouse.
    pub store_addr: String,
    /// Number of ranks in the group; a quorum round waits for all of them. At least 1.
    pub world_size: u64,
    /// Period of the heartbeat sent to the lighthouse (kept while the lighthouse is down).
    pub heartbeat_interval: Duration,
    /// Bound on establishing a connection to the lighthouse.
    pub connect_timeout: Duration,
    /// How many times a failed lighthouse quorum request is retried (with backoff) in a round.
    pub quorum_retries: u64,
    /// Token and TLS of this server and of its calls to the lighthouse.
    pub security: crate::security::Security,
    /// Largest request message accepted (larger ones fail with a clear status, changing
    /// nothing).
    pub max_request_bytes: usize,
    /// This group's place in the job's topology file (`WORLD_TOPOLOGY_FILE`), announced to
    /// the other groups so heal sources follow the file; None: locality by host name only.
    pub placement: Option<topology::Placement>,
    /// The job (room) this group belongs to on a lighthouse serving many jobs; empty: the
    /// default room (see [`crate::lighthouse::rooms`]).
    pub job: String,
    /// Ask the lighthouse for the sparse form of each quorum (this group's own answer and the
    /// few members it names, see [`sparse`]) when there is no topology file; off: the full
    /// member list, so every answer's `replica_ids` names every member.
    pub sparse_quorum: bool,
}

/// Default bound on one request to a manager server (ranks' reports are the largest).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

impl Default for ManagerOptions {
    fn default() -> Self {
        Self {
            replica_id: String::new(),
            lighthouse_addr: String::new(),
            hostname: "localhost".to_string(),
            bind: "[::]:0".to_string(),
            store_addr: String::new(),
            world_size: 1,
            heartbeat_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(60),
            quorum_retries: 0,
            security: crate::security::Security::none(),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            placement: None,
            job: String::new(),
            sparse_quorum: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_budget_is_a_little_less_than_the_timeout() {
        assert_eq!(
            server_budget(Duration::from_secs(10)),
            Duration::from_millis(9980)
        );
        assert_eq!(
            server_budget(Duration::from_millis(100)),
            Duration::from_millis(95)
        );
        assert_eq!(server_budget(Duration::ZERO), Duration::ZERO);
    }
}
