//! Clients of the lighthouse and of the manager servers, and what both ends of their wire
//! share (the compact quorum form, the digest bound, how a failed call reads).
//!
//! Servers depend down on this folder, never on each other: the manager server asks the
//! lighthouse through [`LighthouseClient`], the lighthouse's kill action reaches a group
//! through [`ManagerClient`].
//!
//! - [`lighthouse`]: the [`LighthouseClient`] (compact replies expanded back to full quorums).
//! - [`manager`]: the [`ManagerClient`] every group rank uses.
//! - [`compact`]: the compact forms of a quorum reply, built by the lighthouse, expanded here.

use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;

use crate::error::{Error, Result};
use crate::net::{error_chain, Backoff};
use crate::security::client::{authenticated, endpoint, AuthChannel};
use crate::security::Security;

/// The two constructors every client has, `connect` and `connect_with`, given how the
/// client wraps its dialled channel (a function, or a closure that captures nothing, from
/// the `AuthChannel` to the client); expanded inside the client's `impl` block.
macro_rules! dial_constructors {
    ($wrap:expr) => {
        /// Dials `addr` (`http://host:port` or `host:port`), retrying until
        /// `connect_timeout` (the server may start a moment after its clients), with the
        /// token and TLS settings of the environment
        /// ([`Security::from_env`](crate::security::Security::from_env)).
        pub async fn connect(
            addr: &str,
            connect_timeout: std::time::Duration,
        ) -> $crate::error::Result<Self> {
            let security = $crate::security::Security::from_env()?;
            Self::connect_with(addr, connect_timeout, &security).await
        }

        /// Dials `addr` with explicit token and TLS settings.
        pub async fn connect_with(
            addr: &str,
            connect_timeout: std::time::Duration,
            security: &$crate::security::Security,
        ) -> $crate::error::Result<Self> {
            let wrap: fn(
                $crate::security::client::AuthChannel,
                &str,
                &$crate::security::Security,
            ) -> Self = $wrap;
            Ok(wrap(
                $crate::client::dial(addr, connect_timeout, security).await?,
                addr,
                security,
            ))
        }
    };
}

pub mod compact;
pub mod in_process;
pub mod lighthouse;
pub mod manager;

pub use lighthouse::LighthouseClient;
pub use manager::ManagerClient;

/// Longest state digest of one rank, in bytes: a group checks it before sending, the
/// lighthouse when it receives.
pub const MAX_DIGEST_BYTES: usize = 64;

/// Dials `addr` with `security`'s TLS settings, retrying with exponential backoff until
/// `connect_timeout` has passed.
///
/// Retrying matters at start-up, when the peer (a lighthouse or a group's manager server) may
/// come up a moment after us. A TLS handshake that fails says so, with the likely cause.
pub async fn connect(
    addr: &str,
    connect_timeout: Duration,
    security: &Security,
) -> Result<Channel> {
    let endpoint = endpoint(addr, connect_timeout, security)?;
    let uri = endpoint.uri().to_string();
    let deadline = Instant::now() + connect_timeout;
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(channel),
            Err(e) => {
                let now = Instant::now();
                let reason = error_chain(&e);
                if security.tls.dials_tls() && is_tls_failure(&reason) {
                    // A handshake that fails will not succeed by retrying: say so at once.
                    return Err(Error::Connect {
                        addr: uri,
                        reason: format!(
                            "TLS handshake failed: {reason} (is the server running without \
                             TLS, or with a certificate not signed by TORCHFT_TLS_CA?)"
                        ),
                    });
                }
                if now >= deadline {
                    return Err(Error::Connect {
                        addr: uri,
                        reason: format!("{reason} (gave up after {connect_timeout:?})"),
                    });
                }
                tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
            }
        }
    }
}

/// True if a connection error text says the TLS layer failed (rather than TCP).
fn is_tls_failure(reason: &str) -> bool {
    [
        "corrupt message",
        "InvalidContentType",
        "invalid peer certificate",
        "HandshakeFailure",
        "peer is incompatible",
        "alert",
        "tls handshake eof",
        "UnknownIssuer",
        "NotValidForName",
    ]
    .iter()
    .any(|needle| reason.contains(needle))
}

/// Dials `addr` (see [`connect`]) and wraps the channel so every call carries `security`'s
/// token.
async fn dial(addr: &str, connect_timeout: Duration, security: &Security) -> Result<AuthChannel> {
    let channel = connect(addr, connect_timeout, security).await?;
    Ok(authenticated(channel, security.token.as_ref()))
}

/// Converts a failed RPC's status to an error, given when the call started and its timeout.
///
/// A `CANCELLED` status before the deadline is not a timeout: the transport dropped the call
/// (typically the peer's connection closed under it), so it is reported as `Unavailable` and
/// Python sees a torchft error rather than a misleading `TimeoutError`.
pub(crate) fn rpc_error(status: tonic::Status, started: Instant, timeout: Duration) -> Error {
    if status.code() == tonic::Code::Cancelled && started.elapsed() < timeout {
        return Error::Unavailable(format!(
            "the connection dropped the call: {}",
            status.message()
        ));
    }
    Error::from(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn cancelled_before_the_deadline_is_unavailable_not_timeout() {
        let started = tokio::time::Instant::now();
        let t = Duration::from_secs(1);
        let e = rpc_error(
            tonic::Status::cancelled("operation was canceled"),
            started,
            t,
        );
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        let e = rpc_error(tonic::Status::deadline_exceeded("late"), started, t);
        assert!(e.is_timeout());
        tokio::time::advance(t).await;
        let e = rpc_error(tonic::Status::cancelled("Timeout expired"), started, t);
        assert!(e.is_timeout());
        let e = rpc_error(tonic::Status::invalid_argument("bad"), started, t);
        assert!(matches!(e, Error::InvalidArgument(_)));
    }
}
