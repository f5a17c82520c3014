//! Address, deadline and backoff helpers shared by every client and server (no dialing here:
//! that is [`crate::client::connect`], above the security layer).

use std::time::Duration;

use crate::error::{Error, Result};

/// Normalises a user-supplied address to a URI tonic can dial (`host:port` → `http://host:port`).
pub fn normalize_addr(addr: &str) -> Result<String> {
    let addr = addr.trim();
    if addr.is_empty() {
        return Err(Error::InvalidArgument("address must not be empty".into()));
    }
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    uri.parse::<tonic::codegen::http::Uri>()
        .map_err(|e| Error::InvalidArgument(format!("invalid address {addr:?}: {e}")))?;
    Ok(uri)
}

/// An error with its chain of causes, `: `-separated (tonic's transport errors say only
/// "transport error" at the top).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// Exponential backoff with full jitter, capped at `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and doubling up to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { next: initial, max }
    }

    /// The delay before the next attempt (jittered to avoid thundering herds).
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        let jitter = rand::random::<f64>() * 0.5 + 0.5;
        base.mul_f64(jitter)
    }
}

/// Parses a gRPC `grpc-timeout` header value (`"100m"`, `"5S"`, ...) into a duration.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The deadline a caller attached to a request, if any.
pub fn request_timeout<T>(req: &tonic::Request<T>) -> Option<Duration> {
    req.metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
}

/// Builds a request carrying `timeout` as its gRPC deadline.
pub fn with_timeout<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout("10q"), None);
        assert_eq!(parse_grpc_timeout("-1S"), None);
    }

    #[test]
    fn normalize() {
        assert_eq!(
            normalize_addr("localhost:1").ok().as_deref(),
            Some("http://localhost:1")
        );
        assert_eq!(
            normalize_addr("http://[::1]:2").ok().as_deref(),
            Some("http://[::1]:2")
        );
        assert!(normalize_addr("").is_err());
        assert!(normalize_addr("bad host:1").is_err());
    }

    #[test]
    fn backoff_caps() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(40));
        for _ in 0..10 {
            assert!(b.next_delay() <= Duration::from_millis(40));
        }
    }
}
