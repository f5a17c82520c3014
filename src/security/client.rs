//! Clients' side: the endpoint to dial (TLS when configured) and the interceptor that adds
//! the token to every call.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::{Security, Token};
use crate::error::{Error, Result};

/// A channel whose every call carries the token (when one is configured).
pub type AuthChannel = InterceptedService<Channel, ClientAuth>;

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    header: Option<MetadataValue<Ascii>>,
}

impl ClientAuth {
    /// Sends `token` (nothing when `None`).
    pub fn new(token: Option<&Token>) -> Self {
        Self {
            // A validated token is visible ASCII, always a valid header value.
            header: token.and_then(|t| t.bearer().parse().ok()),
        }
    }
}

impl Interceptor for ClientAuth {
    fn call(
        &mut self,
        mut req: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// Wraps `channel` so every call carries `token`.
pub fn authenticated(channel: Channel, token: Option<&Token>) -> AuthChannel {
    InterceptedService::new(channel, ClientAuth::new(token))
}

/// Normalises `addr` (`host:port`, `http://…`, `https://…`) to the URI to dial: `https://`
/// whenever this process dials TLS (a configured CA never silently falls back to plain
/// TCP); an `https://` address without a CA is refused with a message saying what to set.
pub fn uri(addr: &str, security: &Security) -> Result<String> {
    let uri = crate::net::normalize_addr(addr)?;
    let tls = security.tls.dials_tls();
    if let Some(rest) = uri.strip_prefix("http://") {
        return Ok(if tls { format!("https://{rest}") } else { uri });
    }
    if uri.starts_with("https://") && !tls {
        return Err(Error::InvalidArgument(format!(
            "{addr} is a TLS (https) address but no CA is configured to verify it: set \
             TORCHFT_TLS_CA"
        )));
    }
    Ok(uri)
}

/// The endpoint for `addr` with the transport settings torchft's clients use (TCP no
/// delay, HTTP/2 keep-alive) and TLS as `security` says.
pub fn endpoint(addr: &str, connect_timeout: Duration, security: &Security) -> Result<Endpoint> {
    Ok(with_keep_alive(quiet_endpoint(
        addr,
        connect_timeout,
        security,
    )?))
}

/// `endpoint` with the HTTP/2 keep-alive pings every other torchft client uses.
pub fn with_keep_alive(endpoint: Endpoint) -> Endpoint {
    endpoint
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
}

/// As [`endpoint`], without HTTP/2 keep-alive pings: for a connection that is driven only
/// while its owner waits on a call (between calls nothing would answer a ping in time, and a
/// late answer would close a healthy connection). Without them a dead peer is not detected:
/// each call's deadline bounds that call, and the owner must close a connection that may be
/// dead (the manager server's own commit link does).
pub fn quiet_endpoint(
    addr: &str,
    connect_timeout: Duration,
    security: &Security,
) -> Result<Endpoint> {
    let uri = uri(addr, security)?;
    let mut endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| Error::InvalidArgument(format!("invalid address {addr:?}: {e}")))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true);
    if let Some(ca) = &security.tls.ca {
        let read =
            |what: &str, p: &std::path::Path| super::read_named(what, p, |p| std::fs::read(p));
        let mut tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("TLS CA", ca)?));
        if let (Some(cert), Some(key)) = (&security.tls.cert, &security.tls.key) {
            tls = tls.identity(Identity::from_pem(
                read("TLS certificate", cert)?,
                read("TLS key", key)?,
            ));
        }
        endpoint = endpoint.tls_config(tls).map_err(|e| {
            Error::InvalidArgument(format!(
                "TLS setup for {uri} failed: {}",
                crate::net::error_chain(&e)
            ))
        })?;
    }
    Ok(endpoint)
}
