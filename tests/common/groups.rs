//! Replica groups for the wire tests: a real lighthouse and real manager servers on
//! 127.0.0.1:0, with a client per group rank.

use std::time::Duration;

use torchft::error::Error;
use torchft::lighthouse::{LighthouseOptions, LighthouseServer};
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{ManagerQuorumRequest, ManagerQuorumResponse};

/// Connect timeout of every client.
pub const CONNECT: Duration = Duration::from_secs(5);
/// A deadline no healthy call comes near.
pub const LONG: Duration = Duration::from_secs(10);

/// A lighthouse on a free local port.
pub async fn lighthouse(min_replicas: u64) -> LighthouseServer {
    lighthouse_on("127.0.0.1:0", min_replicas).await
}

/// A lighthouse on `bind` (a restart reuses the address it had).
pub async fn lighthouse_on(bind: &str, min_replicas: u64) -> LighthouseServer {
    LighthouseServer::bind(
        bind,
        LighthouseOptions {
            min_replicas,
            join_timeout: Duration::from_secs(5),
            quorum_tick: Duration::from_millis(10),
            heartbeat_timeout: Duration::from_secs(2),
            // Not about the no-regression rules: no startup hold, no wait for progress.
            progress_wait: Duration::ZERO,
            state_file: None,
            hang_timeout: None,
        },
    )
    .await
    .unwrap()
}

/// Options of a manager server of `world_size` ranks reaching the lighthouse at `lighthouse_addr`.
pub fn opts(replica_id: &str, lighthouse_addr: &str, world_size: u64) -> ManagerOptions {
    ManagerOptions {
        replica_id: replica_id.to_string(),
        lighthouse_addr: lighthouse_addr.to_string(),
        hostname: "127.0.0.1".to_string(),
        bind: "127.0.0.1:0".to_string(),
        store_addr: format!("{replica_id}-store:29500"),
        world_size,
        heartbeat_interval: Duration::from_millis(50),
        connect_timeout: CONNECT,
        ..ManagerOptions::default()
    }
}

/// A started manager server and one client per group rank.
pub struct Group {
    pub server: ManagerServer,
    pub clients: Vec<ManagerClient>,
}

/// A started group with `opts`' defaults.
pub async fn group(replica_id: &str, lighthouse_addr: &str, world_size: u64) -> Group {
    group_with(opts(replica_id, lighthouse_addr, world_size)).await
}

/// A started group.
pub async fn group_with(o: ManagerOptions) -> Group {
    let world_size = o.world_size;
    let server = ManagerServer::start(o).await.unwrap();
    let mut clients = Vec::new();
    for rank in 0..world_size {
        let c = ManagerClient::connect(&server.address(), CONNECT)
            .await
            .unwrap();
        // As in a job: group rank 0 hosts the server (its calls skip the network), the other
        // ranks are other processes.
        clients.push(if rank == 0 { c } else { c.network_only() });
    }
    Group { server, clients }
}

/// Group rank `group_rank`'s quorum request at `step`.
pub fn req(group_rank: i64, step: i64) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank,
        step,
        checkpoint_metadata: format!("meta-{group_rank}"),
        shrink_only: false,
        init_sync: true,
        commit_failures: 0,
    }
}

/// Every rank of `g` asks for a quorum at `step` concurrently; results in group-rank order.
pub async fn round(
    g: &Group,
    step: i64,
    timeout: Duration,
) -> Vec<Result<ManagerQuorumResponse, Error>> {
    let calls = g.clients.iter().enumerate().map(|(rank, c)| {
        let c = c.clone();
        async move { c.quorum(req(rank as i64, step), timeout).await }
    });
    futures::future::join_all(calls).await
}

/// A free local port nobody listens on.
pub fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
