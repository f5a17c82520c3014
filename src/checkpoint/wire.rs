//! Frames of the native checkpoint data stream.
//!
//! One TCP connection carries one request and the answer to it:
//!
//! ```text
//! request : REQUEST_MAGIC | u32 json_len | json {token, step, gen, start, end[, direct]}
//! reply   : REPLY_MAGIC   | u32 status   | u32 message_len | message (UTF-8)
//! then, if status is OK, the range frame of tensors [start, end):
//!           RANGE_MAGIC | u64 start | u64 end
//!           for each tensor: raw bytes | u32 crc32(raw)
//!           END_MAGIC | u64 (end - start) | u32 crc32(all tensor crcs)
//! ```
//!
//! The range frame is byte for byte the one the Python HTTP path streams (same magics, same
//! CRC-32 as zlib), so both paths are checked by the same rules. Integers are little endian.
//!
//! `direct` (absent: false) changes no byte on the wire, only what a tensor's checksum
//! promises: with it, the server may send a tensor straight from its memory, so a tensor
//! written while it was sent can arrive with a checksum that does not match, and the receiver
//! asks for that tensor again without `direct`. Servers that do not know the field ignore it
//! (they always stage), and requests without it are served as before.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Opens a request: distinguishes this protocol from anything else reaching the port.
pub const REQUEST_MAGIC: &[u8; 8] = b"TFTNDQ01";
/// Opens a reply.
pub const REPLY_MAGIC: &[u8; 8] = b"TFTNDA01";
/// Opens a range frame (shared with the HTTP path's format).
pub const RANGE_MAGIC: &[u8; 8] = b"TFTCKR01";
/// Closes a range frame (shared with the HTTP path's format).
pub const END_MAGIC: &[u8; 8] = b"TFTCKEND";
/// Largest request accepted: a request carries a token and a few numbers.
pub const MAX_REQUEST_BYTES: usize = 64 << 10;
/// Largest reply message accepted.
pub const MAX_MESSAGE_BYTES: usize = 64 << 10;
/// How often each side of a data stream sets its socket's timeouts again to the time left
/// before the deadline (a blocking call may end up to this much after the deadline).
pub const TIMEOUT_REFRESH: std::time::Duration = std::time::Duration::from_millis(50);

/// When a stream's socket timeouts were last set to the time left: they are set again at
/// most every [`TIMEOUT_REFRESH`], not before every read or write (two system calls per
/// read otherwise cost a tenth of a heal's receiving time when reads return small pieces).
#[derive(Debug, Default)]
pub struct TimeoutRefresh(Option<std::time::Instant>);

impl TimeoutRefresh {
    /// Whether the timeouts are due to be set (never set, or set [`TIMEOUT_REFRESH`] or
    /// more before `now`); if so, `now` counts as when they were.
    pub fn due(&mut self, now: std::time::Instant) -> bool {
        let due = self
            .0
            .is_none_or(|at| now.saturating_duration_since(at) >= TIMEOUT_REFRESH);
        if due {
            self.0 = Some(now);
        }
        due
    }
}

/// Reply status: the range frame follows.
pub const STATUS_OK: u32 = 200;
/// Reply status: the request was malformed.
pub const STATUS_BAD_REQUEST: u32 = 400;
/// Reply status: missing or wrong token.
pub const STATUS_UNAUTHORIZED: u32 = 401;
/// Reply status: the requested state (step and generation) is not served (any more).
pub const STATUS_NOT_SERVED: u32 = 409;
/// Reply status: the server failed to read its own state (not worth retrying).
pub const STATUS_INTERNAL: u32 = 500;
/// Reply status: the server is at its connection limit or shutting down.
pub const STATUS_UNAVAILABLE: u32 = 503;

/// What a receiver asks for: tensors `[start, end)` of the state offered as `gen` for `step`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The job's shared secret, when it has one.
    pub token: Option<String>,
    /// The step the receiver heals to.
    pub step: i64,
    /// The generation id of the offer (from the header), so two offers never mix.
    pub gen: String,
    /// First tensor index.
    pub start: u64,
    /// One past the last tensor index.
    pub end: u64,
    /// The receiver fetches again, without `direct`, every tensor whose checksum does not
    /// match: the server may send tensor memory as it is, without staging a copy first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub direct: bool,
}

/// Writes a request frame.
pub fn write_request(w: &mut impl Write, req: &Request) -> io::Result<()> {
    let json = serde_json::to_vec(req).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(12 + json.len());
    buf.extend_from_slice(REQUEST_MAGIC);
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&json);
    w.write_all(&buf)
}

/// Reads a request frame; `Err(msg)` says what was wrong with it (I/O errors included).
pub fn read_request(r: &mut impl Read) -> Result<Request, String> {
    let mut prefix = [0u8; 12];
    r.read_exact(&mut prefix)
        .map_err(|e| format!("reading the request: {e}"))?;
    if &prefix[..8] != REQUEST_MAGIC {
        return Err("not a torchft checkpoint data request (bad magic)".into());
    }
    let len = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize;
    if len > MAX_REQUEST_BYTES {
        return Err(format!("request of {len} bytes is too large"));
    }
    let mut json = vec![0u8; len];
    r.read_exact(&mut json)
        .map_err(|e| format!("reading the request: {e}"))?;
    serde_json::from_slice(&json).map_err(|e| format!("malformed request: {e}"))
}

/// Writes a reply frame.
pub fn write_reply(w: &mut impl Write, status: u32, message: &str) -> io::Result<()> {
    let msg = &message.as_bytes()[..message.len().min(MAX_MESSAGE_BYTES)];
    let mut buf = Vec::with_capacity(16 + msg.len());
    buf.extend_from_slice(REPLY_MAGIC);
    buf.extend_from_slice(&status.to_le_bytes());
    buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    buf.extend_from_slice(msg);
    w.write_all(&buf)
}

/// Reads a reply frame: `(status, message)`. A peer that is not a data server fails with
/// `InvalidData`.
pub fn read_reply(r: &mut impl Read) -> io::Result<(u32, String)> {
    let mut prefix = [0u8; 16];
    r.read_exact(&mut prefix)?;
    if &prefix[..8] != REPLY_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer is not a torchft checkpoint data server (bad reply magic)",
        ));
    }
    let status = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    let len = u32::from_le_bytes([prefix[12], prefix[13], prefix[14], prefix[15]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply message of {len} bytes is too large"),
        ));
    }
    let mut msg = vec![0u8; len];
    r.read_exact(&mut msg)?;
    Ok((status, String::from_utf8_lossy(&msg).into_owned()))
}

/// The range frame's opening bytes.
pub fn range_prefix(start: u64, end: u64) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(RANGE_MAGIC);
    b[8..16].copy_from_slice(&start.to_le_bytes());
    b[16..].copy_from_slice(&end.to_le_bytes());
    b
}

/// The range frame's closing bytes, over the concatenated little-endian tensor CRCs.
pub fn range_trailer(count: u64, crcs: &[u8]) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[..8].copy_from_slice(END_MAGIC);
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b[16..].copy_from_slice(&crc32fast::hash(crcs).to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_due_first_then_once_per_refresh() {
        let t = std::time::Instant::now();
        let mut r = TimeoutRefresh::default();
        assert!(r.due(t));
        assert!(!r.due(t + TIMEOUT_REFRESH / 2));
        assert!(r.due(t + TIMEOUT_REFRESH));
        assert!(!r.due(t + TIMEOUT_REFRESH + TIMEOUT_REFRESH / 2));
    }

    #[test]
    fn request_round_trips_and_rejects_garbage() {
        let req = Request {
            token: Some("s3cret".into()),
            step: 7,
            gen: "abc".into(),
            start: 1,
            end: 4,
            direct: false,
        };
        let mut buf = Vec::new();
        write_request(&mut buf, &req).unwrap();
        assert_eq!(read_request(&mut buf.as_slice()).unwrap(), req);
        // Without `direct`, the request is byte for byte what receivers sent before it.
        assert!(!String::from_utf8_lossy(&buf).contains("direct"));
        let direct = Request {
            direct: true,
            ..req.clone()
        };
        let mut buf = Vec::new();
        write_request(&mut buf, &direct).unwrap();
        assert_eq!(read_request(&mut buf.as_slice()).unwrap(), direct);
        // Fields a server does not know are ignored (how `direct` reaches older servers).
        let json = br#"{"token":null,"step":7,"gen":"g","start":0,"end":1,"later":[1]}"#;
        let mut buf = REQUEST_MAGIC.to_vec();
        buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
        buf.extend_from_slice(json);
        let got = read_request(&mut buf.as_slice()).unwrap();
        assert!(!got.direct && got.end == 1);
        let http = b"GET /checkpoint/7 HTTP/1.1\r\n\r\n".to_vec();
        assert!(read_request(&mut http.as_slice())
            .unwrap_err()
            .contains("bad magic"));
        let mut huge = REQUEST_MAGIC.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_request(&mut huge.as_slice())
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn reply_round_trips_and_rejects_other_servers() {
        let mut buf = Vec::new();
        write_reply(&mut buf, STATUS_UNAUTHORIZED, "wrong token").unwrap();
        assert_eq!(
            read_reply(&mut buf.as_slice()).unwrap(),
            (STATUS_UNAUTHORIZED, "wrong token".to_string())
        );
        let http = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nabc".to_vec();
        let e = read_reply(&mut http.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn trailer_crc_matches_zlib_crc32() {
        // zlib.crc32(b"123456789") == 0xCBF43926: the Python side checks the same value.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
        let t = range_trailer(2, b"12345678");
        assert_eq!(&t[..8], END_MAGIC);
        assert_eq!(u64::from_le_bytes(t[8..16].try_into().unwrap()), 2);
    }
}
