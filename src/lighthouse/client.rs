//! A client of the lighthouse gRPC service (used by manager servers, tools and tests).

use std::time::Duration;

use tonic::transport::Channel;

use crate::error::{Error, Result};
use crate::net::{connect, with_timeout};
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::{LighthouseHeartbeatRequest, LighthouseQuorumRequest, Quorum, QuorumMember};

/// A cheap-to-clone handle on one lighthouse connection (HTTP/2 multiplexes the calls).
#[derive(Debug, Clone)]
pub struct LighthouseClient {
    client: LighthouseServiceClient<Channel>,
}

impl LighthouseClient {
    /// Dials `addr` (`http://host:port` or `host:port`), retrying until `connect_timeout`.
    pub async fn connect(addr: &str, connect_timeout: Duration) -> Result<Self> {
        let channel = connect(addr, connect_timeout).await?;
        Ok(Self::from_channel(channel))
    }

    /// Wraps an existing channel (e.g. one shared by many clients).
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            client: LighthouseServiceClient::new(channel)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
        }
    }

    /// Joins the current round and waits until `requester` is in an issued quorum.
    ///
    /// Fails with [`Error::Timeout`] when `timeout` passes first (the request then leaves the
    /// round on the server), [`Error::InvalidArgument`] for a malformed member.
    pub async fn quorum(&self, requester: QuorumMember, timeout: Duration) -> Result<Quorum> {
        let mut client = self.client.clone();
        let req = with_timeout(
            LighthouseQuorumRequest {
                requester: Some(requester),
            },
            timeout,
        );
        let resp = tokio::time::timeout(timeout, client.quorum(req))
            .await
            .map_err(|_| Error::timeout("lighthouse quorum", timeout))??;
        resp.into_inner()
            .quorum
            .ok_or_else(|| Error::Remote("lighthouse answered without a quorum".into()))
    }

    /// Tells the lighthouse `replica_id` is alive.
    pub async fn heartbeat(&self, replica_id: &str, timeout: Duration) -> Result<()> {
        let mut client = self.client.clone();
        let req = with_timeout(
            LighthouseHeartbeatRequest {
                replica_id: replica_id.to_string(),
            },
            timeout,
        );
        tokio::time::timeout(timeout, client.heartbeat(req))
            .await
            .map_err(|_| Error::timeout("lighthouse heartbeat", timeout))??;
        Ok(())
    }
}
